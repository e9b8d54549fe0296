//! Fetching the descriptor of a peer's segment: a duplicate of this process's own descriptor,
//! `pidfd_getfd` with the owner's pidfd (kept in a bounded cache) in another process, and the
//! `/proc` fallback where `pidfd_getfd` is not allowed.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use super::proc_fallback::open_via_proc;
use super::segment_table::segments;
use super::{lock, HostHandle, HostMemory};
use crate::backend::descriptor::{self, has_exited, BadPid, Got, Pidfd};
use crate::error::{os, IpcError, Result};

/// The pidfds of owners whose handles opened, most recently used last; at most
/// [`HostMemory::PIDFD_CACHE_CAPACITY`], none of a process known to have exited.
#[derive(Debug, Default)]
pub(super) struct PidfdCache {
    entries: Vec<(u32, Arc<OwnedFd>)>,
}

impl PidfdCache {
    /// The cached pidfd of `pid`, unless its process has exited (the entry is dropped then:
    /// the pid may name a new process now).
    fn get(&mut self, pid: u32) -> Option<Arc<OwnedFd>> {
        let i = self.entries.iter().position(|(p, _)| *p == pid)?;
        let entry = self.entries.remove(i);
        if has_exited(&entry.1) {
            return None;
        }
        let pidfd = entry.1.clone();
        self.entries.push(entry);
        Some(pidfd)
    }

    /// Keeps the pidfd of `pid` (whose handle just opened) as the most recently used, after
    /// dropping the entries of exited processes and, when full, the least recently used.
    pub(super) fn keep(&mut self, pid: u32, pidfd: Arc<OwnedFd>) {
        self.entries.retain(|(p, fd)| *p != pid && !has_exited(fd));
        if self.entries.len() >= HostMemory::PIDFD_CACHE_CAPACITY {
            self.entries.remove(0);
        }
        self.entries.push((pid, pidfd));
    }

    pub(super) fn forget(&mut self, pid: u32) {
        self.entries.retain(|(p, _)| *p != pid);
    }
}

/// A descriptor fetched for a handle, and the owner's pidfd it was fetched with (to cache
/// once the open succeeded).
pub(super) struct Fetched {
    pub(super) fd: OwnedFd,
    pub(super) pidfd: Option<Arc<OwnedFd>>,
}

impl HostMemory {
    pub(super) fn cache(&self) -> std::sync::MutexGuard<'_, PidfdCache> {
        lock(&self.pidfds)
    }

    /// The pidfd of `pid`, cached or freshly opened (and not cached: see
    /// [`PidfdCache::keep`]); `None` where the kernel (or a tool such as valgrind) does not
    /// provide `pidfd_open`, in which case `/proc` serves instead.
    pub(super) fn pidfd(&self, pid: u32) -> Result<Option<Arc<OwnedFd>>> {
        if let Some(fd) = self.cache().get(pid) {
            return Ok(Some(fd));
        }
        let owner = descriptor::process(pid).map_err(|bad| {
            IpcError::InvalidHandle(match bad {
                BadPid::OutOfRange => format!("pid {pid} out of range"),
                BadPid::NotAProcessId => format!("pid {pid} is not a process id"),
            })
        })?;
        match descriptor::open_pidfd(owner, pid)? {
            Pidfd::Open(fd) => Ok(Some(Arc::new(fd))),
            Pidfd::Refused(_) => Ok(None),
        }
    }

    /// Fetches the descriptor `h` names (not checked yet: see [`check_segment`]).
    ///
    /// [`check_segment`]: super::segment_checks::check_segment
    pub(super) fn fetch_fd(&self, h: &HostHandle) -> Result<Fetched> {
        let (pid, fd) = (h.pid, h.fd);
        if pid == std::process::id() {
            return Ok(Fetched {
                fd: dup_own(fd, h.inode)?,
                pidfd: None,
            });
        }
        let Some(pidfd) = self.pidfd(pid)? else {
            return Ok(Fetched {
                fd: open_via_proc(h)?,
                pidfd: None,
            });
        };
        match descriptor::get_fd(&pidfd, pid, fd) {
            Ok(Got::Fd(got)) => Ok(Fetched {
                fd: got,
                pidfd: Some(pidfd),
            }),
            // Not allowed to ptrace the owner (or no pidfd_getfd): reopen through /proc.
            Ok(Got::Refused) => Ok(Fetched {
                fd: open_via_proc(h)?,
                pidfd: None,
            }),
            Err(e @ IpcError::OwnerGone { .. }) => {
                self.cache().forget(pid);
                Err(e)
            }
            Err(e) => Err(e),
        }
    }
}

/// Duplicates this process's descriptor `fd`, which must belong to the live segment `inode`.
pub(super) fn dup_own(fd: i32, inode: u64) -> Result<OwnedFd> {
    let table = segments();
    table.check_live(fd, inode)?;
    // SAFETY: the table lists `fd` as the segment descriptor of live HostBuffers; each holds
    // its segment (and so the descriptor) and removes its entry under this lock, which we
    // hold, before letting go of it, and the entry goes with the segment's last buffer, so
    // `fd` stays open for the duration of this borrow.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 0).map_err(os("fcntl(F_DUPFD_CLOEXEC)"))
}
