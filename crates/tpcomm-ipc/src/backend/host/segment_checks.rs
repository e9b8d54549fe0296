//! What a handle and the descriptor fetched for it must be before anything is mapped: the
//! handle's own fields, the segment's identity, seals, file system, name and size (see the
//! module documentation of `host` for each check and why).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::fs::SealFlags;
use rustix::io::Errno;

use super::{HostHandle, PeerMap, SEGMENT_NAME, SEGMENT_SEALS};
use crate::backend::descriptor::{self, Identity, IfStatxRefused};
use crate::error::{os, IpcError, Result, SegmentProblem};

/// Seals that forbid mapping a segment read-write.
const WRITE_SEALS: SealFlags = SealFlags::WRITE.union(SealFlags::FUTURE_WRITE);

/// `statfs.f_type` of tmpfs, which memfds (other than hugetlbfs ones) live on.
pub(super) const TMPFS_MAGIC: u32 = 0x0102_1994;

/// `statfs.f_type` of hugetlbfs.
pub(super) const HUGETLBFS_MAGIC: u32 = 0x9584_58f6;

/// The fields of a handle that can be checked without its segment: a non-empty range inside
/// the segment, a descriptor number, sizes this process can address. Returns the segment's
/// length.
pub(super) fn check_fields(h: &HostHandle) -> Result<usize> {
    descriptor::check_range_and_fd(h.offset, h.len, h.segment_len, "segment", h.fd)?;
    usize::try_from(h.segment_len)
        .map_err(|_| IpcError::InvalidHandle("segment length out of range".into()))
}

/// A handle of a segment mapped already announces the segment's true size.
pub(super) fn check_len(map: &PeerMap, h: &HostHandle) -> Result<()> {
    if u64::try_from(map.len).ok() != Some(h.segment_len) {
        return Err(IpcError::InvalidHandle(format!(
            "segment is {} bytes, the handle says {}",
            map.len, h.segment_len
        )));
    }
    Ok(())
}

/// The handle's descriptor names the handle's inode, or the handle is stale.
pub(super) fn check_identity(h: &HostHandle, id: &Identity) -> Result<()> {
    if !id.is(h.dev, h.inode) {
        return Err(IpcError::StaleHandle(format!(
            "descriptor {} of pid {} names inode {} now, not segment inode {}",
            h.fd, h.pid, id.inode, h.inode
        )));
    }
    Ok(())
}

/// The file system magic number (32 bits on every file system; the field's width varies by
/// architecture).
pub(super) fn fs_magic(fs: &rustix::fs::StatFs) -> u32 {
    fs.f_type as u32
}

/// Checks, before anything is mapped, that `fd` (fetched for `h`) is the segment `h` names
/// and a segment of this backend: see the module documentation for each check and why.
pub(super) fn check_segment(fd: &OwnedFd, h: &HostHandle) -> Result<()> {
    let not = |problem| IpcError::NotASegment {
        pid: h.pid,
        fd: h.fd,
        problem,
    };
    let id = descriptor::cached_identity(fd.as_fd(), IfStatxRefused::Fstat)?;
    check_identity(h, &id)?;
    // Before anything that may reach the file's file system: only shmem files (tmpfs,
    // hugetlbfs) have seals, and the VFS answers for every other file without asking its
    // file system (an O_PATH descriptor is refused outright).
    let seals = match rustix::fs::fcntl_get_seals(fd) {
        Ok(seals) => seals,
        Err(Errno::INVAL | Errno::BADF) => return Err(not(SegmentProblem::NotMemfd)),
        Err(e) => {
            return Err(IpcError::Os {
                call: "fcntl(F_GET_SEALS)",
                source: e,
            })
        }
    };
    if !seals.contains(SEGMENT_SEALS) {
        return Err(not(SegmentProblem::Unsealed {
            seals: seals.bits(),
        }));
    }
    if seals.intersects(WRITE_SEALS) {
        return Err(not(SegmentProblem::WriteSealed {
            seals: seals.bits(),
        }));
    }
    let fs = rustix::fs::fstatfs(fd).map_err(os("fstatfs"))?;
    if fs_magic(&fs) != TMPFS_MAGIC {
        return Err(not(SegmentProblem::NotTmpfs {
            fs_type: fs_magic(&fs),
        }));
    }
    let link = rustix::fs::readlink(format!("/proc/self/fd/{}", fd.as_raw_fd()), Vec::new())
        .map_err(os("readlink /proc/self/fd"))?;
    let name = link.to_string_lossy();
    if name != format!("/memfd:{SEGMENT_NAME} (deleted)") {
        return Err(not(SegmentProblem::ForeignName {
            name: name.into_owned(),
        }));
    }
    // Read after the seals: the size cannot change any more.
    let size = rustix::fs::fstat(fd).map_err(os("fstat"))?.st_size;
    if u64::try_from(size).ok() != Some(h.segment_len) {
        return Err(IpcError::InvalidHandle(format!(
            "segment is {size} bytes, the handle says {}",
            h.segment_len
        )));
    }
    Ok(())
}
