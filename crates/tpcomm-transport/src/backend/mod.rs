//! Transport backends: the local threads group, MPI and NCCL, each in a folder of its own.
//! `unsafe` code of this crate lives in backend modules: these, the byte copies of
//! [`crate::copy`] and the CUDA driver's loader and entry points, `crate::cuda_driver`.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
