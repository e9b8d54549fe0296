//! Peer-memory backends. The `unsafe` code of this crate lives here only.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_vmm;
mod descriptor;
pub mod host;
