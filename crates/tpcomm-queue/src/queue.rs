//! [`BroadcastQueue`]: creation, the writer's `send`, the readers' `recv`, the transport path,
//! and the lifecycle (suspend, resume, close).

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tpcomm_ipc::{tagged_all_gather, HostHandle, HostMemory, IpcError, Step, StepTag};
use tpcomm_objects::Options;
use tpcomm_transport::backend::spin::SpinBudget;
use tpcomm_transport::process::{Liveness, ProcessIdentity};
use tpcomm_transport::Communicator;

use crate::error::{Corruption, Departure, QueueError, Result};
use crate::layout::{chunk_count, header, piece, Layout, ReaderState, WriterState};
use crate::ring::{self, Look, Position, RingMemory};
use crate::shm::{JoinError, SharedRing};
use crate::wait::{liveness_interval, wait_until, wake_if_parked, Interrupted, Park};

/// Settings of a queue.
///
/// `writer`, `depth`, `chunk_bytes`, `options.max_total_bytes` and `options.max_depth` are
/// *agreed*: every rank passes the same values, checked at creation
/// ([`QueueError::ConfigMismatch`] on every rank otherwise). `timeout`, `spin` and
/// `via_transport` are this rank's own.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// The rank that sends (default 0). Valid range: `0..comm.size()`.
    pub writer: usize,
    /// Chunks in the ring (default 16): how far the writer may run ahead of the slowest
    /// reader on its host, in chunks. Valid range: `1..=`[`QueueConfig::MAX_DEPTH`].
    pub depth: usize,
    /// Payload bytes per chunk (default 256 KiB: a 4 MiB ring, which stays in a server CPU's
    /// last-level cache, and a message of 1 MiB streams through 4 chunks, the readers copying
    /// one while the writer fills the next). A message takes
    /// `max(1, ceil(len / chunk_bytes))` consecutive chunks: a message larger than the
    /// whole ring streams through it, the writer filling chunks as the readers free them.
    /// Valid range: `1..=`[`QueueConfig::MAX_CHUNK_BYTES`].
    pub chunk_bytes: usize,
    /// The encoding limits: `max_total_bytes` is the largest message (its postcard bytes)
    /// the writer sends and a reader accepts, `max_depth` the decode's nesting bound. The
    /// other fields are not used. Validated as [`Options::validate`] does.
    pub options: Options,
    /// Longest time one wait on a peer may take (default 60 s): a reader for the writer's
    /// next chunk, the writer for the slowest reader to free one. Not agreed.
    pub timeout: Duration,
    /// Longest time a wait spins before it parks (default 50 us; adapted per rank as the
    /// local transport's budget is, none when the ranks of this host outnumber its CPUs).
    /// Not agreed.
    pub spin: Duration,
    /// This reader receives through the transport even when it could map the ring (the
    /// transport path of readers on other hosts, on this one). Not agreed; ignored on the
    /// writer.
    pub via_transport: bool,
}

impl QueueConfig {
    /// The largest `depth`.
    pub const MAX_DEPTH: usize = 1 << 16;
    /// The largest `chunk_bytes`: 1 GiB.
    pub const MAX_CHUNK_BYTES: usize = 1 << 30;

    /// The default settings with `writer` as the writer.
    pub fn with_writer(writer: usize) -> Self {
        Self {
            writer,
            ..Self::default()
        }
    }

    /// Checks every field against its range for a group of `size` ranks.
    fn validate(&self, size: usize) -> std::result::Result<(), String> {
        if self.writer >= size {
            return Err(format!(
                "writer {} is not a rank of a group of {size}",
                self.writer
            ));
        }
        if !(1..=Self::MAX_DEPTH).contains(&self.depth) {
            return Err(format!(
                "depth {} is outside 1..={}",
                self.depth,
                Self::MAX_DEPTH
            ));
        }
        if !(1..=Self::MAX_CHUNK_BYTES).contains(&self.chunk_bytes) {
            return Err(format!(
                "chunk_bytes {} is outside 1..={}",
                self.chunk_bytes,
                Self::MAX_CHUNK_BYTES
            ));
        }
        self.options.validate().map_err(|e| e.to_string())
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            writer: 0,
            depth: 16,
            chunk_bytes: 256 << 10,
            options: Options::default(),
            timeout: Duration::from_secs(60),
            spin: Duration::from_micros(50),
            via_transport: false,
        }
    }
}

/// The agreed settings, as they travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Settings {
    writer: u64,
    depth: u64,
    chunk_bytes: u64,
    max_message_bytes: u64,
    max_depth: u64,
}

/// Names of [`Settings`]' fields, in [`Settings::fields`] order.
const SETTING_NAMES: [&str; 5] = [
    "writer",
    "depth",
    "chunk_bytes",
    "options.max_total_bytes",
    "options.max_depth",
];

impl Settings {
    fn of(c: &QueueConfig) -> Self {
        Self {
            writer: c.writer as u64,
            depth: c.depth as u64,
            chunk_bytes: c.chunk_bytes as u64,
            max_message_bytes: c.options.max_total_bytes as u64,
            max_depth: c.options.max_depth as u64,
        }
    }

    fn fields(&self) -> [u64; 5] {
        [
            self.writer,
            self.depth,
            self.chunk_bytes,
            self.max_message_bytes,
            self.max_depth,
        ]
    }
}

/// What each rank says in the creation step.
#[derive(Debug, Serialize, Deserialize)]
struct Proposal {
    /// `None` when this rank's configuration is invalid.
    settings: Option<Settings>,
    identity: Vec<u8>,
    via_transport: bool,
    nonce: u64,
}

/// How each rank took part in the join step.
#[derive(Debug, Serialize, Deserialize)]
enum Joined {
    Writer,
    /// Mapped the ring and claimed its slot.
    Mapped,
    /// Reads through the transport (asked to, or on another host).
    Transport,
    /// Could not map the ring: reads through the transport.
    Unreachable(String),
    /// Refused by the ring (joined late, a corrupt header): creation fails.
    Refused(String),
}

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

/// Bytes of a transport frame: a 24-byte header and the first [`INLINE`] bytes.
const FRAME: usize = 256;
/// Message bytes a frame carries.
const INLINE: usize = FRAME - 24;
/// A frame's first bytes.
const FRAME_MAGIC: [u8; 4] = *b"tpQF";
/// The frame format's version.
const FRAME_VERSION: u16 = 1;
/// Frame kinds.
const DATA: u8 = 1;
const END: u8 = 2;

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
    frame: [u8; FRAME],
    budget: SpinBudget,
    peers: Vec<ProcessIdentity>,
    /// The peer-liveness interval of waits on other processes.
    liveness: Duration,
    /// Set once this rank told its peers it left (a close): `Drop` has nothing left to say.
    departed: bool,
}

/// The steps of creation, by sequence number.
const CREATE: u64 = 0;
const SEGMENT: u64 = 1;
const JOIN: u64 = 2;

