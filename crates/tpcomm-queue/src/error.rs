//! The one error type of the broadcast queue.

use std::time::Duration;

use tpcomm_ipc::IpcError;
use tpcomm_objects::ObjectError;
use tpcomm_transport::TransportError;

/// What a reader found wrong in the ring or in a frame from the writer (or the writer in a
/// reader's progress word): every value read from shared memory or from a peer is checked
/// before it is used, and a value that no honest peer writes is one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Corruption {
    /// The segment does not start with the queue's magic number.
    #[error("the ring's magic number is {found:#018x}, not tpcomm's")]
    Magic {
        /// What the first 8 bytes hold.
        found: u64,
    },
    /// The segment's layout version is not the one this build reads.
    #[error("the ring's layout version is {found}, this build reads version {supported}")]
    Version {
        /// The version in the segment.
        found: u32,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// A field of the segment header differs from what the ranks agreed at creation.
    #[error("the ring header's {field} is {found}, the agreed value is {expected}")]
    Header {
        /// Which field.
        field: &'static str,
        /// What the segment holds.
        found: u64,
        /// What the ranks agreed.
        expected: u64,
    },
    /// A chunk's stamp is neither the chunk this reader waits for nor the one it replaces.
    #[error("chunk #{chunk}'s stamp is {found}, expected {expected} (or {previous} before it is written)")]
    Stamp {
        /// The chunk (its sequence number since creation).
        chunk: u64,
        /// The stamp found.
        found: u64,
        /// The stamp of the chunk once written.
        expected: u64,
        /// The stamp the slot holds until then.
        previous: u64,
    },
    /// A chunk belongs to another message than the one being read.
    #[error("chunk #{chunk} says it is part of message #{found}")]
    ChunkMessage {
        /// The chunk.
        chunk: u64,
        /// The message number it carries.
        found: u64,
    },
    /// A chunk's length, offset or total disagrees with the message it continues, or its
    /// length is past the chunk's size.
    #[error(
        "chunk #{chunk} says {len} bytes at offset {offset} of a {total}-byte message; the \
         reader expected offset {expected_offset}, {expected_len} bytes of at most {chunk_bytes} \
         per chunk"
    )]
    ChunkFraming {
        /// The chunk.
        chunk: u64,
        /// The length it announces.
        len: u64,
        /// The offset it announces.
        offset: u64,
        /// The total it announces.
        total: u64,
        /// The offset the reader has reached in the message.
        expected_offset: u64,
        /// The only length a chunk at that offset may have.
        expected_len: u64,
        /// The agreed chunk size.
        chunk_bytes: u64,
    },
    /// A chunk's flags are not the ones its place in the message implies (the first chunk
    /// alone is `FIRST`, the last alone is `LAST`), or hold unknown bits.
    #[error("chunk #{chunk}'s flags are {found:#x}, expected {expected:#x}")]
    Flags {
        /// The chunk.
        chunk: u64,
        /// The flags found.
        found: u64,
        /// The flags expected.
        expected: u64,
    },
    /// A chunk's shape (the writer's value's, `tpcomm_objects::Shape`) is not the one the
    /// message's first chunk carried.
    #[error("chunk #{chunk} says the message's shape is {found:#018x}, its first chunk {expected:#018x}")]
    ChunkShape {
        /// The chunk.
        chunk: u64,
        /// The shape it carries.
        found: u64,
        /// The first chunk's.
        expected: u64,
    },
    /// A message announces more bytes than the agreed cap ([`tpcomm_objects::Options::max_total_bytes`]),
    /// which the writer refuses to send.
    #[error("a {total}-byte message is announced, over the agreed cap of {cap} bytes")]
    TooLarge {
        /// The announced length.
        total: u64,
        /// The agreed cap.
        cap: u64,
    },
    /// The writer rewrote a chunk while this reader was copying it: it had not released it.
    #[error("chunk #{chunk} was rewritten while it was read (its stamp moved to {found})")]
    Overwritten {
        /// The chunk.
        chunk: u64,
        /// The stamp found after the copy.
        found: u64,
    },
    /// A reader's progress word claims chunks the writer never published.
    #[error("reader slot {slot} says it consumed {consumed} chunks, {published} were published")]
    ReaderProgress {
        /// The reader's slot.
        slot: usize,
        /// What it claims.
        consumed: u64,
        /// What the writer published.
        published: u64,
    },
    /// A reader's claim on its slot is not the one it made (another process took it).
    #[error("reader slot {slot}'s claim is {found:#x}, not this reader's {expected:#x}")]
    Claim {
        /// The slot.
        slot: usize,
        /// The claim word found.
        found: u64,
        /// This reader's claim.
        expected: u64,
    },
    /// A transport frame of the remote path is malformed.
    #[error("a frame of the transport path is malformed: {0}")]
    Frame(&'static str),
    /// A count of parked waiters is one no honest peer leaves: more waiters than can park
    /// on it, or none while this waiter is parked on it.
    #[error(
        "the {which} count is {found}, outside what the waiters on it can make it (0..={most})"
    )]
    Parked {
        /// Which count (`"readers parked"`, `"writer parked"`).
        which: &'static str,
        /// The count found (as this waiter counted itself in or out).
        found: u32,
        /// The most waiters that can park on it.
        most: u32,
    },
    /// A rank number read from the ring is not a rank of the group.
    #[error("the {which} word names rank {found}, in a group of {size}")]
    Rank {
        /// Which word (`"culprit"`).
        which: &'static str,
        /// The rank it names.
        found: u64,
        /// The group's size.
        size: usize,
    },
    /// A state word holds a value no peer writes.
    #[error("the {which} state word holds {found}, not a state")]
    State {
        /// `"writer"` or `"reader slot N"`.
        which: &'static str,
        /// The value.
        found: u32,
    },
}

