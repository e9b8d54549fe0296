//! The regions this backend hands out: its own buffers (`HostBuffer`) and the mappings of
//! peers' segments (`HostMapping`, sharing one `PeerMap` per segment), with their traits,
//! accessors and release.

use std::ffi::c_void;
use std::fmt;
use std::os::fd::AsRawFd;

use super::segment_table::segments;
use super::{lock, stable, HostBuffer, HostMapping, PeerMap};
use crate::error::{os, Result};
use crate::memory::{MemoryRegion, Sealed};

// SAFETY: a HostBuffer holds an owned segment (descriptor and MAP_SHARED mapping), usable
// from any thread; all access to the bytes goes through raw copies or atomics.
unsafe impl Send for HostBuffer {}

// SAFETY: shared references only expose the address and length; reads and writes of the
// memory are raw copies whose races are the documented contract of shared memory.
unsafe impl Sync for HostBuffer {}

// SAFETY: an mmap owned by this value, usable from any thread.
unsafe impl Send for PeerMap {}

// SAFETY: `&PeerMap` exposes only the address and length.
unsafe impl Sync for PeerMap {}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("fd", &self.segment.as_ref().map(|s| s.fd.as_raw_fd()))
            .field("offset", &self.carved.as_ref().map_or(0, |c| c.offset))
            .finish()
    }
}

impl fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMapping")
            .field("addr", &self.addr())
            .field("len", &self.len)
            .field("detached", &self.detached)
            .finish()
    }
}

impl Sealed for HostBuffer {}

impl Sealed for HostMapping {}

impl MemoryRegion for HostBuffer {
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl MemoryRegion for HostMapping {
    fn addr(&self) -> u64 {
        self.map.ptr.as_ptr() as u64 + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl HostBuffer {
    /// Raw pointer to the first byte, for atomics and kernels over shared memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether this buffer was carved out of a shared chunk (see
    /// [`HostMemory::CARVE_MAX_BYTES`]) rather than given a segment of its own.
    ///
    /// [`HostMemory::CARVE_MAX_BYTES`]: super::HostMemory::CARVE_MAX_BYTES
    pub fn is_carved(&self) -> bool {
        self.carved.is_some()
    }
}

impl HostMapping {
    /// Raw pointer to the first byte of the mapped range.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr() as *mut u8
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Removed before the segment can go (fields drop after this body): see `dup_own`.
        segments().remove(self.ptr.as_ptr() as usize);
        match (&self.carved, &self.segment) {
            (Some(carved), Some(segment)) => {
                lock(&carved.arena).give_back(segment, carved.offset, self.len);
            }
            // Released: the reservation is this buffer's to give back.
            (_, None) => stable::free_reservation(self.ptr, self.len),
            (None, Some(_)) => {}
        }
    }
}

impl PeerMap {
    /// The segment's identity and owner.
    pub(super) fn key(&self) -> (u64, u64, u32) {
        (self.dev, self.inode, self.owner)
    }

    /// Unmaps now, reporting a failure (`Drop` can only log it).
    pub(super) fn unmap(mut self) -> Result<()> {
        // Dropped here: `ManuallyDrop` below would leak it.
        drop(self.pidfd.take());
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the mapping made in `open`, unmapped once: `ManuallyDrop` keeps `Drop`
        // from unmapping it again.
        unsafe { rustix::mm::munmap(this.ptr.as_ptr().cast::<c_void>(), this.len) }
            .map_err(os("munmap"))
    }
}

impl Drop for PeerMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `open`, unmapped once here.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a peer mapping failed");
        }
    }
}
