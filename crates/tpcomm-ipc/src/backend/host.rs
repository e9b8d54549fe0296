//! The host backend: shared-memory segments made with `memfd_create`.
//!
//! A segment is an anonymous memfd named `tpcomm-peer`, sized once with `ftruncate`, sealed
//! against growing and shrinking (and against further sealing) before it is mapped or
//! exported, mode 0600, and mapped `MAP_SHARED` into its owner. It never has a name in
//! `/dev/shm`, so nothing is left behind after any exit, SIGKILL included: the kernel frees
//! the segment when its last descriptor and mapping are gone.
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
//! Anything else is [`IpcError::NotASegment`] (or `StaleHandle` / `InvalidHandle`), the
//! fetched descriptor is closed and nothing is mapped. The descriptor is also closed right
//! after a successful `mmap`: a mapping holds no descriptor.
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
use std::ffi::c_void;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::{FileType, MemfdFlags, Mode, OFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};
use serde::{Deserialize, Serialize};

use crate::error::{os, IpcError, Result, SegmentProblem};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Sealed};

/// The name of every segment (the kernel shows it as `/memfd:tpcomm-peer`).
const SEGMENT_NAME: &str = "tpcomm-peer";

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

/// One live segment of this process, for `export` by address.
#[derive(Debug, Clone, Copy)]
struct Segment {
    len: usize,
    fd: i32,
    dev: u64,
    inode: u64,
}

/// Live segments of this process by base address: every `HostMemory` of the process shares
/// it, so that a handle exported by one thread can be opened by another without going
/// through `/proc`.
static SEGMENTS: Mutex<SegmentTable> = Mutex::new(SegmentTable {
    by_addr: BTreeMap::new(),
    inode_of_fd: BTreeMap::new(),
});

/// The live segments of this process, by base address (for `export`) and by descriptor
/// (for same-process opens).
struct SegmentTable {
    by_addr: BTreeMap<usize, Segment>,
    inode_of_fd: BTreeMap<i32, u64>,
}

impl SegmentTable {
    fn insert(&mut self, base: usize, segment: Segment) {
        self.inode_of_fd.insert(segment.fd, segment.inode);
        self.by_addr.insert(base, segment);
    }

    fn remove(&mut self, base: usize) {
        if let Some(segment) = self.by_addr.remove(&base) {
            self.inode_of_fd.remove(&segment.fd);
        }
    }
}

fn segments() -> std::sync::MutexGuard<'static, SegmentTable> {
    // Nothing panics while holding the lock.
    SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The host (CPU) peer-memory backend. Cheap to clone; clones share a cache of process
