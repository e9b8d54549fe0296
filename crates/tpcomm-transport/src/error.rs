//! The one error type of the transport layer.

use std::fmt;
use std::time::Duration;

/// The collective operation an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Communicator::barrier`](crate::Communicator::barrier).
    Barrier,
    /// [`Communicator::all_gather`](crate::Communicator::all_gather).
    AllGather,
    /// [`Communicator::all_gather_varcount`](crate::Communicator::all_gather_varcount).
    AllGatherVarcount,
    /// [`Communicator::gather_varcount`](crate::Communicator::gather_varcount).
    GatherVarcount,
    /// [`Communicator::broadcast`](crate::Communicator::broadcast).
    Broadcast,
    /// [`Communicator::all_to_all_varcount`](crate::Communicator::all_to_all_varcount).
    AllToAllVarcount,
    /// [`Communicator::split`](crate::Communicator::split).
    Split,
    /// Creating or tearing down a communicator.
    Setup,
    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce) and
    /// `DeviceCommunicator::all_reduce` (feature `nccl`).
    AllReduce,
    /// `DeviceCommunicator::reduce_scatter` (feature `nccl`).
    ReduceScatter,
    /// Suspending a device communicator (feature `nccl`).
    Suspend,
    /// Resuming a device communicator (feature `nccl`).
    Resume,
}

impl Op {
    /// The operation's name as it appears in errors and tracing spans.
    pub fn name(self) -> &'static str {
        match self {
            Op::Barrier => "barrier",
            Op::AllGather => "all_gather",
            Op::AllGatherVarcount => "all_gather_varcount",
            Op::GatherVarcount => "gather_varcount",
            Op::Broadcast => "broadcast",
            Op::AllToAllVarcount => "all_to_all_varcount",
            Op::Split => "split",
            Op::Setup => "setup",
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::Suspend => "suspend",
            Op::Resume => "resume",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which argument of a collective call was wrong, and how.
///
/// Argument errors are detected on the calling rank before anything is sent,
/// so they never leave a partial transfer behind on that rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgumentError {
    /// `root` is not a rank of this communicator.
    #[error("root {root} is out of range for a communicator of size {size}")]
    RootOutOfRange {
        /// The root that was passed.
        root: usize,
        /// The communicator's size.
        size: usize,
    },
    /// The send buffer's length does not match what the other arguments imply.
    #[error("send buffer holds {actual} bytes, expected {expected}")]
    SendLength {
        /// The length the counts require.
        expected: usize,
        /// The length of the buffer that was passed.
        actual: usize,
    },
    /// The receive buffer's length does not match what the other arguments imply.
    #[error("receive buffer holds {actual} bytes, expected {expected}")]
    RecvLength {
        /// The length the counts require.
        expected: usize,
        /// The length of the buffer that was passed.
        actual: usize,
    },
    /// A counts or displacements slice does not have one entry per rank.
    #[error("{which} has {actual} entries, expected one per rank ({expected})")]
    TableLength {
        /// `"counts"`, `"displacements"`, `"send counts"`...
        which: &'static str,
        /// The communicator's size.
        expected: usize,
        /// The slice's length.
        actual: usize,
    },
    /// A count exceeds what one call of this transport can move.
    #[error("{which}[{index}] = {value} exceeds the transport's max_count {max}")]
    CountTooLarge {
        /// `"counts"`, `"send count"`, `"displacements"`...
        which: &'static str,
        /// The rank the entry belongs to.
        index: usize,
        /// The value that was passed.
        value: usize,
        /// The transport's limit ([`Communicator::max_count`](crate::Communicator::max_count)).
        max: usize,
    },
    /// `displacement + count` of one entry lies past the end of its buffer.
    #[error(
        "{which} region of rank {index} ({displacement}..{displacement}+{count}) lies outside \
         the {buffer_len}-byte buffer"
    )]
    OutOfBounds {
        /// `"receive"` or `"send"`.
        which: &'static str,
        /// The rank the entry belongs to.
        index: usize,
        /// Its displacement.
        displacement: usize,
        /// Its count.
        count: usize,
        /// The buffer's length.
        buffer_len: usize,
    },
    /// Two non-empty receive regions overlap.
    #[error("{which} regions of ranks {first} and {second} overlap")]
    Overlap {
        /// `"receive"`.
        which: &'static str,
        /// One rank.
        first: usize,
        /// The other rank.
        second: usize,
    },
    /// A size computed from the arguments does not fit in `usize`.
    #[error("{what} overflows usize")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// The arguments reached a backend checked for another rank or communicator size than
    /// the backend's own: a communicator that forwards checked arguments to another one
    /// reported a rank or size of its own.
    #[error(
        "the arguments were checked for rank {checked_rank} of {checked_size}, but the \
         communicator running the call is rank {rank} of {size}: a communicator that forwards \
         checked arguments must report the rank and size of the one it forwards to"
    )]
    OtherGroup {
        /// The rank the arguments were checked for.
        checked_rank: usize,
        /// The communicator size the arguments were checked for.
        checked_size: usize,
        /// The backend's rank.
        rank: usize,
        /// The backend's size.
        size: usize,
    },
    /// The root of a gather passed no receive layout.
    #[error("the root of a gather must pass a receive buffer with counts and displacements")]
    MissingRootReceive,
    /// A buffer of a numeric all-reduce does not hold a whole number of elements.
    #[error("{which} buffer holds {len} bytes, not a whole number of {dtype} elements ({elem} bytes each)")]
    PartialElement {
        /// `"send"` or `"receive"`.
        which: &'static str,
        /// The buffer's length in bytes.
        len: usize,
        /// The element type's name.
        dtype: &'static str,
        /// Bytes per element.
        elem: usize,
    },
    /// A device buffer lives on another device than the communicator's.
    #[error("{which} buffer is on device {actual}, the communicator on device {expected}")]
    WrongDevice {
        /// `"send"` or `"receive"`.
        which: &'static str,
        /// The communicator's device ordinal.
        expected: usize,
        /// The buffer's device ordinal.
        actual: usize,
    },
}

