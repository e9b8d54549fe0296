//! The error type of peer-memory management.

use tpcomm_objects::ObjectError;
use tpcomm_transport::TransportError;

/// Every failure of a peer-memory operation. Each variant says what was wrong with which
/// handle, address or rank; OS and driver failures keep their raw code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A system call failed.
    #[error("{call} failed: {source} (errno {errno})", errno = source.raw_os_error())]
    Os {
        /// The call and what it was for.
        call: &'static str,
        /// The OS error (keeps the raw errno).
        #[source]
        source: rustix::io::Errno,
    },
    /// The process that exported the handle no longer exists.
    #[error("the owner of the handle (pid {pid}) is gone")]
    OwnerGone {
        /// The owner's pid.
        pid: u32,
    },
    /// The handle no longer names the segment it was made for (its owner closed or freed
    /// it, or the descriptor number now names something else).
    #[error("stale handle: {0}")]
    StaleHandle(String),
    /// The handle is malformed or inconsistent (garbage bytes, a range outside the segment,
    /// a size that does not match the segment).
    #[error("invalid handle: {0}")]
    InvalidHandle(String),
    /// The handle was exported by another group of ranks.
    #[error("handle from another group (group {found:#x}, this group {expected:#x})")]
    ForeignHandle {
        /// This registry's group id.
        expected: u64,
        /// The handle's group id.
        found: u64,
    },
    /// The address range cannot be exported by this backend (not inside one of its
    /// allocations, or memory of a kind that cannot be shared).
    #[error("cannot export {len} bytes at {addr:#x}: {reason}")]
    NotExportable {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: usize,
        /// Why.
        reason: String,
    },
    /// A copy or access fell outside its region.
    #[error("access of {len} bytes at offset {offset} is outside a {region_len}-byte region")]
    OutOfBounds {
        /// Offset of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// A copy was handed a region of another backend (e.g. device memory to the host backend).
    #[error("{backend} backend cannot copy into a {region}")]
    ForeignRegion {
        /// The backend asked to copy.
        backend: &'static str,
        /// The region's type.
        region: &'static str,
    },
    /// An allocation request was invalid (zero bytes, overflow).
    #[error("invalid allocation: {0}")]
    InvalidAllocation(String),
    /// The registry is closed (after `close_all`, before `reopen_all`): peer mappings are not
    /// reachable.
    #[error("peer mappings are closed; call reopen_all first")]
    Closed,
    /// A lookup named an exchange, rank or index that does not exist.
    #[error("no such mapping: {0}")]
    NoSuchMapping(String),
    /// Ranks disagree on an exchange (different numbers of regions).
    #[error("ranks disagree: {0}")]
    Mismatch(String),
    /// A peer is in another collective step than this rank (it skipped a step, or runs
    /// something else on the communicator): every rank in a tagged step reads the same tags
    /// and returns this error, naming the first rank that is elsewhere. Nothing of the step
    /// was decoded or opened.
    #[error(
        "rank {rank} is in {}, while this rank is in {expected}",
        crate::step::describe(found)
    )]
    StepMismatch {
        /// The first rank whose tag differs.
        rank: usize,
        /// The step this rank is in.
        expected: crate::step::StepTag,
        /// The step that rank is in; `None` when its bytes carry no tag (a collective that is
        /// not a tagged tpcomm step).
        found: Option<crate::step::StepTag>,
    },
    /// Opening failed on some ranks; every rank returns this error and the exchange was
    /// rolled back everywhere.
    #[error("opening peer handles failed on ranks {ranks:?}{}", local.as_ref().map(|e| format!(" (here: {e})")).unwrap_or_default())]
    PeerOpenFailed {
        /// The ranks where opening failed.
        ranks: Vec<usize>,
        /// This rank's own error, when it is one of `ranks`.
        local: Option<Box<IpcError>>,
    },
    /// There is no usable device or driver (CUDA backend).
    #[error("no device: {0}")]
    NoDevice(String),
    /// A CUDA driver call failed.
    #[error("{call} failed with CUDA error {code} ({name}): {message}")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The raw `CUresult`.
        code: i32,
        /// Its symbolic name.
        name: String,
        /// The driver's description.
        message: String,
    },
    /// Exchanging handles failed.
    #[error(transparent)]
    Exchange(#[from] ObjectError),
}

impl From<TransportError> for IpcError {
    fn from(e: TransportError) -> Self {
        IpcError::Exchange(ObjectError::Transport(e))
    }
}

/// Result of peer-memory operations.
pub type Result<T, E = IpcError> = std::result::Result<T, E>;

/// Maps an errno with the call it came from.
pub(crate) fn os(call: &'static str) -> impl FnOnce(rustix::io::Errno) -> IpcError {
    move |source| IpcError::Os { call, source }
}
