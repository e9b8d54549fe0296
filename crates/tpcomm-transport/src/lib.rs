//! # tpcomm-transport
//!
//! The bottom layer of tpcomm: a [`Communicator`] trait over host bytes, with
//!
//! - [`LocalGroup`] (always built, the embedded default): N communicators for N threads of
//!   one process, with real blocking semantics and bounded waits;
//! - `MpiCommunicator` (feature `mpi`): an MPI communicator (world or a split), with every
//!   MPI return code checked and counts converted with checks.
//!
//! Argument checks are shared by every backend (module [`check`]): a bad argument is a
//! typed [`TransportError::InvalidArgument`] naming the argument, raised before anything is
//! sent. Each collective opens a `tracing` span (`collective`) with the operation, rank,
//! size and byte count.
//!
//! Groups: [`Communicator::split`] gives sub-communicators (tensor-, pipeline-,
//! data-parallel groups); collectives in sibling groups run concurrently.

pub mod backend;
pub mod check;
mod communicator;
mod error;

pub use backend::local::{LocalCommunicator, LocalGroup, LocalGroupConfig};
#[cfg(feature = "mpi")]
pub use backend::mpi::MpiCommunicator;
pub use check::{GatherRecv, Layout};
pub use communicator::{dense_displacements, Communicator};
pub use error::{ArgumentError, Op, Result, TransportError};
