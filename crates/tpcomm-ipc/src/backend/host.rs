//! The host backend: shared-memory segments made with `memfd_create`.
//!
//! A segment is an anonymous memfd, sized once with `ftruncate`, sealed against growing
//! and shrinking, mode 0600, and mapped `MAP_SHARED` into its owner. It never has a name in
//! `/dev/shm`, so nothing is left behind after any exit, SIGKILL included: the kernel frees
//! the segment when its last descriptor and mapping are gone.
//!
//! A [`HostHandle`] names the owner's pid, the descriptor number in the owner, the
//! segment's device and inode (its identity), its size, and the exported range. Another
//! process opens it by fetching the descriptor with `pidfd_getfd` (falling back to
//! reopening `/proc/<pid>/fd/<n>`, which also works for an unprivileged same-user process
//! when ptrace restrictions forbid `pidfd_getfd`); another thread of the owner reopens
//! `/proc/self/fd/<n>`. Either way the descriptor's inode is checked against the handle
//! before anything is mapped, so a descriptor number that was closed or reused gives
//! [`IpcError::StaleHandle`], never a mapping of the wrong memory. The descriptor is closed
//! right after `mmap`: a mapping holds no descriptor.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::fs::{MemfdFlags, Mode, OFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};
use serde::{Deserialize, Serialize};

use crate::error::{os, IpcError, Result};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Sealed};

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
    pidfds: Arc<Mutex<HashMap<u32, Arc<OwnedFd>>>>,
}

impl HostMemory {
    /// A backend.
    pub fn new() -> Self {
        Self::default()
    }

    /// The pidfd of `pid`, opened once and cached; `None` where the kernel (or a tool such
    /// as valgrind) does not provide `pidfd_open`, in which case `/proc` serves instead.
    fn pidfd(&self, pid: u32) -> Result<Option<Arc<OwnedFd>>> {
        let mut cache = self.pidfds.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(fd) = cache.get(&pid) {
            return Ok(Some(fd.clone()));
        }
        let raw_pid = i32::try_from(pid)
            .map_err(|_| IpcError::InvalidHandle(format!("pid {pid} out of range")))?;
        let owner = Pid::from_raw(raw_pid)
            .ok_or_else(|| IpcError::InvalidHandle(format!("pid {pid} is not a process id")))?;
        match rustix::process::pidfd_open(owner, PidfdFlags::empty()) {
            Ok(fd) => {
                let fd = Arc::new(fd);
                cache.insert(pid, fd.clone());
                Ok(Some(fd))
            }
            Err(Errno::SRCH) => Err(IpcError::OwnerGone { pid }),
            Err(Errno::NOSYS | Errno::PERM | Errno::ACCESS) => Ok(None),
            Err(e) => Err(IpcError::Os {
                call: "pidfd_open",
                source: e,
            }),
        }
    }

    fn forget_pidfd(&self, pid: u32) {
        self.pidfds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&pid);
    }

    /// Fetches descriptor `fd` (of segment `inode`) of process `pid`.
    fn fetch_fd(&self, pid: u32, fd: i32, inode: u64) -> Result<OwnedFd> {
        if pid == std::process::id() {
            return dup_own(fd, inode);
        }
        let Some(pidfd) = self.pidfd(pid)? else {
            return open_via_proc(pid, fd);
        };
        match rustix::process::pidfd_getfd(&*pidfd, fd, PidfdGetfdFlags::empty()) {
            Ok(got) => Ok(got),
            Err(Errno::BADF) => Err(IpcError::StaleHandle(format!(
                "descriptor {fd} of pid {pid} is closed"
            ))),
            Err(Errno::SRCH) => {
                self.forget_pidfd(pid);
                Err(IpcError::OwnerGone { pid })
            }
            // Not allowed to ptrace the owner (or no pidfd_getfd): reopen through /proc.
            Err(Errno::PERM | Errno::NOSYS | Errno::ACCESS) => open_via_proc(pid, fd),
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

/// Reopens descriptor `fd` of `pid` through `/proc` (allowed for a same-user process when
/// ptrace restrictions forbid `pidfd_getfd`).
fn open_via_proc(pid: u32, fd: i32) -> Result<OwnedFd> {
    rustix::fs::open(
        format!("/proc/{pid}/fd/{fd}"),
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::NOENT
            if rustix::fs::access(format!("/proc/{pid}"), rustix::fs::Access::EXISTS).is_err() =>
        {
            IpcError::OwnerGone { pid }
        }
        Errno::NOENT => IpcError::StaleHandle(format!("descriptor {fd} of pid {pid} is closed")),
        e => IpcError::Os {
            call: "open /proc/<pid>/fd",
            source: e,
        },
    })
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
            "tpcomm-peer",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(os("memfd_create"))?;
        rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR).map_err(os("fchmod 0600"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(os("fcntl(F_ADD_SEALS)"))?;
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
        let fd = self.fetch_fd(h.pid, h.fd, h.inode)?;
        let stat = rustix::fs::fstat(&fd).map_err(os("fstat"))?;
        if stat.st_ino != h.inode || stat.st_dev != h.dev {
            return Err(IpcError::StaleHandle(format!(
                "descriptor {} of pid {} names inode {} now, not segment inode {}",
                h.fd, h.pid, stat.st_ino, h.inode
            )));
        }
        if stat.st_size as u64 != h.segment_len {
            return Err(IpcError::InvalidHandle(format!(
                "segment is {} bytes, the handle says {}",
                stat.st_size, h.segment_len
            )));
        }
        let page = page_size() as u64;
        let map_offset = h.offset - h.offset % page;
        let delta = (h.offset - map_offset) as usize;
        let len = usize::try_from(h.len)
            .map_err(|_| IpcError::InvalidHandle("length out of range".into()))?;
        let map_len = delta + len;
        let map = map_shared(&fd, map_offset, map_len)?;
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
        // read-write for `region.len()` bytes, and the range was checked above; `src` is a
        // Rust slice that cannot overlap shared memory we only reach through raw pointers.
        unsafe {
            ptr::copy_nonoverlapping(
                src.as_ptr(),
                (region.addr() as *mut u8).add(offset),
                src.len(),
            )
        };
        Ok(())
    }

    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        host_region(region)?;
        check_range(offset, dst.len(), region.len())?;
        // SAFETY: as in `write`: a live mapping of at least `offset + dst.len()` bytes.
        unsafe {
            ptr::copy_nonoverlapping(
                (region.addr() as *const u8).add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }
}
