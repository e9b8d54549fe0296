//! # tpcomm-allreduce
//!
//! The graph-safe custom all-reduce: one-stage and two-stage all-reduce over peer memory,
//! for small and medium tensors inside a node, whose launches read every peer address
//! through *stable tables*, so that a process can suspend (every peer mapping closed) and
//! resume (mappings reopened at new addresses) while plans captured before the suspend stay
//! valid. The lifecycle is fail-fast: a failed transition leaves the communicator Failed
//! for good.
//!
//! The communicator ([`CustomAllReduce`]) is the same for every backend; a [`Backend`] only
//! knows its Signal layout and how to run one launch. [`HostBackend`] is a real CPU
//! all-reduce over shared memory (CPU inference, and every piece of the lifecycle tested
//! without a GPU); the CUDA backend plugs into the same trait.
//!
//! See `docs/all-reduce.md` and `docs/lifecycle.md`.

pub mod backend;
mod custom_all_reduce;
pub mod dispatch;
pub mod dtype;
mod error;
#[cfg(feature = "nccl")]
mod fallback;
pub mod lifecycle;
pub mod topology;

#[cfg(feature = "cuda")]
pub use backend::cuda::{CudaBackend, CudaOptions};
pub use backend::host::HostBackend;
pub use backend::Backend;
pub use custom_all_reduce::{
    Capture, CapturedPlan, Config, CustomAllReduce, HostRoute, RegisteredInput,
};
#[cfg(feature = "cuda")]
pub use custom_all_reduce::{CaptureMark, DeviceGraph};
pub use dispatch::{Algorithm, FallbackReason};
pub use dtype::{DType, Element};
pub use error::{AllReduceError, Refused, Result};
#[cfg(feature = "nccl")]
pub use fallback::{DeviceAllReduce, Route};
pub use lifecycle::{Lifecycle, Phase};
pub use topology::{Link, TopologyCheck, TopologyDecision};
