//! Fetching a peer's descriptor and checking it before anything can block: the handle's own
//! range and descriptor number, the owner's pidfd (`pidfd_open`), the descriptor
//! (`pidfd_getfd`), the file's identity from the kernel's cached attributes, and the close of
//! a refused descriptor off the caller's thread.
//! Shared by the backends that fetch descriptors (host memfds, CUDA virtual-memory
//! allocations); where they answer differently (the host backend falls back to `/proc` and to
//! `fstat`, the virtual-memory one cannot), these functions say what happened and each backend
//! decides.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::{AtFlags, StatxFlags};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

use crate::error::{os, IpcError, Result};

/// Whether the process of `pidfd` has exited: a pidfd polls readable from then on. An
/// error of `poll` (none is expected) counts as alive; the host backend's pidfd cache is
/// bounded anyway.
pub(super) fn has_exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut fds, Some(&now)), Ok(n) if n > 0)
}

/// Why a handle's pid cannot name a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BadPid {
    /// Above `i32::MAX`.
    OutOfRange,
    /// Not a process id (`Pid::from_raw` refuses it).
    NotAProcessId,
}

/// The process a handle's `pid` names, or why it cannot name one (each backend words it).
pub(super) fn process(pid: u32) -> std::result::Result<Pid, BadPid> {
    let raw = i32::try_from(pid).map_err(|_| BadPid::OutOfRange)?;
    Pid::from_raw(raw).ok_or(BadPid::NotAProcessId)
}

/// The fields of a handle that can be checked without its file: a non-empty range of `len`
/// bytes at `offset` inside the `whole` bytes of the file it announces (a `what`, in the
/// refusal), and a descriptor number `fd` that can be one; [`IpcError::InvalidHandle`]
/// otherwise.
pub(super) fn check_range_and_fd(
    offset: u64,
    len: u64,
    whole: u64,
    what: &str,
    fd: i32,
) -> Result<()> {
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > whole) {
        return Err(IpcError::InvalidHandle(format!(
            "range {offset}+{len} outside a {whole}-byte {what}"
        )));
    }
    if fd < 0 {
        return Err(IpcError::InvalidHandle(format!("negative descriptor {fd}")));
    }
    Ok(())
}

/// What `pidfd_open` of a handle's owner gave.
#[derive(Debug)]
pub(super) enum Pidfd {
    /// The owner's pidfd.
    Open(OwnedFd),
    /// The kernel (or a tool such as valgrind) does not provide `pidfd_open`, or it is not
    /// allowed here (`NOSYS`, `PERM`, `ACCESS`): the host backend turns to `/proc`, the
    /// virtual-memory backend fails (with the errno, which only it reads).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Refused(Errno),
}

/// `pidfd_open` of `owner`, the process of `pid`: [`IpcError::OwnerGone`] when it does not
/// exist, [`IpcError::Os`] for an unexpected failure.
pub(super) fn open_pidfd(owner: Pid, pid: u32) -> Result<Pidfd> {
    match rustix::process::pidfd_open(owner, PidfdFlags::empty()) {
        Ok(fd) => Ok(Pidfd::Open(fd)),
        Err(Errno::SRCH) => Err(IpcError::OwnerGone { pid }),
        Err(e @ (Errno::NOSYS | Errno::PERM | Errno::ACCESS)) => Ok(Pidfd::Refused(e)),
        Err(e) => Err(IpcError::Os {
            call: "pidfd_open",
            source: e,
        }),
    }
}

/// What `pidfd_getfd` of a handle's descriptor gave.
#[derive(Debug)]
pub(super) enum Got {
    /// A copy of the descriptor (not checked yet).
    Fd(OwnedFd),
    /// Not allowed to ptrace the owner, or no `pidfd_getfd` (`PERM`, `NOSYS`, `ACCESS`): the
    /// host backend reopens through `/proc`, the virtual-memory backend is unsupported here.
    Refused,
}

/// `pidfd_getfd` of descriptor `fd` of process `pid`, whose pidfd is `pidfd`:
/// [`IpcError::OwnerGone`] when the owner has exited (reaped or not),
/// [`IpcError::StaleHandle`] when the descriptor is closed, [`IpcError::Os`] for an
/// unexpected failure.
pub(super) fn get_fd(pidfd: &OwnedFd, pid: u32, fd: i32) -> Result<Got> {
    match rustix::process::pidfd_getfd(pidfd, fd, PidfdGetfdFlags::empty()) {
        Ok(got) => Ok(Got::Fd(got)),
        // An exiting or exited owner not reaped yet has no descriptors left: kernels
        // before 6.9 say EBADF for it (later ones ESRCH).
        Err(Errno::BADF) if has_exited(pidfd) => Err(IpcError::OwnerGone { pid }),
        Err(Errno::BADF) => Err(IpcError::StaleHandle(format!(
            "descriptor {fd} of pid {pid} is closed"
        ))),
        Err(Errno::SRCH) => Err(IpcError::OwnerGone { pid }),
        Err(Errno::PERM | Errno::NOSYS | Errno::ACCESS) => Ok(Got::Refused),
        Err(e) => Err(IpcError::Os {
            call: "pidfd_getfd",
            source: e,
        }),
    }
}

