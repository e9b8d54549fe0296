//! The collective creation: the settings and process identities agreed in one step, the
//! writer's ring allocated and offered, the readers on its host joining it, and the
//! transport readers split off into a sub-communicator of the writer and them.

use serde::{Deserialize, Serialize};
use tpcomm_ipc::{HostHandle, HostMemory, Step};
use tpcomm_objects::Options;
use tpcomm_transport::process::ProcessIdentity;
use tpcomm_transport::spin::SpinBudget;
use tpcomm_transport::Communicator;

use super::config::{Settings, SETTING_NAMES};
use super::lifecycle::step;
use super::transport::FRAME;
use super::{BroadcastQueue, Life, Locality, QueueConfig, Role};
use crate::error::{QueueError, Result};
use crate::layout::{Layout, WriterState};
use crate::shm::{JoinError, SharedRing};
use crate::wait::liveness_interval;

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
                match join_ring(&memory, h, layout, (id, writer), (slot, rank)) {
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
        // Failures on `comm` (the split itself) blame ranks of the queue's numbering; those
        // of `bound_waits`, on the split, blame none.
        let on_comm = |source: tpcomm_transport::TransportError| QueueError::Transport {
            rank,
            message: 0,
            culprit: source.culprit(),
            source: Box::new(source),
        };
        let on_split = |source| QueueError::Transport {
            rank,
            message: 0,
            culprit: None,
            source: Box::new(source),
        };
        let mut remote = if locality.transport.is_empty() {
            None
        } else {
            let member = rank == writer || locality.transport.contains(&rank);
            let key = if rank == writer { 0 } else { rank as i32 + 1 };
            comm.split(member.then_some(0), key).map_err(on_comm)?
        };
        // The frames' broadcasts wait no longer than the queue's timeout (a backend with no
        // bounded path keeps its own).
        if let Some(remote) = &mut remote {
            remote.bound_waits(config.timeout).map_err(on_split)?;
        }
        if let Role::Writer {
            ring: Some(ring), ..
        } = &role
        {
            ring.set_writer_state(WriterState::Open, None);
        }
        let here = 1 + locality.shared_memory.len();
        // The ring's ranks that are threads of this process (the others run in processes of
        // their own, on CPUs this one may not be allowed to use).
        let me = &peers[rank];
        let in_process = std::iter::once(writer)
            .chain(locality.shared_memory.iter().copied())
            .filter(|&r| peers[r].same_process(me))
            .count()
            .max(1);
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
            slots: candidates.len(),
            role,
            remote,
            memory,
            life: Life::Active,
            steps: JOIN + 1,
            messages: 0,
            buf: Vec::new(),
            shape: 0,
            size_next: true,
            frame: [0; FRAME],
            budget: SpinBudget::for_ranks(config.spin, in_process, here),
            peers,
            liveness: liveness_interval(config.timeout),
            departed: false,
        })
    }
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

/// [`SharedRing::join`]; in this crate's tests, a thread that set
/// [`tests::REFUSE_MAPPING`](super::tests::REFUSE_MAPPING) cannot map the ring (as under a
/// ptrace policy that refuses it).
fn join_ring(
    memory: &HostMemory,
    handle: &HostHandle,
    layout: Layout,
    writer: (u64, usize),
    reader: (usize, usize),
) -> std::result::Result<SharedRing, JoinError> {
    #[cfg(test)]
    if super::tests::REFUSE_MAPPING.with(std::cell::Cell::get) {
        return Err(JoinError::Unreachable(
            tpcomm_ipc::IpcError::InvalidAllocation("mapping refused by the test".into()),
        ));
    }
    SharedRing::join(memory, handle, layout, writer, reader)
}