/// How a peer left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// Its process exited (checked through `/proc`: same host only).
    Exited,
    /// It dropped its queue without closing it (a panic unwinding, an early return).
    Dropped,
    /// It closed its queue on its own ([`BroadcastQueue::close`](crate::BroadcastQueue::close)).
    Closed,
}

impl std::fmt::Display for Departure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Departure::Exited => "its process exited",
            Departure::Dropped => "it dropped its queue without closing it",
            Departure::Closed => "it closed its queue",
        })
    }
}

/// Every failure of the broadcast queue.
///
/// Each variant names the rank that reports it (`rank`) and, where one is to blame, the
/// peer, and the message number (`message`: messages sent, or received, before this one).
/// [`culprit`](Self::culprit) returns the rank to blame.
///
/// Errors that leave the queue usable: [`Encode`](Self::Encode), [`TooDeep`](Self::TooDeep),
/// [`MessageTooLarge`](Self::MessageTooLarge) (nothing was sent), [`Decode`](Self::Decode)
/// and [`TypeMismatch`](Self::TypeMismatch) (the message was consumed; the next `recv`
/// reads the next one), a ring reader's [`Allocation`](Self::Allocation) (the message was
/// passed over), a ring reader's [`WriterTimeout`](Self::WriterTimeout) before any chunk of
/// the message arrived (call `recv` again), and the argument and role errors. Any other error leaves the queue
/// failed for good: every later call returns [`Failed`](Self::Failed) naming the first
/// error's culprit, and a failing writer tells its local readers, so that those waiting
/// fail too, naming the same culprit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// This rank's configuration is outside its documented ranges; its peers get
    /// [`PeerInvalidConfig`](Self::PeerInvalidConfig).
    #[error("queue on rank {rank}: invalid configuration: {reason}")]
    InvalidConfig {
        /// This rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// Peers passed configurations outside their ranges.
    #[error("queue on rank {rank}: ranks {ranks:?} passed invalid configurations")]
    PeerInvalidConfig {
        /// This rank.
        rank: usize,
        /// Every rank whose configuration is invalid.
        ranks: Vec<usize>,
    },
    /// Ranks passed different agreed settings (writer, depth, chunk size, message cap,
    /// decode depth); every rank returns this same error.
    #[error(
        "queue on rank {rank}: ranks {ranks:?} passed a different {setting} than rank {reference}"
    )]
    ConfigMismatch {
        /// This rank.
        rank: usize,
        /// The first setting (in field order) that differs.
        setting: &'static str,
        /// The rank the others are compared with (rank 0).
        reference: usize,
        /// Every rank whose setting differs from the reference's.
        ranks: Vec<usize>,
    },
    /// `send` was called on a reader.
    #[error("queue on rank {rank}: only the writer, rank {writer}, sends")]
    NotWriter {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
    },
    /// `recv` was called on the writer.
    #[error("queue on rank {rank}: the writer does not receive")]
    NotReader {
        /// This rank.
        rank: usize,
    },
    /// The value could not be serialized; nothing was sent, the queue is usable.
    #[error("queue on rank {rank}: cannot serialize message #{message}")]
    Encode {
        /// This rank (the writer).
        rank: usize,
        /// The message that was not sent.
        message: u64,
        /// postcard's error.
        #[source]
        source: postcard::Error,
    },
    /// The value nests deeper than the agreed `max_depth` (counted as the decoder counts
    /// it), or deeper than the writer thread's stack holds (less than 256 KiB of it left:
    /// `limit` is then the level reached): nothing was sent, the queue is usable.
    #[error(
        "queue on rank {rank}: message #{message} nests deeper than {limit} levels \
         (Options::max_depth): not sent"
    )]
    TooDeep {
        /// This rank (the writer).
        rank: usize,
        /// The message that was not sent.
        message: u64,
        /// The agreed depth limit.
        limit: usize,
    },
    /// The serialized value is over the agreed cap; nothing was sent, the queue is usable.
    #[error(
        "queue on rank {rank}: message #{message} is {bytes} bytes, over the agreed cap of {cap} \
         bytes (Options::max_total_bytes)"
    )]
    MessageTooLarge {
        /// This rank (the writer).
        rank: usize,
        /// The message that was not sent.
        message: u64,
        /// Its serialized length.
        bytes: usize,
        /// The cap.
        cap: usize,
    },
    /// The value encoded to another length than the size pass just before counted (a
    /// `Serialize` impl whose output changes from one call to the next): the writer had
    /// started streaming it into the ring, so the queue fails (unless nothing was
    /// published yet, when it stays usable and nothing was sent).
    #[error(
        "queue on rank {rank}: message #{message} encoded to another length than the \
         {sized} bytes its size pass counted (a Serialize impl that changes its output)"
    )]
    UnstableEncoding {
        /// This rank (the writer).
        rank: usize,
        /// The message being sent.
        message: u64,
        /// The length the size pass counted.
        sized: usize,
    },
    /// A message arrived whole but does not decode as the requested type (or nests deeper
    /// than the agreed depth, or than the decoder's stack holds); it is consumed, the queue
    /// is usable.
    #[error(
        "queue on rank {rank}: cannot decode message #{message} from the writer, rank {writer}"
    )]
    Decode {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// The message.
        message: u64,
        /// The decoder's error.
        #[source]
        source: ObjectError,
    },
    /// A message decoded as the requested type, but its shape (the serde calls of the
    /// writer's value, see `docs/queue.md`) is not the shape of the requested type: the
    /// writer sent another type. The message is consumed, the queue is usable.
    #[error(
        "queue on rank {rank}: message #{message} from the writer, rank {writer}, is of another \
         type than the one requested (shape {sent:#018x}, the requested type's {found:#018x})"
    )]
    TypeMismatch {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// The message.
        message: u64,
        /// The shape the writer's value had.
        sent: u64,
        /// The shape the requested type decoded with.
        found: u64,
    },
    /// A reader waited for the writer longer than the timeout.
    #[error(
        "queue on rank {rank}: timed out after {waited:?} waiting for message #{message} from \
         the writer, rank {writer}"
    )]
    WriterTimeout {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// The message waited for.
        message: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// The writer waited for a reader to release a chunk (the writer lapped it) longer
    /// than the timeout.
    #[error(
        "queue on rank {rank}: timed out after {waited:?} sending message #{message}: reader \
         rank {reader} has not released the ring's oldest chunk"
    )]
    ReaderTimeout {
        /// This rank (the writer).
        rank: usize,
        /// The slowest reader.
        reader: usize,
        /// The message being sent.
        message: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// The writer left the queue while this reader waited for a message it had not sent.
    #[error(
        "queue on rank {rank}: the writer, rank {writer}, is gone before message #{message}: {how}"
    )]
    WriterGone {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// The message waited for.
        message: u64,
        /// How it left.
        how: Departure,
    },
    /// A reader left the queue while the writer waited for it.
    #[error("queue on rank {rank}: reader rank {reader} is gone while message #{message} is sent: {how}")]
    ReaderGone {
        /// This rank (the writer).
        rank: usize,
        /// The reader.
        reader: usize,
        /// The message being sent.
        message: u64,
        /// How it left.
        how: Departure,
    },
    /// The writer failed the queue (a reader it waited for timed out, left or corrupted
    /// its progress) and told this reader so.
    #[error(
        "queue on rank {rank}: the writer, rank {writer}, failed the queue before message \
         #{message} because of rank {culprit}"
    )]
    WriterFailed {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// The message waited for.
        message: u64,
        /// The rank the writer blamed.
        culprit: usize,
    },
    /// The writer closed the queue and every message it sent was received.
    #[error("queue on rank {rank}: the writer, rank {writer}, closed the queue after {messages} messages")]
    Closed {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// Messages sent (and received).
        messages: u64,
    },
    /// A peer's memory or frame held a value no honest peer writes.
    #[error("queue on rank {rank}: corrupt data from rank {peer} at message #{message}")]
    Corrupt {
        /// This rank.
        rank: usize,
        /// The rank whose data it is (the writer, or a reader for the writer).
        peer: usize,
        /// The message being read or sent.
        message: u64,
        /// What was wrong.
        #[source]
        problem: Corruption,
    },
    /// A reader tried to join the ring after the writer had started sending (or its slot
    /// was taken): it would have missed messages, so it is refused.
    #[error(
        "queue on rank {rank}: refused to join the ring of writer rank {writer}: {messages} \
         messages were sent before this reader joined"
    )]
    JoinedLate {
        /// This rank.
        rank: usize,
        /// The writer.
        writer: usize,
        /// Messages sent before the join.
        messages: u64,
    },
    /// The queue is suspended: only `resume`, `close` and `close_with` are allowed.
    #[error("queue on rank {rank}: {op} refused: the queue is suspended")]
    Suspended {
        /// This rank.
        rank: usize,
        /// The refused operation.
        op: &'static str,
    },
    /// An earlier error failed the queue; every later call returns this.
    #[error("queue on rank {rank}: {op} refused: the queue failed earlier ({reason})")]
    Failed {
        /// This rank.
        rank: usize,
        /// The refused operation.
        op: &'static str,
        /// The rank the first error blamed, if any.
        culprit: Option<usize>,
        /// The first error's message.
        reason: String,
    },
    /// Ranks failed a collective step of the queue's life (creation, suspend, resume,
    /// close); every other rank returns this, naming them.
    #[error("queue on rank {rank}: {step} failed on ranks {ranks:?}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The step.
        step: &'static str,
        /// The ranks that failed it.
        ranks: Vec<usize>,
    },
    /// The ring's memory could not be allocated, exported, mapped or unmapped.
    #[error("queue on rank {rank}: {what} failed")]
    Memory {
        /// This rank.
        rank: usize,
        /// What was being done.
        what: &'static str,
        /// The peer-memory error.
        #[source]
        source: IpcError,
    },
    /// A collective step of the queue's life failed in the exchange itself (a transport
    /// failure, a peer in another step).
    #[error("queue on rank {rank}: the exchange of {step} failed")]
    Step {
        /// This rank.
        rank: usize,
        /// The step.
        step: &'static str,
        /// The exchange's error.
        #[source]
        source: IpcError,
    },
    /// The receive buffer could not grow to hold a message. A ring reader passes over the
    /// rest of it (the next `recv` reads the next message); a transport reader's queue
    /// fails.
    #[error("queue on rank {rank}: cannot allocate {bytes} more bytes for message #{message}")]
    Allocation {
        /// This rank.
        rank: usize,
        /// The message.
        message: u64,
        /// The bytes asked for.
        bytes: usize,
    },
    /// A collective call of the queue got another communicator than the one it was created
    /// on (another rank or size).
    #[error(
        "queue on rank {rank} of {size} was given a communicator of rank {comm_rank} of {comm_size}"
    )]
    WrongCommunicator {
        /// This rank.
        rank: usize,
        /// The queue's group size.
        size: usize,
        /// The communicator's rank.
        comm_rank: usize,
        /// The communicator's size.
        comm_size: usize,
    },
    /// The transport failed on the path of the readers that receive through it.
    #[error("queue on rank {rank}: the transport path failed at message #{message}")]
    Transport {
        /// This rank.
        rank: usize,
        /// The message.
        message: u64,
        /// The rank the transport's error blames, in the queue's numbering (the transport
        /// path runs on a split of the writer and its transport readers, whose ranks are
        /// not the queue's), where it blames one.
        culprit: Option<usize>,
        /// The transport's error (boxed: it is large, and this path is rare).
        #[source]
        source: Box<TransportError>,
    },
    /// The writer's broadcast of a message to the transport readers did not complete within
    /// the queue's timeout; the queue is failed. `readers` (queue ranks) are the transport
    /// readers the transport blames: those whose process is gone first, then those that did
    /// not answer its roll call (MPI), or that did not arrive (threads); every transport
    /// reader when the transport cannot tell.
    #[error(
        "queue on rank {rank}: the transport path timed out sending message #{message}: \
         transport readers {readers:?} did not take it"
    )]
    TransportTimeout {
        /// This rank (the writer).
        rank: usize,
        /// The message being sent.
        message: u64,
        /// The transport readers to blame, in the queue's numbering.
        readers: Vec<usize>,
        /// The transport's error, which says how long it waited (its ranks are those of the
        /// transport path's split; boxed).
        #[source]
        source: Box<TransportError>,
    },
}

