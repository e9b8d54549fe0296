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
    /// The input cannot use the custom kernels; nothing ran. Host inputs: reduce them with
    /// the transport's [`Communicator::all_reduce`](tpcomm_transport::Communicator::all_reduce)
    /// (or call [`CustomAllReduce::all_reduce_or_transport`](crate::CustomAllReduce::all_reduce_or_transport),
    /// which does); device buffers: NCCL (`DeviceAllReduce`, feature `nccl`, routes them
    /// itself).
    #[error("the custom all-reduce cannot serve this input ({0}): reduce it with the transport's Communicator::all_reduce (host) or NCCL (device buffers)")]
    Fallback(FallbackReason),
    /// The dispatch table cannot be read, or cannot be used with this backend and
    /// [`Reproducibility`](crate::dispatch::Reproducibility) (the error names the file and
    /// the line).
    #[error(transparent)]
    DispatchTable(Box<crate::dispatch::TableError>),
    /// Called in a lifecycle state that does not allow it.
    #[error("{call} is not allowed while {phase}")]
    WrongState {
        /// What was called.
        call: &'static str,
        /// The current phase.
        phase: Phase,
    },
    /// This rank maps a peer buffer that a process checkpoint could not bring back
    /// (`cuCheckpointProcess*`): checked before anything is suspended.
    #[error("rank {rank} maps {buffer}, which a process checkpoint cannot restore: {reason}")]
    NotCheckpointable {
        /// This rank.
        rank: usize,
        /// Which buffer ("rank 1's registered buffer at 0x7f... (4096 bytes)").
        buffer: String,
        /// Why, as the peer-memory backend says it, with what to do instead.
        reason: String,
    },
    /// The communicator failed earlier; this is the original cause, returned by every call.
    #[error("the communicator failed during {during}")]
    Failed {
        /// The transition or operation that failed.
        during: &'static str,
        /// The original error (also the [`source`](std::error::Error::source) of this one).
        #[source]
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
    /// A rank shared a Signal block smaller than this backend's layout (a peer built with
    /// another layout); nothing is launched over it.
    #[error("rank {rank}'s Signal block has {bytes} bytes, this backend's layout needs {needed}")]
    SignalTooSmall {
        /// The rank.
        rank: usize,
        /// Its Signal block's length.
        bytes: usize,
        /// What this rank's backend needs.
        needed: usize,
    },
    /// A rank shared a region (its Signal block, temp buffer, staging buffer or a
    /// registered buffer) at an address not aligned as every launch reads it: honest
    /// ranks only share page-aligned host buffers and 16-byte aligned device buffers, so
    /// the peer sent a forged handle; nothing is launched over it.
    #[error("rank {rank} shared its {region} at {addr:#x}, not {align}-byte aligned")]
    PeerMisaligned {
        /// The rank.
        rank: usize,
        /// `"Signal block"`, `"temp buffer"` or `"input"`.
        region: &'static str,
        /// The address as mapped on this rank.
        addr: u64,
        /// The alignment every launch needs.
        align: usize,
    },
    /// A captured plan or device graph reads a registered buffer that was unregistered
    /// since; nothing ran.
    #[error("the launch reads RankData slot {slot}, whose registered buffer was unregistered after it was captured")]
    UnregisteredInput {
        /// The slot.
        slot: usize,
    },
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
    /// A launch would read more bytes of a buffer than some rank's region holds (registered
    /// buffers of different sizes, temp buffers of different sizes); refused before
    /// anything ran, on this rank (nothing changes: the communicator stays usable).
    #[error("a launch of {bytes} bytes reads rank {rank}'s {buffer} buffer (RankData slot {slot}), which holds {region_bytes} bytes")]
    RegionTooSmall {
        /// `"input"` (the slot's regions) or `"temp"` (two-stage).
        buffer: &'static str,
        /// The slot.
        slot: usize,
        /// Bytes the launch reduces.
        bytes: usize,
        /// The rank whose region is the smallest.
        rank: usize,
        /// Its length.
        region_bytes: usize,
    },
    /// The ranks launched different all-reduces (element counts, types, or RankData slots:
    /// different inputs): detected at the start barrier, before any peer data was read.
    /// Every rank of the launch reports it.
    #[error(
        "rank {rank} launched {bytes} bytes of {dtype}{}, but rank {peer} launched {peer_bytes} bytes of {peer_dtype}{}",
        from_slot(*.slot),
        from_slot(*.peer_slot)
    )]
    LaunchMismatch {
        /// This rank.
        rank: usize,
        /// Bytes this rank reduces.
        bytes: u64,
        /// Element type this rank reduces.
        dtype: &'static str,
        /// The RankData slot this rank's launch reads (0: the staging buffers), where the
        /// backend carries it (the host backend; not the CUDA kernels).
        slot: Option<usize>,
        /// A rank that launched something else.
        peer: usize,
        /// Bytes it reduces.
        peer_bytes: u64,
        /// Element type it reduces (`"unknown"` for a code this version does not know).
        peer_dtype: &'static str,
        /// The slot its launch reads, where carried.
        peer_slot: Option<usize>,
    },
    /// Captured call `call` (in capture order) reduces different sizes on two ranks.
    #[error("captured call #{call} reduces {bytes} bytes on rank {rank} but {peer_bytes} bytes on rank {peer}")]
    CaptureMismatch {
        /// Index of the captured call since the last registration.
        call: usize,
        /// This rank.
        rank: usize,
        /// Bytes this rank captured.
        bytes: usize,
        /// A rank that captured another size.
        peer: usize,
        /// Bytes it captured.
        peer_bytes: usize,
    },
    /// A captured plan (or device graph) or registered input was used on a communicator
    /// other than the one that made it.
    #[error("{what} belongs to communicator #{owner}, not to this one (#{communicator})")]
    ForeignToken {
        /// What was passed: "a captured plan", "a device graph", "a registered input".
        what: &'static str,
        /// The communicator that made it.
        owner: u64,
        /// The communicator it was passed to.
        communicator: u64,
    },
    /// Ranks disagreed on a collective call's arguments (e.g. unregistered different
    /// buffers); nothing changed.
    #[error("ranks disagree on {what}: {values:?}")]
    Disagreement {
        /// What was compared.
        what: &'static str,
        /// Every rank's value, in rank order.
        values: Vec<u64>,
    },
    /// The group's ranks are on more than one host (another kernel boot or PID namespace):
    /// the custom all-reduce reads its peers' memory, so every rank must be on one host.
    /// Every rank returns this at creation, naming each host and its ranks, before anything
    /// was exchanged. Create it on each host's ranks
    /// (`tpcomm_transport::hosts::split_by_host`) and reduce across hosts with the
    /// transport.
    #[error(
        "the group spans {} hosts ({}): the custom all-reduce needs every rank on one host",
        hosts.len(),
        describe_hosts(hosts)
    )]
    SpansHosts {
        /// This rank.
        rank: usize,
        /// Every host's name (as its lowest rank reported it) and ranks, in order of their
        /// lowest rank.
        hosts: Vec<(String, Vec<usize>)>,
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
    /// A device buffer passed by the caller is not aligned as the kernels need (they move
    /// 16-byte packs); refused before anything ran on this rank (the communicator stays
    /// usable; peers that did launch time out naming this rank, as for
    /// [`RegionTooSmall`](Self::RegionTooSmall)).
    #[error("the {buffer} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// `"output"`.
        buffer: &'static str,
        /// Its device address.
        addr: u64,
        /// The alignment needed.
        align: usize,
    },
    /// A device buffer passed by the caller holds fewer elements than the all-reduce
    /// writes; refused before anything ran on this rank.
    #[error("the {buffer} holds {len} elements, the all-reduce writes {count}")]
    BufferTooSmall {
        /// `"output"`.
        buffer: &'static str,
        /// Elements it holds.
        len: usize,
        /// Elements the all-reduce reduces (the input's length).
        count: usize,
    },
    /// The caller's stream cannot carry this communicator's work: another device, or a
    /// context other than the device's primary context (where the kernels are loaded and
    /// the peer mappings opened).
    #[error("the stream belongs to {found}, but the all-reduce runs in the primary context of device {device}")]
    ForeignStream {
        /// The all-reduce's device ordinal.
        device: i32,
        /// What the stream belongs to.
        found: String,
    },
    /// Peer memory failed.
    #[error(transparent)]
    Ipc(Arc<IpcError>),
    /// The transport failed.
    #[error(transparent)]
    Transport(Arc<TransportError>),
}

