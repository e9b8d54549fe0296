//! The error type of the custom all-reduce.

use std::sync::Arc;
use std::time::Duration;

use tpcomm_ipc::IpcError;
use tpcomm_transport::TransportError;

use crate::dispatch::FallbackReason;
use crate::lifecycle::Phase;

/// Every failure of the custom all-reduce.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AllReduceError {
    /// The input cannot use the custom kernels; the caller should use MPI or NCCL.
    #[error("use the fallback all-reduce: {0}")]
    Fallback(FallbackReason),
    /// Called in a lifecycle state that does not allow it.
    #[error("{call} is not allowed while {phase}")]
    WrongState {
        /// What was called.
        call: &'static str,
        /// The current phase.
        phase: Phase,
    },
    /// The communicator failed earlier; this is the original cause, returned by every call.
    #[error("the communicator failed during {during}: {cause}")]
    Failed {
        /// The transition or operation that failed.
        during: &'static str,
        /// The original error.
        cause: Arc<AllReduceError>,
    },
    /// A peer did not reach a barrier in time.
    #[error("rank {rank} waited {waited:?} in the {barrier} barrier: rank {peer} never arrived")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The rank that did not arrive.
        peer: usize,
        /// Which barrier.
        barrier: &'static str,
        /// How long this rank waited.
        waited: Duration,
    },
    /// An argument was invalid on this rank (nothing was run).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A captured input was used before `register_graph_buffers`.
    #[error("captured inputs are not registered yet: call register_graph_buffers after capture")]
    UnregisteredGraphBuffers,
    /// The RankData slot pool is full.
    #[error("all {0} RankData slots are in use")]
    SlotsExhausted(usize),
    /// After a resume, a peer's new mapping did not show the nonce it wrote.
    #[error("rank {peer}'s Signal block shows nonce {found:#x} through the new mapping, expected {expected:#x}")]
    NonceMismatch {
        /// The peer.
        peer: usize,
        /// The nonce it announced.
        expected: u64,
        /// What this rank read.
        found: u64,
    },
    /// Another rank could not set up its part of a collective setup (this rank's own failure
    /// is returned as itself); every rank fails the setup together.
    #[error("rank {rank} could not set up: {reason}")]
    PeerSetup {
        /// The rank that failed.
        rank: usize,
        /// Its error, as text.
        reason: String,
    },
    /// Ranks passed different settings to `CustomAllReduce::new` (a [`Config`](crate::Config)
    /// field, or the backend's shape) where they must be equal. Every rank returns it, and
    /// nothing was exchanged or kept.
    #[error("ranks disagree on {field}: {}", values.iter().map(|(r, v)| format!("rank {r} has {v}")).collect::<Vec<_>>().join(", "))]
    ConfigMismatch {
        /// The field (`max_bytes`, `slots`, `algorithm`, `backend`, `signal_bytes`, ...).
        field: String,
        /// Every rank's value, in rank order.
        values: Vec<(usize, String)>,
    },
    /// Peer memory failed.
    #[error(transparent)]
    Ipc(Arc<IpcError>),
    /// The transport failed.
    #[error(transparent)]
    Transport(Arc<TransportError>),
}

impl From<IpcError> for AllReduceError {
    fn from(e: IpcError) -> Self {
        AllReduceError::Ipc(Arc::new(e))
    }
}

impl From<TransportError> for AllReduceError {
    fn from(e: TransportError) -> Self {
        AllReduceError::Transport(Arc::new(e))
    }
}

impl From<tpcomm_objects::ObjectError> for AllReduceError {
    fn from(e: tpcomm_objects::ObjectError) -> Self {
        AllReduceError::Ipc(Arc::new(IpcError::Exchange(e)))
    }
}

/// Result of all-reduce operations.
pub type Result<T, E = AllReduceError> = std::result::Result<T, E>;
