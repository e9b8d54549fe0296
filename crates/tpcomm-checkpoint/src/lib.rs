//! # tpcomm-checkpoint
//!
//! Process checkpoint of a tensor-parallel group through the CUDA driver
//! (`cuCheckpointProcess*`, driver 570+): every rank's GPU state is moved to host memory
//! (the GPU's memory released) and brought back at the same virtual addresses, with every
//! tpcomm object suspended around it, so that CUDA graphs captured before the checkpoint
//! replay correctly after it.
//!
//! [`checkpoint_group`] runs one sequence over any [`Communicator`](tpcomm_transport::Communicator):
//! `prepare_for_suspend` of every registered [`Suspendable`] object -> lock every process ->
//! checkpoint every process -> the caller's pause -> restore every process -> unlock every
//! process -> `reinit_after_resume`. Each step's outcome on every rank is all-gathered
//! before the next step: no process is checkpointed before every process is locked, none is
//! unlocked before every process is restored, and a failure anywhere is rolled back the same
//! way on every rank (see `docs/checkpoint.md`).
//!
//! - The coordination is a sans-IO state machine ([`Sequence`]) over a driver trait
//!   ([`CheckpointDriver`]); [`fake::FakeDriver`] runs it without a GPU.
//! - The real driver, `CudaCheckpoint` (feature `cuda`), resolves the entry points at run
//!   time in the driver library tpcomm's probe loaded: no driver, or one older than the 570
//!   series, is [`Unsupported`] with the versions.
//! - Each process checkpoints itself, from one of its own threads (its lowest rank; a
//!   process is its pid and a random identity, since pids repeat across containers): the
//!   driver allows it (measured on driver 580), so no controller process is needed.
//! - A process that still imports CUDA IPC memory through tpcomm is refused before it is
//!   locked ([`Reason::ImportedMappings`]): the driver checkpoints it, but cannot restore
//!   it. Mappings other libraries opened are not seen (the driver cannot count them): they
//!   must be released first.
//!
//! Two ranks as threads, a host all-reduce suspended around the checkpoint, and the fake
//! driver standing in for `CudaCheckpoint::load()`:
//!
//! ```
//! use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend};
//! use tpcomm_checkpoint::{checkpoint_group, fake::FakeDriver, CheckpointOptions, Step};
//! use tpcomm_ipc::HostMemory;
//! use tpcomm_transport::{Communicator, LocalGroup};
//!
//! let driver = FakeDriver::new(); // the real one: tpcomm_checkpoint::CudaCheckpoint::load()
//! let results = LocalGroup::new(2).run(|comm| {
//!     let mut ar =
//!         CustomAllReduce::new(HostBackend::new(), HostMemory::new(), &comm, Config::default())
//!             .unwrap();
//!     let report = checkpoint_group(
//!         &comm,
//!         &driver,
//!         &mut [&mut ar],
//!         &CheckpointOptions::default(),
//!         |paused| {
//!             // Every process is checkpointed here: dump it, wait, or return at once.
//!             let _ = paused.driver_rank;
//!             Ok(())
//!         },
//!     )
//!     .unwrap();
//!     let mut out = [0f32; 4];
//!     ar.all_reduce(&[1.0; 4], &mut out).unwrap(); // resumed
//!     (report.timing(Step::Checkpoint).is_some(), out[0])
//! });
//! for r in results {
//!     assert_eq!(r.unwrap(), (true, 2.0));
//! }
//! ```

#[cfg(feature = "cuda")]
pub mod backend;
mod coordinator;
mod driver;
mod error;
pub mod fake;
mod process_hold;
mod sequence;
mod suspend;

#[cfg(feature = "cuda")]
pub use backend::cuda::CudaCheckpoint;
#[cfg(feature = "cuda")]
pub use backend::smi::GpuMemory;
pub use coordinator::{checkpoint_group, CheckpointOptions, CheckpointReport, Paused, StepTiming};
pub use driver::{
    check_support, CheckpointDriver, DriverError, DriverInfo, ProcessState, Unsupported,
    CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_VALUE, ENTRY_POINTS, MIN_DRIVER_API_VERSION,
};
pub use error::{Aftermath, CheckpointError, ExchangeError, ObjectsLeft, Reason, StepFailure};
pub use sequence::{Sequence, Step, StepReport};
pub use suspend::{nccl_suspend_support, BoxError, Suspendable};
