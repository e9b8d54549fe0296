//! The timed path's owned buffers: receive copies that end at a `PROT_NONE` guard page, so
//! that a peer sending more than agreed cannot make MPI write past them, and the spare pair
//! a communicator keeps between collectives so that a call maps and faults in nothing.

use std::ffi::c_void;
use std::ptr;
use std::sync::{Mutex, PoisonError};

use crate::copy::copy_slice;
use crate::error::{Op, Result, TransportError};

/// A receive buffer whose last byte is followed by a `PROT_NONE` page: an anonymous
/// mapping of whole pages plus one guard page, the bytes placed so that they end exactly
/// where the guard begins.
///
/// Why: Open MPI 4.1's shared-memory transport (`btl/vader` with the CMA single-copy
/// mechanism, its default on Linux) moves a message larger than its eager limit (4 KiB)
/// with one `process_vm_readv` of the *sender's* length into the receive buffer, even when
/// the receive count is smaller (it reports `MPI_ERR_TRUNCATE`, after the copy). A peer
/// that sends more than was agreed then overwrote the honest rank's heap (SIGSEGV,
/// `malloc(): corrupted top size`). Into a guarded buffer the kernel copy stops at the
/// guard page with `EFAULT` instead: nothing outside this mapping is written, and MPI
/// reports the truncation as an error. (A user-space copy, as XPMEM does, would fault on
/// the guard page instead: a crash, still no silent corruption.)
///
/// One mapping serves calls of any length up to its capacity: [`GuardedBuf::resize`] moves
/// the start of the data so that its end stays at the guard.
pub(super) struct GuardedBuf {
    /// Start of the mapping (page-aligned).
    map: *mut c_void,
    /// Length of the mapping: the data pages plus the guard page.
    map_len: usize,
    /// Offset of the first byte of data in the mapping.
    start: usize,
    /// Bytes of data (at least one).
    len: usize,
}

// SAFETY: a `GuardedBuf` owns its mapping alone (nothing else refers to it while it lives),
// like a `Vec` owns its allocation; moving it to another thread moves that ownership.
unsafe impl Send for GuardedBuf {}

