//! Peer-memory backends. The `unsafe` code of this crate lives here only.
//!
//! - `host`: memfd shared memory (always built), with `HostMemory::stable` in `host/stable.rs`;
//! - `cuda_driver`: the CUDA driver as both CUDA backends call it: the checked `result` layer
//!   over cudarc (public as `backend::cuda::result`), the virtual-memory entry points of
//!   `tpcomm_transport::cuda_driver::vmm`, the primary context, and the one mapping of a
//!   `CUresult` to `IpcError::Cuda` (feature `cuda`);
//! - `cuda`: legacy CUDA IPC (feature `cuda`);
//! - `cuda_vmm`: the driver's virtual-memory API (feature `cuda`);
//! - `descriptor`: fetching a peer's descriptor and the checks on it, shared by `host` and
//!   `cuda_vmm`.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_driver;
#[cfg(feature = "cuda")]
pub mod cuda_vmm;
mod descriptor;
pub mod host;
