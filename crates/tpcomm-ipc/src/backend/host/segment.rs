//! The segments this process makes: a memfd created, made private to this user, sized,
//! sealed and mapped whole (`OwnedSegment`), freed with its last buffer; and the shared
//! mapping every segment and peer segment goes through.

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::{self, NonNull};

use rustix::fs::{MemfdFlags, Mode};
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};

use super::{OwnedSegment, SEGMENT_SEALS};
use crate::error::{os, IpcError, Result};

/// A new memfd of `len` bytes named `name`, made private to this user, sized and sealed
/// (before it is mapped or exported: no one can change its size from then on); its
/// descriptor, device and inode.
pub(super) fn segment_file(len: usize, name: &str) -> Result<(OwnedFd, u64, u64)> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(os("memfd_create"))?;
    rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR).map_err(os("fchmod 0600"))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
    rustix::fs::fcntl_add_seals(&fd, SEGMENT_SEALS).map_err(os("fcntl(F_ADD_SEALS)"))?;
    let stat = rustix::fs::fstat(&fd).map_err(os("fstat"))?;
    Ok((fd, stat.st_dev, stat.st_ino))
}

// SAFETY: an owned descriptor plus a MAP_SHARED mapping; neither is tied to the creating
// thread, and the bytes are only reached through raw copies or atomics.
unsafe impl Send for OwnedSegment {}

// SAFETY: `&OwnedSegment` exposes nothing but the address, length and identity.
unsafe impl Sync for OwnedSegment {}

impl fmt::Debug for OwnedSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedSegment")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("fd", &self.fd.as_raw_fd())
            .finish()
    }
}

impl OwnedSegment {
    /// A new segment of `len` bytes (a multiple of the page size) named `name`: created,
    /// made private to this user, sized, sealed (before it is mapped or exported: no one can
    /// change its size from then on) and mapped.
    pub(super) fn new(len: usize, name: &str) -> Result<Self> {
        let (fd, dev, inode) = segment_file(len, name)?;
        let ptr = map_shared(&fd, 0, len)?;
        Ok(Self {
            ptr,
            len,
            fd,
            dev,
            inode,
        })
    }

    /// Frees the pages of `offset..offset + len` (page aligned, inside the segment): their
    /// memory goes back to the system and the range reads as zeros, here and in every peer
    /// mapping. Zeroed by hand where the file system refuses to punch holes.
    ///
    /// Called only on an extent being handed out again: see the `arena` module.
    pub(super) fn punch(&self, offset: usize, len: usize) {
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        if let Err(e) = rustix::fs::fallocate(&self.fd, flags, offset as u64, len as u64) {
            tracing::debug!(error = %e, "punching a freed extent failed: zeroing it");
            // SAFETY: `offset..offset + len` lies inside this live mapping of a file sealed
            // against shrinking (checked by the caller, the arena's extent), and no Rust
            // reference points into shared memory.
            unsafe { ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
        }
    }
}

impl Drop for OwnedSegment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, unmapped once here; the
        // descriptor closes after (a field).
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a host segment failed");
        }
    }
}

/// Maps `len` bytes of `fd` from `offset` (page aligned) shared, read-write.
pub(super) fn map_shared(fd: &OwnedFd, offset: u64, len: usize) -> Result<NonNull<u8>> {
    // SAFETY: a fresh mapping at an address chosen by the kernel (null hint, no MAP_FIXED)
    // cannot alias any existing Rust object; `fd` is a valid descriptor for the call.
    let p = unsafe {
        rustix::mm::mmap(
            ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            offset,
        )
    }
    .map_err(os("mmap"))?;
    NonNull::new(p.cast::<u8>()).ok_or(IpcError::Os {
        call: "mmap",
        source: Errno::NOMEM,
    })
}

pub(super) fn page_size() -> usize {
    rustix::param::page_size()
}
