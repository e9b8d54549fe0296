//! [`BroadcastQueue`]: its state (its role, its lifecycle, the agreed settings), its public
//! types and accessors. Each mechanism has a file of its own: `config.rs` (the settings,
//! and which of them are agreed), `create.rs` (the collective creation), `send.rs` (the
//! writer's path), `stream.rs` (the encoder that writes straight into the ring's chunks),
//! `receive.rs` (the readers' path through the ring), `transport.rs` (the frames of the
//! readers that receive through the transport) and `lifecycle.rs` (suspend, resume, close,
//! failure).

use std::time::Duration;

use tpcomm_ipc::{HostHandle, HostMemory};
use tpcomm_objects::Options;
use tpcomm_transport::process::ProcessIdentity;
use tpcomm_transport::spin::SpinBudget;
use tpcomm_transport::Communicator;

use crate::layout::header;
#[cfg(test)]
use crate::layout::Layout;
use crate::shm::SharedRing;
use crate::wait::Park;

mod config;
mod create;
mod lifecycle;
mod receive;
mod send;
mod stream;
#[cfg(test)]
mod tests;
mod transport;

pub use config::QueueConfig;
use config::Settings;
use transport::FRAME;

/// Which way this rank's messages travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueuePath {
    /// This rank is the writer.
    Writer,
    /// This reader reads the ring in shared memory.
    SharedMemory,
    /// This reader receives through the transport.
    Transport,
}

/// Which readers read the ring and which receive through the transport, as agreed at
/// creation (the same on every rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locality {
    /// Readers that map the ring (the writer's host), ascending.
    pub shared_memory: Vec<usize>,
    /// Readers that receive through the transport, ascending.
    pub transport: Vec<usize>,
}

/// The queue's lifecycle.
#[derive(Debug)]
enum Life {
    Active,
    Suspended,
    /// The writer closed the queue and this reader received every message.
    Ended,
    Failed {
        culprit: Option<usize>,
        reason: String,
    },
}

/// This rank's part.
#[derive(Debug)]
enum Role {
    Writer {
        /// `None` when no reader maps the ring.
        ring: Option<SharedRing>,
        /// Reader slots of the readers that joined.
        active: Vec<usize>,
        /// The rank of each reader slot.
        slot_ranks: Vec<usize>,
        next_chunk: u64,
        /// Chunks every active reader had released when their progress was last read (a
        /// lower bound): the writer reads the progress words only when the next chunk's slot
        /// is not known free.
        released: u64,
    },
    Reader {
        /// `None` while suspended.
        ring: Option<SharedRing>,
        handle: HostHandle,
        slot: usize,
        next_chunk: u64,
    },
    Remote,
}

/// A per-step broadcast queue: one writer, many readers, no collective call per message.
///
/// Created collectively over a [`Communicator`] ([`create`](Self::create)); then the writer
/// calls [`send`](Self::send) and every reader [`recv`](Self::recv) (or
/// [`recv_borrowed`](Self::recv_borrowed)) once per message, in the same order. Readers on
/// the writer's host read a ring of chunks in a shared-memory segment the writer owns;
/// readers elsewhere receive the same messages through the transport, in a sub-communicator
/// of the writer and them (see the crate documentation for the protocol and its guarantees).
///
/// ```
/// use tpcomm_queue::{BroadcastQueue, QueueConfig};
/// use tpcomm_transport::LocalGroup;
///
/// #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
/// struct Step { id: u64, tokens: Vec<u32> }
///
/// let results = LocalGroup::new(3).run(|comm| -> tpcomm_queue::Result<Vec<u64>> {
///     let mut queue = BroadcastQueue::create(&comm, QueueConfig::with_writer(0))?;
///     let mut seen = Vec::new();
///     for id in 0..4 {
///         if queue.is_writer() {
///             queue.send(&Step { id, tokens: vec![1, 2, 3] })?;
///         } else {
///             let step: Step = queue.recv()?;
///             assert_eq!(step.tokens, [1, 2, 3]);
///             seen.push(step.id);
///         }
///     }
///     queue.close_with(&comm)?;
///     Ok(seen)
/// });
/// assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap(), &[0, 1, 2, 3]);
/// ```
#[derive(Debug)]
pub struct BroadcastQueue<C: Communicator> {
    rank: usize,
    size: usize,
    writer: usize,
    settings: Settings,
    options: Options,
    timeout: Duration,
    id: u64,
    locality: Locality,
    /// Reader slots in the ring: every reader on the writer's host that did not ask for
    /// the transport, including those that then could not map the ring.
    slots: usize,
    role: Role,
    /// The writer and the transport readers.
    remote: Option<C>,
    memory: HostMemory,
    life: Life,
    /// Tagged steps run so far.
    steps: u64,
    /// Messages sent (writer) or received (reader).
    messages: u64,
    /// The writer's encoding, a reader's received bytes (kept between messages).
    buf: Vec<u8>,
    /// The shape of the message a reader just received (`tpcomm_objects::Shape`).
    shape: u64,
    /// Whether the writer's next `send` sizes its value first: after a message too small to
    /// stream, it encodes the next one straight into its buffer (`stream.rs`, "size pass").
    size_next: bool,
    frame: [u8; FRAME],
    budget: SpinBudget,
    peers: Vec<ProcessIdentity>,
    /// The peer-liveness interval of waits on other processes.
    liveness: Duration,
    /// Set once this rank told its peers it left (a close): `Drop` has nothing left to say.
    departed: bool,
}

