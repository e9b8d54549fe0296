//! The [`PeerMemory`] trait: what a backend (host shared memory, CUDA IPC) provides, and the
//! words it speaks in ([`MemoryRegion`], [`Region`]).

use std::fmt::Debug;
use std::hash::Hash;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Result;

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// One address range this rank shares, as passed to
/// [`PeerMappings::exchange`](crate::PeerMappings::exchange).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Start address (inside one exportable allocation of the backend).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

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

    /// Whether a mapping can give up its memory and keep its address range reserved
    /// ([`detach`](Self::detach)), so that a fresh handle of the same size maps at the same
    /// address again ([`reattach`](Self::reattach)). [`PeerMappings`](crate::PeerMappings)
    /// then closes with `detach` and reopens with `reattach`: peer addresses survive a
    /// suspend and resume, and tables holding them need no rewrite. `false` by default
    /// (legacy CUDA IPC chooses the address of every open).
    fn keeps_addresses(&self) -> bool {
        false
    }

    /// Unmaps `mapping`'s memory and keeps its address range reserved: nothing else can be
    /// placed there, its address and length stay as they were, and every copy through it is
    /// refused ([`IpcError::Unbacked`](crate::IpcError::Unbacked)) until a
    /// [`reattach`](Self::reattach). Dropping a detached mapping frees the reservation. A
    /// failure leaves the mapping as it was (still mapped) or, where the unmap happened and
    /// only the reservation failed, detached with a note in the log. Backends that do not
    /// [`keep addresses`](Self::keeps_addresses) return
    /// [`IpcError::Unsupported`](crate::IpcError::Unsupported).
    fn detach(&self, mapping: &mut Self::Mapping) -> Result<()> {
        let _ = mapping;
        Err(crate::IpcError::Unsupported {
            backend: self.name(),
            what: "keeping the address of a closed mapping".into(),
        })
    }

    /// Maps `handle` (checked as [`open`](Self::open) checks it) into the address range a
    /// [`detach`](Self::detach)ed `mapping` kept, so that the mapping's address is what it
    /// was. Fails with [`IpcError::AddressNotKept`](crate::IpcError::AddressNotKept),
    /// leaving the mapping detached, when the handle's range does not fit the reservation
    /// exactly (another size or offset) or the mapping is not detached; with the errors of
    /// `open` otherwise. Backends that do not keep addresses return
    /// [`IpcError::Unsupported`](crate::IpcError::Unsupported).
    fn reattach(&self, mapping: &mut Self::Mapping, handle: &Self::Handle) -> Result<()> {
        let _ = (mapping, handle);
        Err(crate::IpcError::Unsupported {
            backend: self.name(),
            what: "mapping a handle at a kept address".into(),
        })
    }

    /// Whether [`release_backing`](Self::release_backing) frees the memory of this
    /// backend's buffers while their addresses stay reserved. `false` by default.
    fn releases_backing(&self) -> bool {
        false
    }

    /// Frees the memory behind `buffer` and keeps its address range reserved; returns the
    /// bytes freed (0 when it was released already). Its handles go stale (peers must have
    /// detached or closed their mappings of it first), copies through it are refused
    /// ([`IpcError::Unbacked`](crate::IpcError::Unbacked)), and
    /// [`restore_backing`](Self::restore_backing) maps fresh zeroed memory at the same
    /// address. What a suspend before a process checkpoint does with the buffers only this
    /// library reads. [`IpcError::Unsupported`](crate::IpcError::Unsupported) by default.
    fn release_backing(&self, buffer: &mut Self::Buffer) -> Result<usize> {
        let _ = buffer;
        Err(crate::IpcError::Unsupported {
            backend: self.name(),
            what: "releasing a buffer's memory at a kept address".into(),
        })
    }

    /// Maps fresh zeroed memory of the same size at the address of a buffer whose backing
    /// was released (a no-op for a backed buffer); the buffer exports new handles from then
    /// on. [`IpcError::Unsupported`](crate::IpcError::Unsupported) by default.
    fn restore_backing(&self, buffer: &mut Self::Buffer) -> Result<()> {
        let _ = buffer;
        Err(crate::IpcError::Unsupported {
            backend: self.name(),
            what: "restoring a buffer's memory at a kept address".into(),
        })
    }

    /// Closes what this backend keeps open so that peers can fetch the handles it exported
    /// for `regions` (CUDA virtual memory: the descriptors of the allocations holding them).
    /// Peers that opened them keep their mappings; handles exported before go stale, and the
    /// next export makes fresh ones. [`PeerMappings::close_all`](crate::PeerMappings::close_all)
    /// calls it with its own regions (every peer has opened what it needs by then), so that a
    /// process checkpoint finds nothing exported open. A no-op by default.
    fn close_exports(&self, regions: &mut dyn Iterator<Item = Region>) {
        let _ = regions;
    }

    /// Why a mapping opened from `handle` would keep this process from being checkpointed
    /// and restored with its peers (`cuCheckpointProcess*`), or `None` when it would not:
    /// the check a process checkpoint makes on every exchanged region before anything is
    /// suspended. `None` by default (host memory is checkpointed with the process).
    fn checkpoint_blocker(&self, handle: &Self::Handle) -> Option<String> {
        let _ = handle;
        None
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
