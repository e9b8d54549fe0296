//! # tpcomm-ipc
//!
//! Peer memory for tensor-parallel programs: allocations that other ranks map, behind one
//! [`PeerMemory`] trait, and the [`PeerMappings`] registry that exchanges handles through
//! `tpcomm-objects` over any `Communicator`, opens each handle once, and can close every
//! imported mapping and rebuild them all (suspend/resume).
//!
//! Backends:
//! - [`HostMemory`] (always built): memfd shared-memory segments; peers in other processes
//!   fetch the descriptor (`pidfd_getfd`, or `/proc/<pid>/fd`), threads of the same process
//!   map it again. The CPU twin of CUDA IPC, where every piece of the lifecycle is tested
//!   without a GPU.
//! - `CudaMemory` (feature `cuda`): legacy CUDA IPC (`cuIpcGetMemHandle` /
//!   `cuIpcOpenMemHandle`) over `cuMemAlloc` buffers rounded up to 2 MiB, one process per rank.
//!   The driver is loaded at run time: the feature builds without CUDA, and a machine without
//!   a driver or GPU gets [`IpcError::NoDevice`].
//! - `CudaVmmMemory` (feature `cuda`): the driver's virtual-memory API (`cuMemCreate`,
//!   POSIX-descriptor handles fetched with `pidfd_getfd`, peers mapping into ranges they
//!   reserve), whose peer mappings keep their addresses through a suspend and resume and
//!   whose buffers can give their memory back at a suspend (`PeerMemory::detach`,
//!   `PeerMemory::release_backing`); memory the caller allocated with `cuMemAlloc` travels
//!   as legacy IPC. [`HostMemory::stable`] is its CPU twin.
//!
//! What may change across [`PeerMappings::close_all`] + [`PeerMappings::reopen_all`]: the
//! addresses of peer mappings (and so any pointer to them), unless the backend keeps them
//! ([`PeerMemory::keeps_addresses`]). What never changes: local
//! allocations and their addresses, the group id, exchange ids and region order.

pub mod backend;
mod error;
mod fault;
mod memory;
mod registry;
mod step;

#[cfg(feature = "cuda")]
pub use backend::cuda::{
    alias_access, imported_allocations as cuda_imported_allocations, AliasAccess, BufferView,
    CudaAddressHold, CudaBuffer, CudaHandle, CudaMapping, CudaMemory, DevicePeerMemory,
};
#[cfg(feature = "cuda")]
pub use backend::cuda_vmm::{CudaPeerHandle, CudaVmmHandle, CudaVmmMemory};
pub use backend::host::{AddressHold, HostBuffer, HostHandle, HostMapping, HostMemory};
pub use error::{IpcError, Result, SegmentProblem};
pub use fault::{FaultInjection, FaultPoint};
pub use memory::{MemoryRegion, PeerMemory, Region};
pub use registry::{
    fresh_group_id, CheckpointBlocker, Counters, Envelope, ExchangeId, PeerMappings,
};
pub use step::{tagged_all_gather, Step, StepTag, TAG_BYTES};
