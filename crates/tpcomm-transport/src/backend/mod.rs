//! Transport backends. `unsafe` code of this crate lives here only.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