/// descriptors (pidfds) of the peers whose handles they opened.
#[derive(Debug, Clone, Default)]
pub struct HostMemory {
    pidfds: Arc<Mutex<PidfdCache>>,
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

/// Whether the process of `pidfd` has exited: a pidfd polls readable from then on. An
/// error of `poll` (none is expected) counts as alive; the cache is bounded anyway.
fn has_exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut fds, Some(&now)), Ok(n) if n > 0)
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

    /// A backend.
    pub fn new() -> Self {
        Self::default()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, PidfdCache> {
        // Nothing panics while holding the lock.
        self.pidfds.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The pidfd of `pid`, cached or freshly opened (and not cached: see
    /// [`PidfdCache::keep`]); `None` where the kernel (or a tool such as valgrind) does not
    /// provide `pidfd_open`, in which case `/proc` serves instead.
    fn pidfd(&self, pid: u32) -> Result<Option<Arc<OwnedFd>>> {
        if let Some(fd) = self.cache().get(pid) {
            return Ok(Some(fd));
        }
        let raw_pid = i32::try_from(pid)
            .map_err(|_| IpcError::InvalidHandle(format!("pid {pid} out of range")))?;
        let owner = Pid::from_raw(raw_pid)
            .ok_or_else(|| IpcError::InvalidHandle(format!("pid {pid} is not a process id")))?;
        match rustix::process::pidfd_open(owner, PidfdFlags::empty()) {
            Ok(fd) => Ok(Some(Arc::new(fd))),
            Err(Errno::SRCH) => Err(IpcError::OwnerGone { pid }),
            Err(Errno::NOSYS | Errno::PERM | Errno::ACCESS) => Ok(None),
            Err(e) => Err(IpcError::Os {
                call: "pidfd_open",
                source: e,
            }),
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
        match rustix::process::pidfd_getfd(&*pidfd, fd, PidfdGetfdFlags::empty()) {
            Ok(got) => Ok(Fetched {
                fd: got,
                pidfd: Some(pidfd),
            }),
            // An exiting or exited owner not reaped yet has no descriptors left: kernels
            // before 6.9 say EBADF for it (later ones ESRCH).
            Err(Errno::BADF) if has_exited(&pidfd) => {
                self.cache().forget(pid);
                Err(IpcError::OwnerGone { pid })
            }
            Err(Errno::BADF) => Err(IpcError::StaleHandle(format!(
                "descriptor {fd} of pid {pid} is closed"
            ))),
            Err(Errno::SRCH) => {
                self.cache().forget(pid);
                Err(IpcError::OwnerGone { pid })
            }
            // Not allowed to ptrace the owner (or no pidfd_getfd): reopen through /proc.
            Err(Errno::PERM | Errno::NOSYS | Errno::ACCESS) => Ok(Fetched {
                fd: open_via_proc(h)?,
                pidfd: None,
            }),
            Err(e) => Err(IpcError::Os {
                call: "pidfd_getfd",
                source: e,
            }),
        }
    }
}

/// Duplicates this process's descriptor `fd`, which must belong to the live segment `inode`.
fn dup_own(fd: i32, inode: u64) -> Result<OwnedFd> {
    let table = segments();
    if table.inode_of_fd.get(&fd) != Some(&inode) {
        return Err(IpcError::StaleHandle(format!(
            "no live segment of this process has descriptor {fd} and inode {inode}"
        )));
    }
    // SAFETY: the table lists `fd` as the descriptor of a live HostBuffer, and a HostBuffer
    // removes its entry (under this lock, which we hold) before its descriptor is closed, so
    // `fd` stays open for the duration of this borrow.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 0).map_err(os("fcntl(F_DUPFD_CLOEXEC)"))
}

/// Reopens the descriptor `h` names through `/proc` (allowed for a same-user process when
/// ptrace restrictions forbid `pidfd_getfd`).
///
/// Reopening opens the file anew, so it is first looked at through an `O_PATH` descriptor,
/// which opens nothing: only a regular file on tmpfs (or hugetlbfs) with the handle's inode
/// is reopened, so that a forged handle can never make this process open a device, a FIFO
/// or an ordinary file of the owner.
fn open_via_proc(h: &HostHandle) -> Result<OwnedFd> {
    let (pid, fd) = (h.pid, h.fd);
    let path = rustix::fs::open(
        format!("/proc/{pid}/fd/{fd}"),
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::NOENT if process_exited(pid) => IpcError::OwnerGone { pid },
        Errno::NOENT => IpcError::StaleHandle(format!("descriptor {fd} of pid {pid} is closed")),
        e => IpcError::Os {
            call: "open /proc/<pid>/fd (O_PATH)",
            source: e,
        },
    })?;
    let stat = rustix::fs::fstat(&path).map_err(os("fstat"))?;
    check_identity(h, &stat)?;
    let fs = rustix::fs::fstatfs(&path).map_err(os("fstatfs"))?;
    // hugetlbfs files are let through so that `check_segment` names them as on the
    // `pidfd_getfd` path; opening one has no side effect either.
    let shmem = [TMPFS_MAGIC, HUGETLBFS_MAGIC].contains(&fs_magic(&fs));
    if !FileType::from_raw_mode(stat.st_mode).is_file() || !shmem {
        return Err(IpcError::NotASegment {
            pid,
            fd,
            problem: SegmentProblem::NotMemfd,
        });
    }
    rustix::fs::open(
        format!("/proc/self/fd/{}", path.as_raw_fd()),
        OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(os("open /proc/self/fd (reopen)"))
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

/// The handle's descriptor names the handle's inode, or the handle is stale.
fn check_identity(h: &HostHandle, stat: &rustix::fs::Stat) -> Result<()> {
    if stat.st_ino != h.inode || stat.st_dev != h.dev {
        return Err(IpcError::StaleHandle(format!(
            "descriptor {} of pid {} names inode {} now, not segment inode {}",
            h.fd, h.pid, stat.st_ino, h.inode
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
    check_identity(h, &rustix::fs::fstat(fd).map_err(os("fstat"))?)?;
    let seals = match rustix::fs::fcntl_get_seals(fd) {
        Ok(seals) => seals,
        Err(Errno::INVAL) => return Err(not(SegmentProblem::NotMemfd)),
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

/// A shared-memory segment owned by this process, mapped at [`addr`](MemoryRegion::addr).
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

/// This process's mapping of a (possibly remote) segment range.
pub struct HostMapping {
    /// Start of the mmap (page aligned).
    map: NonNull<u8>,
    map_len: usize,
    /// Offset of the exported range inside the mmap.
    delta: usize,
    len: usize,
}

// SAFETY: a HostBuffer is an owned descriptor plus a MAP_SHARED mapping; neither is tied to
// the creating thread, and all access to the bytes goes through raw copies or atomics.
unsafe impl Send for HostBuffer {}
// SAFETY: shared references only expose the address and length; reads and writes of the
// memory are raw copies whose races are the documented contract of shared memory.
unsafe impl Sync for HostBuffer {}
// SAFETY: as for HostBuffer: an mmap owned by this value, usable from any thread.
unsafe impl Send for HostMapping {}
// SAFETY: as for HostBuffer: `&HostMapping` exposes only the address and length.
unsafe impl Sync for HostMapping {}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("fd", &self.fd.as_raw_fd())
            .finish()
    }
}

impl fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMapping")
            .field("addr", &self.addr())
            .field("len", &self.len)
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
        self.map.as_ptr() as u64 + self.delta as u64
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
}

impl HostMapping {
    /// Raw pointer to the first byte of the mapped range.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr() as *mut u8
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Removed before `fd` is closed (fields drop after this body): see `dup_own`.
        segments().remove(self.ptr.as_ptr() as usize);
        // SAFETY: `ptr`/`len` are exactly the mapping made in `allocate`, unmapped once here.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a host segment failed");
        }
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: `map`/`map_len` are exactly the mapping made in `open`, unmapped once here.
        if let Err(e) = unsafe { rustix::mm::munmap(self.map.as_ptr().cast(), self.map_len) } {
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

/// Accepts only this backend's own region types: host memory mapped by this process.
fn host_region<R: MemoryRegion>(region: &R) -> Result<()> {
    let any = region.as_any();
    if any.is::<HostBuffer>() || any.is::<HostMapping>() {
        Ok(())
    } else {
        Err(IpcError::ForeignRegion {
            backend: "host",
            region: std::any::type_name::<R>(),
        })
    }
}

impl PeerMemory for HostMemory {
    type Handle = HostHandle;
    type Buffer = HostBuffer;
    type Mapping = HostMapping;

    fn name(&self) -> &'static str {
        "host"
    }

    fn allocate(&self, bytes: usize) -> Result<HostBuffer> {
        if bytes == 0 {
            return Err(IpcError::InvalidAllocation("zero bytes".into()));
        }
        let page = page_size();
        let len = bytes.checked_next_multiple_of(page).ok_or_else(|| {
            IpcError::InvalidAllocation(format!("{bytes} bytes overflow when rounded to pages"))
        })?;
        let fd = rustix::fs::memfd_create(
            SEGMENT_NAME,
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(os("memfd_create"))?;
        rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR).map_err(os("fchmod 0600"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
        // Sealed before it is mapped or exported: no one can change its size from now on.
        rustix::fs::fcntl_add_seals(&fd, SEGMENT_SEALS).map_err(os("fcntl(F_ADD_SEALS)"))?;
        let stat = rustix::fs::fstat(&fd).map_err(os("fstat"))?;
        let ptr = map_shared(&fd, 0, len)?;
        let segment = Segment {
            len,
            fd: fd.as_raw_fd(),
            dev: stat.st_dev,
            inode: stat.st_ino,
        };
        segments().insert(ptr.as_ptr() as usize, segment);
        tracing::trace!(
            len,
            fd = segment.fd,
            inode = segment.inode,
            "host segment allocated"
        );
        Ok(HostBuffer { ptr, len, fd })
    }

    fn export(&self, addr: u64, len: usize) -> Result<HostHandle> {
        let not = |reason: &str| IpcError::NotExportable {
            addr,
            len,
            reason: reason.into(),
        };
        let a = usize::try_from(addr).map_err(|_| not("address out of range"))?;
        let table = segments();
        let (&base, seg) = table
            .by_addr
            .range(..=a)
            .next_back()
            .ok_or_else(|| not("not inside a segment of this backend"))?;
        let offset = a - base;
        if offset >= seg.len || len == 0 || offset.checked_add(len).is_none_or(|end| end > seg.len)
        {
            return Err(not("range not inside one segment (or empty)"));
        }
        Ok(HostHandle {
            pid: std::process::id(),
            fd: seg.fd,
            dev: seg.dev,
            inode: seg.inode,
            segment_len: seg.len as u64,
            offset: offset as u64,
            len: len as u64,
        })
    }

    fn open(&self, h: &HostHandle) -> Result<HostMapping> {
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
        let Fetched { fd, pidfd } = self.fetch_fd(h)?;
        check_segment(&fd, h)?;
        let page = page_size() as u64;
        let map_offset = h.offset - h.offset % page;
        let delta = (h.offset - map_offset) as usize;
        let len = usize::try_from(h.len)
            .map_err(|_| IpcError::InvalidHandle("length out of range".into()))?;
        let map_len = delta + len;
        let map = map_shared(&fd, map_offset, map_len)?;
        if let Some(pidfd) = pidfd {
            self.cache().keep(h.pid, pidfd);
        }
        Ok(HostMapping {
            map,
            map_len,
            delta,
            len,
        })
    }

    fn close(&self, mapping: HostMapping) -> Result<()> {
        let mapping = std::mem::ManuallyDrop::new(mapping);
        // SAFETY: the mapping made in `open`, unmapped once: `ManuallyDrop` keeps `Drop`
        // from unmapping it again.
        unsafe { rustix::mm::munmap(mapping.map.as_ptr().cast::<c_void>(), mapping.map_len) }
            .map_err(os("munmap"))
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
            super::copy::copy_bytes(
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
            super::copy::copy_bytes(
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

    use super::*;

    /// A `sleep` holding `fd` as its descriptor 0, and a handle naming all `len` bytes of it.
    fn hold(fd: OwnedFd, len: u64) -> (Child, HostHandle) {
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