impl<C: Communicator> BroadcastQueue<C> {
    /// Collective: creates the queue over `comm`.
    ///
    /// 1. Every rank's configuration is checked and the agreed settings compared
    ///    ([`InvalidConfig`](QueueError::InvalidConfig) on the rank with an invalid one,
    ///    [`PeerInvalidConfig`](QueueError::PeerInvalidConfig) and
    ///    [`ConfigMismatch`](QueueError::ConfigMismatch) on every rank), with every rank's
    ///    process identity, in one tagged all-gather.
    /// 2. The writer allocates the ring (a sealed memfd) with one slot per reader on its host
    ///    (same kernel boot and PID namespace), unless `via_transport`, and its handle is
    ///    all-gathered.
    /// 3. Each of those readers maps it, checks its header against the agreed settings and
    ///    claims its slot; one that cannot map it (ptrace restrictions, say) reads through
    ///    the transport instead. The outcomes are all-gathered: the [`Locality`] is the same
    ///    on every rank.
    /// 4. When some readers receive through the transport, `comm` is split into the writer
    ///    and them.
    pub fn create(comm: &C, config: QueueConfig) -> Result<Self> {
        let (rank, size) = (comm.rank(), comm.size());
        let _span = tracing::info_span!(
            "queue_create",
            rank,
            writer = config.writer,
            depth = config.depth,
            chunk_bytes = config.chunk_bytes
        )
        .entered();
        let valid = config.validate(size);
        let proposal = Proposal {
            settings: valid.is_ok().then(|| Settings::of(&config)),
            identity: ProcessIdentity::current().encode().to_vec(),
            via_transport: config.via_transport,
            nonce: tpcomm_ipc::fresh_group_id(),
        };
        let all: Vec<Proposal> = step(comm, Step::QueueCreate, 0, CREATE, &proposal)?;
        let settings = agree_settings(rank, &all, valid)?;
        let writer = settings.writer as usize;
        let id = all[writer].nonce;
        let peers: Vec<ProcessIdentity> = all
            .iter()
            .map(|p| ProcessIdentity::decode(&p.identity))
            .collect();
        let candidates: Vec<usize> = (0..size)
            .filter(|&r| r != writer && !all[r].via_transport && peers[r].same_host(&peers[writer]))
            .collect();
        let layout = Layout::new(settings.depth, settings.chunk_bytes, candidates.len())
            .ok_or_else(|| QueueError::InvalidConfig {
                rank,
                reason: "the ring's size overflows".into(),
            })?;
        let memory = HostMemory::new();

        // The writer's ring and its handle.
        let mut created = None;
        let mut own_error = None;
        let offer: Option<std::result::Result<HostHandle, String>> =
            if rank == writer && !candidates.is_empty() {
                match SharedRing::create(&memory, layout, id, writer, &candidates) {
                    Ok((ring, handle)) => {
                        created = Some(ring);
                        Some(Ok(handle))
                    }
                    Err(e) => {
                        let text = e.to_string();
                        own_error = Some(QueueError::Memory {
                            rank,
                            what: "allocating the ring",
                            source: e,
                        });
                        Some(Err(text))
                    }
                }
            } else {
                None
            };
        let offers: Vec<Option<std::result::Result<HostHandle, String>>> =
            step(comm, Step::QueueSegment, id, SEGMENT, &offer)?;
        let handle = match offers.into_iter().nth(writer).flatten() {
            Some(Ok(h)) => Some(h),
            Some(Err(_)) => {
                return Err(own_error.unwrap_or(QueueError::PeerFailed {
                    rank,
                    step: "allocating the ring",
                    ranks: vec![writer],
                }))
            }
            None => None,
        };

        // The readers on the writer's host join.
        let mut joined_ring = None;
        let mut refusal = None;
        let slot = candidates.iter().position(|&r| r == rank);
        let joined = match (rank == writer, slot, &handle) {
            (true, _, _) => Joined::Writer,
            (false, Some(slot), Some(h)) => {
                match SharedRing::join(&memory, h, layout, (id, writer), (slot, rank)) {
                    Ok(ring) => {
                        joined_ring = Some(ring);
                        Joined::Mapped
                    }
                    Err(JoinError::Unreachable(e)) => {
                        tracing::info!(rank, error = %e, "the ring cannot be mapped here: reading through the transport");
                        Joined::Unreachable(e.to_string())
                    }
                    Err(JoinError::Late { messages }) => {
                        let e = QueueError::JoinedLate {
                            rank,
                            writer,
                            messages,
                        };
                        let text = e.to_string();
                        refusal = Some(e);
                        Joined::Refused(text)
                    }
                    Err(JoinError::Corrupt(problem)) => {
                        let e = QueueError::Corrupt {
                            rank,
                            peer: writer,
                            message: 0,
                            problem,
                        };
                        let text = e.to_string();
                        refusal = Some(e);
                        Joined::Refused(text)
                    }
                }
            }
            _ => Joined::Transport,
        };
        let joins: Vec<Joined> = step(comm, Step::QueueJoined, id, JOIN, &joined)?;
        let refused: Vec<usize> = (0..size)
            .filter(|&r| matches!(joins[r], Joined::Refused(_)))
            .collect();
        if !refused.is_empty() {
            return Err(refusal.unwrap_or(QueueError::PeerFailed {
                rank,
                step: "joining the ring",
                ranks: refused,
            }));
        }
        let locality = Locality {
            shared_memory: (0..size)
                .filter(|&r| matches!(joins[r], Joined::Mapped))
                .collect(),
            transport: (0..size)
                .filter(|&r| matches!(joins[r], Joined::Transport | Joined::Unreachable(_)))
                .collect(),
        };
        let role = if rank == writer {
            let active: Vec<usize> = (0..candidates.len())
                .filter(|&s| matches!(joins[candidates[s]], Joined::Mapped))
                .collect();
            // A ring nobody mapped is freed now.
            let ring = if active.is_empty() { None } else { created };
            Role::Writer {
                ring,
                active,
                slot_ranks: candidates.clone(),
                next_chunk: 0,
                released: 0,
            }
        } else {
            match (joined_ring, handle, slot) {
                (Some(ring), Some(handle), Some(slot)) => Role::Reader {
                    ring: Some(ring),
                    handle,
                    slot,
                    next_chunk: 0,
                },
                _ => Role::Remote,
            }
        };
        let remote = if locality.transport.is_empty() {
            None
        } else {
            let member = rank == writer || locality.transport.contains(&rank);
            let key = if rank == writer { 0 } else { rank as i32 + 1 };
            comm.split(member.then_some(0), key)
                .map_err(|source| QueueError::Transport {
                    rank,
                    message: 0,
                    source,
                })?
        };
        if let Role::Writer {
            ring: Some(ring), ..
        } = &role
        {
            ring.set_writer_state(WriterState::Open, None);
        }
        let here = 1 + locality.shared_memory.len();
        tracing::info!(
            rank,
            writer,
            shared_memory = ?locality.shared_memory,
            transport = ?locality.transport,
            "queue created"
        );
        Ok(Self {
            rank,
            size,
            writer,
            settings,
            options: Options {
                max_total_bytes: settings.max_message_bytes as usize,
                max_depth: settings.max_depth as usize,
                ..config.options
            },
            timeout: config.timeout,
            id,
            locality,
            role,
            remote,
            memory,
            life: Life::Active,
            steps: JOIN + 1,
            messages: 0,
            buf: Vec::new(),
            frame: [0; FRAME],
            budget: SpinBudget::for_waiters(config.spin, here),
            peers,
            liveness: liveness_interval(config.timeout),
            departed: false,
        })
    }

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

