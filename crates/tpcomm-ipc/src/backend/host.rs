//! The host backend: shared-memory segments made with `memfd_create`.
//!
//! A segment is an anonymous memfd named `tpcomm-peer`, sized once with `ftruncate`, sealed
//! against growing and shrinking (and against further sealing) before it is mapped or
//! exported, mode 0600, and mapped `MAP_SHARED` into its owner. It never has a name in
//! `/dev/shm`, so nothing is left behind after any exit, SIGKILL included: the kernel frees
//! the segment when its last descriptor and mapping are gone. A large buffer is a segment of
//! its own; small ones are carved out of shared chunks (the `arena` module).
//!
//! A [`HostHandle`] names the owner's pid, the descriptor number in the owner, the
//! segment's device and inode (its identity), its size, and the exported range. Another
//! process opens it by fetching the descriptor with `pidfd_getfd` (falling back to
//! reopening `/proc/<pid>/fd/<n>`, which also works for an unprivileged same-user process
//! when ptrace restrictions forbid `pidfd_getfd`); another thread of the owner duplicates
//! its own descriptor. Before anything is mapped, the descriptor must be the segment the
//! handle names and a segment of this backend at all:
//!
//! - its inode and device are the handle's, or the handle is [`IpcError::StaleHandle`] (a
//!   descriptor number that was closed or reused);
//! - `F_GET_SEALS` accepts it (only memfds and other shmem files have seals) and reports
//!   `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL` and no write seal. The kernel starts every
//!   tmpfs file and every memfd made without `MFD_ALLOW_SEALING` with `F_SEAL_SEAL` alone,
//!   and seals are never removed, so these seals mean: a memfd made to be sealed, whose size
//!   no one can change any more. A peer's truncation can then never turn an access of the
//!   mapping into SIGBUS;
//! - it lives on tmpfs (`fstatfs`), which rules out hugetlbfs memfds;
//! - `/proc/self/fd/<n>` names it `/memfd:tpcomm-peer (deleted)`: a segment of this backend
//!   and not another program's sealed memfd (the name is no secret: it only keeps forged
//!   handles off other programs' memory);
//! - its size (read after the seals) is the handle's segment size.
//!
//! These checks run in an order that never waits on a file system server (a forged handle
//! may name a FUSE or NFS file whose server never answers): the identity from the kernel's
//! cached attributes (`statx` with `AT_STATX_DONT_SYNC`), then the seals (answered by the
//! VFS), and only for a shmem file `fstatfs`, the name and the size. The `/proc` fallback
//! first reads the descriptor's link, which must name a memfd.
//!
//! Anything else is [`IpcError::NotASegment`] (or `StaleHandle` / `InvalidHandle`), the
//! fetched descriptor is closed (on a thread of its own unless it is shmem: closing flushes
//! the file, which FUSE and NFS send to the server) and nothing is mapped. The descriptor
//! is also closed right after a successful `mmap`: a mapping holds no descriptor.
//!
//! A backend (with its clones) maps a peer segment once, whole; every handle opened in it
//! shares that mapping, and the last [`HostMapping`] of it to go unmaps it. A handle of a
//! segment mapped already skips the fetch (the mapping holds the file, so the device and
//! inode name it), not the checks of its own fields nor the owner's liveness.
//!
//! The pidfds of owners are cached for reuse, at most
//! [`HostMemory::PIDFD_CACHE_CAPACITY`] of them (least recently used first out); an entry
//! whose process has exited (its pidfd polls readable) is dropped, and only the pidfd of an
//! owner whose handle opened is kept.
//!
//! What these checks cannot do: `pidfd_getfd` needs ptrace (attach) access to the owner, so
//! a process that opens a peer's handle can already read and write all of that peer's
//! memory; the `/proc/<pid>/fd` fallback needs read access, which opens every file the owner
//! has open. The checks protect an honest process from buggy or lying peers and forged
//! handles; they are no boundary against a malicious process of the same user (see
//! `docs/peer-memory.md`).

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::ops::Bound::{Excluded, Unbounded};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use rustix::fs::{FileType, MemfdFlags, Mode, OFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};
use serde::{Deserialize, Serialize};

use super::descriptor::{self, has_exited, BadPid, Got, Identity, IfStatxRefused, Pidfd};
use crate::error::{os, IpcError, Result, SegmentProblem};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Region, Sealed};

mod arena;
mod stable;
#[cfg(test)]
mod stalled_fuse;

use arena::Arena;

/// The name of every segment peers may map (the kernel shows it as `/memfd:tpcomm-peer`).
const SEGMENT_NAME: &str = "tpcomm-peer";

/// The name of the segments of `allocate_private`: `open` refuses it (`ForeignName`), so a
/// handle forged to name one (say by a third rank, for another rank's tables) never maps it.
const PRIVATE_SEGMENT_NAME: &str = "tpcomm-private";

/// The seals of every segment: its size is fixed, and no seal can be added.
const SEGMENT_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Seals that forbid mapping a segment read-write.
const WRITE_SEALS: SealFlags = SealFlags::WRITE.union(SealFlags::FUTURE_WRITE);

/// `statfs.f_type` of tmpfs, which memfds (other than hugetlbfs ones) live on.
const TMPFS_MAGIC: u32 = 0x0102_1994;

/// `statfs.f_type` of hugetlbfs.
const HUGETLBFS_MAGIC: u32 = 0x9584_58f6;

/// The handle of a range of a host shared-memory segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostHandle {
    /// Pid of the owning process.
    pub pid: u32,
    /// The segment's descriptor number in the owner.
    pub fd: i32,
    /// Device of the segment's inode.
    pub dev: u64,
    /// Inode of the segment: its identity.
    pub inode: u64,
    /// Size of the whole segment.
    pub segment_len: u64,
    /// Start of the exported range in the segment.
    pub offset: u64,
    /// Length of the exported range.
    pub len: u64,
}

