//! The timed path's receive copies: owned buffers that end at a `PROT_NONE` guard page, so
//! that a peer sending more than agreed cannot make MPI write past them.

use std::ffi::c_void;
use std::ptr;

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

impl GuardedBuf {
    /// A guarded buffer holding a copy of `init` (which must not be empty).
    pub(super) fn copy_of(op: Op, init: &[u8]) -> Result<Self> {
        let os = |call: &'static str| {
            move |e: rustix::io::Errno| TransportError::Os {
                op,
                call,
                source: e.into(),
            }
        };
        let len = init.len().max(1);
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
        // SAFETY: `start + len == data_len`: the data lies inside the readable and writable
        // pages of the mapping, which nothing else refers to yet.
        let data = unsafe { std::slice::from_raw_parts_mut(this.data(), len) };
        copy_slice(&mut data[..init.len()], init);
        Ok(this)
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
}

impl Drop for GuardedBuf {
    fn drop(&mut self) {
        // SAFETY: `map`/`map_len` is the mapping created in `copy_of`, owned by `self`;
        // nothing refers to it after drop (an `InFlight` MPI may still use is leaked,
        // never dropped).
        if let Err(e) = unsafe { rustix::mm::munmap(self.map, self.map_len) } {
            tracing::warn!(error = %e, "munmap of a guarded receive buffer failed");
        }
    }
}