impl From<crate::dispatch::TableError> for AllReduceError {
    fn from(e: crate::dispatch::TableError) -> Self {
        AllReduceError::DispatchTable(Box::new(e))
    }
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

/// A refused call that had taken ownership of its argument
/// ([`CustomAllReduce::register_buffer`](crate::CustomAllReduce::register_buffer)'s buffer,
/// [`CustomAllReduce::unregister`](crate::CustomAllReduce::unregister)'s token): the error,
/// and the argument handed back whenever the caller may have it again, so that a refusal
/// loses nothing. `?` turns it into its [`AllReduceError`] (dropping the argument).
///
/// ```
/// use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend, Phase};
/// use tpcomm_ipc::{HostMemory, PeerMemory};
/// use tpcomm_transport::LocalGroup;
///
/// let results = LocalGroup::new(2).run(|comm| -> tpcomm_allreduce::Result<()> {
///     let mut ar = CustomAllReduce::new(HostBackend::new(), HostMemory::new(), &comm, Config::default())?;
///     let buffer = ar.memory()?.allocate(4096)?;
///     ar.prepare_for_suspend(&comm)?;
///     // Refused while suspended: the buffer comes back with the error.
///     let refused = ar.register_buffer(&comm, buffer).unwrap_err();
///     assert_eq!(ar.phase(), Phase::Suspended);
///     let buffer = refused.into_value().expect("handed back");
///     ar.reinit_after_resume(&comm)?;
///     let token = ar.register_buffer(&comm, buffer)?;
///     drop(ar.unregister(&comm, token)?);
///     Ok(())
/// });
/// for r in results {
///     r.unwrap().unwrap();
/// }
/// ```
pub struct Refused<T> {
    error: AllReduceError,
    value: Option<T>,
}

impl<T> Refused<T> {
    /// The error, with `value` handed back to the caller.
    pub(crate) fn returning(error: AllReduceError, value: T) -> Self {
        Refused {
            error,
            value: Some(value),
        }
    }

