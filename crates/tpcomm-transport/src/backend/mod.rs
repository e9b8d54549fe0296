//! Transport backends. `unsafe` code of this crate lives here only.

pub mod copy;
#[cfg(feature = "cuda-driver")]
pub mod cuda_driver;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod spin;