    /// Sends `value` to every reader (the writer only). Returns once every chunk of it is in
    /// the ring and the transport readers' broadcast is done: a reader on this host that
    /// lags by the whole ring makes it wait, bounded by the timeout.
    ///
    /// A value of few, large pieces (byte strings, strings: a size pass of postcard counts
    /// its bytes, giving up past 64 pieces that average under 64 bytes) of at least 16 KiB or
    /// more than a chunk is encoded straight into the ring's chunks when every reader maps
    /// the ring: each chunk is published as
    /// soon as it is full, so that the readers copy it out while the rest is encoded. Any
    /// other value is encoded into the writer's buffer, then copied into the ring.
    ///
    /// Fails with [`Encode`](QueueError::Encode) or
    /// [`MessageTooLarge`](QueueError::MessageTooLarge) before anything is sent (the queue
    /// stays usable); with [`UnstableEncoding`](QueueError::UnstableEncoding) when the value
    /// encodes to another length than its size pass counted (failing the queue if a chunk
    /// of it was published already); with [`ReaderTimeout`](QueueError::ReaderTimeout),
    /// [`ReaderGone`](QueueError::ReaderGone) or [`Corrupt`](QueueError::Corrupt) naming the
    /// reader when one does not free its chunk, and then the queue is failed: the writer
    /// marks the ring failed, so that its readers stop waiting with
    /// [`WriterFailed`](QueueError::WriterFailed) naming the same reader.
    pub fn send<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.usable("send")?;
        if !self.is_writer() {
            return Err(QueueError::NotWriter {
                rank: self.rank,
                writer: self.writer,
            });
        }
        let message = self.messages;
        let cap = self.options.max_total_bytes;
        let encode = |source| QueueError::Encode {
            rank: self.rank,
            message,
            source,
        };
        let too_large = |bytes| QueueError::MessageTooLarge {
            rank: self.rank,
            message,
            bytes,
            cap,
        };
        // A value of few, large pieces (a byte string) of at least `STREAM_MIN_BYTES` or more
        // than a chunk is sized first and encoded straight into the ring; any other, into the
        // writer's buffer and then copied.
        let sized = if self.streams() {
            encoded_size(value)
        } else {
            SizePass::GaveUp
        };
        match sized {
            SizePass::Bytes(Err(source)) => return Err(encode(source)),
            SizePass::Bytes(Ok(bytes)) if bytes > cap => return Err(too_large(bytes)),
            SizePass::Bytes(Ok(bytes))
                if bytes >= STREAM_MIN_BYTES || bytes as u64 > self.settings.chunk_bytes =>
            {
                match self.ring_stream(message, value, bytes) {
                    Ok(()) => {}
                    Err(Streamed::Unpublished(e)) => return Err(e),
                    Err(Streamed::Failed(e)) => return Err(self.fail(e)),
                }
            }
            SizePass::Bytes(Ok(_)) | SizePass::GaveUp => {
                let buf = std::mem::take(&mut self.buf);
                self.buf = tpcomm_objects::encode_append(value, clear(buf)).map_err(encode)?;
                if self.buf.len() > cap {
                    return Err(too_large(self.buf.len()));
                }
                let sent = self
                    .ring_send(message)
                    .and_then(|()| self.remote_send(message));
                if let Err(e) = sent {
                    return Err(self.fail(e));
                }
            }
        }
        self.messages += 1;
        if let Role::Writer {
            ring: Some(ring), ..
        } = &self.role
        {
            ring.header_u64(header::MESSAGES)
                .store(self.messages, std::sync::atomic::Ordering::Release);
        }
        Ok(())
    }

    /// Receives the next message as an owned value (a reader only).
    ///
    /// Waits (bounded by the timeout) for the writer. Fails with
    /// [`Decode`](QueueError::Decode) when the bytes are not a `T` (the message is consumed;
    /// the next call reads the next one), [`WriterTimeout`](QueueError::WriterTimeout)
    /// when nothing of it came in time (call again), [`Closed`](QueueError::Closed) once the
    /// writer closed the queue and every message was received, and otherwise
    /// ([`Corrupt`](QueueError::Corrupt), [`WriterGone`](QueueError::WriterGone),
    /// [`WriterFailed`](QueueError::WriterFailed), a timeout in the middle of a message)
    /// fails the queue.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T> {
        self.recv_bytes()?;
        self.decode()
    }

    /// Receives the next message as a value that borrows from this queue's receive buffer
    /// (`&str`, `&[u8]` with `serde_bytes`, ...), valid until the next call on the queue.
    /// The bytes are copied out of shared memory first: the value never points into memory
    /// a peer can write. Fails as [`recv`](Self::recv).
    pub fn recv_borrowed<'a, T: Deserialize<'a>>(&'a mut self) -> Result<T> {
        self.recv_bytes()?;
        self.decode()
    }

    /// Decodes the message just received, with the agreed depth limit.
    fn decode<'a, T: Deserialize<'a>>(&'a self) -> Result<T> {
        let message = self.messages - 1;
        tpcomm_objects::decode_from_with(self.writer, &self.buf, &self.options).map_err(|source| {
            QueueError::Decode {
                rank: self.rank,
                writer: self.writer,
                message,
                source,
            }
        })
    }

    /// Collective: suspends the queue with the rest of the group. Every rank agrees in one
    /// tagged step; then each reader on the writer's host unmaps the ring, so that this
    /// process holds no peer mapping. The ring is host memory owned by the writer: messages
    /// sent and not received yet stay in it. Until [`resume`](Self::resume), `send` and
    /// `recv` fail with [`Suspended`](QueueError::Suspended). Suspending a suspended queue
    /// does nothing.
    pub fn suspend(&mut self, comm: &C) -> Result<()> {
        self.same_group(comm)?;
        match &self.life {
            Life::Suspended => return Ok(()),
            Life::Failed { .. } => return Err(self.refused("suspend")),
            Life::Active | Life::Ended => {}
        }
        let _span = tracing::info_span!("queue_suspend", rank = self.rank).entered();
        let sequence = self.next_step();
        if let Err(e) = step(comm, Step::QueueSuspend, self.id, sequence, &self.messages) {
            return Err(self.fail(e));
        }
        if let Role::Reader { ring, .. } = &mut self.role {
            if let Some(ring) = ring.take() {
                let unmapped = ring
                    .unmap(&self.memory)
                    .map_err(|source| QueueError::Memory {
                        rank: self.rank,
                        what: "unmapping the ring",
                        source,
                    });
                if let Err(e) = unmapped {
                    return Err(self.fail(e));
                }
            }
        }
        self.life = Life::Suspended;
        tracing::info!(
            rank = self.rank,
            messages = self.messages,
            "queue suspended"
        );
        Ok(())
    }

    /// Collective: resumes a suspended queue. Each reader on the writer's host maps the ring
    /// again and checks it (the layout version and every header field against the agreed
    /// settings, its slot's claim, its progress word against its own count); the outcomes
    /// are agreed, so that a failure on one rank fails the queue on every rank
    /// ([`PeerFailed`](QueueError::PeerFailed) naming it). Resuming an active queue does
    /// nothing.
    pub fn resume(&mut self, comm: &C) -> Result<()> {
        self.same_group(comm)?;
        match &self.life {
            Life::Suspended => {}
            Life::Failed { .. } => return Err(self.refused("resume")),
            Life::Active | Life::Ended => return Ok(()),
        }
        let _span = tracing::info_span!("queue_resume", rank = self.rank).entered();
        let mut own_error = None;
        if let Role::Reader {
            ring,
            handle,
            slot,
            next_chunk,
        } = &mut self.role
        {
            let layout = Layout::new(
                self.settings.depth,
                self.settings.chunk_bytes,
                self.locality.shared_memory.len(),
            )
            .expect("the layout existed at creation");
            match SharedRing::rejoin(
                &self.memory,
                handle,
                layout,
                (self.id, self.writer),
                (*slot, self.rank),
                *next_chunk,
            ) {
                Ok(mapped) => *ring = Some(mapped),
                Err(e) => {
                    own_error = Some(match e {
                        JoinError::Unreachable(source) => QueueError::Memory {
                            rank: self.rank,
                            what: "mapping the ring again",
                            source,
                        },
                        JoinError::Corrupt(problem) => QueueError::Corrupt {
                            rank: self.rank,
                            peer: self.writer,
                            message: self.messages,
                            problem,
                        },
                        JoinError::Late { messages } => QueueError::JoinedLate {
                            rank: self.rank,
                            writer: self.writer,
                            messages,
                        },
                    })
                }
            }
        }
        let sequence = self.next_step();
        let verdict = own_error.as_ref().map(|e| e.to_string());
        let verdicts: Vec<Option<String>> =
            match step(comm, Step::QueueResume, self.id, sequence, &verdict) {
                Ok(v) => v,
                Err(e) => return Err(self.fail(e)),
            };
        let failed: Vec<usize> = (0..self.size).filter(|&r| verdicts[r].is_some()).collect();
        if !failed.is_empty() {
            let e = own_error.unwrap_or(QueueError::PeerFailed {
                rank: self.rank,
                step: "resume",
                ranks: failed,
            });
            return Err(self.fail(e));
        }
        self.life = Life::Active;
        tracing::info!(rank = self.rank, messages = self.messages, "queue resumed");
        Ok(())
    }

    /// Collective: closes the queue on every rank. The ranks agree in one tagged step (each
    /// saying how many messages it sent or received: messages a reader never received are
    /// reported in the trace), then the writer frees the ring and the readers unmap it.
    /// Works on a suspended queue too; on a failed one, [`close`](Self::close) is the way.
    pub fn close_with(mut self, comm: &C) -> Result<()> {
        self.same_group(comm)?;
        let _span = tracing::info_span!("queue_close", rank = self.rank).entered();
        let sequence = self.next_step();
        let counts: Vec<u64> = step(comm, Step::QueueClose, self.id, sequence, &self.messages)?;
        let sent = counts[self.writer];
        let unread: Vec<(usize, u64)> = (0..self.size)
            .filter(|&r| r != self.writer && counts[r] < sent)
            .map(|r| (r, sent - counts[r]))
            .collect();
        if !unread.is_empty() {
            tracing::info!(
                rank = self.rank,
                ?unread,
                "queue closed with messages not received"
            );
        }
        self.depart(Departure::Closed, false);
        self.release()
    }

    /// Closes this rank's side alone (not collective): the writer marks the ring closed,
    /// so that its readers receive every message it sent and then
    /// [`Closed`](QueueError::Closed), and sends the transport readers an end frame; a
    /// reader marks its slot closed, so that a writer that laps it gets
    /// [`ReaderGone`](QueueError::ReaderGone). Then the ring is freed or unmapped. Dropping
    /// the queue does the same without the end frame, and says it was dropped.
    pub fn close(mut self) -> Result<()> {
        let _span =
            tracing::info_span!("queue_close", rank = self.rank, collective = false).entered();
        self.depart(Departure::Closed, true);
        self.release()
    }

    // ----- the writer's paths -----

    /// Whether `send` may encode straight into the ring: a ring some readers map, and no
    /// transport reader (whose broadcast needs the encoded bytes in the writer's buffer).
    fn streams(&self) -> bool {
        matches!(self.role, Role::Writer { ring: Some(_), .. }) && self.remote.is_none()
    }

    /// Encodes `value` (message `message`, `total` bytes by the size pass) straight into the
    /// ring's chunks, publishing each chunk as soon as it is full, so that the readers copy
    /// it out while the writer encodes the next.
    fn ring_stream<T: Serialize + ?Sized>(
        &mut self,
        message: u64,
        value: &T,
        total: usize,
    ) -> std::result::Result<(), Streamed> {
        let Role::Writer {
            ring: Some(ring),
            next_chunk,
            released,
            ..
        } = &self.role
        else {
            return Ok(());
        };
        let first = *next_chunk;
        let mut at = StreamAt {
            c: first,
            known: *released,
            offset: 0,
            fill: 0,
            stopped: None,
        };
        let sink = RingSink {
            queue: self,
            ring,
            readers: Park {
                word: ring.header_u32(header::WAKE),
                parked: ring.header_u32(header::SLEEPERS),
            },
            message,
            total: total as u64,
            at: &mut at,
        };
        let encoded = postcard::serialize_with_flavor(value, sink);
        if let Role::Writer {
            next_chunk,
            released,
            ..
        } = &mut self.role
        {
            *released = at.known;
            if encoded.is_ok() {
                *next_chunk = at.c;
            }
        }
        let source = match encoded {
            Ok(()) => return Ok(()),
            Err(source) => source,
        };
        match at.stopped {
            // A wait on the readers failed: the queue fails, as in `ring_send`.
            Some(e @ Stop::Wait(_)) => Err(Streamed::Failed(e.into_error())),
            stopped => {
                let e = match stopped {
                    Some(stop) => stop.into_error(),
                    None => QueueError::Encode {
                        rank: self.rank,
                        message,
                        source,
                    },
                };
                // Nothing published: the chunks written are never read, the queue is usable.
                if at.c == first {
                    Err(Streamed::Unpublished(e))
                } else {
                    Err(Streamed::Failed(e))
                }
            }
        }
    }

    /// Writes `self.buf` (message `message`) into the ring, chunk by chunk.
    fn ring_send(&mut self, message: u64) -> Result<()> {
        let Role::Writer {
            ring: Some(ring),
            next_chunk,
            released,
            ..
        } = &self.role
        else {
            return Ok(());
        };
        let (mut c, mut known) = (*next_chunk, *released);
        let total = self.buf.len() as u64;
        let chunk_bytes = ring.chunk_bytes();
        let readers = Park {
            word: ring.header_u32(header::WAKE),
            parked: ring.header_u32(header::SLEEPERS),
        };
        let mut offset = 0u64;
        for _ in 0..chunk_count(total, chunk_bytes) {
            let need = ring::needed(ring, c);
            if known < need {
                known = self.wait_for_readers(ring, c, need, message)?;
            }
            let (len, _) = piece(total, chunk_bytes, offset);
            let part = &self.buf[offset as usize..(offset + len) as usize];
            ring::write_chunk(ring, c, message, total, offset, part);
            wake_if_parked(readers);
            c += 1;
            offset += len;
        }
        if let Role::Writer {
            next_chunk,
            released,
            ..
        } = &mut self.role
        {
            (*next_chunk, *released) = (c, known);
        }
        Ok(())
    }

    /// Waits until every ring reader has released `need` chunks, so that chunk `c` may be
    /// written; returns the chunks they have released (at least `need`).
    fn wait_for_readers(&self, ring: &SharedRing, c: u64, need: u64, message: u64) -> Result<u64> {
        let Role::Writer {
            active, slot_ranks, ..
        } = &self.role
        else {
            return Ok(need);
        };
        let me = &self.peers[self.rank];
        let other_process = slot_ranks.iter().any(|&r| !self.peers[r].same_process(me));
        let parked = Park {
            word: ring.header_u32(header::WRITER_WAKE),
            parked: ring.header_u32(header::WRITER_PARKED),
        };
        let (mut known, mut lag) = (need, None);
        let ready = || -> Result<bool> {
            match ring::released(ring, c, active) {
                Ok((least, _)) if least >= need => {
                    known = least;
                    Ok(true)
                }
                Ok((_, slot)) => {
                    lag = slot;
                    if let Some(s) = slot {
                        reader_left(ring, s, slot_ranks[s], (self.rank, message))?;
                    }
                    Ok(false)
                }
                Err((s, problem)) => Err(QueueError::Corrupt {
                    rank: self.rank,
                    peer: slot_ranks[s],
                    message,
                    problem,
                }),
            }
        };
        let check = || -> Result<()> {
            for &s in active.iter() {
                let r = slot_ranks[s];
                if self.peers[r].same_host(me)
                    && !self.peers[r].same_process(me)
                    && self.peers[r].liveness() == Liveness::Gone
                {
                    return Err(QueueError::ReaderGone {
                        rank: self.rank,
                        reader: r,
                        message,
                        how: Departure::Exited,
                    });
                }
            }
            Ok(())
        };
        let waited = wait_until(
            &self.budget,
            self.timeout,
            parked,
            other_process.then_some(self.liveness),
            ready,
            check,
        );
        match waited {
            Ok(()) => Ok(known),
            Err(Interrupted::Failed(e)) => Err(e),
            Err(Interrupted::Timeout(waited)) => {
                let slow = ring::released(ring, c, active)
                    .ok()
                    .and_then(|(_, s)| s)
                    .or(lag);
                Err(QueueError::ReaderTimeout {
                    rank: self.rank,
                    reader: slow.map_or(self.writer, |s| slot_ranks[s]),
                    message,
                    waited,
                })
            }
        }
    }

    /// Broadcasts `self.buf` (message `message`) to the transport readers: one frame, and
    /// the rest of the bytes when they do not fit in it.
    fn remote_send(&mut self, message: u64) -> Result<()> {
        let Some(remote) = &self.remote else {
            return Ok(());
        };
        let total = self.buf.len();
        let inline = total.min(INLINE);
        write_frame(&mut self.frame, DATA, message, total as u64);
        self.frame[24..24 + inline].copy_from_slice(&self.buf[..inline]);
        let transport = |source| QueueError::Transport {
            rank: self.rank,
            message,
            source,
        };
        remote.broadcast(0, &mut self.frame).map_err(transport)?;
        if total > INLINE {
            remote
                .broadcast(0, &mut self.buf[INLINE..])
                .map_err(transport)?;
        }
        Ok(())
    }

    // ----- the readers' paths -----

    /// Receives the next message's bytes into `self.buf`.
    fn recv_bytes(&mut self) -> Result<()> {
        if let Life::Ended = self.life {
            return Err(QueueError::Closed {
                rank: self.rank,
                writer: self.writer,
                messages: self.messages,
            });
        }
        self.usable("recv")?;
        let received = match self.role {
            Role::Writer { .. } => return Err(QueueError::NotReader { rank: self.rank }),
            Role::Reader { .. } => self.ring_recv(),
            Role::Remote => self.remote_recv(),
        };
        match received {
            Ok(()) => {
                self.messages += 1;
                Ok(())
            }
            Err(e @ QueueError::Closed { .. }) => {
                self.life = Life::Ended;
                Err(e)
            }
            Err(e @ (QueueError::WriterTimeout { .. } | QueueError::Allocation { .. })) => Err(e),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Reads the next message out of the ring, chunk by chunk, releasing each as soon as
    /// it is copied.
    fn ring_recv(&mut self) -> Result<()> {
        let Role::Reader {
            ring: Some(ring),
            slot,
            next_chunk,
            ..
        } = &mut self.role
        else {
            return Err(self.refused("recv"));
        };
        let (rank, writer, message) = (self.rank, self.writer, self.messages);
        let cap = self.options.max_total_bytes as u64;
        let park = Park {
            word: ring.header_u32(header::WAKE),
            parked: ring.header_u32(header::SLEEPERS),
        };
        let writer_park = Park {
            word: ring.header_u32(header::WRITER_WAKE),
            parked: ring.header_u32(header::WRITER_PARKED),
        };
        let writer_id = self.peers[writer];
        let other_process = !writer_id.same_process(&self.peers[rank]);
        let corrupt = |problem| QueueError::Corrupt {
            rank,
            peer: writer,
            message,
            problem,
        };
        let mut at = Position::start(message);
        self.buf.clear();
        loop {
            let c = *next_chunk;
            let started = at.total.is_some();
            let ready = || -> Result<bool> {
                match ring::look(ring, c).map_err(corrupt)? {
                    Look::Ready => return Ok(true),
                    Look::NotYet => {}
                }
                // The park handshake's look: published (sequentially consistent) after the
                // stamp, so a count past `c` means the stamp is there.
                if ring.published().load(std::sync::atomic::Ordering::SeqCst) > c {
                    return Ok(ring::look(ring, c).map_err(corrupt)? == Look::Ready);
                }
                writer_ended(ring, (rank, writer, message), started)?;
                Ok(false)
            };
            let check = || -> Result<()> {
                // A writer that failed the queue (or closed it) and then exited said so first.
                writer_ended(ring, (rank, writer, message), started)?;
                if writer_id.liveness() == Liveness::Gone {
                    return Err(QueueError::WriterGone {
                        rank,
                        writer,
                        message,
                        how: Departure::Exited,
                    });
                }
                Ok(())
            };
            match wait_until(
                &self.budget,
                self.timeout,
                park,
                other_process.then_some(self.liveness),
                ready,
                check,
            ) {
                Ok(()) => {}
                Err(Interrupted::Failed(e)) => return Err(e),
                Err(Interrupted::Timeout(waited)) => {
                    let e = QueueError::WriterTimeout {
                        rank,
                        writer,
                        message,
                        waited,
                    };
                    // In the middle of a message the stream cannot be resumed.
                    return Err(if started { self.fail(e) } else { e });
                }
            }
            let reserved = ring::read_chunk(ring, c, &mut at, cap, &mut self.buf, |v, n| {
                v.try_reserve(n).map_err(|_| n)
            })
            .map_err(corrupt)?;
            if let Err(bytes) = reserved {
                return Err(QueueError::Allocation {
                    rank,
                    message,
                    bytes,
                });
            }
            ring::release(ring, *slot, c);
            wake_if_parked(writer_park);
            *next_chunk = c + 1;
            if at.complete() {
                return Ok(());
            }
        }
    }

    /// Receives the next message's frame (and the rest of its bytes) from the transport.
    fn remote_recv(&mut self) -> Result<()> {
        let (rank, message) = (self.rank, self.messages);
        let Some(remote) = &self.remote else {
            return Err(self.refused("recv"));
        };
        let transport = |source| QueueError::Transport {
            rank,
            message,
            source,
        };
        remote.broadcast(0, &mut self.frame).map_err(transport)?;
        let corrupt = |problem| QueueError::Corrupt {
            rank,
            peer: self.writer,
            message,
            problem,
        };
        let (kind, number, total) = read_frame(&self.frame).map_err(corrupt)?;
        if kind == END {
            return Err(QueueError::Closed {
                rank,
                writer: self.writer,
                messages: message,
            });
        }
        if number != message {
            return Err(corrupt(Corruption::Frame("a message number out of order")));
        }
        let cap = self.options.max_total_bytes as u64;
        if total > cap {
            return Err(corrupt(Corruption::TooLarge { total, cap }));
        }
        // `total <= cap <= isize::MAX`.
        let total = total as usize;
        self.buf.clear();
        if self.buf.try_reserve(total).is_err() {
            return Err(QueueError::Allocation {
                rank,
                message,
                bytes: total,
            });
        }
        let inline = total.min(INLINE);
        self.buf.extend_from_slice(&self.frame[24..24 + inline]);
        if total > INLINE {
            self.buf.resize(total, 0);
            remote
                .broadcast(0, &mut self.buf[INLINE..])
                .map_err(transport)?;
        }
        Ok(())
    }

    // ----- lifecycle helpers -----

    /// Ok while active; the refusal otherwise.
    fn usable(&self, op: &'static str) -> Result<()> {
        match self.life {
            Life::Active => Ok(()),
            _ => Err(self.refused(op)),
        }
    }

    /// The error refusing `op` in the current state.
    fn refused(&self, op: &'static str) -> QueueError {
        match &self.life {
            Life::Suspended => QueueError::Suspended {
                rank: self.rank,
                op,
            },
            Life::Failed { culprit, reason } => QueueError::Failed {
                rank: self.rank,
                op,
                culprit: *culprit,
                reason: reason.clone(),
            },
            Life::Ended => QueueError::Closed {
                rank: self.rank,
                writer: self.writer,
                messages: self.messages,
            },
            Life::Active => QueueError::Failed {
                rank: self.rank,
                op,
                culprit: None,
                reason: "the ring is not mapped".into(),
            },
        }
    }

    /// Fails the queue for good with `e` (the first failure is kept), telling the peers on
    /// this host: the writer marks the ring failed naming the culprit, a reader marks its
    /// slot as left. Returns `e`.
    fn fail(&mut self, e: QueueError) -> QueueError {
        if !matches!(self.life, Life::Failed { .. }) {
            let culprit = e.culprit();
            tracing::warn!(rank = self.rank, error = %e, "queue failed");
            match &self.role {
                Role::Writer {
                    ring: Some(ring), ..
                } => {
                    ring.set_writer_state(WriterState::Failed, culprit.or(Some(self.rank)));
                }
                Role::Reader {
                    ring: Some(ring),
                    slot,
                    ..
                } => ring.set_reader_state(*slot, ReaderState::Dropped),
                _ => {}
            }
            self.life = Life::Failed {
                culprit,
                reason: e.to_string(),
            };
        }
        e
    }

    /// Tells the peers on this host that this rank leaves (`how`), and with `end_frame` the
    /// transport readers too (the writer's end frame).
    fn depart(&mut self, how: Departure, end_frame: bool) {
        if self.departed {
            return;
        }
        self.departed = true;
        let failed = matches!(self.life, Life::Failed { .. });
        match &self.role {
            Role::Writer {
                ring: Some(ring), ..
            } if !failed => {
                let state = match how {
                    Departure::Closed => WriterState::Closed,
                    Departure::Dropped | Departure::Exited => WriterState::Dropped,
                };
                ring.set_writer_state(state, None);
            }
            Role::Reader {
                ring: Some(ring),
                slot,
                ..
            } => {
                let state = match how {
                    Departure::Closed => ReaderState::Closed,
                    Departure::Dropped | Departure::Exited => ReaderState::Dropped,
                };
                ring.set_reader_state(*slot, state);
            }
            _ => {}
        }
        if end_frame && self.is_writer() && !failed {
            if let Some(remote) = &self.remote {
                write_frame(&mut self.frame, END, self.messages, 0);
                if let Err(e) = remote.broadcast(0, &mut self.frame) {
                    tracing::warn!(rank = self.rank, error = %e, "the end frame was not sent");
                }
            }
        }
        tracing::info!(rank = self.rank, messages = self.messages, how = %how, "queue closed");
    }

    /// Frees the writer's ring or unmaps a reader's, reporting a failure.
    fn release(mut self) -> Result<()> {
        let ring = match &mut self.role {
            Role::Writer { ring, .. } | Role::Reader { ring, .. } => ring.take(),
            Role::Remote => None,
        };
        match ring {
            Some(ring) => ring
                .unmap(&self.memory)
                .map_err(|source| QueueError::Memory {
                    rank: self.rank,
                    what: "unmapping the ring",
                    source,
                }),
            None => Ok(()),
        }
    }

    fn same_group(&self, comm: &C) -> Result<()> {
        if comm.rank() == self.rank && comm.size() == self.size {
            return Ok(());
        }
        Err(QueueError::WrongCommunicator {
            rank: self.rank,
            size: self.size,
            comm_rank: comm.rank(),
            comm_size: comm.size(),
        })
    }

    fn next_step(&mut self) -> u64 {
        let s = self.steps;
        self.steps += 1;
        s
    }
}

impl<C: Communicator> Drop for BroadcastQueue<C> {
    fn drop(&mut self) {
        self.depart(Departure::Dropped, false);
    }
}

/// Values that encode to fewer bytes, and fit in one chunk, go through the writer's buffer
/// even when sized: one local encoding and one copy into the ring cost less than the ring
/// writes of their small pieces (a scheduler step of one request between two processes:
/// 0.67 us streamed), and there is no second chunk to overlap with.
const STREAM_MIN_BYTES: usize = 16 << 10;

/// The size pass of `send` counts at most this many pieces (postcard's writes: a varint, a
/// string, a byte string) before it gives up...
const SIZE_PASS_PIECES: usize = 64;
/// ...unless they average at least this many bytes. A size pass costs about what encoding
/// costs per piece (a traversal of the value), and what streaming saves is a copy of the
/// bytes: worth it for byte strings and other large pieces, not for a value of many small
/// fields (a scheduler step of 100,000 requests: a size pass of 2.3 ms where the copy it
/// saves takes 0.6 ms). Giving up after `n` pieces costs at most `n` pieces' traversal, less
/// than the copy of the `n * 64` bytes that streaming would have saved.
const SIZE_PASS_PIECE_BYTES: usize = 64;

/// What the size pass of `send` found.
#[derive(Debug)]
enum SizePass {
    /// The value's encoded length, or postcard's error.
    Bytes(std::result::Result<usize, postcard::Error>),
    /// Too many small pieces: encode into the writer's buffer instead.
    GaveUp,
}

/// The encoded length of `value`, unless it has many small pieces ([`SIZE_PASS_PIECES`]).
fn encoded_size<T: Serialize + ?Sized>(value: &T) -> SizePass {
    let gave_up = std::cell::Cell::new(false);
    let counted = postcard::serialize_with_flavor(
        value,
        CountBytes {
            bytes: 0,
            pieces: 0,
            gave_up: &gave_up,
        },
    );
    if gave_up.get() {
        SizePass::GaveUp
    } else {
        SizePass::Bytes(counted)
    }
}

/// postcard's output counted, not written: the size pass.
struct CountBytes<'a> {
    bytes: usize,
    pieces: usize,
    gave_up: &'a std::cell::Cell<bool>,
}

