//! The error type of peer-memory management.

use tpcomm_objects::ObjectError;
use tpcomm_transport::TransportError;

/// Every failure of a peer-memory operation. Each variant says what was wrong with which
/// handle, address or rank; OS and driver failures keep their raw code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A system call failed.
    #[error("{call} failed with errno {errno}", errno = source.raw_os_error())]
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
    /// The descriptor a handle names is not a segment made by the host backend (an ordinary
    /// file, a socket, an unsealed or write-sealed memfd, another program's memfd): it was
    /// closed again and nothing was mapped.
    #[error("descriptor {fd} of pid {pid} is not a tpcomm segment: {problem}")]
    NotASegment {
        /// The owner's pid, as the handle names it.
        pid: u32,
        /// The descriptor number in the owner, as the handle names it.
        fd: i32,
        /// What the descriptor is instead.
        problem: SegmentProblem,
    },
    /// The handle comes from a rank on another host (another kernel boot or PID namespace,
    /// as the ranks' process identities say): its pid and descriptor number mean nothing
    /// here, so it was refused before any descriptor was fetched. Peer memory is shared
    /// between the ranks of one host only (split the group by host first:
    /// `tpcomm_transport::hosts::split_by_host`).
    #[error("rank {rank}'s handle comes from {host}, while this rank is on {this_host}: peer memory is shared within one host only")]
    OtherHost {
        /// The rank that sent the handle.
        rank: usize,
        /// Its host (`host `name``).
        host: String,
        /// This rank's host.
        this_host: String,
    },
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
    /// A collective call of a registry (or of a layer built on it) was passed a
    /// communicator other than the one it was created with: another rank or size (a
    /// sub-communicator, another group). Refused on this rank before anything is sent.
    #[error("this object belongs to rank {rank} of {size}, but the communicator passed is rank {comm_rank} of {comm_size}")]
    WrongCommunicator {
        /// This rank in the group it was created for.
        rank: usize,
        /// That group's size.
        size: usize,
        /// The rank of the communicator passed.
        comm_rank: usize,
        /// Its size.
        comm_size: usize,
    },
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
    #[error("opening peer handles failed on ranks {ranks:?}")]
    PeerOpenFailed {
        /// The ranks where opening failed.
        ranks: Vec<usize>,
        /// This rank's own error, when it is one of `ranks` (also its `source()`).
        #[source]
        local: Option<Box<IpcError>>,
    },
    /// A context could not be given access to another device's memory
    /// (`cuCtxEnablePeerAccess` failed for a reason other than "already enabled"): ranks
    /// that are threads of one process on two GPUs cannot read each other's buffers.
    #[error("device {device} cannot be given access to device {peer_device}'s memory")]
    PeerAccess {
        /// The device whose context would read.
        device: i32,
        /// The device that owns the memory.
        peer_device: i32,
        /// The driver's error.
        #[source]
        cause: Box<IpcError>,
    },
    /// A device buffer was paired with a stream of another device
    /// ([`CudaBuffer::view`](crate::CudaBuffer::view)).
    #[error("a buffer on device {buffer} cannot be viewed on a stream of device {stream}")]
    WrongDevice {
        /// The device the buffer lives on.
        buffer: i32,
        /// The device of the stream.
        stream: usize,
    },
    /// The backend (or the driver under it) does not provide what was asked.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What it lacks (for a driver: the missing capability or entry point).
        what: String,
    },
    /// A fresh handle cannot be mapped at the address a detached mapping kept: nothing was
    /// mapped, the reservation is kept (callers open the handle elsewhere instead).
    #[error("cannot map at the kept address {addr:#x}: {reason}")]
    AddressNotKept {
        /// The kept address of the mapped range.
        addr: u64,
        /// Why not (sizes or offsets that differ, a mapping that is not detached).
        reason: String,
    },
    /// A copy reached memory that is not mapped now: a detached mapping, or a buffer whose
    /// backing was released (see `PeerMemory::detach` and `PeerMemory::release_backing`).
    #[error("the {len} bytes at {addr:#x} are not backed now ({what})")]
    Unbacked {
        /// Start of the region.
        addr: u64,
        /// Its length.
        len: usize,
        /// "a detached mapping" or "a released buffer".
        what: &'static str,
    },
    /// The descriptor a CUDA virtual-memory handle names is not an allocation handle the
    /// driver exported (an ordinary file, a memfd, another device's file): it was closed
    /// again and nothing was imported.
    #[error("descriptor {fd} of pid {pid} is not a CUDA allocation handle: {found}")]
    NotAnAllocation {
        /// The owner's pid, as the handle names it.
        pid: u32,
        /// The descriptor number in the owner, as the handle names it.
        fd: i32,
        /// What the descriptor is instead.
        found: String,
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

/// Why a descriptor fetched for a host handle is not a segment of the host backend (see
/// [`IpcError::NotASegment`]). A segment is a memfd named `tpcomm-peer`, on the kernel's
/// internal tmpfs, sealed with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL` and not sealed
/// against writing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SegmentProblem {
    /// `F_GET_SEALS` refused it (`EINVAL`): not a memfd or other shared-memory file (an
    /// ordinary file, a directory, a socket, a pipe, a device), or (through `/proc`) not a
    /// regular file on tmpfs or hugetlbfs.
    NotMemfd,
    /// Not sealed against shrinking, growing and further sealing: its owner could shrink it
    /// under the mapping, and the next access would raise SIGBUS.
    Unsealed {
        /// The seals it has (`F_GET_SEALS`, raw bits).
        seals: u32,
    },
    /// Sealed against writing (`F_SEAL_WRITE` or `F_SEAL_FUTURE_WRITE`): it cannot be mapped
    /// read-write.
    WriteSealed {
        /// The seals it has (`F_GET_SEALS`, raw bits).
        seals: u32,
    },
    /// A memfd on another file system than tmpfs (a hugetlbfs memfd).
    NotTmpfs {
        /// The file system's magic number (`statfs.f_type`).
        fs_type: u32,
    },
    /// A memfd with another name than the host backend's: another program's segment.
    ForeignName {
        /// Its name as `/proc/self/fd` shows it.
        name: String,
    },
}

impl std::fmt::Display for SegmentProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotMemfd => f.write_str("it is not a memfd (F_GET_SEALS refused it)"),
            Self::Unsealed { seals } => write!(
                f,
                "it is not sealed against shrinking, growing and sealing \
                 (seals {seals:#x}, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL required)"
            ),
            Self::WriteSealed { seals } => write!(
                f,
                "it is sealed against writing (seals {seals:#x}) and cannot be mapped read-write"
            ),
            Self::NotTmpfs { fs_type } => {
                write!(f, "it lives on file system {fs_type:#x}, not on tmpfs")
            }
            Self::ForeignName { name } => {
                write!(f, "it is {name:?}, not a memfd named \"tpcomm-peer\"")
            }
        }
    }
}

/// Result of peer-memory operations.
pub type Result<T, E = IpcError> = std::result::Result<T, E>;

/// Maps an errno with the call it came from.
pub(crate) fn os(call: &'static str) -> impl FnOnce(rustix::io::Errno) -> IpcError {
    move |source| IpcError::Os { call, source }
}