/// One live buffer of this process, for `export` by address: the buffer's length and where
/// it lies in its segment.
#[derive(Debug, Clone, Copy)]
struct Exportable {
    len: usize,
    fd: i32,
    dev: u64,
    inode: u64,
    segment_len: usize,
    offset: usize,
}

/// Live buffers of this process by base address: every `HostMemory` of the process shares
/// it, so that a handle exported by one thread can be opened by another without going
/// through `/proc`.
static SEGMENTS: Mutex<SegmentTable> = Mutex::new(SegmentTable::new());

/// The live buffers of this process, by base address (for `export`), and the descriptors of
/// their segments with the number of buffers in each (for same-process opens).
struct SegmentTable {
    by_addr: BTreeMap<usize, Exportable>,
    /// Descriptor -> (inode, live buffers in the segment).
    fds: BTreeMap<i32, (u64, usize)>,
    /// Changes of the table so far (the export stamp).
    generation: u64,
    /// The process that made the last change: a child forked since has its own pid in its
    /// handles, so the stamp means nothing there until it changes the table itself.
    pid: u32,
}

impl SegmentTable {
    const fn new() -> Self {
        Self {
            by_addr: BTreeMap::new(),
            fds: BTreeMap::new(),
            generation: 0,
            pid: 0,
        }
    }

    /// `fd` is the descriptor of a segment of this process, `inode`, that holds a live
    /// buffer; otherwise the handle naming them is stale.
    fn check_live(&self, fd: i32, inode: u64) -> Result<()> {
        if self.fds.get(&fd).map(|&(i, _)| i) != Some(inode) {
            return Err(IpcError::StaleHandle(format!(
                "no live segment of this process has descriptor {fd} and inode {inode}"
            )));
        }
        Ok(())
    }

    fn changed(&mut self) {
        self.generation += 1;
        self.pid = std::process::id();
    }

    /// The export stamp: the generation, in the process that made it.
    fn stamp(&self) -> Option<u64> {
        (self.pid == std::process::id()).then_some(self.generation)
    }

    fn insert(&mut self, base: usize, buffer: Exportable) {
        self.changed();
        self.fds.entry(buffer.fd).or_insert((buffer.inode, 0)).1 += 1;
        self.by_addr.insert(base, buffer);
    }

    fn remove(&mut self, base: usize) {
        let Some(buffer) = self.by_addr.remove(&base) else {
            return;
        };
        self.changed();
        if let std::collections::btree_map::Entry::Occupied(mut e) = self.fds.entry(buffer.fd) {
            e.get_mut().1 -= 1;
            if e.get().1 == 0 {
                e.remove();
            }
        }
    }
}

fn segments() -> std::sync::MutexGuard<'static, SegmentTable> {
    lock(&SEGMENTS)
}

/// The host (CPU) peer-memory backend. Cheap to clone; clones share the chunks small
/// buffers are carved from (see [`CARVE_MAX_BYTES`](Self::CARVE_MAX_BYTES)), the mappings of
/// peer segments open now (one per segment, whatever the number of handles opened in it) and
/// a cache of process descriptors (pidfds) of the peers whose handles they opened.
#[derive(Debug, Clone, Default)]
pub struct HostMemory {
    pidfds: Arc<Mutex<PidfdCache>>,
    arena: Arc<Mutex<Arena>>,
    views: Arc<Mutex<ViewCache>>,
    /// Made by [`HostMemory::stable`]: buffers are never carved, peer mappings keep their
    /// addresses through a detach, buffers can release their backing.
    stable: bool,
}

/// The mappings of peer segments open now, by segment identity (device, inode). An entry
/// whose mapping is gone fails to upgrade and is replaced.
///
/// Keying by identity alone is sound: a live mapping holds its file, so no other file can
/// have the same device and inode while the entry upgrades.
#[derive(Debug, Default)]
struct ViewCache {
    by_segment: HashMap<(u64, u64), Weak<PeerMap>>,
}

impl ViewCache {
    /// Entries past which dead ones are swept on insertion.
    const SWEEP_AT: usize = 64;

    fn get(&self, dev: u64, inode: u64) -> Option<Arc<PeerMap>> {
        self.by_segment.get(&(dev, inode)).and_then(Weak::upgrade)
    }