impl<C: Communicator> BroadcastQueue<C> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The writer's rank.
    pub fn writer(&self) -> usize {
        self.writer
    }

    /// Whether this rank is the writer.
    pub fn is_writer(&self) -> bool {
        self.rank == self.writer
    }

    /// Which way this rank's messages travel.
    pub fn path(&self) -> QueuePath {
        match self.role {
            Role::Writer { .. } => QueuePath::Writer,
            Role::Reader { .. } => QueuePath::SharedMemory,
            Role::Remote => QueuePath::Transport,
        }
    }

    /// Which readers read the ring and which the transport (the same on every rank).
    pub fn locality(&self) -> &Locality {
        &self.locality
    }

    /// Messages sent (the writer) or received (a reader) so far.
    pub fn messages(&self) -> u64 {
        self.messages
    }

    /// Whether the queue is suspended.
    pub fn is_suspended(&self) -> bool {
        matches!(self.life, Life::Suspended)
    }
}

/// The words the readers park on, which the writer bumps when it publishes a chunk: at
/// most one reader per slot is parked on them.
fn park_of_readers(ring: &SharedRing) -> Park<'_> {
    Park {
        word: ring.header_u32(header::WAKE),
        parked: ring.header_u32(header::SLEEPERS),
        most: u32::try_from(ring.reader_slots()).unwrap_or(u32::MAX),
        which: "readers parked",
    }
}

/// The words the writer parks on, which a reader bumps when it releases a chunk.
fn park_of_writer(ring: &SharedRing) -> Park<'_> {
    Park {
        word: ring.header_u32(header::WRITER_WAKE),
        parked: ring.header_u32(header::WRITER_PARKED),
        most: 1,
        which: "writer parked",
    }
}

/// The corruption of a parked count that a wait found (`found` waiters, see
/// [`Interrupted::Miscounted`](crate::wait::Interrupted::Miscounted)).
fn miscounted(park: Park<'_>, found: u32) -> crate::error::Corruption {
    crate::error::Corruption::Parked {
        which: park.which,
        found,
        most: park.most,
    }
}

/// The size of a transport frame, for the tests that craft one.
#[cfg(test)]
pub(crate) const FRAME_FOR_TEST: usize = FRAME;

/// Writes a data frame's header (message `message`, `total` bytes), for the tests that
/// craft one.
#[cfg(test)]
pub(crate) fn write_frame_for_test(frame: &mut [u8; FRAME], message: u64, total: u64) {
    transport::write_frame(frame, transport::DATA, message, (total, 0));
}

#[cfg(test)]
impl<C: Communicator> BroadcastQueue<C> {
    /// The ring this rank maps or owns, for the tests that corrupt it.
    pub(crate) fn ring_for_test(&self) -> Option<&SharedRing> {
        match &self.role {
            Role::Writer { ring, .. } | Role::Reader { ring, .. } => ring.as_ref(),
            Role::Remote => None,
        }
    }

    /// The sub-communicator of the transport path, for the tests that send crafted frames.
    pub(crate) fn remote_for_test(&self) -> Option<&C> {
        self.remote.as_ref()
    }

    /// The capacity of the receive buffer, for the tests of what a frame makes a reader
    /// reserve.
    pub(crate) fn buf_capacity_for_test(&self) -> usize {
        self.buf.capacity()
    }

    /// The handle and layout of the ring, for the test of a late join.
    pub(crate) fn join_args_for_test(&self) -> (HostHandle, Layout, u64) {
        let Role::Reader { handle, .. } = &self.role else {
            panic!("a reader on the writer's host has the handle");
        };
        let layout = Layout::new(self.settings.depth, self.settings.chunk_bytes, self.slots)
            .expect("the layout exists");
        (handle.clone(), layout, self.id)
    }
}