/// Every failure of a transport operation.
///
/// Each variant names the operation and, where one is to blame, the rank.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// An argument was invalid on this rank; nothing was sent.
    #[error("{op} on rank {rank}: invalid argument")]
    InvalidArgument {
        /// The operation.
        op: Op,
        /// The calling rank.
        rank: usize,
        /// What was wrong.
        #[source]
        source: ArgumentError,
    },
    /// A wait on peers ran past the configured timeout.
    #[error("{op} on rank {rank} timed out after {waited:?}: ranks {missing:?} never arrived")]
    Timeout {
        /// The operation.
        op: Op,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks that did not arrive in time.
        missing: Vec<usize>,
    },
    /// A wait on peers ran past the configured timeout where the transport cannot see which
    /// ranks arrived (an MPI collective: MPI does not say who is missing). Instead it names
    /// the peers whose *process* it found gone (same host, checked through `/proc`), the
    /// peers that did not answer a roll call (MPI: on any host, those not waiting in this
    /// communicator's collectives: lost with their host, stopped, cut off, or elsewhere), and
    /// the peers it could not check at all.
    #[error(
        "{op} on rank {rank} timed out after {waited:?}: {}",
        describe_unresponsive(gone, silent, unchecked)
    )]
    Unresponsive {
        /// The operation.
        op: Op,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// Peers whose process no longer exists, in the order they were found gone while
        /// waiting (the first one died first, as far as this rank could see).
        gone: Box<[usize]>,
        /// Peers not known gone that did not answer this rank's roll call and did not call
        /// it either, ascending: not waiting in a collective of this communicator when this
        /// rank gave up (MPI's timed path; a peer on another host that is lost is here).
        silent: Box<[usize]>,
        /// Peers that could not be checked: on other hosts without a roll call, or every
        /// peer where the transport knows no process identities (NCCL).
        unchecked: Box<[usize]>,
    },
    /// Ranks called different operations, or made inconsistent calls, at the same point.
    #[error("{op} on rank {rank}: ranks disagree: {detail}")]
    Mismatch {
        /// The operation this rank called.
        op: Op,
        /// The calling rank.
        rank: usize,
        /// What disagreed.
        detail: String,
    },
    /// The group was aborted (a rank timed out, panicked, dropped its communicator
    /// or detected a mismatch); every later call fails with this error.
    #[error("{op} on rank {rank}: group aborted by rank {by}: {reason}")]
    Aborted {
        /// The operation.
        op: Op,
        /// The calling rank.
        rank: usize,
        /// The rank that caused the abort.
        by: usize,
        /// Why.
        reason: String,
    },
    /// A rank of [`LocalGroup::run`](crate::LocalGroup::run) panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// An MPI call returned an error code.
    #[error("{op}: {call} failed with MPI error code {code} (class {class}): {message}")]
    Mpi {
        /// The operation.
        op: Op,
        /// The MPI function that failed.
        call: &'static str,
        /// The raw code it returned.
        code: i32,
        /// The code's error class (`-1` when MPI could not classify it, or was not
        /// initialized yet).
        class: i32,
        /// `MPI_Error_string` of the code (or a note when MPI could not describe it).
        message: String,
    },
    /// An operating-system call the transport needs (for example mapping a guarded
    /// receive buffer) failed.
    #[error("{op}: {call} failed")]
    Os {
        /// The operation.
        op: Op,
        /// The system call that failed.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The communicator could not be built.
    #[error("cannot create a communicator: {0}")]
    Setup(String),
    /// An NCCL call returned an error code (feature `nccl`).
    #[error("{op}: {call} failed with NCCL error code {code}: {message}")]
    Nccl {
        /// The operation.
        op: Op,
        /// The NCCL function that failed.
        call: &'static str,
        /// The raw `ncclResult_t` it returned (kept even when this crate does not know it).
        code: i32,
        /// `ncclGetErrorString` of the code, followed by `ncclGetLastError` when NCCL has
        /// more to say.
        message: String,
    },
    /// A CUDA driver call made for a device communicator failed (feature `nccl`).
    #[error("{op}: {call} failed with CUDA error code {code}: {message}")]
    Cuda {
        /// The operation.
        op: Op,
        /// What was called.
        call: &'static str,
        /// The raw `CUresult`.
        code: i32,
        /// The driver's name and description of the code.
        message: String,
    },
    /// A library a backend loads at run time is not installed, or lacks a function the
    /// backend needs; nothing of it was called.
    #[error("{library} is not usable: {detail}")]
    LibraryMissing {
        /// `"libcuda"` or `"libnccl"`.
        library: &'static str,
        /// Where it was looked for, or which functions are missing.
        detail: String,
    },
    /// The CUDA driver is present but the requested device is not (no GPU, or the ordinal is
    /// out of range).
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    /// The loaded library does not offer this operation.
    #[error("{op} is not supported: {reason}")]
    Unsupported {
        /// The operation.
        op: Op,
        /// Why (which library version or symbol is missing).
        reason: String,
    },
    /// The communicator is suspended: only `resume` (and dropping it) are allowed.
    #[error("{op} on rank {rank}: the communicator is suspended")]
    Suspended {
        /// The operation that was refused.
        op: Op,
        /// The calling rank.
        rank: usize,
    },
}

