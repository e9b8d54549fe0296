//! Peer-memory backends. The `unsafe` code of this crate lives here only.
//!
//! - `host`: memfd shared memory (always built), with `HostMemory::stable` in `host/stable.rs`;
//! - `cuda`: legacy CUDA IPC, and the checked `result` layer over the driver (feature `cuda`);
//! - `cuda_vmm`: the driver's virtual-memory API (feature `cuda`);
//! - `descriptor`: fetching a peer's descriptor and the checks on it, shared by `host` and
//!   `cuda_vmm`.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_vmm;
mod descriptor;
pub mod host;