    fn insert(&mut self, dev: u64, inode: u64, map: &Arc<PeerMap>) {
        if self.by_segment.len() >= Self::SWEEP_AT {
            self.by_segment.retain(|_, m| m.strong_count() > 0);
        }
        self.by_segment.insert((dev, inode), Arc::downgrade(map));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing panics while holding these locks.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The pidfds of owners whose handles opened, most recently used last; at most
/// [`HostMemory::PIDFD_CACHE_CAPACITY`], none of a process known to have exited.
#[derive(Debug, Default)]
struct PidfdCache {
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
    fn keep(&mut self, pid: u32, pidfd: Arc<OwnedFd>) {
        self.entries.retain(|(p, fd)| *p != pid && !has_exited(fd));
        if self.entries.len() >= HostMemory::PIDFD_CACHE_CAPACITY {
            self.entries.remove(0);
        }
        self.entries.push((pid, pidfd));
    }

    fn forget(&mut self, pid: u32) {
        self.entries.retain(|(p, _)| *p != pid);
    }
}

/// A descriptor fetched for a handle, and the owner's pidfd it was fetched with (to cache
/// once the open succeeded).
struct Fetched {
    fd: OwnedFd,
    pidfd: Option<Arc<OwnedFd>>,
}

impl HostMemory {
    /// How many owners' pidfds a backend (and its clones) keeps open at most.
    pub const PIDFD_CACHE_CAPACITY: usize = 32;

    /// Allocations of at most this many bytes are carved out of shared chunks (one segment
    /// each, of [`CHUNK_BYTES`](Self::CHUNK_BYTES)); larger ones get a segment of their own.
    /// A peer maps a segment once however many of its buffers it opens, so that a thousand
    /// registered graph buffers cost a suspend one `munmap` and a resume one `mmap` per peer
    /// chunk instead of a thousand each.
    pub const CARVE_MAX_BYTES: usize = 1 << 20;

    /// The size of a chunk (virtual: its pages take memory once touched, and give it back
    /// when the buffer using them is freed).
    pub const CHUNK_BYTES: usize = 32 << 20;

    /// A backend.
    pub fn new() -> Self {
        Self::default()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, PidfdCache> {
        lock(&self.pidfds)
    }

    /// Chunks this backend (and its clones) carves small buffers from now.
    pub fn chunks(&self) -> usize {
        lock(&self.arena).chunks()
    }

    /// The mapping of the segment `h` names, after checking `h`: the one open already (its
    /// owner still alive), or a new one made after fetching and checking the descriptor.
    /// `views` is held while fetching and mapping, so that two threads opening handles of
    /// one segment map it once.
    fn segment_map(
        &self,
        views: &mut ViewCache,
        h: &HostHandle,
        own_pid: u32,
    ) -> Result<Arc<PeerMap>> {
        let segment_len = check_fields(h)?;
        if let Some(map) = views.get(h.dev, h.inode).filter(|m| m.owner == h.pid) {
            check_len(&map, h)?;
            check_alive(&map, h, own_pid)?;
            return Ok(map);
        }
        let Fetched { fd, pidfd } = self.fetch_fd(h)?;
        let fd = descriptor::checked(fd, |fd| check_segment(fd, h))?;
        let ptr = map_shared(&fd, 0, segment_len)?;
        let map = Arc::new(PeerMap {
            ptr,
            len: segment_len,
            owner: h.pid,
            pidfd: pidfd.clone(),
            dev: h.dev,
            inode: h.inode,
        });
        views.insert(h.dev, h.inode, &map);
        if let Some(pidfd) = pidfd {
            self.cache().keep(h.pid, pidfd);
        }
        Ok(map)
    }

    /// Peer segments this backend (and its clones) has mapped now: one per segment, however
    /// many handles of it are open.
    pub fn peer_segments_mapped(&self) -> usize {
        lock(&self.views)
            .by_segment
            .values()
            .filter(|m| m.strong_count() > 0)
            .count()
    }

    /// The pidfd of `pid`, cached or freshly opened (and not cached: see
    /// [`PidfdCache::keep`]); `None` where the kernel (or a tool such as valgrind) does not
    /// provide `pidfd_open`, in which case `/proc` serves instead.
    fn pidfd(&self, pid: u32) -> Result<Option<Arc<OwnedFd>>> {
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
    fn fetch_fd(&self, h: &HostHandle) -> Result<Fetched> {
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
fn dup_own(fd: i32, inode: u64) -> Result<OwnedFd> {
    let table = segments();
    table.check_live(fd, inode)?;
    // SAFETY: the table lists `fd` as the segment descriptor of live HostBuffers; each holds
    // its segment (and so the descriptor) and removes its entry under this lock, which we
    // hold, before letting go of it, and the entry goes with the segment's last buffer, so
    // `fd` stays open for the duration of this borrow.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 0).map_err(os("fcntl(F_DUPFD_CLOEXEC)"))
}

/// Reopens the descriptor `h` names through `/proc` (allowed for a same-user process when
/// ptrace restrictions forbid `pidfd_getfd`).
///
/// Reopening opens the file anew, so it is first looked at: its link must name a memfd,
/// then through an `O_PATH` descriptor, which opens nothing, it must still name one and be
/// a regular file on tmpfs (or hugetlbfs) with the handle's inode. A forged handle can
/// thus never make this process open a device, a FIFO or an ordinary file of the owner,
/// nor ask the server of a network or FUSE file system anything.
fn open_via_proc(h: &HostHandle) -> Result<OwnedFd> {
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
fn process_exited(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // `pid (comm) S ...`: the state follows the last `)` (comm may hold anything).
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some('Z' | 'X' | 'x'))
}

/// A handle of a segment mapped already opens from that mapping only as long as it would
/// open afresh: the segment still has a live buffer (same process), or its owner still
/// runs. Its descriptor is not fetched again: the mapping holds the segment, so its device
/// and inode name it and no other file.
fn check_alive(map: &PeerMap, h: &HostHandle, own_pid: u32) -> Result<()> {
    if h.pid == own_pid {
        return segments().check_live(h.fd, h.inode);
    }
    let exited = match &map.pidfd {
        Some(pidfd) => has_exited(pidfd),
        None => process_exited(h.pid),
    };
    if exited {
        return Err(IpcError::OwnerGone { pid: h.pid });
    }
    Ok(())
}

/// Exports `len` bytes at `addr`, which must lie inside one live buffer of `table`, as a
/// handle of process `pid`.
fn export_from(table: &SegmentTable, pid: u32, addr: u64, len: usize) -> Result<HostHandle> {
    let below = usize::try_from(addr)
        .ok()
        .and_then(|a| table.by_addr.range(..=a).next_back());
    handle_in(below, pid, addr, len)
}

/// Exports every region of `regions` (in their order) from `table`. Regions are looked at
/// in address order, walking up the table from the buffer of the region before: a region
/// within `WALK` (8) buffers of it is found without a search (a registry's regions are
/// mostly buffers allocated one after the other; 1000 graph buffers in a table of 2000
/// buffers: 48-56 us against 66-72 us with a search each). The first region, in `regions`'
/// order, that is not exportable is the error.
fn export_many(table: &SegmentTable, pid: u32, regions: &[Region]) -> Result<Vec<HostHandle>> {
    /// Buffers a region's search walks up before it searches the table instead.
    const WALK: usize = 8;
    let mut order: Vec<usize> = (0..regions.len()).collect();
    order.sort_unstable_by_key(|&i| regions[i].addr);
    // Each region's buffer: the one with the highest base not above it (if any).
    let mut below: Vec<Option<(&usize, &Exportable)>> = vec![None; regions.len()];
    // The buffer of the previous region in address order, and the buffers above it.
    let mut held = None;
    let mut above = table.by_addr.range(..);
    for i in order {
        let Ok(a) = usize::try_from(regions[i].addr) else {
            // Not an address of this process: `handle_in` refuses it.
            continue;
        };
        for steps in 0..=WALK {
            let mut ahead = above.clone();
            match ahead.next() {
                Some(next) if *next.0 <= a && steps < WALK => {
                    held = Some(next);
                    above = ahead;
                }
                Some(next) if *next.0 <= a => {
                    held = table.by_addr.range(..=a).next_back();
                    above = table.by_addr.range((Excluded(a), Unbounded));
                }
                // Regions in address order: `held` is the highest base not above `a`.
                _ => break,
            }
        }
        below[i] = held;
    }
    regions
        .iter()
        .zip(below)
        .map(|(r, below)| handle_in(below, pid, r.addr, r.len))
        .collect()
}

/// The handle of `len` bytes at `addr` in `below`, the live buffer with the highest base
/// address not above `addr` (if any).
fn handle_in(
    below: Option<(&usize, &Exportable)>,
    pid: u32,
    addr: u64,
    len: usize,
) -> Result<HostHandle> {
    let not = |reason: &str| IpcError::NotExportable {
        addr,
        len,
        reason: reason.into(),
    };
    let a = usize::try_from(addr).map_err(|_| not("address out of range"))?;
    let (&base, buf) = below.ok_or_else(|| not("not inside a buffer of this backend"))?;
    let inside = a - base;
    if inside >= buf.len || len == 0 || inside.checked_add(len).is_none_or(|end| end > buf.len) {
        return Err(not("range not inside one buffer (or empty)"));
    }
    Ok(HostHandle {
        pid,
        fd: buf.fd,
        dev: buf.dev,
        inode: buf.inode,
        segment_len: buf.segment_len as u64,
        offset: (buf.offset + inside) as u64,
        len: len as u64,
    })
}

/// The fields of a handle that can be checked without its segment: a non-empty range inside
/// the segment, a descriptor number, sizes this process can address. Returns the segment's
/// length.
fn check_fields(h: &HostHandle) -> Result<usize> {
    let end = h.offset.checked_add(h.len);
    if h.len == 0 || end.is_none_or(|e| e > h.segment_len) {
        return Err(IpcError::InvalidHandle(format!(
            "range {}+{} outside a {}-byte segment",
            h.offset, h.len, h.segment_len
        )));
    }
    if h.fd < 0 {
        return Err(IpcError::InvalidHandle(format!(
            "negative descriptor {}",
            h.fd
        )));
    }
    usize::try_from(h.segment_len)
        .map_err(|_| IpcError::InvalidHandle("segment length out of range".into()))
}

/// A handle of a segment mapped already announces the segment's true size.
fn check_len(map: &PeerMap, h: &HostHandle) -> Result<()> {
    if u64::try_from(map.len).ok() != Some(h.segment_len) {
        return Err(IpcError::InvalidHandle(format!(
            "segment is {} bytes, the handle says {}",
            map.len, h.segment_len
        )));
    }
    Ok(())
}

/// Maps the pages of the small mappings among `mappings` (at most
/// [`HostMemory::CARVE_MAX_BYTES`]: Signal blocks, tables, graph buffers) now, by reading a
/// byte of each of their pages, rather than at first use.
///
/// A fresh mapping costs a page-table entry per page whenever it is made: after a resume
/// that is the first replay of an engine's graph, 1.27-1.35x the steady one with 1000
/// graph buffers (`tpcomm-bench lifecycle`), against 1.04-1.10x when the pages are mapped here
/// (at about the same cost, paid by `reinit_after_resume`). A read fault on a shared
/// mapping maps the page writable, and with it the neighbours already in the file (the
/// kernel's fault-around, 16 pages), so the flag writes do not fault and a run of pages
/// takes one fault per 16. Touching was measured 25-50% faster than `MADV_POPULATE_READ`,
/// which walks every page through `get_user_pages` (1000 pages of a memfd: 240-420 against
/// 405-720 us on a 2-vCPU VM). Large buffers (staging, temp) are left to fault in when used:
/// mapping them would cost every resume, and allocate memory for peers' pages never touched.
fn prefault(mappings: &[HostMapping]) {
    let page = page_size();
    let mut ranges: Vec<(usize, usize)> = mappings
        .iter()
        .filter(|m| m.len <= HostMemory::CARVE_MAX_BYTES)
        .map(|m| {
            let start = m.addr() as usize;
            // Whole pages of the segment's mapping, which is whole pages itself.
            (start - start % page, (start + m.len).next_multiple_of(page))
        })
        .collect();
    ranges.sort_unstable();
    let mut next = 0;
    for (start, end) in ranges {
        // Ranges sorted by start: a page below `next` was read already.
        for addr in (start.max(next)..end).step_by(page) {
            // SAFETY: `addr` is the first byte of a page inside a live mapping of this
            // backend (held by `mappings`), whose segment is sealed against shrinking, so
            // the read cannot fault past its end; an atomic load is defined whatever peers
            // write there at the same time, and changes no byte.
            let byte = unsafe { AtomicU8::from_ptr(addr as *mut u8) };
            std::hint::black_box(byte.load(Ordering::Relaxed));
        }
        next = next.max(end);
    }
}

/// The handle's descriptor names the handle's inode, or the handle is stale.
fn check_identity(h: &HostHandle, id: &Identity) -> Result<()> {
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
fn fs_magic(fs: &rustix::fs::StatFs) -> u32 {
    fs.f_type as u32
}

/// Checks, before anything is mapped, that `fd` (fetched for `h`) is the segment `h` names
/// and a segment of this backend: see the module documentation for each check and why.
fn check_segment(fd: &OwnedFd, h: &HostHandle) -> Result<()> {
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

/// A new memfd of `len` bytes named `name`, made private to this user, sized and sealed
/// (before it is mapped or exported: no one can change its size from then on); its
/// descriptor, device and inode.
fn segment_file(len: usize, name: &str) -> Result<(OwnedFd, u64, u64)> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(os("memfd_create"))?;
    rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR).map_err(os("fchmod 0600"))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
    rustix::fs::fcntl_add_seals(&fd, SEGMENT_SEALS).map_err(os("fcntl(F_ADD_SEALS)"))?;
    let stat = rustix::fs::fstat(&fd).map_err(os("fstat"))?;
    Ok((fd, stat.st_dev, stat.st_ino))
}

/// A segment made by this process (a chunk or a large buffer's own), mapped whole; unmapped
/// and its descriptor closed when the last buffer in it (and its arena) let go.
pub(crate) struct OwnedSegment {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    dev: u64,
    inode: u64,
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
    fn new(len: usize, name: &str) -> Result<Self> {
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
    fn punch(&self, offset: usize, len: usize) {
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

/// Where a carved buffer came from, to give it back on drop.
struct Carved {
    arena: Arc<Mutex<Arena>>,
    offset: usize,
}

/// A shared-memory buffer owned by this process, mapped at [`addr`](MemoryRegion::addr): a
/// segment of its own, or an extent carved out of a chunk (see
/// [`HostMemory::CARVE_MAX_BYTES`]). Its bytes read as zeros when it is allocated.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// `None` while its backing is released ([`PeerMemory::release_backing`]): the range
    /// `ptr..ptr + len` is then an inaccessible reservation this buffer owns.
    segment: Option<Arc<OwnedSegment>>,
    carved: Option<Carved>,
    /// Made by `allocate_private`: never exportable.
    private: bool,
}

/// A peer segment mapped whole by this process; every [`HostMapping`] of a handle in it
/// shares it, and the last to go unmaps it.
struct PeerMap {
    ptr: NonNull<u8>,
    len: usize,
    /// The owner's pid and, when the segment was fetched with it, its pidfd: a handle of the
    /// segment opens from this mapping only while the owner lives.
    owner: u32,
    pidfd: Option<Arc<OwnedFd>>,
    /// The segment's identity.
    dev: u64,
    inode: u64,
}

/// This process's mapping of a (possibly remote) segment range.
pub struct HostMapping {
    map: Arc<PeerMap>,
    /// Offset of the range in the mapping (in the segment, for a whole segment's mapping).
    offset: usize,
    len: usize,
    /// Detached ([`PeerMemory::detach`]): the mapping's range is an inaccessible
    /// reservation until a reattach.
    detached: bool,
}

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
    fn key(&self) -> (u64, u64, u32) {
        (self.dev, self.inode, self.owner)
    }

    /// Unmaps now, reporting a failure (`Drop` can only log it).
    fn unmap(mut self) -> Result<()> {
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

/// Maps `len` bytes of `fd` from `offset` (page aligned) shared, read-write.
fn map_shared(fd: &OwnedFd, offset: u64, len: usize) -> Result<NonNull<u8>> {
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

fn page_size() -> usize {
    rustix::param::page_size()
}

/// Accepts only this backend's own region types, mapped now: host memory mapped by this
/// process (a detached mapping or a released buffer is [`IpcError::Unbacked`]).
fn host_region<R: MemoryRegion>(region: &R) -> Result<()> {
    let any = region.as_any();
    let unbacked = |what| IpcError::Unbacked {
        addr: region.addr(),
        len: region.len(),
        what,
    };
    if let Some(buffer) = any.downcast_ref::<HostBuffer>() {
        buffer
            .segment
            .as_ref()
            .map(drop)
            .ok_or_else(|| unbacked("a released buffer"))
    } else if let Some(mapping) = any.downcast_ref::<HostMapping>() {
        if mapping.detached {
            Err(unbacked("a detached mapping"))
        } else {
            Ok(())
        }
    } else {
        Err(IpcError::ForeignRegion {
            backend: "host",
            region: std::any::type_name::<R>(),
        })
    }
}

/// `bytes` (not zero) rounded up to whole pages.
fn page_rounded(bytes: usize) -> Result<usize> {
    if bytes == 0 {
        return Err(IpcError::InvalidAllocation("zero bytes".into()));
    }
    bytes.checked_next_multiple_of(page_size()).ok_or_else(|| {
        IpcError::InvalidAllocation(format!("{bytes} bytes overflow when rounded to pages"))
    })
}

impl PeerMemory for HostMemory {
    type Handle = HostHandle;
    type Buffer = HostBuffer;
    type Mapping = HostMapping;

    fn name(&self) -> &'static str {
        "host"
    }

    fn allocate(&self, bytes: usize) -> Result<HostBuffer> {
        let len = page_rounded(bytes)?;
        let (segment, carved) = if len <= Self::CARVE_MAX_BYTES && !self.stable {
            let (chunk, offset) = lock(&self.arena).carve(len, Self::CHUNK_BYTES)?;
            let carved = Carved {
                arena: self.arena.clone(),
                offset,
            };
            (chunk, Some(carved))
        } else {
            (Arc::new(OwnedSegment::new(len, SEGMENT_NAME)?), None)
        };
        let offset = carved.as_ref().map_or(0, |c| c.offset);
        // SAFETY: `offset + len` lies inside the segment's mapping (the arena's extent, or
        // the whole of a segment of `len` bytes).
        let ptr = unsafe { NonNull::new_unchecked(segment.ptr.as_ptr().add(offset)) };
        let entry = Exportable {
            len,
            fd: segment.fd.as_raw_fd(),
            dev: segment.dev,
            inode: segment.inode,
            segment_len: segment.len,
            offset,
        };
        segments().insert(ptr.as_ptr() as usize, entry);
        tracing::trace!(
            len,
            fd = entry.fd,
            inode = entry.inode,
            offset,
            "host buffer allocated"
        );
        Ok(HostBuffer {
            ptr,
            len,
            segment: Some(segment),
            carved,
            private: false,
        })
    }

    /// A segment of its own (never a chunk's extent, which peers map whole), left out of
    /// the table of exportable buffers (`export` refuses every address in it) and named so
    /// that `open` refuses a handle naming it.
    fn allocate_private(&self, bytes: usize) -> Result<HostBuffer> {
        let len = page_rounded(bytes)?;
        let segment = Arc::new(OwnedSegment::new(len, PRIVATE_SEGMENT_NAME)?);
        tracing::trace!(len, "private host buffer allocated");
        Ok(HostBuffer {
            ptr: segment.ptr,
            len,
            segment: Some(segment),
            carved: None,
            private: true,
        })
    }

    /// A carved buffer's extent is never given back to its chunk: no later buffer is
    /// carved over it (its pages are not punched), for as long as the chunk lives.
    fn retire(&self, mut buffer: HostBuffer) {
        if buffer.carved.take().is_some() {
            tracing::debug!(
                len = buffer.len,
                "carved host buffer retired: its extent is not handed out again"
            );
        }
        drop(buffer);
    }

    fn export(&self, addr: u64, len: usize) -> Result<HostHandle> {
        export_from(&segments(), std::process::id(), addr, len)
    }

    fn export_all(&self, regions: &[Region]) -> Result<Vec<HostHandle>> {
        let (table, pid) = (segments(), std::process::id());
        export_many(&table, pid, regions)
    }

    /// Changes with every allocation and free of any `HostMemory` of the process: an
    /// export reads nothing but the table of live buffers and the process id.
    fn export_stamp(&self) -> Option<u64> {
        segments().stamp()
    }

    fn open(&self, h: &HostHandle) -> Result<HostMapping> {
        let mut mappings = self.open_all(&[h])?;
        mappings
            .pop()
            .ok_or_else(|| IpcError::InvalidHandle("a batch of one handle opened nothing".into()))
    }

    fn open_all(&self, handles: &[&HostHandle]) -> Result<Vec<HostMapping>> {
        if self.stable {
            return self.open_unshared(handles);
        }
        let mut views = lock(&self.views);
        let pid = std::process::id();
        let mut mappings: Vec<HostMapping> = Vec::with_capacity(handles.len());
        for &h in handles {
            // Handles of one segment come in runs: the previous one's mapping (checked alive
            // in this batch) serves the next, after the same checks of its own fields.
            let map = match mappings.last() {
                Some(prev) if prev.map.key() == (h.dev, h.inode, h.pid) => {
                    let map = prev.map.clone();
                    check_fields(h)?;
                    check_len(&map, h)?;
                    map
                }
                _ => self.segment_map(&mut views, h, pid)?,
            };
            mappings.push(HostMapping {
                map,
                offset: h.offset as usize,
                len: h.len as usize,
                detached: false,
            });
        }
        prefault(&mappings);
        Ok(mappings)
    }

    fn close(&self, mapping: HostMapping) -> Result<()> {
        match Arc::into_inner(mapping.map) {
            Some(map) => map.unmap(),
            None => Ok(()),
        }
    }

    fn keeps_addresses(&self) -> bool {
        self.stable
    }

    fn detach(&self, mapping: &mut HostMapping) -> Result<()> {
        self.detach_mapping(mapping)
    }

    fn reattach(&self, mapping: &mut HostMapping, handle: &HostHandle) -> Result<()> {
        self.reattach_mapping(mapping, handle)
    }

    fn releases_backing(&self) -> bool {
        self.stable
    }

    fn release_backing(&self, buffer: &mut HostBuffer) -> Result<usize> {
        self.release_buffer(buffer)
    }

    fn restore_backing(&self, buffer: &mut HostBuffer) -> Result<()> {
        self.restore_buffer(buffer)
    }

    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()> {
        host_region(region)?;
        check_range(offset, src.len(), region.len())?;
        // SAFETY: `region` is a live HostBuffer or HostMapping (checked above), mapped
        // read-write for `region.len()` bytes, and the range was checked above; the file
        // behind it is sealed against shrinking at a size covering the mapping (made so by
        // `allocate`, checked by `open`), so no access faults with SIGBUS; `src` is a Rust
        // slice that cannot overlap shared memory we only reach through raw pointers.
        unsafe {
            tpcomm_transport::backend::copy::copy_bytes(
                (region.addr() as *mut u8).add(offset),
                src.as_ptr(),
                src.len(),
            )
        };
        Ok(())
    }

    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        host_region(region)?;
        check_range(offset, dst.len(), region.len())?;
        // SAFETY: as in `write`: a live mapping of at least `offset + dst.len()` bytes of a
        // file that cannot shrink.
        unsafe {
            tpcomm_transport::backend::copy::copy_bytes(
                dst.as_mut_ptr(),
                (region.addr() as *const u8).add(offset),
                dst.len(),
            )
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The `/proc` fallback, which `open` takes only where `pidfd_getfd` is not allowed.

    use std::process::{Child, Command, Stdio};

    use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

    use super::stalled_fuse::{self, StalledFuse};
    use super::*;

    /// Held while a test of this module starts a process, and by a FUSE test throughout: a
    /// process started while a FUSE file is open here would inherit that descriptor until
    /// its `exec` closes it, and that close waits on the server once it stalls.
    static FORKS: Mutex<()> = Mutex::new(());

    /// A `sleep` holding `fd` as its descriptor 0, and a handle naming all `len` bytes of it.
    fn hold(fd: OwnedFd, len: u64) -> (Child, HostHandle) {
        let _forks = lock(&FORKS);
        spawn_holder(fd, len)
    }

    /// [`hold`], for a caller that holds [`FORKS`].
    fn spawn_holder(fd: OwnedFd, len: u64) -> (Child, HostHandle) {
        let stat = rustix::fs::fstat(&fd).unwrap();
        let child = Command::new("sleep")
            .arg("600")
            .stdin(Stdio::from(fd))
            .spawn()
            .unwrap();
        let h = HostHandle {
            pid: child.id(),
            fd: 0,
            dev: stat.st_dev,
            inode: stat.st_ino,
            segment_len: len,
            offset: 0,
            len,
        };
        (child, h)
    }

    fn reap(mut child: Child) {
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A FUSE file system serving one file, or `None` after recording why the test skips.
    fn fuse() -> Option<StalledFuse> {
        StalledFuse::mount()
            .map_err(|why| tpcomm_transport::testing::skip(&why))
            .ok()
    }

    /// A `sleep` holding the file system's file open, and a handle naming it; from then on
    /// the file system answers nothing. The caller holds [`FORKS`].
    ///
    /// The file is opened without `O_CLOEXEC`: the child keeps its inherited copy, where
    /// closing it in `exec` (which `spawn` does not wait for) would wait on the stalled server
    /// with the child's exec lock held, and so block `pidfd_getfd` on the child.
    fn hold_stalled(fs: &StalledFuse) -> (Child, HostHandle) {
        let file =
            rustix::fs::open(fs.file(), OFlags::RDWR, Mode::empty()).expect("the FUSE file opens");
        let held = spawn_holder(file, stalled_fuse::FILE_LEN);
        fs.stall();
        held
    }

    /// `result` (of `within_10s`) is the refusal of a file that is no memfd, in time.
    fn assert_refused_at_once(what: &str, result: Option<Result<()>>) {
        match result {
            Some(Err(IpcError::NotASegment {
                problem: SegmentProblem::NotMemfd,
                ..
            })) => {}
            None => panic!("{what} waited on a file system that never answers for 10 s"),
            Some(other) => panic!("{what}: expected NotASegment(NotMemfd), got {other:?}"),
        }
    }

    /// What `f` returns, or `None` when it has not returned after 10 s (it goes on on its
    /// own thread).
    fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(10)).ok()
    }

    #[test]
    fn a_handle_naming_a_file_whose_server_never_answers_is_refused_without_waiting() {
        let _forks = lock(&FORKS);
        let Some(fs) = fuse() else { return };
        let (child, h) = hold_stalled(&fs);
        // Whether `open` fetches the descriptor (`pidfd_getfd`, allowed to this process) or
        // takes the `/proc` fallback, which refuses by the link and fetches nothing.
        let fetches = rustix::process::pidfd_open(Pid::from_child(&child), PidfdFlags::empty())
            .and_then(|pidfd| rustix::process::pidfd_getfd(&pidfd, 1, PidfdGetfdFlags::empty()))
            .is_ok();
        let result = within_10s(move || HostMemory::new().open(&h).map(|_| ()));
        // The refused descriptor's close reached the server (on a thread of its own, whose
        // wait `open` gave up after `CLOSE_WAIT`): closing it on the caller's thread would
        // have waited there.
        let held = fs.held();
        // Unmounting answers what is held, and lets the child's own close end.
        drop(fs);
        reap(child);
        assert_refused_at_once("open", result);
        if fetches {
            assert!(held >= 1, "the refused descriptor was never closed");
        } else {
            eprintln!(
                "pidfd_getfd is not allowed here: the /proc fallback served (nothing fetched)"
            );
        }
    }

    #[test]
    fn the_proc_fallback_refuses_a_file_whose_server_never_answers_without_waiting() {
        let _forks = lock(&FORKS);
        let Some(fs) = fuse() else { return };
        let (child, h) = hold_stalled(&fs);
        let result = within_10s(move || open_via_proc(&h).map(|_| ()));
        drop(fs);
        reap(child);
        assert_refused_at_once("the /proc fallback", result);
    }

    #[test]
    fn the_proc_fallback_reopens_a_segment_of_another_process() {
        let fd = rustix::fs::memfd_create(SEGMENT_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        rustix::fs::fcntl_add_seals(&fd, SEGMENT_SEALS).unwrap();
        let (child, h) = hold(fd, 4096);
        let reopened = open_via_proc(&h);
        reap(child);
        check_segment(&reopened.unwrap(), &h).unwrap();
    }

    #[test]
    fn a_handle_naming_another_processs_private_segment_is_foreign() {
        let private = HostMemory::new().allocate_private(4096).unwrap();
        let (child, h) = hold(
            private.segment.as_ref().unwrap().fd.try_clone().unwrap(),
            4096,
        );
        let reopened = open_via_proc(&h);
        reap(child);
        match check_segment(&reopened.unwrap(), &h) {
            Err(IpcError::NotASegment {
                problem: SegmentProblem::ForeignName { .. },
                ..
            }) => {}
            other => panic!("expected NotASegment(ForeignName), got {other:?}"),
        }
    }

    #[test]
    fn the_proc_fallback_never_opens_an_ordinary_file_of_another_process() {
        let path =
            std::env::temp_dir().join(format!("tpcomm-proc-fallback-{}", std::process::id()));
        std::fs::write(&path, [7u8; 4096]).unwrap();
        let file = rustix::fs::open(&path, OFlags::RDWR, Mode::empty()).unwrap();
        let (child, h) = hold(file, 4096);
        let result = open_via_proc(&h);
        reap(child);
        std::fs::remove_file(&path).unwrap();
        match result {
            Err(IpcError::NotASegment {
                problem: SegmentProblem::NotMemfd,
                ..
            }) => {}
            other => panic!("expected NotASegment(NotMemfd), got {other:?}"),
        }
    }

    #[test]
    fn the_proc_fallback_checks_the_inode_before_reopening() {
        let fd = rustix::fs::memfd_create(SEGMENT_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let (child, mut h) = hold(fd, 4096);
        h.inode ^= 1;
        let result = open_via_proc(&h);
        reap(child);
        assert!(
            matches!(result, Err(IpcError::StaleHandle(_))),
            "{result:?}"
        );
    }

    #[test]
    fn the_proc_fallback_names_an_exited_owner_not_yet_reaped() {
        let fd = rustix::fs::memfd_create(SEGMENT_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let (mut child, h) = hold(fd, 4096);
        child.kill().unwrap();
        // Until it has exited, leaving a zombie (NOWAIT): its descriptors are gone.
        rustix::process::waitid(
            rustix::process::WaitId::Pid(Pid::from_child(&child)),
            rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT,
        )
        .unwrap();
        let result = open_via_proc(&h);
        child.wait().unwrap();
        match result {
            Err(IpcError::OwnerGone { pid }) => assert_eq!(pid, h.pid),
            other => panic!("expected OwnerGone, got {other:?}"),
        }
    }
}

#[cfg(test)]
mod export_tests {
    //! `export_all`'s walk up the table against one search per region.

    use proptest::prelude::*;

    use super::*;

    /// A table of disjoint buffers: each `(gap, len)` starts `gap` bytes after the end of
    /// the one before (from address 4096).
    fn table(buffers: &[(usize, usize)]) -> SegmentTable {
        let mut table = SegmentTable::new();
        let mut at = 4096;
        for (i, &(gap, len)) in buffers.iter().enumerate() {
            at += gap;
            let fd = i32::try_from(i % 3).unwrap();
            let buffer = Exportable {
                len,
                fd,
                dev: 1,
                inode: 100 + u64::from(fd.unsigned_abs()),
                segment_len: 1 << 30,
                offset: at % (1 << 20),
            };
            table.insert(at, buffer);
            at += len;
        }
        table
    }

    proptest! {
        #[test]
        fn exporting_many_regions_gives_each_regions_own_export(
            buffers in proptest::collection::vec((0usize..64, 1usize..200), 0..40),
            regions in proptest::collection::vec((0u64..12_000, 0usize..260), 0..60),
        ) {
            let table = table(&buffers);
            let regions: Vec<Region> = regions
                .into_iter()
                .map(|(addr, len)| Region { addr, len })
                .collect();
            // Every region's handle, or the first failure in the regions' order (as text:
            // the errors are not comparable).
            let one_by_one: Result<Vec<HostHandle>> = regions
                .iter()
                .map(|r| export_from(&table, 7, r.addr, r.len))
                .collect();
            let expected = format!("{one_by_one:?}");
            let got = format!("{:?}", export_many(&table, 7, &regions));
            prop_assert_eq!(got, expected);
        }
    }

    proptest! {
        #[test]
        fn exporting_regions_inside_buffers_gives_each_regions_own_handle(
            buffers in proptest::collection::vec((0usize..64, 1usize..200), 1..40),
            picks in proptest::collection::vec(
                (any::<usize>(), prop_oneof![Just(0usize), 0usize..200], any::<usize>()),
                0..60,
            ),
        ) {
            let table = table(&buffers);
            let bases: Vec<(usize, usize)> =
                table.by_addr.iter().map(|(&base, b)| (base, b.len)).collect();
            // Every region inside one buffer (often at its base), in any order.
            let regions: Vec<Region> = picks
                .iter()
                .map(|&(which, offset, len)| {
                    let (base, buffer_len) = bases[which % bases.len()];
                    let offset = offset % buffer_len;
                    Region {
                        addr: (base + offset) as u64,
                        len: 1 + len % (buffer_len - offset),
                    }
                })
                .collect();
            let one_by_one: Vec<HostHandle> = regions
                .iter()
                .map(|r| export_from(&table, 7, r.addr, r.len).unwrap())
                .collect();
            prop_assert_eq!(export_many(&table, 7, &regions).unwrap(), one_by_one);
        }
    }

    #[test]
    fn regions_far_apart_and_out_of_order_are_found_by_a_search() {
        // 100 buffers of 64 bytes, back to back; regions every 20th buffer, backwards.
        let table = table(&[(0, 64); 100]);
        let regions: Vec<Region> = (0..100)
            .rev()
            .step_by(20)
            .map(|i| Region {
                addr: 4096 + 64 * i + 8,
                len: 16,
            })
            .collect();
        let handles = export_many(&table, 7, &regions).unwrap();
        for (r, h) in regions.iter().zip(&handles) {
            assert_eq!(*h, export_from(&table, 7, r.addr, r.len).unwrap());
        }
        assert_eq!(handles.len(), 5);
    }
}