    /// The error, the communicator keeping the value (peers may still map it).
    pub(crate) fn keeping(error: AllReduceError) -> Self {
        Refused { error, value: None }
    }

    /// Why the call was refused.
    pub fn error(&self) -> &AllReduceError {
        &self.error
    }

    /// The argument, handed back; `None` where the communicator keeps it until it is
    /// dropped because peers may still map it (the call's docs say when).
    pub fn value(&self) -> Option<&T> {
        self.value.as_ref()
    }

    /// The error, dropping the argument.
    pub fn into_error(self) -> AllReduceError {
        self.error
    }

    /// The argument, handed back (see [`value`](Self::value)).
    pub fn into_value(self) -> Option<T> {
        self.value
    }

    /// The error and the argument.
    pub fn into_parts(self) -> (AllReduceError, Option<T>) {
        (self.error, self.value)
    }
}

impl<T> std::fmt::Debug for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refused")
            .field("error", &self.error)
            .field("handed_back", &self.value.is_some())
            .finish()
    }
}

impl<T> std::fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

impl<T> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl<T> From<Refused<T>> for AllReduceError {
    fn from(refused: Refused<T>) -> Self {
        refused.error
    }
}

/// " from slot N", or nothing when the backend does not carry slots.
fn from_slot(slot: Option<usize>) -> String {
    slot.map(|s| format!(" from slot {s}")).unwrap_or_default()
}

/// Result of all-reduce operations.
pub type Result<T, E = AllReduceError> = std::result::Result<T, E>;

/// `ranks [0, 1] on `a`; ranks [2, 3] on `b``.
fn describe_hosts(hosts: &[(String, Vec<usize>)]) -> String {
    hosts
        .iter()
        .map(|(name, ranks)| {
            let name = if name.is_empty() {
                "an unknown host"
            } else {
                name
            };
            format!("ranks {ranks:?} on `{name}`")
        })
        .collect::<Vec<_>>()
        .join("; ")
}