impl CountBytes<'_> {
    #[inline(always)]
    fn count(&mut self, n: usize) -> postcard::Result<()> {
        self.bytes = self.bytes.saturating_add(n);
        self.pieces += 1;
        if self.pieces > SIZE_PASS_PIECES
            && self.pieces.saturating_mul(SIZE_PASS_PIECE_BYTES) > self.bytes
        {
            self.gave_up.set(true);
            return Err(postcard::Error::SerializeBufferFull);
        }
        Ok(())
    }
}

impl postcard::ser_flavors::Flavor for CountBytes<'_> {
    type Output = usize;

    #[inline(always)]
    fn try_push(&mut self, _byte: u8) -> postcard::Result<()> {
        self.count(1)
    }

    #[inline(always)]
    fn try_extend(&mut self, piece: &[u8]) -> postcard::Result<()> {
        self.count(piece.len())
    }

    fn finalize(self) -> postcard::Result<usize> {
        Ok(self.bytes)
    }
}

/// Why a streamed send did not complete.
#[derive(Debug)]
enum Streamed {
    /// No chunk of the message was published: the queue is usable.
    Unpublished(QueueError),
    /// Some chunks were published, or a wait on the readers failed: the queue fails.
    Failed(QueueError),
}

/// Why the ring sink stopped the encoder.
#[derive(Debug)]
enum Stop {
    /// A wait for the readers to free a chunk failed.
    Wait(QueueError),
    /// The value encoded to more or fewer bytes than its size pass counted.
    Unstable(QueueError),
}

