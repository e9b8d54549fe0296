//! Peer-memory backends. The `unsafe` code of this crate lives here only.
//!
//! - `host`: memfd shared memory (always built), with `HostMemory::stable` in `host/stable.rs`;
//! - `cuda_driver`: the CUDA driver as both CUDA backends call it: the checked `result` layer
//!   over cudarc (public as `backend::cuda::result`), the virtual-memory entry points of
//!   `tpcomm_transport::cuda_driver::vmm`, the primary context, and the one mapping of a
//!   `CUresult` to `IpcError::Cuda` (feature `cuda`);
//! - `cuda_region`: the regions both CUDA backends hand out (`CudaBuffer`, `CudaMapping`),
//!   the process-wide records of them and their release, `DevicePeerMemory` (feature `cuda`);
//! - `cuda`: legacy CUDA IPC (feature `cuda`);
//! - `cuda_vmm`: the driver's virtual-memory API (feature `cuda`); it builds on `cuda`
//!   (memory the caller allocated travels as legacy IPC), never the other way round;
//! - `descriptor`: fetching a peer's descriptor and the checks on it, shared by `host` and
//!   `cuda_vmm`.
//!
//! The CUDA modules import downwards only: `cuda_driver` imports no other backend module,
//! `cuda_region` only `cuda_driver` and `descriptor`, `cuda` those, and `cuda_vmm` those and
//! `cuda`.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_driver;
#[cfg(feature = "cuda")]
mod cuda_region;
#[cfg(feature = "cuda")]
pub mod cuda_vmm;
mod descriptor;
pub mod host;
