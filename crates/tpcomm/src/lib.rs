//! # tpcomm
//!
//! The facade of the tpcomm workspace: it re-exports each layer, with one cargo feature per
//! backend so that a program depends on exactly what it uses.
//!
//! | feature | what it adds |
//! |---------|--------------|
//! | (none)  | [`transport`] with the local (threads) backend; [`objects`] (serde values over any communicator); [`ipc`] (peer memory, host shared-memory backend, with stable addresses as `ipc::HostMemory::stable`); [`allreduce`] (custom all-reduce, host backend); [`queue`] (the per-step broadcast queue: a shared-memory ring for one writer and its readers) |
//! | `mpi`   | `transport::MpiCommunicator` over MPI, and rsmpi itself as [`mpi`] (a program calls `tpcomm::mpi::initialize()`) |
//! | `cuda`  | `ipc::CudaMemory` (legacy CUDA IPC) and `ipc::CudaVmmMemory` (the driver's virtual memory: peer addresses kept and buffers released across a suspend, what a process checkpoint of several processes needs) peer memory, and `allreduce::CudaBackend`, the custom all-reduce's kernels; building needs nvcc (`cargo xtask setup-cuda`), running a GPU (driver loaded at run time unless the program links cudarc) |
//! | `nccl`  | `transport::NcclCommunicator` and `transport::DeviceCommunicator`: NCCL collectives on device buffers (libcuda and libnccl loaded at run time) |
//! | `gpu`   | `cuda` and `nccl`, and `allreduce::DeviceAllReduce` (the custom kernels with NCCL as the fallback) |
//! | `checkpoint` | [`checkpoint`]: process checkpoint of a group through the CUDA driver (`checkpoint_group`), with every tpcomm object suspended around it; with `cuda`, the real driver `checkpoint::CudaCheckpoint` (loaded at run time, driver 570+) |
//! | `cuda-13000` (default) | cudarc's CUDA 13.0 bindings, when a GPU feature builds cudarc; turn the default features off when your program picks cudarc's CUDA version itself (see `docs/gpu.md`) |
//!
//! ```
//! use tpcomm::transport::{Communicator, LocalGroup};
//!
//! let sums = LocalGroup::new(2).run(|comm| {
//!     let mut all = [0u8; 2];
//!     comm.all_gather(&[comm.rank() as u8 + 1], &mut all)?;
//!     Ok::<u32, tpcomm::transport::TransportError>(all.iter().map(|&b| u32::from(b)).sum())
//! });
//! assert!(sums.into_iter().all(|s| s.unwrap().unwrap() == 3));
//! ```

pub use tpcomm_allreduce as allreduce;
#[cfg(feature = "checkpoint")]
pub use tpcomm_checkpoint as checkpoint;
pub use tpcomm_ipc as ipc;
pub use tpcomm_objects as objects;
pub use tpcomm_queue as queue;
pub use tpcomm_transport as transport;

// The error types of every layer, so that a program names them without knowing the crates.
pub use tpcomm_allreduce::AllReduceError;
pub use tpcomm_ipc::IpcError;
pub use tpcomm_objects::ObjectError;
pub use tpcomm_queue::QueueError;
pub use tpcomm_transport::{Communicator, ReduceOp, TransportError};

/// The `half` crate (`f16`, `bf16`): the element types of the all-reduces, in the version
/// tpcomm's traits are implemented for.
pub use half;

/// rsmpi (the `mpi` crate, feature `mpi`), in the version tpcomm's MPI backend is built
/// against: initialize MPI with `tpcomm::mpi::initialize()` and pass the universe to
/// `transport::MpiCommunicator::world`.
#[cfg(feature = "mpi")]
pub use mpi;

/// cudarc (features `cuda` and `nccl`), the version tpcomm's CUDA code is built against:
/// with it, a program's tensors (`cudarc::driver::CudaSlice`) and streams are the types
/// tpcomm takes. A program that depends on cudarc itself gets this same crate as long as its
/// requirement is compatible (cargo builds one cudarc per major version): tpcomm needs
/// 0.19.10 or a later 0.19 release (`docs/gpu.md`).
#[cfg(any(feature = "cuda", feature = "nccl"))]
pub use cudarc;

/// The repository's README, whose examples run as doctests of this crate (so they cannot
/// drift from the API).
#[doc = include_str!("../../../README.md")]
pub mod readme {}