impl Stop {
    fn into_error(self) -> QueueError {
        match self {
            Stop::Wait(e) | Stop::Unstable(e) => e,
        }
    }
}

/// Where a streamed send is: the chunk being filled and what is known of the readers.
#[derive(Debug)]
struct StreamAt {
    /// The chunk being filled.
    c: u64,
    /// Chunks every reader released, as last read.
    known: u64,
    /// The message offset of chunk `c`'s first byte.
    offset: u64,
    /// Bytes written into chunk `c` so far.
    fill: u64,
    stopped: Option<Stop>,
}

/// postcard's output written straight into the ring's chunks: each piece is copied into
/// the chunk being filled (which every reader released: the writer owns it until it
/// publishes it), and a chunk is published as soon as it holds all its bytes, so that the
/// readers copy it out while the encoder fills the next. The message's length is known
/// before the first byte (the size pass): every chunk carries it, and a value that
/// encodes to another length this time stops the encoder.
struct RingSink<'q, C: Communicator> {
    queue: &'q BroadcastQueue<C>,
    ring: &'q SharedRing,
    readers: Park<'q>,
    message: u64,
    total: u64,
    at: &'q mut StreamAt,
}

impl<C: Communicator> RingSink<'_, C> {
    /// Stops the encoder with `stop`.
    fn stop(&mut self, stop: Stop) -> postcard::Error {
        self.at.stopped = Some(stop);
        postcard::Error::SerializeBufferFull
    }

    /// The value encodes to another length than its size pass counted.
    fn unstable(&mut self) -> postcard::Error {
        let e = QueueError::UnstableEncoding {
            rank: self.queue.rank,
            message: self.message,
            sized: self.total as usize,
        };
        self.stop(Stop::Unstable(e))
    }

    /// Makes sure chunk `at.c` is free (released by every reader) before its first byte.
    fn begin_chunk(&mut self) -> postcard::Result<()> {
        let need = ring::needed(self.ring, self.at.c);
        if self.at.known < need {
            match self
                .queue
                .wait_for_readers(self.ring, self.at.c, need, self.message)
            {
                Ok(known) => self.at.known = known,
                Err(e) => return Err(self.stop(Stop::Wait(e))),
            }
        }
        Ok(())
    }

    /// Publishes chunk `at.c` (the bytes at `at.offset`, `len` of them) and moves on.
    fn publish(&mut self, len: u64) {
        let at = &mut *self.at;
        ring::publish_chunk(self.ring, at.c, self.message, self.total, at.offset);
        wake_if_parked(self.readers);
        at.c += 1;
        at.offset += len;
        at.fill = 0;
    }

    fn write(&mut self, mut piece: &[u8]) -> postcard::Result<()> {
        let chunk_bytes = self.ring.chunk_bytes();
        while !piece.is_empty() {
            if self.at.offset >= self.total {
                return Err(self.unstable());
            }
            if self.at.fill == 0 {
                self.begin_chunk()?;
            }
            let (len, _) = crate::layout::piece(self.total, chunk_bytes, self.at.offset);
            // `len - fill` is at most a chunk, which fits `usize` (the layout exists).
            let n = ((len - self.at.fill) as usize).min(piece.len());
            ring::fill_chunk(self.ring, self.at.c, self.at.fill as usize, &piece[..n]);
            self.at.fill += n as u64;
            piece = &piece[n..];
            if self.at.fill == len {
                self.publish(len);
            }
        }
        Ok(())
    }
}

