//! # tpcomm-transport
//!
//! The bottom layer of tpcomm: a [`Communicator`] trait over host bytes, with
//!
//! - [`LocalGroup`] (always built, the embedded default): N communicators for N threads of
//!   one process, with real blocking semantics and bounded waits;
//! - `MpiCommunicator` (feature `mpi`): an MPI communicator (world or a split), with every
//!   MPI return code checked and counts converted with checks;
//! - `NcclCommunicator` (feature `nccl`): a `DeviceCommunicator` over
//!   NCCL for device buffers (cudarc), bootstrapped through any host [`Communicator`]; libcuda
//!   and libnccl are loaded at run time, and a machine without them gets a typed error.
//!
//! Argument checks are shared by every backend (module [`check`]): a bad argument is a
//! typed [`TransportError::InvalidArgument`] naming the argument, raised before anything is
//! sent. Each collective opens a `tracing` span (`collective`) with the operation, rank,
//! size and byte count.
//!
//! Numbers: [`Communicator::all_reduce`] (sum, product, min, max of integers, `f32`,
//! `f64`, `f16` and `bf16`, in place or not) on every backend; see [`reduce`].
//!
//! Groups: [`Communicator::split`] gives sub-communicators (tensor-, pipeline-,
//! data-parallel groups); collectives in sibling groups run concurrently.
//! [`hosts::split_by_host`] gives each host's ranks a group of their own.

pub mod backend;
pub mod check;
mod communicator;
pub mod copy;
pub mod cuda_driver;
#[cfg(feature = "nccl")]
pub mod device;
mod error;
pub mod hosts;
pub mod process;
pub mod reduce;
pub mod spin;
#[doc(hidden)]
pub mod testing;

pub use backend::local::{LocalCommunicator, LocalGroup, LocalGroupConfig};
#[cfg(feature = "mpi")]
pub use backend::mpi::MpiCommunicator;
#[cfg(feature = "nccl")]
pub use backend::nccl::{NcclCommunicator, NcclLibrary};
pub use check::{AllReduceArgs, DeviceCollective, GatherRecv, Layout};
pub use communicator::{dense_displacements, Communicator};
#[cfg(feature = "nccl")]
pub use device::{DeviceArgs, DeviceCommunicator, DeviceElement, NcclDataType, NcclRedOp};
pub use error::{ArgumentError, Op, Result, TransportError};
pub use reduce::{DataType, Element, ReduceOp};
