//! Buffers kept for the next collective of the same thread.
//!
//! A collective of mid-size values needs a send buffer (the serialized value) and a receive
//! buffer (every rank's bytes). Allocating them on every call costs more than the transfer
//! itself once they pass glibc's mmap threshold (128 KiB at first): the memory comes back
//! from the kernel zeroed, one page fault per 4 KiB page (about 3.4 us each on the
//! development VM: 110 us for the 128 KiB that an all-gather of two 64 KiB values receives,
//! three times the whole collective in mpi4py).
//!
//! So each thread keeps its last send buffer and its last receive buffer (the buffer of a
//! dropped [`Gathered`](crate::Gathered) comes back here), and the next collective on that
//! thread reuses their capacity: in steady state an object collective allocates only the
//! values it returns. A kept buffer is *empty*: its old contents are never read again (a
//! receive region is zeroed before the transport fills it, as for a new buffer, so bytes a
//! peer did not send are zeros, never another collective's data).
//!
//! What it costs: each thread that ran a collective holds up to two buffers of at most
//! [`KEEP_MAX_BYTES`] each (the largest it used recently); a larger one is freed as before.
//! [`release_buffers`](crate::release_buffers) frees the calling thread's at once.

use std::cell::RefCell;

use crate::error::{ObjectError, Result};

/// The largest buffer a thread keeps (64 MiB): the receive buffer of an all-gather of a few
/// ranks' 16 MiB values. Larger transfers allocate on every call, where the page faults
/// are a smaller part of a transfer that size.
pub(crate) const KEEP_MAX_BYTES: usize = 64 << 20;

/// Buffers smaller than this are not worth keeping (the allocator's own free lists serve
/// them without a system call).
const KEEP_MIN_BYTES: usize = 4 << 10;

thread_local! {
    static SEND: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static RECV: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Which of the thread's kept buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kept {
    Send,
    Recv,
}

impl Kept {
    fn with<R>(self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
        let key = match self {
            Kept::Send => &SEND,
            Kept::Recv => &RECV,
        };
        // `try_with`: a buffer taken or returned while the thread is being torn down (a
        // `Gathered` dropped by another thread-local's destructor) is simply not kept.
        let mut f = Some(f);
        let mut call = |v: &mut Vec<u8>| (f.take().expect("called once"))(v);
        match key.try_with(|cell| cell.try_borrow_mut().ok().map(|mut v| call(&mut v))) {
            Ok(Some(r)) => r,
            _ => call(&mut Vec::new()),
        }
    }

    /// The kept buffer, empty, with room for at least `bytes` (a new one when none is kept).
    /// Fails without aborting when the memory cannot be had ([`ObjectError::Allocation`]):
    /// `bytes` may come from peers, and must have been checked against the cap.
    pub(crate) fn take(self, bytes: usize) -> Result<Vec<u8>> {
        let mut v = self.with(std::mem::take);
        if v.capacity() < bytes {
            // Growing would copy the old capacity's bytes: start afresh.
            v = Vec::new();
        }
        v.clear();
        v.try_reserve_exact(bytes)
            .map_err(|_| ObjectError::Allocation { bytes })?;
        Ok(v)
    }

    /// Keeps `buf` for the thread's next collective when its size is worth keeping and it
    /// is at least as large as the buffer already kept.
    pub(crate) fn give_back(self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if !(KEEP_MIN_BYTES..=KEEP_MAX_BYTES).contains(&cap) {
            return;
        }
        buf.clear();
        self.with(|kept| {
            if kept.capacity() <= cap {
                *kept = buf;
            }
        });
    }
}

/// Frees the buffers the calling thread keeps for its next object collective (see the
/// crate docs: each thread keeps its last send and receive buffer, up to 64 MiB each, so
/// that steady-state collectives allocate only the values they return). Call it after a
/// burst of large collectives on a thread that will not run more.
pub fn release_buffers() {
    for kept in [Kept::Send, Kept::Recv] {
        kept.with(|v| *v = Vec::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_taken_again_empty_with_its_capacity() {
        release_buffers();
        let mut v = Kept::Recv.take(100 << 10).unwrap();
        v.extend_from_slice(&[7; 1000]);
        let ptr = v.as_ptr();
        Kept::Recv.give_back(v);
        let again = Kept::Recv.take(50 << 10).unwrap();
        assert!(again.is_empty());
        assert!(again.capacity() >= 100 << 10);
        assert_eq!(again.as_ptr(), ptr);
    }

    #[test]
    fn small_and_huge_buffers_are_not_kept() {
        release_buffers();
        Kept::Send.give_back(Vec::with_capacity(100));
        assert_eq!(Kept::Send.take(0).unwrap().capacity(), 0);
        // A capacity over the limit, without touching its pages.
        Kept::Send.give_back(Vec::with_capacity(KEEP_MAX_BYTES + 1));
        assert_eq!(Kept::Send.take(0).unwrap().capacity(), 0);
    }

    #[test]
    fn release_frees_what_the_thread_keeps() {
        Kept::Recv.give_back(Vec::with_capacity(1 << 20));
        release_buffers();
        assert_eq!(Kept::Recv.take(0).unwrap().capacity(), 0);
    }

    #[test]
    fn an_impossible_size_is_an_allocation_error_not_an_abort() {
        assert!(matches!(
            Kept::Recv.take(usize::MAX),
            Err(ObjectError::Allocation { .. })
        ));
    }
}
