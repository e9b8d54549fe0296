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
//! [`KEEP_MAX_BYTES`] each, plus a receive window's largest offset (the largest it used
//! recently); a larger one is freed as before.
//! [`release_buffers`](crate::release_buffers) frees the calling thread's at once.

use std::cell::{Cell, RefCell};

use tpcomm_transport::copy::SMALL;

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
    /// Receive buffers taken on this thread so far (see [`receive_offset`]).
    static RECEIVES: Cell<usize> = const { Cell::new(0) };
}

/// Where the next receive buffer's bytes start, for a collective whose largest value is
/// `largest` bytes: 0, 64, ..., 4032 bytes into it, then 0 again, one step per such call on
/// the thread; always 0 when no value is long enough for `memcpy` to copy it slowly
/// ([`SMALL`] bytes), which spares small collectives the prefix.
///
/// Why: the values decoded from a receive buffer are copied out of it by the user's types
/// (`Vec<u8>`, `String`) with glibc's `memcpy`, into memory that the allocator hands out at
/// the same place call after call. Where `memcpy` runs about 20 times slower for a
/// destination 1 to 63 bytes after its source modulo 4 KiB (AMD EPYC with glibc 2.36; see
/// `tpcomm_transport::copy`), a receive buffer that never moves makes every call of
/// a run slow for some destinations (`examples/layouts.rs`, two 64 KiB byte strings copied
/// to every 16-byte offset of a page: 2-3 of 256 offsets at 60-108 us against 18-21 us).
/// Moved by 64 bytes at each call, the bytes are in that relation with a given destination
/// in at most one call in 64.
pub(crate) fn receive_offset(largest: usize) -> usize {
    if largest < SMALL {
        return 0;
    }
    RECEIVES.with(|n| {
        let k = n.get();
        n.set(k.wrapping_add(1));
        (k % 64) * 64
    })
}

/// The largest [`receive_offset`].
const MAX_RECEIVE_OFFSET: usize = 63 * 64;

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

    /// [`take`](Self::take) for `bytes` after a zeroed prefix of `offset` bytes (one of
    /// [`receive_offset`]'s): the buffer's length is `offset`. Its capacity has room for the
    /// largest offset, so that the same kept buffer serves the next calls' offsets.
    pub(crate) fn take_at(self, offset: usize, bytes: usize) -> Result<Vec<u8>> {
        debug_assert!(offset <= MAX_RECEIVE_OFFSET);
        let mut v = self.take(bytes.saturating_add(MAX_RECEIVE_OFFSET))?;
        v.resize(offset, 0);
        Ok(v)
    }

    /// Keeps `buf` for the thread's next collective when its size is worth keeping and it
    /// is at least as large as the buffer already kept.
    pub(crate) fn give_back(self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if !(KEEP_MIN_BYTES..=KEEP_MAX_BYTES + MAX_RECEIVE_OFFSET).contains(&cap) {
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
        Kept::Send.give_back(Vec::with_capacity(KEEP_MAX_BYTES + MAX_RECEIVE_OFFSET + 1));
        assert_eq!(Kept::Send.take(0).unwrap().capacity(), 0);
    }

    #[test]
    fn receive_offsets_step_by_64_through_a_page_and_share_one_kept_buffer() {
        release_buffers();
        assert_eq!(
            receive_offset(SMALL - 1),
            0,
            "values too short to be copied slowly"
        );
        let offsets: Vec<usize> = (0..128).map(|_| receive_offset(SMALL)).collect();
        let mut page = offsets[..64].to_vec();
        page.sort_unstable();
        assert_eq!(page, (0..64).map(|k| k * 64).collect::<Vec<_>>());
        assert_eq!(offsets[..64], offsets[64..], "the offsets cycle");
        let mut first = None;
        for &off in &offsets[..64] {
            let mut v = Kept::Recv.take_at(off, 100 << 10).unwrap();
            assert_eq!(v.len(), off);
            assert!(v.iter().all(|&b| b == 0), "the prefix is zeroed");
            assert!(v.capacity() >= off + (100 << 10));
            let ptr = *first.get_or_insert(v.as_ptr());
            assert_eq!(v.as_ptr(), ptr, "one kept buffer serves every offset");
            // Bytes a collective wrote, which the next prefix must not show.
            v.resize(off + 100, 9);
            Kept::Recv.give_back(v);
        }
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