impl TransportError {
    /// The rank that caused this error, where one is known.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            TransportError::InvalidArgument { rank, .. }
            | TransportError::Mismatch { rank, .. }
            | TransportError::RankPanicked { rank, .. } => Some(*rank),
            TransportError::Aborted { by, .. } => Some(*by),
            TransportError::Timeout { missing, .. } => missing.first().copied(),
            TransportError::Unresponsive { gone, silent, .. } => {
                gone.first().or(silent.first()).copied()
            }
            TransportError::Mpi { .. }
            | TransportError::Os { .. }
            | TransportError::Setup(_)
            | TransportError::Nccl { .. }
            | TransportError::Cuda { .. }
            | TransportError::LibraryMissing { .. }
            | TransportError::NoDevice(_)
            | TransportError::Unsupported { .. }
            | TransportError::Suspended { .. } => None,
        }
    }
}

/// The peer part of [`TransportError::Unresponsive`]'s message.
fn describe_unresponsive(gone: &[usize], silent: &[usize], unchecked: &[usize]) -> String {
    let mut text = match (gone.is_empty(), silent.is_empty()) {
        (true, true) => {
            "no peer process on this host is gone (a rank is late or stuck)".to_string()
        }
        (false, _) => format!("the processes of ranks {gone:?} are gone"),
        (true, false) => format!("ranks {silent:?} did not answer a roll call"),
    };
    if !gone.is_empty() && !silent.is_empty() {
        text.push_str(&format!("; ranks {silent:?} did not answer a roll call"));
    }
    if !unchecked.is_empty() {
        text.push_str(&format!(
            "; ranks {unchecked:?} could not be checked (other hosts, or a transport that \
             cannot see its peers' processes)"
        ));
    }
    text
}

/// Result of transport operations.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;
