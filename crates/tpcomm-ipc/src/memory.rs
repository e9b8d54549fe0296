//! The [`PeerMemory`] trait: what a backend (host shared memory, CUDA IPC) provides.

use std::fmt::Debug;
use std::hash::Hash;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Result;
use crate::registry::Region;

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// A range of backend memory: a local allocation or a mapping of a peer's.
///
/// Sealed: only backend types implement it, so an address handed to a copy is always one
/// that a backend itself mapped and that stays valid while the value lives; each backend
/// checks (with [`as_any`](Self::as_any)) that the region is one of its own types.
pub trait MemoryRegion: Sealed + Debug + Send + Sync {
    /// Address of the first byte (a host or device address, per backend).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True for an empty region (never produced by the backends).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The concrete region, so that a backend copies only into its own buffer and mapping
    /// types: handed another backend's region (a device address to a host backend, say) it
    /// returns [`IpcError::ForeignRegion`](crate::IpcError::ForeignRegion) instead of
    /// touching the address.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A peer-memory backend: exportable allocations, handles, peer mappings and copies.
///
/// Handles are plain serde values with stable bytes: they travel to peers through any
/// [`Communicator`](tpcomm_transport::Communicator) (see
/// [`PeerMappings`](crate::PeerMappings)). Opening a handle yields a mapping at an address
/// chosen by the backend; closing and reopening may give another address.
pub trait PeerMemory: Send + Sync + Debug + 'static {
    /// A serialized reference to `len` bytes at `offset` in one exportable allocation.
    type Handle: Clone + Debug + Eq + Hash + Serialize + DeserializeOwned + Send + Sync;
    /// A local allocation that peers can map.
    type Buffer: MemoryRegion;
    /// This process's mapping of a peer's allocation (closed on drop).
    type Mapping: MemoryRegion;

    /// A short name (`"host"`, `"cuda"`).
    fn name(&self) -> &'static str;

    /// Allocates an exportable buffer of at least `bytes` bytes (rounded up to the
    /// backend's granularity: a page for host memory, 2 MiB for CUDA so that no two
    /// buffers share a handle). The memory is zeroed.
    fn allocate(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Allocates a zeroed buffer of at least `bytes` bytes for this process alone: tables
    /// that only this rank reads and trusts (the all-reduce's pointer tables). It is never
    /// exportable where the backend can tell, and it shares no mapping with an exportable
    /// buffer, so a peer that maps what this rank exported cannot reach it, whatever that
    /// peer writes. The default is [`allocate`](Self::allocate), right for backends whose
    /// allocations are mapped one by one (CUDA); backends that carve small buffers out of
    /// shared segments override it.
    fn allocate_private(&self, bytes: usize) -> Result<Self::Buffer> {
        self.allocate(bytes)
    }

    /// Frees `buffer` without letting its memory serve another allocation of this process:
    /// for a buffer peers may still read or write after this rank let go of it (a close
    /// without the ranks' agreement), so that a late peer reads what was there and its
    /// writes land in memory nobody else uses. The default drops it, right for backends
    /// whose free releases the allocation itself (CUDA); the host backend keeps a carved
    /// buffer's extent out of its chunk's free list for as long as the chunk lives (a
    /// buffer with a segment of its own is freed as usual: a peer's mapping keeps its pages).
    fn retire(&self, buffer: Self::Buffer) {
        drop(buffer);
    }

    /// Exports `len` bytes at address `addr`, which must lie inside one exportable
    /// allocation of this process: the handle names the allocation's base plus the offset.
    fn export(&self, addr: u64, len: usize) -> Result<Self::Handle>;

    /// Opens a peer's handle. Never call it twice for the same handle in one process
    /// without closing in between ([`PeerMappings`](crate::PeerMappings) memoizes to
    /// guarantee that).
    fn open(&self, handle: &Self::Handle) -> Result<Self::Mapping>;

    /// Closes a mapping, reporting a failure (dropping it closes too, logging failures).
    fn close(&self, mapping: Self::Mapping) -> Result<()>;

    /// [`export`](Self::export) of every region, in order; the first failure fails the
    /// batch. Backends override it where a batch is cheaper than its parts.
    fn export_all(&self, regions: &[Region]) -> Result<Vec<Self::Handle>> {
        regions.iter().map(|r| self.export(r.addr, r.len)).collect()
    }

    /// A value that stays the same only while [`export_all`](Self::export_all) of any
    /// regions returns the same handles (or fails the same way): every allocation and every
    /// free of this process changes it. [`PeerMappings`](crate::PeerMappings) compares it
    /// with the one read before its last export so that a resume after which nothing was
    /// allocated or freed skips exporting every region again. `None` (the default) when the
    /// backend cannot tell; the registry then exports again and compares the handles.
    fn export_stamp(&self) -> Option<u64> {
        None
    }

    /// [`open`](Self::open) of every handle (distinct ones), in order; the first failure
    /// fails the batch, and the mappings opened before it are closed. Backends override it
    /// where a batch is cheaper than its parts (the host backend checks each peer segment
    /// once per batch).
    fn open_all(&self, handles: &[&Self::Handle]) -> Result<Vec<Self::Mapping>> {
        handles.iter().map(|h| self.open(h)).collect()
    }

    /// Copies `src` into `region` at `offset`.
    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()>;

    /// Copies `dst.len()` bytes from `region` at `offset` into `dst`.
    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()>;
}

/// Checks that `offset..offset + len` lies inside a region of `region_len` bytes.
pub(crate) fn check_range(offset: usize, len: usize, region_len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(crate::IpcError::OutOfBounds {
            offset,
            len,
            region_len,
        }),
    }
}
