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

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use rustix::fs::SealFlags;
use serde::{Deserialize, Serialize};

use crate::error::{IpcError, Result};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Region};

mod address_hold;
mod arena;
mod export;
mod fetch;
mod peer_segments;
mod prefault;
mod proc_fallback;
mod regions;
mod segment;
mod segment_checks;
mod segment_table;
mod stable;
#[cfg(test)]
mod stalled_fuse;

pub use address_hold::AddressHold;
use arena::Arena;
use export::{export_from, export_many};
use fetch::PidfdCache;
use peer_segments::ViewCache;
use prefault::prefault;
use segment::page_size;
use segment_checks::{check_fields, check_len};
use segment_table::{segments, Exportable};

/// The name of every segment peers may map (the kernel shows it as `/memfd:tpcomm-peer`).
const SEGMENT_NAME: &str = "tpcomm-peer";

/// The name of the segments of `allocate_private`: `open` refuses it (`ForeignName`), so a
/// handle forged to name one (say by a third rank, for another rank's tables) never maps it.
const PRIVATE_SEGMENT_NAME: &str = "tpcomm-private";

/// The seals of every segment: its size is fixed, and no seal can be added.
const SEGMENT_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing panics while holding these locks.
    m.lock().unwrap_or_else(PoisonError::into_inner)
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

    /// Chunks this backend (and its clones) carves small buffers from now.
    pub fn chunks(&self) -> usize {
        lock(&self.arena).chunks()
    }
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
            tpcomm_transport::copy::copy_bytes(
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
            tpcomm_transport::copy::copy_bytes(
                dst.as_mut_ptr(),
                (region.addr() as *const u8).add(offset),
                dst.len(),
            )
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod export_tests;
