//! The `/proc/<pid>/fd` fallback, for a same-user owner whose descriptors `pidfd_getfd` may
//! not fetch: the descriptor's link and an `O_PATH` look at it decide before anything is
//! opened.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

use super::segment_checks::{check_identity, fs_magic, HUGETLBFS_MAGIC, TMPFS_MAGIC};
use super::HostHandle;
use crate::backend::descriptor::{self, IfStatxRefused};
use crate::error::{os, IpcError, Result, SegmentProblem};

/// Reopens the descriptor `h` names through `/proc` (allowed for a same-user process when
/// ptrace restrictions forbid `pidfd_getfd`).
///
/// Reopening opens the file anew, so it is first looked at: its link must name a memfd,
/// then through an `O_PATH` descriptor, which opens nothing, it must still name one and be
/// a regular file on tmpfs (or hugetlbfs) with the handle's inode. A forged handle can
/// thus never make this process open a device, a FIFO or an ordinary file of the owner,
/// nor ask the server of a network or FUSE file system anything.
pub(super) fn open_via_proc(h: &HostHandle) -> Result<OwnedFd> {
    let (pid, fd) = (h.pid, h.fd);
    let gone = |e, call| match e {
        Errno::NOENT if process_exited(pid) => IpcError::OwnerGone { pid },
        Errno::NOENT => IpcError::StaleHandle(format!("descriptor {fd} of pid {pid} is closed")),
        e => IpcError::Os { call, source: e },
    };
    let not_memfd = IpcError::NotASegment {
        pid,
        fd,
        problem: SegmentProblem::NotMemfd,
    };
    let owners = format!("/proc/{pid}/fd/{fd}");
    // The link is read from the owner's table without touching the file: a file of any
    // other file system (one whose server may never answer) is refused before it is
    // looked up, let alone stat'ed.
    match names_a_memfd(&owners) {
        Ok(true) => {}
        Ok(false) => return Err(not_memfd),
        Err(IpcError::Os { source, call }) => return Err(gone(source, call)),
        Err(e) => return Err(e),
    }
    let path = rustix::fs::open(&owners, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| gone(e, "open /proc/<pid>/fd (O_PATH)"))?;
    // Again for the file now held (the owner may have put another file at that number).
    if !names_a_memfd(&format!("/proc/self/fd/{}", path.as_raw_fd()))? {
        return Err(not_memfd);
    }
    let id = descriptor::cached_identity(path.as_fd(), IfStatxRefused::Fstat)?;
    check_identity(h, &id)?;
    // A memfd lives on the kernel's internal tmpfs (or on hugetlbfs): `fstatfs` asks no
    // server. hugetlbfs files are let through so that `check_segment` names them as on the
    // `pidfd_getfd` path; opening one has no side effect either.
    let fs = rustix::fs::fstatfs(&path).map_err(os("fstatfs"))?;
    let shmem = [TMPFS_MAGIC, HUGETLBFS_MAGIC].contains(&fs_magic(&fs));
    if !FileType::from_raw_mode(id.mode).is_file() || !shmem {
        return Err(not_memfd);
    }
    rustix::fs::open(
        format!("/proc/self/fd/{}", path.as_raw_fd()),
        OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(os("open /proc/self/fd (reopen)"))
}

/// Whether the descriptor link `link` (under `/proc`) names a memfd (`/memfd:<name>`,
/// which only `memfd_create` files show). Reading a link asks no file system.
fn names_a_memfd(link: &str) -> Result<bool> {
    let target = rustix::fs::readlink(link, Vec::new()).map_err(os("readlink /proc/<pid>/fd"))?;
    Ok(target.as_bytes().starts_with(b"/memfd:"))
}

/// Whether process `pid` is gone or has exited (a zombie not reaped yet, whose descriptors
/// are all closed), as `/proc` tells.
pub(super) fn process_exited(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // `pid (comm) S ...`: the state follows the last `)` (comm may hold anything).
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some('Z' | 'X' | 'x'))
}