impl QueueError {
    /// The rank to blame for this error, where one is known: the peer that timed out, left,
    /// sent corrupt data or passed a different setting.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            QueueError::WriterTimeout { writer, .. }
            | QueueError::WriterGone { writer, .. }
            | QueueError::Closed { writer, .. } => Some(*writer),
            QueueError::ReaderTimeout { reader, .. } | QueueError::ReaderGone { reader, .. } => {
                Some(*reader)
            }
            QueueError::WriterFailed { culprit, .. } => Some(*culprit),
            QueueError::Corrupt { peer, .. } => Some(*peer),
            QueueError::Failed { culprit, .. } => *culprit,
            QueueError::PeerFailed { ranks, .. }
            | QueueError::PeerInvalidConfig { ranks, .. }
            | QueueError::ConfigMismatch { ranks, .. } => ranks.first().copied(),
            QueueError::Transport { culprit, .. } => *culprit,
            QueueError::TransportTimeout { readers, .. } => readers.first().copied(),
            QueueError::Step { source, .. } => step_culprit(source),
            QueueError::InvalidConfig { .. }
            | QueueError::NotWriter { .. }
            | QueueError::NotReader { .. }
            | QueueError::Encode { .. }
            | QueueError::TooDeep { .. }
            | QueueError::TypeMismatch { .. }
            | QueueError::UnstableEncoding { .. }
            | QueueError::MessageTooLarge { .. }
            | QueueError::Decode { .. }
            | QueueError::JoinedLate { .. }
            | QueueError::Suspended { .. }
            | QueueError::Allocation { .. }
            | QueueError::WrongCommunicator { .. }
            | QueueError::Memory { .. } => None,
        }
    }
}

/// The rank a failed exchange blames.
fn step_culprit(e: &IpcError) -> Option<usize> {
    match e {
        IpcError::Exchange(ObjectError::Transport(t)) => t.culprit(),
        IpcError::StepMismatch { rank, .. } => Some(*rank),
        _ => None,
    }
}

/// Result of queue operations.
pub type Result<T, E = QueueError> = std::result::Result<T, E>;