impl<C: Communicator> postcard::ser_flavors::Flavor for RingSink<'_, C> {
    type Output = ();

    #[inline]
    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.write(&[byte])
    }

    #[inline]
    fn try_extend(&mut self, piece: &[u8]) -> postcard::Result<()> {
        self.write(piece)
    }

    fn finalize(mut self) -> postcard::Result<()> {
        if self.total == 0 {
            // An empty message is one empty chunk.
            self.begin_chunk()?;
            self.publish(0);
            return Ok(());
        }
        if self.at.offset != self.total {
            return Err(self.unstable());
        }
        Ok(())
    }
}

/// `buf`, emptied (its capacity kept).
fn clear(mut buf: Vec<u8>) -> Vec<u8> {
    buf.clear();
    buf
}

/// One tagged all-gather of the queue's life.
fn step<C, T>(comm: &C, step: Step, group: u64, sequence: u64, value: &T) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let tag = StepTag {
        step,
        group,
        sequence,
    };
    tagged_all_gather(comm, tag, value).map_err(|source: IpcError| QueueError::Step {
        rank: comm.rank(),
        step: step.name(),
        source,
    })
}

/// The agreed settings, or the error every rank returns.
fn agree_settings(
    rank: usize,
    all: &[Proposal],
    valid: std::result::Result<(), String>,
) -> Result<Settings> {
    let invalid: Vec<usize> = (0..all.len())
        .filter(|&r| all[r].settings.is_none())
        .collect();
    if !invalid.is_empty() {
        return Err(match valid {
            Err(reason) => QueueError::InvalidConfig { rank, reason },
            Ok(()) => QueueError::PeerInvalidConfig {
                rank,
                ranks: invalid,
            },
        });
    }
    let settings: Vec<Settings> = all.iter().filter_map(|p| p.settings).collect();
    let reference = settings[0].fields();
    for (i, name) in SETTING_NAMES.iter().enumerate() {
        let ranks: Vec<usize> = (0..settings.len())
            .filter(|&r| settings[r].fields()[i] != reference[i])
            .collect();
        if !ranks.is_empty() {
            return Err(QueueError::ConfigMismatch {
                rank,
                setting: name,
                reference: 0,
                ranks,
            });
        }
    }
    Ok(settings[0])
}

