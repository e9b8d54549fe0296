//! `AddressHold`: an inaccessible reservation of an address range, so that tests can prove a
//! reopened mapping lands elsewhere than a closed one.

use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;

use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{os, IpcError, Result};

/// An address range held inaccessible (`PROT_NONE`) so that no mapping can land there;
/// released on drop.
///
/// Used to prove that callers never keep stale peer addresses: hold the address of a closed
/// mapping, reopen, and the new mapping must be elsewhere.
pub struct AddressHold {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an inaccessible reservation owned by this value; no thread affinity.
unsafe impl Send for AddressHold {}

impl fmt::Debug for AddressHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressHold")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl AddressHold {
    /// Reserves `len` bytes at `addr` (page aligned), failing if anything is mapped there.
    pub fn at(addr: u64, len: usize) -> Result<Self> {
        let hint = addr as usize as *mut c_void;
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping (the kernel fails
        // with EEXIST instead), so no live memory is touched; the reservation is PROT_NONE.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                hint,
                len,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE | MapFlags::NORESERVE,
            )
        }
        .map_err(os("mmap(MAP_FIXED_NOREPLACE)"))?;
        if p != hint {
            // Kernels before 4.17 ignore the flag and may map elsewhere: give it back.
            // SAFETY: the mapping just made, unmapped once.
            let _ = unsafe { rustix::mm::munmap(p, len) };
            return Err(IpcError::Os {
                call: "mmap(MAP_FIXED_NOREPLACE)",
                source: Errno::EXIST,
            });
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(IpcError::Os {
            call: "mmap",
            source: Errno::INVAL,
        })?;
        Ok(Self { ptr, len })
    }
}

impl Drop for AddressHold {
    fn drop(&mut self) {
        // SAFETY: the reservation made in `at`, unmapped once.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "releasing an address hold failed");
        }
    }
}