/// How long a refusal waits for a refused descriptor's close on its own thread before it
/// returns without it.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// Closes a descriptor fetched for a handle and refused. Closing a file calls its file
/// system's `flush`, which for a FUSE file (or one on a hard NFS mount) waits on a server
/// that may never answer: a file that is not shmem (which has no `flush`) is therefore
/// closed on a thread of its own, waited for [`CLOSE_WAIT`] at most (an ordinary file's
/// close ends long before: the descriptor is gone when the refusal returns), and left to
/// that thread after. A thread that cannot be spawned closes it here (the closure is dropped
/// with the descriptor).
pub(super) fn close_refused(fd: OwnedFd) {
    if rustix::fs::fcntl_get_seals(&fd).is_ok() {
        return drop(fd);
    }
    let (closed, wait) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("tpcomm-ipc-close".into())
        .spawn(move || {
            drop(fd);
            let _ = closed.send(());
        });
    match spawned {
        Ok(_) => {
            if wait.recv_timeout(CLOSE_WAIT).is_err() {
                tracing::warn!("a refused descriptor's close is still waiting on its file system");
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "a refused descriptor was closed on the caller's thread")
        }
    }
}

/// `fd` if `check` accepts it; otherwise its error, and `fd` is closed with
/// [`close_refused`] (a refused descriptor may be a file whose server never answers).
pub(super) fn checked(fd: OwnedFd, check: impl FnOnce(&OwnedFd) -> Result<()>) -> Result<OwnedFd> {
    match check(&fd) {
        Ok(()) => Ok(fd),
        Err(e) => {
            close_refused(fd);
            Err(e)
        }
    }
}

/// The identity (device, inode, device number, mode) of the file `fd` refers to, as the
/// kernel has it cached: `statx` with `AT_STATX_DONT_SYNC`, which FUSE and NFS answer without
/// asking their server, so that looking at a forged handle's file never waits on a server
/// that does not answer (other network file systems may still ask theirs). Where `statx` is
/// refused (a seccomp filter, a kernel before 4.11), a plain `fstat` serves if the caller
/// asks for it ([`IfStatxRefused::Fstat`]), which does ask.
pub(super) fn cached_identity(fd: BorrowedFd<'_>, if_refused: IfStatxRefused) -> Result<Identity> {
    let flags = AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC;
    match rustix::fs::statx(fd, c"", flags, StatxFlags::TYPE | StatxFlags::INO) {
        Ok(x) => Ok(Identity {
            dev: rustix::fs::makedev(x.stx_dev_major, x.stx_dev_minor),
            inode: x.stx_ino,
            rdev: rustix::fs::makedev(x.stx_rdev_major, x.stx_rdev_minor),
            mode: u32::from(x.stx_mode),
        }),
        Err(Errno::NOSYS | Errno::PERM) if if_refused == IfStatxRefused::Fstat => {
            let stat = rustix::fs::fstat(fd).map_err(os("fstat"))?;
            Ok(Identity {
                dev: stat.st_dev,
                inode: stat.st_ino,
                rdev: stat.st_rdev,
                mode: stat.st_mode,
            })
        }
        Err(e) => Err(IpcError::Os {
            call: "statx(AT_STATX_DONT_SYNC)",
            source: e,
        }),
    }
}

/// What [`cached_identity`] does where `statx` is refused (`NOSYS`, `PERM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IfStatxRefused {
    /// Reads `fstat` instead (the host backend).
    Fstat,
    /// Fails with [`IpcError::Os`] (the CUDA virtual-memory backend).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Fail,
}

/// What the kernel's cached attributes say a descriptor is ([`cached_identity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Identity {
    /// Device of the inode.
    pub(super) dev: u64,
    /// The inode.
    pub(super) inode: u64,
    /// The device the file is, for a device file (`st_rdev`).
    pub(super) rdev: u64,
    /// File type and permissions (`st_mode`).
    pub(super) mode: u32,
}

impl Identity {
    /// Whether this is the file of device `dev` and inode `inode` (a handle's file).
    pub(super) fn is(&self, dev: u64, inode: u64) -> bool {
        self.dev == dev && self.inode == inode
    }
}