/// A reader slot whose reader left (or whose state word is no state): the writer's error.
fn reader_left(
    ring: &SharedRing,
    slot: usize,
    reader: usize,
    (rank, message): (usize, u64),
) -> Result<()> {
    let word = ring
        .reader_state(slot)
        .load(std::sync::atomic::Ordering::SeqCst);
    let how = match ReaderState::from_word(word) {
        Some(ReaderState::Active) => return Ok(()),
        Some(ReaderState::Closed) => Departure::Closed,
        Some(ReaderState::Dropped) => Departure::Dropped,
        Some(ReaderState::Free) | None => {
            return Err(QueueError::Corrupt {
                rank,
                peer: reader,
                message,
                problem: Corruption::State {
                    which: "reader slot",
                    found: word,
                },
            })
        }
    };
    Err(QueueError::ReaderGone {
        rank,
        reader,
        message,
        how,
    })
}

/// The writer's state seen by a reader waiting for message `message` (`started`: some of it
/// arrived): an error when the writer will send nothing more.
fn writer_ended(
    ring: &SharedRing,
    (rank, writer, message): (usize, usize, u64),
    started: bool,
) -> Result<()> {
    let how = match ring.writer_state() {
        Ok(WriterState::Creating | WriterState::Open) => return Ok(()),
        Ok(WriterState::Closed) if !started => {
            return Err(QueueError::Closed {
                rank,
                writer,
                messages: message,
            })
        }
        Ok(WriterState::Closed) => Departure::Closed,
        Ok(WriterState::Dropped) => Departure::Dropped,
        Ok(WriterState::Failed) => {
            return Err(QueueError::WriterFailed {
                rank,
                writer,
                message,
                culprit: ring.culprit().unwrap_or(writer),
            })
        }
        Err(found) => {
            return Err(QueueError::Corrupt {
                rank,
                peer: writer,
                message,
                problem: Corruption::State {
                    which: "writer",
                    found,
                },
            })
        }
    };
    Err(QueueError::WriterGone {
        rank,
        writer,
        message,
        how,
    })
}