impl GuardedBuf {
    /// A guarded buffer with room for `capacity` bytes (at least one), its data the last
    /// `capacity` bytes before the guard, zeroed.
    pub(super) fn new(op: Op, capacity: usize) -> Result<Self> {
        let os = |call: &'static str| {
            move |e: rustix::io::Errno| TransportError::Os {
                op,
                call,
                source: e.into(),
            }
        };
        let len = capacity.max(1);
        let page = rustix::param::page_size();
        let data_len = len
            .div_ceil(page)
            .checked_mul(page)
            .and_then(|d| d.checked_add(page).map(|m| (d, m)));
        let Some((data_len, map_len)) = data_len else {
            return Err(TransportError::Os {
                op,
                call: "mmap",
                source: std::io::Error::other(format!("a {len}-byte guarded buffer")),
            });
        };
        // SAFETY: a fresh private anonymous mapping at an address the kernel chooses: no
        // existing memory is touched.
        let map = unsafe {
            rustix::mm::mmap_anonymous(
                ptr::null_mut(),
                map_len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(os("mmap"))?;
        let this = Self {
            map,
            map_len,
            start: data_len - len,
            len,
        };
        // SAFETY: `[map + data_len, map + map_len)` is the last page of the mapping just
        // created and owned by `this`; nothing refers to it.
        unsafe {
            rustix::mm::mprotect(
                map.cast::<u8>().add(data_len).cast(),
                page,
                rustix::mm::MprotectFlags::empty(),
            )
        }
        .map_err(os("mprotect"))?;
        Ok(this)
    }

    /// Bytes of data the mapping can hold before its guard page.
    pub(super) fn capacity(&self) -> usize {
        self.map_len - rustix::param::page_size()
    }

    /// Makes the data the last `len` bytes before the guard page (`len` at least one and at
    /// most the capacity, else the length is left as it was and `None` returned), and
    /// returns them to fill. Bytes of an earlier use are still there: callers either fill
    /// the data or let MPI write all of it.
    pub(super) fn resize(&mut self, len: usize) -> Option<&mut [u8]> {
        let capacity = self.capacity();
        if len == 0 || len > capacity {
            return None;
        }
        self.start = capacity - len;
        self.len = len;
        Some(self.as_mut_slice())
    }

    /// The first byte of data.
    fn data(&self) -> *mut u8 {
        // SAFETY: `start < map_len`: the offset stays inside the mapping.
        unsafe { self.map.cast::<u8>().add(self.start) }
    }

    /// Where MPI writes (valid for `len` bytes, followed by the guard page).
    pub(super) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.data()
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: the `len` data bytes are readable and owned by `self`; `&self` excludes
        // writes through `as_mut_ptr` for the slice's life. MPI writes only while the
        // request is active, and callers read only after it completed.
        unsafe { std::slice::from_raw_parts(self.data(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `start + len == capacity`: the data lies inside the readable and writable
        // pages of the mapping, owned by `self`; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.data(), self.len) }
    }
}

impl Drop for GuardedBuf {
    fn drop(&mut self) {
        // SAFETY: `map`/`map_len` is the mapping created in `new`, owned by `self`; nothing
        // refers to it after drop (an `InFlight` MPI may still use is leaked, never
        // dropped).
        if let Err(e) = unsafe { rustix::mm::munmap(self.map, self.map_len) } {
            tracing::warn!(error = %e, "munmap of a guarded receive buffer failed");
        }
    }
}

/// The largest buffers a communicator keeps between collectives: a larger call maps its
/// own and lets it go after (its transfer costs far more than the mapping).
const KEEP: usize = 16 << 20;

/// The send and receive buffers of the last timed collective that completed, kept for the
/// next: a stream of calls (a queue's frames and pieces) then reuses warm pages instead of
/// mapping, faulting in and unmapping a receive copy per call. A collective takes them
/// ([`Spare::send_copy`], [`Spare::recv`]) and gives them back only once MPI is done with
/// them ([`Spare::keep`]); buffers of a collective abandoned at its deadline, or that failed,
/// are leaked with it and never come back.
#[derive(Default)]
pub(super) struct Spare {
    send: Mutex<Vec<u8>>,
    recv: Mutex<Option<GuardedBuf>>,
}

impl Spare {
    /// A copy of `bytes` (one zero byte when empty, so that its address is never
    /// `MPI_IN_PLACE`'s), in the spare send buffer when there is one.
    pub(super) fn send_copy(&self, bytes: &[u8]) -> Vec<u8> {
        let mut send =
            std::mem::take(&mut *self.send.lock().unwrap_or_else(PoisonError::into_inner));
        send.clear();
        if bytes.is_empty() {
            send.push(0);
        } else {
            send.extend_from_slice(bytes);
        }
        send
    }

    /// A guarded receive buffer of `len` bytes (one when `len` is 0): the spare when it has
    /// room, else a new mapping. Its bytes are unspecified: the caller fills them, or MPI
    /// writes all of them.
    pub(super) fn recv(&self, op: Op, len: usize) -> Result<GuardedBuf> {
        let len = len.max(1);
        let spare = self
            .recv
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let mut buf = match spare {
            Some(buf) if buf.capacity() >= len => buf,
            _ => GuardedBuf::new(op, len)?,
        };
        let sized = buf.resize(len).is_some();
        debug_assert!(sized, "the buffer has room for {len} bytes");
        Ok(buf)
    }

    /// A guarded receive buffer holding a copy of `init` (one byte when `init` is empty).
    pub(super) fn recv_copy_of(&self, op: Op, init: &[u8]) -> Result<GuardedBuf> {
        let mut buf = self.recv(op, init.len())?;
        copy_slice(&mut buf.as_mut_slice()[..init.len()], init);
        Ok(buf)
    }

    /// Keeps the buffers of a collective MPI is done with for the next one (up to
    /// [`KEEP`] bytes each; larger ones are freed).
    pub(super) fn keep(&self, send: Vec<u8>, recv: GuardedBuf) {
        if send.capacity() <= KEEP {
            *self.send.lock().unwrap_or_else(PoisonError::into_inner) = send;
        }
        if recv.capacity() <= KEEP {
            *self.recv.lock().unwrap_or_else(PoisonError::into_inner) = Some(recv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The permissions `/proc/self/maps` gives the mapping holding `addr` (`rw-p`, `---p`).
    fn permissions_at(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
        for line in maps.lines() {
            let mut fields = line.split_whitespace();
            let (range, perms) = (fields.next().unwrap(), fields.next().unwrap());
            let (lo, hi) = range.split_once('-').unwrap();
            let lo = usize::from_str_radix(lo, 16).unwrap();
            let hi = usize::from_str_radix(hi, 16).unwrap();
            if (lo..hi).contains(&addr) {
                return perms.to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// Where the data ends, and the permissions of its last byte and of the byte after.
    fn end_of(buf: &GuardedBuf) -> (usize, String, String) {
        let data = buf.as_slice();
        let end = data.as_ptr() as usize + data.len();
        (end, permissions_at(end - 1), permissions_at(end))
    }

    #[test]
    fn data_of_every_length_ends_where_the_guard_page_begins() {
        let page = rustix::param::page_size();
        let mut buf = GuardedBuf::new(Op::Broadcast, 3 * page + 5).unwrap();
        assert_eq!(buf.capacity(), 4 * page);
        for len in [1, 64, page, page + 1, 3 * page + 5, 4 * page] {
            let data = buf.resize(len).unwrap();
            assert_eq!(data.len(), len);
            data.fill(0xab);
            let (end, last, after) = end_of(&buf);
            assert_eq!(end % page, 0, "{len} bytes end on a page boundary");
            assert!(
                last.starts_with("rw"),
                "{len}: the data is writable ({last})"
            );
            assert!(
                after.starts_with("---"),
                "{len}: the next page is PROT_NONE ({after})"
            );
            assert!(buf.as_slice().iter().all(|&b| b == 0xab));
        }
    }

    #[test]
    fn a_length_of_zero_or_past_the_capacity_is_refused_and_the_data_left_as_it_was() {
        let page = rustix::param::page_size();
        let mut buf = GuardedBuf::new(Op::Broadcast, page).unwrap();
        buf.resize(10).unwrap().fill(7);
        assert!(buf.resize(0).is_none());
        assert!(buf.resize(page + 1).is_none());
        assert_eq!(buf.as_slice(), &[7; 10]);
    }

    #[test]
    fn the_spare_reuses_a_receive_copy_with_room_and_maps_a_larger_one_when_a_call_needs_it() {
        let page = rustix::param::page_size();
        let spare = Spare::default();
        let first = spare.recv(Op::AllGather, 2 * page).unwrap();
        let capacity_end = first.as_slice().as_ptr() as usize + first.as_slice().len();
        spare.keep(spare.send_copy(b"abc"), first);
        let smaller = spare.recv_copy_of(Op::AllGather, b"hello").unwrap();
        assert_eq!(smaller.as_slice(), b"hello");
        let (end, _, after) = end_of(&smaller);
        assert_eq!(
            end, capacity_end,
            "the kept mapping serves the smaller call"
        );
        assert!(after.starts_with("---"));
        spare.keep(Vec::new(), smaller);
        let larger = spare.recv(Op::AllGather, 5 * page).unwrap();
        assert_eq!(larger.capacity(), 5 * page);
        let (_, _, after) = end_of(&larger);
        assert!(after.starts_with("---"));
    }

    #[test]
    fn buffers_past_the_keep_limit_are_freed_not_kept() {
        let spare = Spare::default();
        let big = spare.recv(Op::Broadcast, KEEP + 1).unwrap();
        spare.keep(Vec::with_capacity(KEEP + 1), big);
        assert!(spare.recv.lock().unwrap().is_none());
        assert_eq!(spare.send.lock().unwrap().capacity(), 0);
        let small = spare.recv(Op::Broadcast, 100).unwrap();
        spare.keep(vec![1; 100], small);
        assert!(spare.recv.lock().unwrap().is_some());
        assert!(spare.send.lock().unwrap().capacity() >= 100);
    }

    #[test]
    fn send_copies_are_never_empty_and_hold_exactly_the_bytes() {
        let spare = Spare::default();
        assert_eq!(spare.send_copy(&[]), vec![0]);
        spare.keep(
            spare.send_copy(&[1, 2, 3, 4, 5]),
            GuardedBuf::new(Op::Barrier, 1).unwrap(),
        );
        assert_eq!(spare.send_copy(&[9, 8]), vec![9, 8]);
    }
}