/// Writes a frame's header.
fn write_frame(frame: &mut [u8; FRAME], kind: u8, message: u64, total: u64) {
    frame[..4].copy_from_slice(&FRAME_MAGIC);
    frame[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
    frame[6] = kind;
    frame[7] = 0;
    frame[8..16].copy_from_slice(&message.to_le_bytes());
    frame[16..24].copy_from_slice(&total.to_le_bytes());
}

/// A frame's kind, message number and total length, checked.
fn read_frame(frame: &[u8; FRAME]) -> std::result::Result<(u8, u64, u64), Corruption> {
    if frame[..4] != FRAME_MAGIC {
        return Err(Corruption::Frame("no frame magic"));
    }
    if frame[4..6] != FRAME_VERSION.to_le_bytes() {
        return Err(Corruption::Frame("another frame version"));
    }
    if frame[7] != 0 || !matches!(frame[6], DATA | END) {
        return Err(Corruption::Frame("an unknown frame kind"));
    }
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&frame[at..at + 8]);
        u64::from_le_bytes(w)
    };
    Ok((frame[6], word(8), word(16)))
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

    /// The handle and layout of the ring, for the test of a late join.
    pub(crate) fn join_args_for_test(&self) -> (HostHandle, Layout, u64) {
        let Role::Reader { handle, .. } = &self.role else {
            panic!("a reader on the writer's host has the handle");
        };
        let layout = Layout::new(
            self.settings.depth,
            self.settings.chunk_bytes,
            self.locality.shared_memory.len(),
        )
        .expect("the layout exists");
        (handle.clone(), layout, self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_bytes::ByteBuf;
    use tpcomm_transport::{LocalCommunicator, LocalGroup};

    #[test]
    fn the_size_pass_counts_values_of_few_large_pieces_and_gives_up_on_many_small_ones() {
        let blob = ByteBuf::from(vec![5u8; 1 << 20]);
        assert!(matches!(encoded_size(&blob), SizePass::Bytes(Ok(n)) if n == (1 << 20) + 3));
        let fields = (1u8, 2u16, "three", [4u32; 8], ByteBuf::from(vec![0; 100]));
        let len = tpcomm_objects::encode_append(&fields, Vec::new())
            .unwrap()
            .len();
        assert!(matches!(encoded_size(&fields), SizePass::Bytes(Ok(n)) if n == len));
        // Every element a piece: a Vec<u8> without serde_bytes, a Vec<u32>.
        assert!(matches!(encoded_size(&vec![1u8; 1000]), SizePass::GaveUp));
        assert!(matches!(encoded_size(&vec![1u32; 65]), SizePass::GaveUp));
        // Small pieces among large ones: counted while they average 64 bytes.
        // (each byte string is two pieces, its length and its bytes)
        let mixed: Vec<ByteBuf> = (0..200).map(|_| ByteBuf::from(vec![1; 200])).collect();
        assert!(matches!(encoded_size(&mixed), SizePass::Bytes(Ok(_))));
        let mixed: Vec<ByteBuf> = (0..200).map(|_| ByteBuf::from(vec![1; 100])).collect();
        assert!(matches!(encoded_size(&mixed), SizePass::GaveUp));
    }

    /// Two chunk-sized byte strings; between them, the writer's encoding (its second
    /// serialization: the first is the size pass) waits at a barrier with the reader.
    struct Pausing<'a> {
        bytes: ByteBuf,
        pause: &'a std::sync::Barrier,
        calls: std::cell::Cell<u32>,
    }

    impl Serialize for Pausing<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            use serde::ser::SerializeTuple;
            let mut t = s.serialize_tuple(2)?;
            t.serialize_element(&self.bytes)?;
            self.calls.set(self.calls.get() + 1);
            if self.calls.get() == 2 {
                // The reader looks at the ring here.
                self.pause.wait();
                self.pause.wait();
            }
            t.serialize_element(&self.bytes)?;
            t.end()
        }
    }

    #[test]
    fn a_streamed_value_s_first_chunks_are_published_while_it_is_still_encoded() {
        const CHUNK: usize = 256;
        let pause = std::sync::Barrier::new(2);
        let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
            let config = QueueConfig {
                depth: 8,
                chunk_bytes: CHUNK,
                ..QueueConfig::default()
            };
            let mut q = BroadcastQueue::create(&comm, config)?;
            let bytes = ByteBuf::from(vec![3u8; 2 * CHUNK]);
            if q.is_writer() {
                q.send(&Pausing {
                    bytes: bytes.clone(),
                    pause: &pause,
                    calls: std::cell::Cell::new(0),
                })?;
            } else {
                pause.wait();
                let published = q
                    .ring_for_test()
                    .unwrap()
                    .published()
                    .load(std::sync::atomic::Ordering::SeqCst);
                pause.wait();
                // The first byte string and its length prefix: two whole chunks.
                assert_eq!(
                    published, 2,
                    "chunks published in the middle of the encoding"
                );
                let got: (ByteBuf, ByteBuf) = q.recv()?;
                assert_eq!(got, (bytes.clone(), bytes));
            }
            q.close_with(&comm)
        });
        assert!(results.into_iter().all(|r| r.unwrap().is_ok()));
    }

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        let mut frame = [0u8; FRAME];
        write_frame(&mut frame, DATA, 7, 1000);
        assert_eq!(read_frame(&frame), Ok((DATA, 7, 1000)));
        let mut bad = frame;
        bad[0] = b'x';
        assert!(read_frame(&bad).is_err());
        let mut bad = frame;
        bad[6] = 9;
        assert!(read_frame(&bad).is_err());
        let mut bad = frame;
        bad[4] = 2;
        assert!(read_frame(&bad).is_err());
    }
}
