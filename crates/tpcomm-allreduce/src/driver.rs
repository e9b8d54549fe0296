//! [`CustomAllReduce`]: allocations, stable tables, registration, capture, lifecycle.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tpcomm_ipc::{ExchangeId, MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm_transport::Communicator;

use crate::backend::{Backend, Buffer, Launch, RANK_DATA_BYTES, RANK_SIGNALS_BYTES};
use crate::dispatch::{self, Algorithm, FallbackReason, MAX_RANKS};
use crate::dtype::{DType, Element};
use crate::error::{AllReduceError, Refused, Result};
use crate::lifecycle::{Lifecycle, Phase, Step, Transition};
use crate::topology::TopologyCheck;

/// Settings of a [`CustomAllReduce`].
///
/// [`CustomAllReduce::new`] checks across ranks that `max_bytes`, `slots` and `algorithm`
/// are equal (and the backend's shape, [`Backend::agreed_shape`]): a launch on one rank
/// reads up to its own `max_bytes` from every peer's staging and temp buffers, every rank
/// must take the same algorithm (the two-stage one has an extra barrier and reads temp
/// buffers), and slots are handed out in lockstep, so a smaller pool would fail one rank
/// alone. A mismatch is [`AllReduceError::ConfigMismatch`] on every rank. `timeout` may
/// differ: it only bounds this rank's own waits.
#[derive(Debug, Clone)]
pub struct Config {
    /// Largest all-reduce served, in bytes (sizes the staging and temp buffers; default
    /// 8 MiB). Larger inputs get [`FallbackReason::TooLarge`](crate::FallbackReason).
    pub max_bytes: usize,
    /// RankData slots (slot 0 serves eager inputs; default 1024, at most
    /// [`MAX_SLOTS`](Self::MAX_SLOTS)).
    pub slots: usize,
    /// Bound on every barrier wait inside a launch (default 30 s).
    pub timeout: Duration,
    /// Forces one algorithm for every size it can serve (benchmarks, tests); `None` (the
    /// default) dispatches by size and world size.
    pub algorithm: Option<Algorithm>,
    /// How a backend that probes the topology (CUDA) decides whether its kernels run:
    /// [`TopologyCheck::Auto`] (the default: vLLM's rule, more than 2 ranks only with every
    /// pair of GPUs on NVLink), `Assume` (run whatever the probe says), `Off` (always fall
    /// back). Agreed across ranks. See `crate::topology`.
    pub topology: TopologyCheck,
}

impl Config {
    /// The most RankData slots: launch shape words carry the slot in 20 bits.
    pub const MAX_SLOTS: usize = 1 << 20;
    /// The largest `max_bytes`: launch shape words carry the byte count in 40 bits.
    pub const MAX_BYTES: usize = (1 << 40) - 1;
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_bytes: 8 << 20,
            slots: 1024,
            timeout: Duration::from_secs(30),
            algorithm: None,
            topology: TopologyCheck::Auto,
        }
    }
}

impl Config {
    /// The settings every rank must share, as (field, value) pairs (see the type's doc).
    fn agreed_fields(&self) -> Vec<(String, String)> {
        vec![
            ("max_bytes".into(), self.max_bytes.to_string()),
            ("slots".into(), self.slots.to_string()),
            (
                "algorithm".into(),
                self.algorithm.map_or("by size", Algorithm::name).into(),
            ),
            ("topology".into(), self.topology.name().into()),
        ]
    }

    /// The algorithm for `bytes` of `dtype` on `world` ranks, if `backend` has a launch for
    /// it; the fallback reason otherwise. `staged`: an eager launch from the staging slot
    /// ([`Backend::staged_one_stage_table`]).
    fn choose<B: Backend>(
        &self,
        backend: &B,
        dtype: DType,
        bytes: usize,
        world: usize,
        staged: bool,
    ) -> Result<Algorithm> {
        let table = if staged {
            backend.staged_one_stage_table()
        } else {
            backend.one_stage_table()
        };
        let chosen = dispatch::choose_with(table, bytes, world, self.max_bytes)
            .map_err(AllReduceError::Fallback)?;
        let algorithm = self.algorithm.unwrap_or(chosen);
        backend
            .supports(world, dtype, bytes, algorithm)
            .map_err(AllReduceError::Fallback)?;
        Ok(algorithm)
    }
}

/// Which registration [`CustomAllReduce::agree_registration`] agrees on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Registering {
    Buffer = 1,
    Graph = 2,
}

impl Registering {
    fn name(self) -> &'static str {
        match self {
            Registering::Buffer => "register_buffer",
            Registering::Graph => "register_graph_buffers",
        }
    }
}

/// Where the addresses of a RankData slot come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotSource {
    /// The staging buffers (region 1 of the base exchange).
    Eager,
    /// Region `index` of an exchange.
    Exchanged(ExchangeId, usize),
    /// A captured input waiting for `register_graph_buffers`.
    Pending,
    /// A registered buffer's slot that a capture recorded, unregistered since: never
    /// reused (a plan or graph that still names it must not read another buffer), zero in
    /// the table, and launches of it are refused.
    Retired,
}

/// Index of each base region in the base exchange.
const SIGNAL: usize = 0;
const STAGING: usize = 1;
const TEMP: usize = 2;

#[derive(Debug)]
struct Resources<B: Backend> {
    peers: PeerMappings<B::Memory>,
    signal: Buffer<B>,
    staging: Buffer<B>,
    /// Only peers and launches (through the tables) touch it; owned here to keep it alive
    /// (and to release its memory at a suspend, where the backend can).
    temp: Buffer<B>,
    rank_signals: Buffer<B>,
    rank_data: Buffer<B>,
    base: ExchangeId,
}

/// This rank's own buffers, allocated before the agreement of [`CustomAllReduce::new`].
struct Allocations<B: Backend> {
    signal: Buffer<B>,
    staging: Buffer<B>,
    temp: Buffer<B>,
    rank_signals: Buffer<B>,
    rank_data: Buffer<B>,
}

impl<B: Backend> Allocations<B> {
    fn new(backend: &B, memory: &B::Memory, config: &Config) -> Result<Self> {
        if !(1..=Config::MAX_SLOTS).contains(&config.slots)
            || !(16..=Config::MAX_BYTES).contains(&config.max_bytes)
        {
            return Err(AllReduceError::InvalidArgument(format!(
                "slots must be 1..={} and max_bytes 16..={} (got {} and {})",
                Config::MAX_SLOTS,
                Config::MAX_BYTES,
                config.slots,
                config.max_bytes
            )));
        }
        let pool_bytes = config
            .slots
            .checked_mul(RANK_DATA_BYTES)
            .ok_or_else(|| AllReduceError::InvalidArgument("slot pool size overflows".into()))?;
        let signal = memory.allocate(backend.signal_bytes())?;
        let staging = memory.allocate(config.max_bytes)?;
        let temp = memory.allocate(config.max_bytes)?;
        // The tables this rank trusts for every peer address: private memory, which a peer
        // mapping the exported buffers above cannot reach.
        let rank_signals = memory.allocate_private(RANK_SIGNALS_BYTES)?;
        let rank_data = memory.allocate_private(pool_bytes)?;
        backend.reset_signal(memory, &signal)?;
        Ok(Self {
            signal,
            staging,
            temp,
            rank_signals,
            rank_data,
        })
    }
}

/// Every rank's (setup error, agreed fields), as all-gathered by `new`.
type Agreement = (Option<String>, Vec<(String, String)>);

/// The most settings a rank may send in its [`Agreement`] (a build sends about ten).
const MAX_AGREED_FIELDS: usize = 256;

/// The first rank that reported a setup error, with it.
fn first_setup_error(errors: &[Option<String>]) -> Option<(usize, String)> {
    errors
        .iter()
        .enumerate()
        .find_map(|(rank, e)| e.clone().map(|e| (rank, e)))
}

/// Fails (identically on every rank: they all read the same values) when a rank could not
/// set up, or when ranks differ in a field that must be equal.
fn check_agreement(all: &[Agreement]) -> Result<()> {
    let errors: Vec<Option<String>> = all.iter().map(|(e, _)| e.clone()).collect();
    if let Some((rank, reason)) = first_setup_error(&errors) {
        return Err(AllReduceError::PeerSetup { rank, reason });
    }
    // Compared name by name below: a peer's list is bounded first, so that a lying peer
    // cannot make the comparison quadratic in what it sends.
    if let Some((rank, (_, fields))) = all
        .iter()
        .enumerate()
        .find(|(_, (_, fields))| fields.len() > MAX_AGREED_FIELDS)
    {
        return Err(AllReduceError::PeerSetup {
            rank,
            reason: format!(
                "it sent {} settings to agree on, more than any build has ({MAX_AGREED_FIELDS})",
                fields.len()
            ),
        });
    }
    // Fields in the order rank 0 sent them, then any only some other rank sent.
    let mut names: Vec<&str> = Vec::new();
    for (_, fields) in all {
        for (name, _) in fields {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    for name in names {
        let values: Vec<(usize, String)> = all
            .iter()
            .enumerate()
            .map(|(rank, (_, fields))| {
                let value = fields
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or_else(|| "nothing".to_string(), |(_, v)| v.clone());
                (rank, value)
            })
            .collect();
        if values.iter().any(|(_, v)| *v != values[0].1) {
            return Err(AllReduceError::ConfigMismatch {
                field: name.to_string(),
                values,
            });
        }
    }
    Ok(())
}

/// Which path served [`CustomAllReduce::all_reduce_or_transport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRoute {
    /// The custom peer-memory all-reduce, with this algorithm.
    Custom(Algorithm),
    /// The transport's numeric all-reduce ([`Communicator::all_reduce`]), because the custom
    /// kernels cannot serve the input, for this reason.
    Transport(FallbackReason),
}

/// A buffer shared with every peer up front ([`CustomAllReduce::register_buffer`]):
/// all-reduces of it are zero-copy.
///
/// The communicator that registered the buffer keeps it alive for as long as it is
/// registered, also when this token is dropped: a registered buffer is never freed under
/// its peers' mappings, a resume re-exports live memory, and no other allocation can take
/// its address meanwhile (so an address lookup never takes a new buffer for it).
/// [`CustomAllReduce::unregister`] (collective) ends the registration and hands the buffer
/// back; otherwise it lives until the communicator is closed.
#[derive(Debug)]
pub struct RegisteredInput<B: Backend> {
    buffer: Arc<Buffer<B>>,
    slot: usize,
    owner: u64,
}

impl<B: Backend> RegisteredInput<B> {
    /// The registered buffer (write this rank's input into it before reducing).
    pub fn buffer(&self) -> &Buffer<B> {
        &self.buffer
    }

    /// Its RankData slot.
    pub fn slot(&self) -> usize {
        self.slot
    }
}

/// A registration as the communicator keeps it.
#[derive(Debug)]
struct Registration<B: Backend> {
    slot: usize,
    exchange: ExchangeId,
    /// Keeps the buffer alive while registered (see [`RegisteredInput`]).
    buffer: Arc<Buffer<B>>,
}

/// One launch recorded by [`CustomAllReduce::capture`].
#[derive(Debug)]
struct Recorded<'b, B: Backend> {
    slot: usize,
    output: &'b Buffer<B>,
    dtype: DType,
    count: usize,
    algorithm: Algorithm,
}

/// The launches recorded during a capture: the host equivalent of a CUDA graph. Replaying
/// reads the tables at run time, so a plan captured before a suspend replays correctly
/// after the resume. A plan replays only on the communicator that captured it.
#[derive(Debug)]
pub struct CapturedPlan<'b, B: Backend> {
    launches: Vec<Recorded<'b, B>>,
    /// The `id` of the communicator that captured it.
    owner: u64,
    /// Alive as long as the plan (and so the borrows of its inputs): the communicator
    /// shares its inputs only while it is (see [`CaptureOwner`]).
    _alive: CaptureOwner,
}

impl<B: Backend> CapturedPlan<'_, B> {
    /// Number of recorded launches.
    pub fn len(&self) -> usize {
        self.launches.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.launches.is_empty()
    }

    /// Runs every recorded launch in order (collective, like the launches themselves).
    /// Refused with [`AllReduceError::ForeignToken`] on a communicator other than the one
    /// that captured it (its slots mean nothing there), and with
    /// [`AllReduceError::UnregisteredGraphBuffers`] before its inputs are registered.
    pub fn replay(&self, ar: &mut CustomAllReduce<B>) -> Result<()> {
        ar.check_owner("a captured plan", self.owner)?;
        for l in &self.launches {
            ar.launch(
                "replay",
                l.slot,
                l.dtype,
                l.count,
                l.algorithm,
                l.output.addr(),
            )?;
        }
        Ok(())
    }
}

/// The recording side of a capture (see [`CustomAllReduce::capture`]).
#[derive(Debug)]
pub struct Capture<'a, 'b, B: Backend> {
    ar: CaptureGuard<'a, B>,
    launches: Vec<Recorded<'b, B>>,
}

/// Held by what a capture made (a [`CapturedPlan`], a CUDA `DeviceGraph`): while it lives,
/// the inputs its calls captured are alive too (a plan borrows them; a graph's contract
/// says so). Once it is dropped, nothing replays those calls and their inputs may be freed:
/// the communicator shares its staging bytes in their place from then on, so that a
/// registration or a resume never exports memory that may be gone.
#[derive(Debug, Default)]
pub(crate) struct CaptureOwner(Arc<()>);

impl CaptureOwner {
    fn watch(&self) -> Weak<()> {
        Arc::downgrade(&self.0)
    }
}

/// What a capture restores when it does not complete: the pending inputs, captured flags and
/// recorded launches as they were when it began.
#[derive(Debug)]
struct CaptureStart {
    pending: usize,
    captured: Vec<bool>,
    recorded: usize,
}

/// A communicator while a capture runs: dropped without [`keep`](Self::keep) (the capture
/// failed, or the closure recording it panicked), it gives back every slot the capture took,
/// so that none of its inputs stays pending and ranks stay in step.
#[derive(Debug)]
pub(crate) struct CaptureGuard<'a, B: Backend> {
    ar: &'a mut CustomAllReduce<B>,
    start: Option<CaptureStart>,
}

impl<'a, B: Backend> CaptureGuard<'a, B> {
    /// Starts a capture whose inputs live as long as `owner`.
    pub(crate) fn new(ar: &'a mut CustomAllReduce<B>, owner: &CaptureOwner) -> Self {
        let start = CaptureStart {
            pending: ar.pending.len(),
            captured: ar.captured.clone(),
            recorded: ar.recorded.len(),
        };
        ar.capture_owner = Some(owner.watch());
        Self {
            ar,
            start: Some(start),
        }
    }

    /// The capture completed: keeps what it took.
    pub(crate) fn keep(mut self) {
        self.start = None;
    }
}

impl<B: Backend> std::ops::Deref for CaptureGuard<'_, B> {
    type Target = CustomAllReduce<B>;
    fn deref(&self) -> &CustomAllReduce<B> {
        self.ar
    }
}

impl<B: Backend> std::ops::DerefMut for CaptureGuard<'_, B> {
    fn deref_mut(&mut self) -> &mut CustomAllReduce<B> {
        self.ar
    }
}

impl<B: Backend> Drop for CaptureGuard<'_, B> {
    fn drop(&mut self) {
        self.ar.capture_owner = None;
        let Some(start) = self.start.take() else {
            return;
        };
        for (slot, _) in self.ar.pending.drain(start.pending..) {
            self.ar.slots[slot] = None;
            self.ar.graph_owners[slot] = None;
        }
        self.ar.captured = start.captured;
        self.ar.recorded.truncate(start.recorded);
    }
}

impl<'b, B: Backend> Capture<'_, 'b, B> {
    /// Records an all-reduce of the first `count` elements of `input` into `output`. An
    /// input not registered ([`CustomAllReduce::register_buffer`]) gets the next free
    /// RankData slot, one per call (an input captured twice takes two slots), filled by
    /// [`CustomAllReduce::register_graph_buffers`].
    pub fn all_reduce(
        &mut self,
        input: &'b Buffer<B>,
        output: &'b Buffer<B>,
        dtype: DType,
        count: usize,
    ) -> Result<Algorithm> {
        self.ar.lifecycle.check_operation("capture")?;
        let bytes = self
            .ar
            .checked_bytes(dtype, count, input.len(), output.len())?;
        let algorithm = self.ar.choose(dtype, bytes, false)?;
        check_no_alias(algorithm, input.addr(), output.addr(), bytes)?;
        let slot = self.ar.graph_slot(input.addr(), bytes)?;
        self.launches.push(Recorded {
            slot,
            output,
            dtype,
            count,
            algorithm,
        });
        Ok(algorithm)
    }
}

/// Bytes every address written into the tables is aligned to: the kernels move 16-byte
/// packs, and the host reduction reads elements where they lie. Honest ranks share
/// page-aligned host buffers and device buffers aligned to at least this.
const PEER_ALIGN: usize = 16;

/// `addr`, when rank `rank`'s `region` lies at an address every launch can read: a forged
/// handle could place it anywhere inside a genuine segment.
fn peer_aligned(rank: usize, region: &'static str, addr: u64) -> Result<u64> {
    if addr.is_multiple_of(PEER_ALIGN as u64) {
        return Ok(addr);
    }
    Err(AllReduceError::PeerMisaligned {
        rank,
        region,
        addr,
        align: PEER_ALIGN,
    })
}

fn check_no_alias(algorithm: Algorithm, input: u64, output: u64, bytes: usize) -> Result<()> {
    if algorithm == Algorithm::OneStage && crate::backend::overlap(input, output, bytes) {
        return Err(AllReduceError::InvalidArgument(
            "the one-stage output must not overlap its input (peers read the input until the end barrier)".into(),
        ));
    }
    Ok(())
}

/// The byte ranges of a `bytes`-byte input that an eager call stages: all of it, or what is
/// left around `private` (elements, from [`Backend::private_part`]), which only this rank
/// reads and the launch takes from the caller's input. Empty ranges are left out.
fn staged_ranges(
    private: Option<std::ops::Range<usize>>,
    dtype: DType,
    bytes: usize,
) -> Result<impl Iterator<Item = std::ops::Range<usize>>> {
    let ranges = match private {
        None => [0..bytes, bytes..bytes],
        Some(part) => {
            let start = part.start.saturating_mul(dtype.size());
            let end = part.end.saturating_mul(dtype.size());
            if start > end || end > bytes {
                return Err(AllReduceError::InvalidArgument(format!(
                    "the backend named bytes {start}..{end} of a {bytes}-byte input as private"
                )));
            }
            [0..start, end..bytes]
        }
    };
    Ok(ranges.into_iter().filter(|r| !r.is_empty()))
}

/// The graph-safe custom all-reduce of one group of ranks.
///
/// Per rank it owns a Signal block, a staging buffer for eager inputs and a temp buffer for
/// two-stage, all in peer memory shared through [`PeerMappings`], plus two *stable tables*
/// at addresses fixed for its whole life: RankSignals (every rank's Signal and temp
/// address as mapped here) and a pool of RankData slots (every rank's input address).
/// Launches name table entries, never peer addresses, so
/// [`prepare_for_suspend`](Self::prepare_for_suspend) can close every mapping and
/// [`reinit_after_resume`](Self::reinit_after_resume) reopen them elsewhere while captured
/// plans stay valid.
///
/// ```
/// use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend};
/// use tpcomm_ipc::HostMemory;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(2).run(|comm| -> tpcomm_allreduce::Result<Vec<f32>> {
///     let mut ar = CustomAllReduce::new(HostBackend::new(), HostMemory::new(), &comm, Config::default())?;
///     let input = vec![comm.rank() as f32 + 1.0; 64];
///     let mut out = vec![0f32; 64];
///     ar.all_reduce(&input, &mut out)?;
///     ar.prepare_for_suspend(&comm)?;
///     ar.reinit_after_resume(&comm)?;
///     ar.all_reduce(&input, &mut out)?;
///     Ok(out)
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![3.0f32; 64]);
/// }
/// ```
#[derive(Debug)]
pub struct CustomAllReduce<B: Backend> {
    backend: B,
    rank: usize,
    world: usize,
    config: Config,
    lifecycle: Lifecycle,
    res: Option<Resources<B>>,
    /// Source of each RankData slot (`None` = free).
    slots: Vec<Option<SlotSource>>,
    /// Per slot, the bytes every rank's region there holds, and the rank with the smallest
    /// (0 for free and pending slots): a launch never reads more (rewritten with the tables).
    slot_limits: Vec<(usize, usize)>,
    /// The bytes every rank's temp buffer holds and the rank with the smallest (two-stage
    /// reads peers' temp buffers).
    temp_limit: (usize, usize),
    /// Captured inputs awaiting `register_graph_buffers`, in capture order, one per call.
    pending: Vec<(usize, Region)>,
    /// Registered buffers by address.
    buffers: HashMap<u64, Registration<B>>,
    /// Per slot, whether a capture (a plan or a device graph) recorded a launch of it.
    captured: Vec<bool>,
    /// Per slot taken by a captured input, what made the capture ([`CaptureOwner`]) while
    /// the input may be shared: once it is gone, staging bytes are shared in its place.
    /// `None` for registered buffers (the communicator keeps them alive), for inputs of an
    /// engine's own capture (its graph's lifetime is unknown here: the input must live as
    /// long as the slot, `docs/gpu.md`) and once replaced.
    graph_owners: Vec<Option<Weak<()>>>,
    /// The owner of the capture running now ([`CaptureGuard`]), if any.
    capture_owner: Option<Weak<()>>,
    /// The slot of every launch recorded into device graphs (while the backend was
    /// capturing) so far, in order.
    recorded: Vec<usize>,
    /// Registrations whose `unregister` failed after the ranks agreed on it: their buffers
    /// live until the communicator is dropped, since a peer may still map them.
    retired: Vec<Registration<B>>,
    /// Unique in the process: ties device graphs to the communicator that captured them.
    id: u64,
    /// Bytes of this rank's Signal, staging and temp buffers whose memory the last suspend
    /// released ([`PeerMemory::release_backing`]); 0 while they are backed.
    released: usize,
    /// The RankSignals table and the used part of the RankData pool as last written to the
    /// device, so that a resume whose peer addresses are all where they were
    /// ([`PeerMemory::keeps_addresses`]) writes nothing.
    written: Option<(Vec<u8>, Vec<u8>)>,
    /// Table writes that reached the backend (a rewrite with every entry unchanged does not).
    table_writes: u64,
}

impl<B: Backend> CustomAllReduce<B> {
    /// Collective: allocates this rank's Signal, staging and temp buffers and the tables,
    /// agrees the settings with every rank, exchanges the buffers with every peer and fills
    /// the tables.
    ///
    /// Every rank returns the same error when ranks differ in `max_bytes`, `slots`,
    /// `algorithm` or the backend's shape ([`AllReduceError::ConfigMismatch`] naming the
    /// field and every rank's value), or when a rank could not set up (its own error there,
    /// [`AllReduceError::PeerSetup`] naming it elsewhere): the agreement rides on the first
    /// collective, and whatever was allocated is freed before returning.
    pub fn new<C: Communicator + ?Sized>(
        mut backend: B,
        memory: B::Memory,
        comm: &C,
        config: Config,
    ) -> Result<Self> {
        backend.apply_topology_check(config.topology);
        let world = comm.size();
        if world > MAX_RANKS {
            // Decided from the group size alone: every rank returns it, nobody is left waiting.
            return Err(AllReduceError::Fallback(
                dispatch::FallbackReason::UnsupportedWorldSize { world },
            ));
        }
        let _span = tracing::debug_span!(
            "allreduce_new",
            rank = comm.rank(),
            world,
            backend = backend.name()
        )
        .entered();
        // A local failure (invalid settings, allocation) still joins the agreement below, so
        // that every rank fails together instead of waiting for this one.
        let local = Allocations::new(&backend, &memory, &config);
        let mut fields = config.agreed_fields();
        fields.push(("backend".into(), backend.name().into()));
        fields.push(("signal_bytes".into(), backend.signal_bytes().to_string()));
        fields.push(("nonce_offset".into(), backend.nonce_offset().to_string()));
        fields.extend(
            backend
                .agreed_shape()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        let mine = (local.as_ref().err().map(ToString::to_string), fields);
        let (mut peers, all) = PeerMappings::new_agreeing(memory, comm, &mine)?;
        let allocations = local?;
        check_agreement(&all)?;
        let Allocations {
            signal,
            staging,
            temp,
            rank_signals,
            rank_data,
        } = allocations;
        let regions = [
            Region {
                addr: signal.addr(),
                len: backend.signal_bytes(),
            },
            Region {
                addr: staging.addr(),
                len: config.max_bytes,
            },
            Region {
                addr: temp.addr(),
                len: config.max_bytes,
            },
        ];
        let base = peers.exchange(comm, &regions)?;
        let mut slots = vec![None; config.slots];
        slots[0] = Some(SlotSource::Eager);
        let slot_limits = vec![(0, comm.rank()); config.slots];
        let captured = vec![false; config.slots];
        let graph_owners = vec![None; config.slots];
        let mut ar = Self {
            backend,
            rank: comm.rank(),
            world,
            config,
            lifecycle: Lifecycle::new(),
            res: Some(Resources {
                peers,
                signal,
                staging,
                temp,
                rank_signals,
                rank_data,
                base,
            }),
            slots,
            slot_limits,
            temp_limit: (0, comm.rank()),
            pending: Vec::new(),
            buffers: HashMap::new(),
            captured,
            graph_owners,
            capture_owner: None,
            recorded: Vec::new(),
            retired: Vec::new(),
            id: {
                use std::sync::atomic::{AtomicU64, Ordering};
                static NEXT: AtomicU64 = AtomicU64::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            released: 0,
            written: None,
            table_writes: 0,
        };
        // Nobody launches before every rank's tables are written; a rank that could not
        // write them still joins, and every rank fails together.
        let written = ar.write_tables();
        let written = if ar.backend.prove_at_creation() {
            ar.prove_at_creation(comm, written)?
        } else {
            written
        };
        let res = ar.res.as_mut().expect("just created");
        let ready: Vec<Option<String>> = res.peers.agree(
            comm,
            tpcomm_ipc::Step::Ready,
            &written.as_ref().err().map(ToString::to_string),
        )?;
        written?;
        if let Some((rank, reason)) = first_setup_error(&ready) {
            return Err(AllReduceError::PeerSetup { rank, reason });
        }
        Ok(ar)
    }

    /// Fails unless an operation may run now (Active).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check_operation(&self, call: &'static str) -> Result<()> {
        self.lifecycle.check_operation(call)
    }

    /// Launches recorded into device graphs so far (a device graph's size is the
    /// difference across its capture).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn recorded_launches(&self) -> usize {
        self.recorded.len()
    }

    /// The distinct slots of the launches recorded into device graphs since `since`
    /// launches (what a device graph captured across that span reads).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn recorded_slots(&self, since: usize) -> Vec<usize> {
        let mut slots = self.recorded.get(since..).unwrap_or_default().to_vec();
        slots.sort_unstable();
        slots.dedup();
        slots
    }

    /// Fails when one of `slots` held a registered buffer that was unregistered since a
    /// capture recorded it ([`AllReduceError::UnregisteredInput`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check_slots_live(&self, slots: &[usize]) -> Result<()> {
        match slots
            .iter()
            .find(|&&s| self.slots.get(s) == Some(&Some(SlotSource::Retired)))
        {
            Some(&slot) => Err(AllReduceError::UnregisteredInput { slot }),
            None => Ok(()),
        }
    }

    /// This communicator's identity in the process.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The lifecycle phase.
    pub fn phase(&self) -> Phase {
        self.lifecycle.phase()
    }

    /// Whether [`prepare_for_suspend`](Self::prepare_for_suspend) would start on this rank:
    /// the communicator is Active or Suspended and its stream is not being captured.
    /// Otherwise that call refuses at once on this rank while its peers wait for it in the
    /// collective steps (until their timeout), so a coordinator asks every rank first and
    /// starts only when none refuses (as `tpcomm_checkpoint::checkpoint_group` does).
    pub fn check_suspend(&self) -> Result<()> {
        match self.phase() {
            Phase::Active | Phase::Suspended => {}
            phase => {
                return Err(AllReduceError::WrongState {
                    call: "prepare_for_suspend",
                    phase,
                })
            }
        }
        self.refuse_while_capturing("prepare_for_suspend")
    }

    /// Fails unless this rank's process can be checkpointed and restored with its peers
    /// (`tpcomm-checkpoint` asks before anything is suspended): every peer buffer it maps
    /// must come back after a restore, as the peer-memory backend judges it
    /// ([`PeerMemory::checkpoint_blocker`]). The first that would not is
    /// [`AllReduceError::NotCheckpointable`], naming it (the base buffers, a registered
    /// buffer or a graph buffer of which rank, at which address) and why. Legacy CUDA IPC
    /// mappings of another process are such buffers: after a checkpoint and restore of both
    /// processes the driver refuses to open fresh legacy handles.
    pub fn check_checkpoint(&self) -> Result<()> {
        let res = self.resources("check_checkpoint")?;
        let Some(blocker) = res.peers.checkpoint_blockers().into_iter().next() else {
            return Ok(());
        };
        let what = if blocker.exchange == res.base {
            match blocker.index {
                SIGNAL => "Signal block",
                STAGING => "staging buffer",
                _ => "temp buffer",
            }
            .to_string()
        } else if self
            .buffers
            .values()
            .any(|reg| reg.exchange == blocker.exchange)
        {
            "registered buffer".to_string()
        } else {
            let slot = self
                .slots
                .iter()
                .position(|s| *s == Some(SlotSource::Exchanged(blocker.exchange, blocker.index)));
            match slot {
                Some(slot) => format!("graph buffer (RankData slot {slot})"),
                None => "buffer".to_string(),
            }
        };
        let addr = res
            .peers
            .address(blocker.exchange, blocker.rank, blocker.index)
            .map_or_else(|_| "a closed mapping".to_string(), |a| format!("{a:#x}"));
        Err(AllReduceError::NotCheckpointable {
            rank: self.rank,
            buffer: format!(
                "rank {}'s {what} (mapped at {addr}, {} bytes)",
                blocker.rank, blocker.len
            ),
            reason: blocker.reason,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The peer-memory backend (to allocate inputs that can be registered or captured).
    pub fn memory(&self) -> Result<&B::Memory> {
        Ok(self.resources("memory")?.peers.backend())
    }

    /// The registry of peer mappings (for counters and tests).
    pub fn peer_mappings(&self) -> Result<&PeerMappings<B::Memory>> {
        Ok(&self.resources("peer_mappings")?.peers)
    }

    /// The address at which region `index` (0 Signal, 1 staging, 2 temp) of `rank` is
    /// mapped now.
    pub fn base_address(&self, rank: usize, index: usize) -> Result<u64> {
        let res = self.resources("base_address")?;
        Ok(res.peers.address(res.base, rank, index)?)
    }

    /// The address of this rank's RankSignals table (never changes).
    pub fn rank_signals_address(&self) -> Result<u64> {
        Ok(self.resources("rank_signals_address")?.rank_signals.addr())
    }

    /// The addresses RankData slot `slot` holds now, one per rank (read back from the
    /// table; zero for a slot never written).
    pub fn rank_data_slot(&self, slot: usize) -> Result<Vec<u64>> {
        if slot >= self.slots.len() {
            return Err(AllReduceError::InvalidArgument(format!(
                "slot {slot} is outside the pool of {}",
                self.slots.len()
            )));
        }
        let res = self.resources("rank_data_slot")?;
        let mut raw = [0u8; RANK_DATA_BYTES];
        res.peers
            .backend()
            .read(&res.rank_data, slot * RANK_DATA_BYTES, &mut raw)?;
        Ok(raw
            .chunks_exact(8)
            .take(self.world)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect())
    }

    fn resources(&self, call: &'static str) -> Result<&Resources<B>> {
        self.res.as_ref().ok_or(AllReduceError::WrongState {
            call,
            phase: Phase::Closed,
        })
    }

    /// Rewrites every RankSignals entry and every RankData slot from the current mappings.
    fn write_tables(&mut self) -> Result<()> {
        let res = self.res.as_ref().ok_or(AllReduceError::WrongState {
            call: "write_tables",
            phase: Phase::Closed,
        })?;
        let memory = res.peers.backend();
        let mut table = [0u8; RANK_SIGNALS_BYTES];
        let mut temp_limit = (usize::MAX, self.rank);
        for r in 0..self.world {
            // Launches access every rank's Signal block with this backend's layout.
            let signal_len = res.peers.region_len(res.base, r, SIGNAL)?;
            if signal_len < self.backend.signal_bytes() {
                return Err(AllReduceError::SignalTooSmall {
                    rank: r,
                    bytes: signal_len,
                    needed: self.backend.signal_bytes(),
                });
            }
            let signal = peer_aligned(r, "Signal block", res.peers.address(res.base, r, SIGNAL)?)?;
            let temp = peer_aligned(r, "temp buffer", res.peers.address(res.base, r, TEMP)?)?;
            let temp_len = res.peers.region_len(res.base, r, TEMP)?;
            if temp_len < temp_limit.0 {
                temp_limit = (temp_len, r);
            }
            table[8 * r..8 * r + 8].copy_from_slice(&signal.to_le_bytes());
            table[64 + 8 * r..64 + 8 * r + 8].copy_from_slice(&temp.to_le_bytes());
        }
        // The pool up to its last used slot, in one write (one device copy for CUDA): free
        // and pending slots hold zeros, as they did since the pool was allocated.
        let used = self
            .slots
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |s| s + 1);
        let mut pool = vec![0u8; used * RANK_DATA_BYTES];
        let mut limits = vec![(0, self.rank); self.slots.len()];
        for (slot, source) in self.slots[..used].iter().enumerate() {
            let (id, index) = match source {
                Some(SlotSource::Eager) => (res.base, STAGING),
                Some(SlotSource::Exchanged(id, index)) => (*id, *index),
                Some(SlotSource::Pending | SlotSource::Retired) | None => continue,
            };
            let entry = &mut pool[slot * RANK_DATA_BYTES..][..RANK_DATA_BYTES];
            let mut limit = (usize::MAX, self.rank);
            for r in 0..self.world {
                let addr = peer_aligned(r, "input", res.peers.address(id, r, index)?)?;
                entry[8 * r..8 * r + 8].copy_from_slice(&addr.to_le_bytes());
                let len = res.peers.region_len(id, r, index)?;
                if len < limit.0 {
                    limit = (len, r);
                }
            }
            limits[slot] = limit;
        }
        // Entries as the device holds them already need no write: a resume that kept every
        // peer address (stable addresses) leaves the tables alone. A failed write forgets
        // what the device holds, so the next rewrite writes everything.
        let unchanged = self
            .written
            .as_ref()
            .is_some_and(|(signals, data)| *signals == table && *data == pool);
        if !unchanged {
            self.written = None;
            self.backend
                .write_table(memory, &res.rank_signals, 0, &table)?;
            self.backend.write_table(memory, &res.rank_data, 0, &pool)?;
            self.table_writes += 1;
            self.written = Some((table.to_vec(), pool));
        }
        self.slot_limits = limits;
        self.temp_limit = temp_limit;
        Ok(())
    }

    /// How many times the stable tables were written to the backend: at creation, after a
    /// registration, and after a resume that moved a peer address. A resume whose every
    /// peer address was kept ([`PeerMemory::keeps_addresses`]) writes nothing.
    pub fn table_writes(&self) -> u64 {
        self.table_writes
    }

    /// Bytes of this rank's Signal, staging and temp buffers whose memory the last
    /// [`prepare_for_suspend`](Self::prepare_for_suspend) released (a backend that
    /// [releases backing](PeerMemory::releases_backing): CUDA virtual memory,
    /// `HostMemory::stable`); 0 after the resume and for other backends.
    pub fn released_bytes(&self) -> usize {
        self.released
    }

    /// Fails unless `comm` is the group this communicator was created for (this rank, the
    /// same size): [`IpcError::WrongCommunicator`](tpcomm_ipc::IpcError::WrongCommunicator),
    /// before anything changes. Once closed, the calls fail as Closed instead.
    pub(crate) fn check_communicator<C: Communicator + ?Sized>(&self, comm: &C) -> Result<()> {
        match &self.res {
            Some(res) => Ok(res.peers.check_communicator(comm)?),
            None => Ok(()),
        }
    }

    /// Fails unless a token made by communicator `owner` belongs to this one.
    fn check_owner(&self, what: &'static str, owner: u64) -> Result<()> {
        if owner == self.id {
            Ok(())
        } else {
            Err(AllReduceError::ForeignToken {
                what,
                owner,
                communicator: self.id,
            })
        }
    }

    /// Tagged step before a registration's exchange: every rank makes the same registration
    /// (`register_buffer` against `register_graph_buffers` would pair one rank's input with
    /// another kind of peer input) into the same RankData slots (`None`: this rank has no
    /// free slot). A difference fails every rank alike, and nothing has changed.
    fn agree_registration<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        call: Registering,
        slots: Option<&[usize]>,
    ) -> Result<()> {
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: call.name(),
            phase: Phase::Closed,
        })?;
        let mine: (u8, Option<Vec<u64>>) = (
            call as u8,
            slots.map(|s| s.iter().map(|&s| s as u64).collect()),
        );
        let all: Vec<(u8, Option<Vec<u64>>)> =
            res.peers.agree(comm, tpcomm_ipc::Step::Register, &mine)?;
        let calls: Vec<u64> = all.iter().map(|(c, _)| u64::from(*c)).collect();
        if calls.iter().any(|&c| c != calls[0]) {
            return Err(AllReduceError::Disagreement {
                what: "the registration (1: register_buffer, 2: register_graph_buffers)",
                values: calls,
            });
        }
        if mine.1.is_none() {
            return Err(AllReduceError::SlotsExhausted(self.slots.len()));
        }
        // Every rank's slots, compared at the first position where any differs (u64::MAX:
        // none there, or no free slot at all).
        let at = |r: &(u8, Option<Vec<u64>>), i: usize| {
            r.1.as_ref()
                .and_then(|s| s.get(i))
                .copied()
                .unwrap_or(u64::MAX)
        };
        let longest = all.iter().map(|r| r.1.as_ref().map_or(1, Vec::len)).max();
        if let Some(i) =
            (0..longest.unwrap_or(0)).find(|&i| all.iter().any(|r| at(r, i) != at(&all[0], i)))
        {
            return Err(AllReduceError::Disagreement {
                what: "the RankData slots of the registration (u64::MAX: none)",
                values: all.iter().map(|r| at(r, i)).collect(),
            });
        }
        Ok(())
    }

    fn free_slot(&self) -> Result<usize> {
        self.slots
            .iter()
            .position(Option::is_none)
            .ok_or(AllReduceError::SlotsExhausted(self.slots.len()))
    }

    fn checked_bytes(
        &self,
        dtype: DType,
        count: usize,
        input_len: usize,
        output_len: usize,
    ) -> Result<usize> {
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| AllReduceError::InvalidArgument(format!("{count} elements overflow")))?;
        if bytes > input_len || bytes > output_len {
            return Err(AllReduceError::InvalidArgument(format!(
                "{count} {} elements ({bytes} bytes) do not fit the input ({input_len} bytes) or output ({output_len} bytes)",
                dtype.name()
            )));
        }
        Ok(bytes)
    }

    /// Runs one launch; a failure leaves the communicator Failed.
    fn launch(
        &mut self,
        call: &'static str,
        slot: usize,
        dtype: DType,
        count: usize,
        algorithm: Algorithm,
        out: u64,
    ) -> Result<()> {
        self.launch_slot(call, slot, dtype, count, algorithm, out, false, None)
    }

    /// [`launch`](Self::launch); `recording` (a device graph capture) may name a slot still
    /// waiting for `register_graph_buffers`, since nothing runs until the graph is replayed.
    /// `own_input`: [`Launch::own_input`] with the private part of the input it serves
    /// ([`Backend::private_part`], already computed by the caller to stage the rest).
    #[allow(clippy::too_many_arguments)]
    fn launch_slot(
        &mut self,
        call: &'static str,
        slot: usize,
        dtype: DType,
        count: usize,
        algorithm: Algorithm,
        out: u64,
        recording: bool,
        own_input: Option<(u64, std::ops::Range<usize>)>,
    ) -> Result<()> {
        self.lifecycle.check_operation(call)?;
        let source = self.slots.get(slot).copied().flatten();
        let pending = source == Some(SlotSource::Pending);
        if pending && !recording {
            return Err(AllReduceError::UnregisteredGraphBuffers);
        }
        if source == Some(SlotSource::Retired) {
            return Err(AllReduceError::UnregisteredInput { slot });
        }
        // What every rank's region in the slot holds bounds what the launch reads (a
        // pending slot, only while recording, is checked by register_graph_buffers: every
        // rank's region there is exactly the captured size).
        let bytes = count.saturating_mul(dtype.size());
        let (limit, smallest) = self
            .slot_limits
            .get(slot)
            .copied()
            .unwrap_or((0, self.rank));
        if !pending && bytes > limit {
            return Err(AllReduceError::RegionTooSmall {
                buffer: "input",
                slot,
                bytes,
                rank: smallest,
                region_bytes: limit,
            });
        }
        if algorithm == Algorithm::TwoStage && bytes > self.temp_limit.0 {
            return Err(AllReduceError::RegionTooSmall {
                buffer: "temp",
                slot,
                bytes,
                rank: self.temp_limit.1,
                region_bytes: self.temp_limit.0,
            });
        }
        let res = self.resources(call)?;
        let launch = Launch {
            algorithm,
            dtype,
            count,
            rank: self.rank,
            world: self.world,
            rank_signals: &res.rank_signals,
            rank_data: &res.rank_data,
            slot,
            own_signal: &res.signal,
            out,
            own_input: own_input.as_ref().map(|(addr, _)| *addr),
            timeout: self.config.timeout,
            checked: crate::backend::Checked {
                signal_bytes: self.backend.signal_bytes(),
                host_addressable: self.backend.host_addressable(),
                private: own_input.map(|(_, private)| private),
            },
        };
        let _span = tracing::trace_span!(
            "allreduce",
            rank = self.rank,
            dtype = dtype.name(),
            count,
            algorithm = algorithm.name(),
            slot
        )
        .entered();
        match self.backend.launch(res.peers.backend(), &launch) {
            Ok(()) => {
                if recording {
                    self.recorded.push(slot);
                    self.captured[slot] = true;
                }
                Ok(())
            }
            Err(e) => Err(self.lifecycle.fail(call, e)),
        }
    }

    /// Eager all-reduce: copies `input` into the staging buffer and reduces every rank's
    /// staging buffer into `output`. Returns the algorithm used, or
    /// [`AllReduceError::Fallback`] with the reason when the custom path cannot serve it.
    pub fn all_reduce<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<Algorithm> {
        self.check_host_addressable("all_reduce")?;
        if input.len() != output.len() {
            return Err(AllReduceError::InvalidArgument(format!(
                "input has {} elements, output {}",
                input.len(),
                output.len()
            )));
        }
        // The route first, from the shape and the agreed settings alone: a rank whose
        // communicator is Failed or Closed still reports a fallback size as `Fallback`, so
        // that `all_reduce_or_transport` takes the transport with its peers instead of
        // failing alone while they wait there.
        let bytes = std::mem::size_of_val(input);
        let algorithm = self.choose(T::DTYPE, bytes, true)?;
        self.lifecycle.check_operation("all_reduce")?;
        let res = self.resources("all_reduce")?;
        let memory = res.peers.backend();
        let raw: &[u8] = bytemuck::cast_slice(input);
        // Peers read the staging copy; a part that none of them reads (this rank's own part
        // of a two-stage reduction) is read from `input` itself instead, and not copied.
        let private =
            self.backend
                .private_part(algorithm, T::DTYPE, input.len(), self.rank, self.world);
        for range in staged_ranges(private.clone(), T::DTYPE, bytes)? {
            memory.write(&res.staging, range.start, &raw[range])?;
        }
        let own_input = private.map(|part| (input.as_ptr() as u64, part));
        let out = output.as_mut_ptr() as u64;
        self.launch_slot(
            "all_reduce",
            0,
            T::DTYPE,
            input.len(),
            algorithm,
            out,
            false,
            own_input,
        )?;
        Ok(algorithm)
    }

    /// [`all_reduce`](Self::all_reduce) that never leaves an input unserved: when the custom
    /// kernels cannot take it ([`AllReduceError::Fallback`]: a size that is not a multiple of
    /// 16 bytes, above `max_bytes`, empty, ...), the sum runs through the transport's numeric
    /// all-reduce ([`Communicator::all_reduce`]: `MPI_Allreduce` under MPI, a real reduction
    /// on the threads backend) on `comm` instead. Returns which path ran.
    ///
    /// Collective like both paths: every rank must pass the same element type and count, so
    /// that every rank takes the same path (the choice depends only on the size and on the
    /// settings every rank agreed on in [`new`](Self::new)). A rank that passes another size
    /// anyway is reported, not summed: by the transport's agreement check where it has one
    /// (threads), or by the custom launch's timeout naming the rank that did not join.
    ///
    /// ```
    /// use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend, HostRoute};
    /// use tpcomm_ipc::HostMemory;
    /// use tpcomm_transport::{Communicator, LocalGroup};
    ///
    /// let results = LocalGroup::new(2).run(|comm| -> tpcomm_allreduce::Result<Vec<HostRoute>> {
    ///     let mut ar = CustomAllReduce::new(HostBackend::new(), HostMemory::new(), &comm, Config::default())?;
    ///     let mut routes = Vec::new();
    ///     for len in [64, 3] {
    ///         // 64 f32 = 256 bytes: the custom kernels; 3 f32 = 12 bytes: not a multiple of 16.
    ///         let input = vec![comm.rank() as f32 + 1.0; len];
    ///         let mut out = vec![0f32; len];
    ///         routes.push(ar.all_reduce_or_transport(&comm, &input, &mut out)?);
    ///         assert_eq!(out, vec![3.0f32; len]);
    ///     }
    ///     Ok(routes)
    /// });
    /// for r in results {
    ///     let routes = r.unwrap().unwrap();
    ///     assert!(matches!(routes[0], HostRoute::Custom(_)));
    ///     assert!(matches!(routes[1], HostRoute::Transport(_)));
    /// }
    /// ```
    pub fn all_reduce_or_transport<T, C>(
        &mut self,
        comm: &C,
        input: &[T],
        output: &mut [T],
    ) -> Result<HostRoute>
    where
        T: Element + tpcomm_transport::reduce::Element,
        C: Communicator + ?Sized,
    {
        match self.all_reduce(input, output) {
            Ok(algorithm) => Ok(HostRoute::Custom(algorithm)),
            Err(AllReduceError::Fallback(reason)) => {
                let _span = tracing::debug_span!(
                    "allreduce_transport_fallback",
                    rank = self.rank,
                    reason = %reason
                )
                .entered();
                comm.all_reduce_bytes(
                    Some(bytemuck::cast_slice(input)),
                    bytemuck::cast_slice_mut(output),
                    <T as tpcomm_transport::reduce::Element>::DTYPE,
                    tpcomm_transport::ReduceOp::Sum,
                )?;
                Ok(HostRoute::Transport(reason))
            }
            Err(e) => Err(e),
        }
    }

    /// Collective: shares `buffer` (backend memory, e.g. from [`memory`](Self::memory)) with
    /// every peer so that all-reduces of it are zero-copy
    /// ([`all_reduce_registered`](Self::all_reduce_registered), or
    /// [`all_reduce_buffer`](Self::all_reduce_buffer) of [`RegisteredInput::buffer`]).
    ///
    /// Takes the buffer: the communicator keeps it alive until
    /// [`unregister`](Self::unregister) hands it back (or until close), so a registration
    /// never outlives its memory. Ranks may register buffers of different sizes; a launch
    /// reads at most the smallest, and a larger one is refused with
    /// [`AllReduceError::RegionTooSmall`].
    ///
    /// A refusal hands the buffer back inside the [`Refused`]: the wrong phase, a capture in
    /// progress, no free slot, or a failed exchange (rolled back on every rank). The one
    /// exception: peers' regions that cannot be written into the tables (a forged handle,
    /// [`AllReduceError::PeerMisaligned`]) leave the communicator Failed, and it keeps the
    /// buffer until it is dropped, since peers that accepted the exchange may map it.
    pub fn register_buffer<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        buffer: Buffer<B>,
    ) -> Result<RegisteredInput<B>, Refused<Buffer<B>>> {
        let exchanged = self.exchange_registration(comm, &buffer);
        let (slot, id) = match exchanged {
            Ok(exchanged) => exchanged,
            Err(e) => return Err(Refused::returning(e, buffer)),
        };
        self.slots[slot] = Some(SlotSource::Exchanged(id, 0));
        let buffer = Arc::new(buffer);
        self.buffers.insert(
            buffer.addr(),
            Registration {
                slot,
                exchange: id,
                buffer: buffer.clone(),
            },
        );
        if let Err(e) = self.write_tables() {
            return Err(Refused::keeping(self.lifecycle.fail("register_buffer", e)));
        }
        Ok(RegisteredInput {
            buffer,
            slot,
            owner: self.id,
        })
    }

    /// The checks of [`register_buffer`](Self::register_buffer) and its exchange: the free
    /// slot it takes and the exchange. Changes nothing when it fails.
    fn exchange_registration<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        buffer: &Buffer<B>,
    ) -> Result<(usize, ExchangeId)> {
        self.check_communicator(comm)?;
        self.lifecycle.check_operation("register_buffer")?;
        self.refuse_while_capturing("register_buffer")?;
        // No free slot is agreed like the rest: every rank refuses, nobody waits alone.
        let slot = self.free_slot().ok();
        let slots = slot.map(|s| vec![s]);
        self.agree_registration(comm, Registering::Buffer, slots.as_deref())?;
        let slot = slot.ok_or(AllReduceError::SlotsExhausted(self.slots.len()))?;
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: "register_buffer",
            phase: Phase::Closed,
        })?;
        let id = res.peers.exchange(
            comm,
            &[Region {
                addr: buffer.addr(),
                len: buffer.len(),
            }],
        )?;
        Ok((slot, id))
    }

    /// Collective: ends the registration of `input` on every rank (every rank passes its
    /// token of the same registration) and hands the buffer back. Every rank first drains
    /// its launches; the ranks agree on the slot (a disagreement is
    /// [`AllReduceError::Disagreement`] on every rank and changes nothing); every rank closes
    /// its mappings of the peers' buffers and zeroes the slot; a final barrier keeps any
    /// rank from freeing its buffer while a peer still maps it. A later resume no longer
    /// exports the buffer, and a new buffer at its address is not taken for it.
    ///
    /// Every refusal hands the token back inside the [`Refused`], so the registration can
    /// still be ended (after a disagreement, a wrong phase, a transport failure) or used.
    /// When a step after the agreement fails (closing the mappings, zeroing the slot, the
    /// final barrier) the communicator is Failed and keeps the buffer until it is dropped:
    /// a peer that missed the barrier may still map it.
    pub fn unregister<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        input: RegisteredInput<B>,
    ) -> Result<Buffer<B>, Refused<RegisteredInput<B>>> {
        let registration = match self.end_registration(comm, &input) {
            Ok(registration) => registration,
            Err(e) => return Err(Refused::returning(e, input)),
        };
        drop(registration);
        match Arc::try_unwrap(input.buffer) {
            Ok(buffer) => Ok(buffer),
            // Unreachable while tokens are not `Clone`: only the token and the registration
            // held the buffer. Kept (not freed) if that ever changes.
            Err(buffer) => {
                let e =
                    AllReduceError::InvalidArgument("the registered buffer is still shared".into());
                Err(Refused::returning(
                    e,
                    RegisteredInput {
                        buffer,
                        slot: input.slot,
                        owner: input.owner,
                    },
                ))
            }
        }
    }

    /// Every step of [`unregister`](Self::unregister) but handing the buffer back: the
    /// registration removed from the communicator, or why not. Past the agreement, a
    /// failure leaves the communicator Failed and the registration kept in `retired`.
    fn end_registration<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        input: &RegisteredInput<B>,
    ) -> Result<Registration<B>> {
        self.check_communicator(comm)?;
        self.lifecycle.check_operation("unregister")?;
        self.refuse_while_capturing("unregister")?;
        // This rank's refusals past the phase checks are agreed with the rest (a tagged
        // step): a token of another communicator or a failed drain fails every rank.
        let owned = self.check_owner("a registered input", input.owner);
        let drained = {
            let res = self.resources("unregister")?;
            self.backend.synchronize(res.peers.backend(), &res.signal)
        };
        let mine = (owned.is_ok() && drained.is_ok()).then_some(input.slot as u64);
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: "unregister",
            phase: Phase::Closed,
        })?;
        let slots: Vec<Option<u64>> = res.peers.agree(comm, tpcomm_ipc::Step::Unregister, &mine)?;
        owned?;
        if let Err(e) = drained {
            return Err(self.lifecycle.fail("unregister", e));
        }
        let slots: Vec<u64> = slots.iter().map(|s| s.unwrap_or(u64::MAX)).collect();
        if slots.iter().any(|&s| s != slots[0]) {
            return Err(AllReduceError::Disagreement {
                what: "the RankData slot to unregister (u64::MAX: a rank that refused)",
                values: slots,
            });
        }
        let addr = input.buffer.addr();
        let registration = match self.buffers.remove(&addr) {
            Some(r) if r.slot == input.slot => r,
            other => {
                if let Some(r) = other {
                    self.buffers.insert(addr, r);
                }
                return Err(AllReduceError::InvalidArgument(
                    "the input is not registered here".into(),
                ));
            }
        };
        // A slot a capture recorded is retired, never reused: a plan or graph naming it is
        // refused instead of reading whichever buffer took the slot next.
        self.slots[registration.slot] = if self.captured[registration.slot] {
            Some(SlotSource::Retired)
        } else {
            None
        };
        self.slot_limits[registration.slot] = (0, self.rank);
        let Some(res) = self.res.as_mut() else {
            self.retired.push(registration);
            return Err(AllReduceError::WrongState {
                call: "unregister",
                phase: Phase::Closed,
            });
        };
        let released = res.peers.release(registration.exchange);
        let zeroed = self.backend.write_table(
            res.peers.backend(),
            &res.rank_data,
            registration.slot * RANK_DATA_BYTES,
            &[0u8; RANK_DATA_BYTES],
        );
        // Every rank closed its mappings of this rank's buffer before it may be freed.
        let barrier = comm.barrier().map_err(AllReduceError::from);
        if let Err(e) = released
            .map_err(AllReduceError::from)
            .and(zeroed)
            .and(barrier)
        {
            self.retired.push(registration);
            return Err(self.lifecycle.fail("unregister", e));
        }
        Ok(registration)
    }

    /// Zero-copy all-reduce of the first `output.len()` elements of a registered input.
    pub fn all_reduce_registered<T: Element>(
        &mut self,
        input: &RegisteredInput<B>,
        output: &mut [T],
    ) -> Result<Algorithm> {
        self.lifecycle.check_operation("all_reduce_registered")?;
        self.check_host_addressable("all_reduce_registered")?;
        self.check_owner("a registered input", input.owner)?;
        let bytes = self.checked_bytes(
            T::DTYPE,
            output.len(),
            input.buffer.len(),
            std::mem::size_of_val(output),
        )?;
        let algorithm = self.choose(T::DTYPE, bytes, false)?;
        let out = output.as_mut_ptr() as u64;
        check_no_alias(algorithm, input.buffer.addr(), out, bytes)?;
        self.launch(
            "all_reduce_registered",
            input.slot,
            T::DTYPE,
            output.len(),
            algorithm,
            out,
        )?;
        Ok(algorithm)
    }

    /// Refuses `call` (which writes the tables) while the backend records a graph: nothing
    /// may be copied between host and device then, and refusing before any state changes
    /// keeps captured inputs pending.
    pub(crate) fn refuse_while_capturing(&self, call: &'static str) -> Result<()> {
        if self.backend.capturing()? {
            return Err(AllReduceError::InvalidArgument(format!(
                "{call} writes the tables and cannot run while the stream is being captured: \
                 call it after the capture ends"
            )));
        }
        Ok(())
    }

    fn check_host_addressable(&self, call: &'static str) -> Result<()> {
        if self.backend.host_addressable() {
            Ok(())
        } else {
            Err(AllReduceError::InvalidArgument(format!(
                "{call} takes host slices, but the {} backend reduces device buffers: use \
                 all_reduce_buffer",
                self.backend.name()
            )))
        }
    }

    /// The algorithm for `bytes` of `dtype`, or the reason the fallback must serve it;
    /// `staged`: a launch from the staging slot (slot 0).
    fn choose(&self, dtype: DType, bytes: usize, staged: bool) -> Result<Algorithm> {
        self.config
            .choose(&self.backend, dtype, bytes, self.world, staged)
    }

    /// The slot of a registered buffer at `addr` holding at least `bytes`, if any. Sound by
    /// address because the communicator keeps every registered buffer alive: no other live
    /// allocation can start there. Captured inputs are never looked up (their buffers may be
    /// freed and their addresses reused; vLLM does not reuse their slots either).
    fn slot_of(&self, addr: u64, bytes: usize) -> Option<usize> {
        self.buffers
            .get(&addr)
            .filter(|r| bytes <= r.buffer.len())
            .map(|r| r.slot)
    }

    /// The slot of a captured input: a registered buffer's own slot, or else the next free
    /// slot, pending until [`register_graph_buffers`](Self::register_graph_buffers). One
    /// slot per captured call, in capture order, never shared with an earlier call of the
    /// same input: ranks may capture different inputs in different orders, and slot `k` of
    /// every rank must name every rank's input of its `k`-th call.
    fn graph_slot(&mut self, addr: u64, bytes: usize) -> Result<usize> {
        if let Some(slot) = self.slot_of(addr, bytes) {
            self.captured[slot] = true;
            return Ok(slot);
        }
        self.pending_slot(Region { addr, len: bytes })
    }

    /// The next free slot, pending until `register_graph_buffers` exports `region` (this
    /// rank's entry of the slot) with every rank's region of the same call.
    fn pending_slot(&mut self, region: Region) -> Result<usize> {
        let slot = self.free_slot()?;
        self.captured[slot] = true;
        self.slots[slot] = Some(SlotSource::Pending);
        self.graph_owners[slot] = self.capture_owner.clone();
        self.pending.push((slot, region));
        Ok(slot)
    }

    /// Whether the input captured in `slot` may be gone: what captured it was dropped.
    fn input_abandoned(&self, slot: usize) -> bool {
        self.graph_owners
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|owner| owner.strong_count() == 0)
    }

    /// The region this rank shares for the input captured in `slot`: `region` itself, or
    /// the same length of this rank's staging buffer once the input is abandoned (nothing
    /// replays its call; peers must still find a region of that length).
    fn shared_region(&mut self, slot: usize, region: Region) -> Result<Region> {
        if !self.input_abandoned(slot) {
            return Ok(region);
        }
        self.graph_owners[slot] = None;
        let staging = self.resources("register_graph_buffers")?.staging.addr();
        tracing::debug!(
            rank = self.rank,
            slot,
            "a captured input's owner was dropped: sharing staging bytes in its place"
        );
        Ok(Region {
            addr: staging,
            len: region.len,
        })
    }

    /// Before a reopen: every exchanged input whose owner was dropped is replaced by staging
    /// bytes of the same length, so that the reopen exports no memory that may be gone.
    fn replace_abandoned_inputs(&mut self) -> Result<()> {
        let abandoned: Vec<(usize, ExchangeId, usize)> = (0..self.slots.len())
            .filter(|&slot| self.input_abandoned(slot))
            .filter_map(|slot| match self.slots[slot] {
                Some(SlotSource::Exchanged(id, index)) => Some((slot, id, index)),
                _ => None,
            })
            .collect();
        for (slot, id, index) in abandoned {
            let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
                call: "reinit_after_resume",
                phase: Phase::Closed,
            })?;
            let len = res.peers.region_len(id, self.rank, index)?;
            let staging = Region {
                addr: res.staging.addr(),
                len,
            };
            res.peers.replace_region(id, index, staging)?;
            self.graph_owners[slot] = None;
        }
        Ok(())
    }

    /// Gives back the slot [`pending_slot`](Self::pending_slot) just took for a call that
    /// was then refused: a refused call takes no slot, so that every rank's `k`-th
    /// captured call still names slot `k`. (A free slot was never captured: see
    /// `end_registration`.)
    fn give_back_pending(&mut self, slot: usize) {
        if self.pending.last().is_some_and(|(s, _)| *s == slot) {
            self.pending.pop();
            self.slots[slot] = None;
            self.captured[slot] = false;
            self.graph_owners[slot] = None;
        }
    }

    /// The all-reduce of a caller's device memory that is not a buffer of the backend's
    /// peer memory (cudarc views on CUDA): `input_addr` holds `count` elements of `dtype`
    /// (the caller's view says so), `out` is the caller's output, already checked to hold
    /// them and to be aligned.
    ///
    /// - a registered buffer at `input_addr`: zero-copy through its slot;
    /// - while the backend records a graph: the call takes the next free slot (one per
    ///   call, in lockstep with every rank). When `shareable()` says this rank's input can
    ///   be exported to peers, the slot names the input (zero-copy); otherwise the
    ///   staging copy (`stage`) is recorded into the graph and the slot names this rank's
    ///   staging buffer. Either way every rank's `k`-th call reads slot `k`, and
    ///   `register_graph_buffers` fills it from whatever each rank exported;
    /// - eager: `stage` copies the input into the staging buffer (stream-ordered), slot 0.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn all_reduce_external(
        &mut self,
        call: &'static str,
        input_addr: u64,
        shareable: impl FnOnce() -> Result<bool>,
        stage: impl FnOnce(&B, &Buffer<B>, usize) -> Result<()>,
        out: u64,
        dtype: DType,
        count: usize,
    ) -> Result<Algorithm> {
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| AllReduceError::InvalidArgument(format!("{count} elements overflow")))?;
        let recording = self.backend.capturing()?;
        let registered = self.slot_of(input_addr, bytes);
        // The route first, from the call's shape alone (every rank of a same-shaped call
        // gets the same answer): a rank whose communicator failed, or whose output the
        // kernels cannot write, still takes the fallback its peers take, instead of failing
        // alone while they wait in it. Slot 0 (the staging slot) exactly when neither
        // registered nor recording.
        let algorithm = self.choose(dtype, bytes, registered.is_none() && !recording)?;
        self.lifecycle.check_operation(call)?;
        if !out.is_multiple_of(PEER_ALIGN as u64) {
            return Err(AllReduceError::Misaligned {
                buffer: "output",
                addr: out,
                align: PEER_ALIGN,
            });
        }
        // A registered slot is marked captured by the launch that records it.
        let (slot, staged) = match registered {
            Some(slot) => (slot, false),
            None if recording => {
                // A one-stage output overlapping its input (an in-place call) is served
                // from the staging copy: peers read the input until the end barrier.
                let in_place = check_no_alias(algorithm, input_addr, out, bytes).is_err();
                if !in_place && shareable()? {
                    (
                        self.pending_slot(Region {
                            addr: input_addr,
                            len: bytes,
                        })?,
                        false,
                    )
                } else {
                    let staging = self.resources(call)?.staging.addr();
                    (
                        self.pending_slot(Region {
                            addr: staging,
                            len: bytes,
                        })?,
                        true,
                    )
                }
            }
            None => (0, true),
        };
        if staged {
            let res = self.resources(call)?;
            if let Err(e) = stage(&self.backend, &res.staging, bytes) {
                return Err(self.lifecycle.fail(call, e));
            }
        } else {
            // Passes for a slot taken above (an overlapping call is staged).
            check_no_alias(algorithm, input_addr, out, bytes)?;
        }
        tracing::trace!(
            rank = self.rank,
            slot,
            staged,
            recording,
            "all-reduce of caller memory"
        );
        let launched = self.launch_slot(call, slot, dtype, count, algorithm, out, recording, None);
        if launched.is_err() && registered.is_none() && recording {
            self.give_back_pending(slot);
        }
        launched.map(|()| algorithm)
    }

    /// All-reduce of the first `count` elements of `input` into `output`, both buffers of
    /// this backend's memory (device buffers for CUDA): the entry point of device backends,
    /// and of host programs that keep their tensors in shared memory.
    ///
    /// - `input` registered ([`register_buffer`](Self::register_buffer)): zero-copy through
    ///   its RankData slot.
    /// - While the backend is capturing a device graph ([`Backend::capturing`]): the input
    ///   takes the next free RankData slot and the launch is recorded; call
    ///   [`register_graph_buffers`](Self::register_graph_buffers) (collective) after the
    ///   capture, before the first replay. Nothing is copied between host and device.
    /// - Otherwise (eager, also for an input captured before): `input` is copied into the
    ///   staging buffer first; on the host backend, all but this rank's own part of a
    ///   two-stage reduction ([`Backend::private_part`]), which the launch reads from `input`.
    ///
    /// Returns the algorithm, or [`AllReduceError::Fallback`] with the reason when the
    /// custom path cannot serve it (nothing ran; the communicator stays usable).
    pub fn all_reduce_buffer(
        &mut self,
        input: &Buffer<B>,
        output: &Buffer<B>,
        dtype: DType,
        count: usize,
    ) -> Result<Algorithm> {
        self.lifecycle.check_operation("all_reduce_buffer")?;
        let bytes = self.checked_bytes(dtype, count, input.len(), output.len())?;
        let recording = self.backend.capturing()?;
        let registered = self.slot_of(input.addr(), bytes);
        // Slot 0 (the staging slot) exactly when neither registered nor recording.
        let algorithm = self.choose(dtype, bytes, registered.is_none() && !recording)?;
        if registered.is_some() || recording {
            // Before a slot is taken: a refused call takes none.
            check_no_alias(algorithm, input.addr(), output.addr(), bytes)?;
        }
        let slot = match registered {
            Some(slot) => Some(slot),
            None if recording => Some(self.pending_slot(Region {
                addr: input.addr(),
                len: bytes,
            })?),
            None => None,
        };
        match slot {
            Some(slot) => {
                let launched = self.launch_slot(
                    "all_reduce_buffer",
                    slot,
                    dtype,
                    count,
                    algorithm,
                    output.addr(),
                    recording,
                    None,
                );
                if launched.is_err() && registered.is_none() {
                    self.give_back_pending(slot);
                }
                launched?;
            }
            None => {
                // As `all_reduce`: peers read the staging copy, but not this rank's own
                // part of a two-stage reduction, which the launch reads from `input`.
                let private = self
                    .backend
                    .private_part(algorithm, dtype, count, self.rank, self.world);
                let ranges = staged_ranges(private.clone(), dtype, bytes)?;
                let res = self.resources("all_reduce_buffer")?;
                for range in ranges {
                    if let Err(e) =
                        self.backend
                            .stage(res.peers.backend(), input, &res.staging, range)
                    {
                        return Err(self.lifecycle.fail("all_reduce_buffer", e));
                    }
                }
                self.launch_slot(
                    "all_reduce_buffer",
                    0,
                    dtype,
                    count,
                    algorithm,
                    output.addr(),
                    false,
                    private.map(|part| (input.addr(), part)),
                )?;
            }
        }
        Ok(algorithm)
    }

    /// Waits for every launch issued so far (device backends run them asynchronously) and
    /// reports a barrier timeout a launch recorded; a failure leaves the communicator
    /// Failed.
    pub fn synchronize(&mut self) -> Result<()> {
        self.lifecycle.check_operation("synchronize")?;
        // A capturing stream refuses to synchronize: that is the caller's mistake, not a
        // failure of the communicator.
        self.refuse_while_capturing("synchronize")?;
        let res = self.resources("synchronize")?;
        match self.backend.synchronize(res.peers.backend(), &res.signal) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.lifecycle.fail("synchronize", e)),
        }
    }

    /// Captured inputs still waiting for
    /// [`register_graph_buffers`](Self::register_graph_buffers).
    pub fn pending_graph_buffers(&self) -> usize {
        self.pending.len()
    }

    /// Fails unless a captured graph may run now: Active, and every captured input
    /// registered.
    pub fn check_replay(&self) -> Result<()> {
        self.lifecycle.check_operation("replay")?;
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(AllReduceError::UnregisteredGraphBuffers)
        }
    }

    /// Records the all-reduces `f` issues without running them. Inputs not registered yet
    /// take the next free RankData slots; call
    /// [`register_graph_buffers`](Self::register_graph_buffers) (collective) before the
    /// first replay.
    ///
    /// When `f` fails (or panics), the capture leaves nothing behind: the slots its calls
    /// took are free again and none of its inputs is pending (so dropping them does not
    /// break the next [`register_graph_buffers`](Self::register_graph_buffers)); an error
    /// is returned.
    pub fn capture<'b, F>(&mut self, f: F) -> Result<CapturedPlan<'b, B>>
    where
        F: FnOnce(&mut Capture<'_, 'b, B>) -> Result<()>,
    {
        self.lifecycle.check_operation("capture")?;
        let owner = self.id;
        let alive = CaptureOwner::default();
        let mut cap = Capture {
            ar: CaptureGuard::new(self, &alive),
            launches: Vec::new(),
        };
        f(&mut cap)?;
        let Capture { ar, launches } = cap;
        ar.keep();
        Ok(CapturedPlan {
            launches,
            owner,
            _alive: alive,
        })
    }

    /// Collective: exports every input captured since the last call, all-gathers the
    /// handles, opens them and fills their RankData slots. Every rank must have captured
    /// the same number of calls, and the `k`-th call of every rank must reduce the same
    /// number of bytes.
    ///
    /// A failed exchange (rolled back on every rank) leaves the captured inputs pending, so
    /// replays stay refused and the call can be repeated. Calls captured with different
    /// sizes ([`AllReduceError::CaptureMismatch`], seen by every rank) or a failure to
    /// write the tables leave the communicator Failed: those plans can never replay.
    pub fn register_graph_buffers<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<usize> {
        self.check_communicator(comm)?;
        self.lifecycle.check_operation("register_graph_buffers")?;
        self.refuse_while_capturing("register_graph_buffers")?;
        // Kept in `pending`: a registration that fails is repeated with the same regions.
        for i in 0..self.pending.len() {
            let (slot, region) = self.pending[i];
            self.pending[i].1 = self.shared_region(slot, region)?;
        }
        let regions: Vec<Region> = self.pending.iter().map(|(_, r)| *r).collect();
        let slots: Vec<usize> = self.pending.iter().map(|(slot, _)| *slot).collect();
        self.agree_registration(comm, Registering::Graph, Some(&slots))?;
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: "register_graph_buffers",
            phase: Phase::Closed,
        })?;
        let id = res.peers.exchange(comm, &regions)?;
        let agreed = agree_captured_sizes(&res.peers, id, self.rank, self.world, &regions);
        if let Err(e) = agreed {
            return Err(self.lifecycle.fail("register_graph_buffers", e));
        }
        let pending = std::mem::take(&mut self.pending);
        for (index, (slot, _)) in pending.iter().enumerate() {
            self.slots[*slot] = Some(SlotSource::Exchanged(id, index));
        }
        if let Err(e) = self.write_tables() {
            return Err(self.lifecycle.fail("register_graph_buffers", e));
        }
        Ok(pending.len())
    }

    /// Collective: drain, tagged barrier, close every imported mapping (Signal blocks,
    /// staging, temp, registered and graph buffers), tagged barrier. A no-op while
    /// Suspended; a failure leaves the communicator Failed.
    ///
    /// The barriers are tagged steps of the registry ([`PeerMappings::agree`]): a peer that
    /// is in another step (it failed an earlier one, or runs another collective) is reported
    /// as [`IpcError::StepMismatch`](tpcomm_ipc::IpcError::StepMismatch) naming it, never
    /// paired with this step silently.
    pub fn prepare_for_suspend<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.check_communicator(comm)?;
        self.refuse_while_capturing("prepare_for_suspend")?;
        if self.lifecycle.begin(Transition::Suspend)? == Step::NoOp {
            return Ok(());
        }
        let _span = tracing::debug_span!("prepare_for_suspend", rank = self.rank).entered();
        let outcome = self.suspend_steps(comm);
        self.lifecycle.finish(Transition::Suspend, outcome)
    }

    fn suspend_steps<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: "prepare_for_suspend",
            phase: Phase::Closed,
        })?;
        // Launches still running read peer mappings: every rank drains its own before
        // anybody closes. A failed drain or close still joins both steps (peers are not left
        // waiting); only this rank fails.
        let drained = self.backend.synchronize(res.peers.backend(), &res.signal);
        res.peers
            .agree(comm, tpcomm_ipc::Step::SuspendDrained, &())?;
        let closed = res.peers.close_all();
        res.peers
            .agree(comm, tpcomm_ipc::Step::SuspendClosed, &())?;
        tracing::debug!(closed = ?closed.as_ref().ok(), "mappings closed for suspend");
        drained?;
        closed?;
        // Every peer has let go of this rank's buffers (the step above): where the backend
        // can, their memory goes now, and comes back fresh at the same addresses on resume.
        let memory = res.peers.backend();
        if memory.releases_backing() {
            for buffer in [&mut res.signal, &mut res.staging, &mut res.temp] {
                let freed = memory.release_backing(buffer);
                self.released += *freed.as_ref().unwrap_or(&0);
                freed?;
            }
            tracing::debug!(bytes = self.released, "buffer memory released for suspend");
        }
        Ok(())
    }

    /// Maps fresh memory back under the buffers the suspend released (a no-op when none
    /// was); the Signal block's is zeroed like every fresh allocation.
    fn restore_buffers(&mut self) -> Result<()> {
        if self.released == 0 {
            return Ok(());
        }
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: "reinit_after_resume",
            phase: Phase::Closed,
        })?;
        let memory = res.peers.backend();
        for buffer in [&mut res.signal, &mut res.staging, &mut res.temp] {
            memory.restore_backing(buffer)?;
        }
        self.released = 0;
        Ok(())
    }

    /// Collective: fresh handles, exchange, reopen; rewrite every RankSignals and RankData
    /// entry in place; reset and re-agree the flag counters; prove the new mappings (each
    /// rank writes a fresh nonce into its Signal block and reads every peer's through the new
    /// mapping); tagged barrier. A no-op while Active; a failure leaves the communicator
    /// Failed. Every exchange is a tagged step, as in
    /// [`prepare_for_suspend`](Self::prepare_for_suspend).
    pub fn reinit_after_resume<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.check_communicator(comm)?;
        self.refuse_while_capturing("reinit_after_resume")?;
        if self.lifecycle.begin(Transition::Resume)? == Step::NoOp {
            return Ok(());
        }
        let _span = tracing::debug_span!("reinit_after_resume", rank = self.rank).entered();
        let outcome = self.resume_steps(comm);
        self.lifecycle.finish(Transition::Resume, outcome)
    }

    fn resume_steps<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        // Local bookkeeping; should it fail, the reopen below still runs (every rank joins
        // it) and reports a region that cannot be exported, agreed.
        if let Err(e) = self.replace_abandoned_inputs() {
            tracing::warn!(rank = self.rank, error = %e, "replacing abandoned captured inputs failed");
        }
        // Likewise: a buffer left without memory cannot be exported, which the reopen
        // reports on every rank.
        if let Err(e) = self.restore_buffers() {
            tracing::warn!(rank = self.rank, error = %e, "restoring the released buffers failed");
        }
        {
            let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
                call: "reinit_after_resume",
                phase: Phase::Closed,
            })?;
            // Failures of the reopen are agreed by the registry: every rank returns here.
            res.peers.reopen_all(comm)?;
        }
        // A local failure from here on still joins both remaining steps, announcing no
        // nonce, then reports itself; peers skip its proof (no voting: they stay Active).
        let reset = self.write_tables().and_then(|()| {
            let res = self.resources("reinit_after_resume")?;
            self.backend.reset_signal(res.peers.backend(), &res.signal)
        });
        // Everybody reset its flags and wrote its nonce before anybody reads or launches.
        let (prepared, proof) = self.nonce_test(
            comm,
            "reinit_after_resume",
            tpcomm_ipc::Step::ResumeNonces,
            reset,
        )?;
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call: "reinit_after_resume",
            phase: Phase::Closed,
        })?;
        // A failed proof still joins the last step: peers are not left waiting.
        res.peers.agree(comm, tpcomm_ipc::Step::ResumeProved, &())?;
        prepared?;
        proof
    }

    /// The one-time P2P data test of creation ([`Backend::prove_at_creation`]): after
    /// `prior` (this rank's table writes), each rank writes a fresh nonce into its Signal
    /// block, the nonces are all-gathered (tagged [`Step::CreateNonces`](tpcomm_ipc::Step)),
    /// and each rank reads every peer's through its mapping. Returns this rank's outcome (for
    /// the `Ready` step, which fails every rank together); `Err` only when the exchange
    /// itself failed.
    fn prove_at_creation<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        prior: Result<()>,
    ) -> Result<Result<()>> {
        let (prepared, proof) =
            self.nonce_test(comm, "new", tpcomm_ipc::Step::CreateNonces, prior)?;
        tracing::debug!(
            rank = self.rank,
            passed = proof.is_ok(),
            "peer-to-peer data test of the new mappings"
        );
        Ok(prepared.and(proof))
    }

    /// The nonce test of fresh mappings, shared by creation and resume: when `prior` (this
    /// rank's own preparation) succeeded, writes a fresh nonce into this rank's Signal block;
    /// every rank all-gathers its nonce, or none after a local failure, under `step`; a rank
    /// that wrote one then reads every announced peer nonce through that peer's mapping.
    /// Returns (this rank's preparation, the proof); `Err` only when the exchange itself
    /// failed. A rank whose preparation failed still joins the exchange, so nobody waits.
    fn nonce_test<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        call: &'static str,
        step: tpcomm_ipc::Step,
        prior: Result<()>,
    ) -> Result<(Result<()>, Result<()>)> {
        let nonce = prior.and_then(|()| {
            let res = self.resources(call)?;
            let nonce = fresh_nonce(self.rank);
            self.backend.write_table(
                res.peers.backend(),
                &res.signal,
                self.backend.nonce_offset(),
                &nonce.to_le_bytes(),
            )?;
            Ok(nonce)
        });
        let res = self.res.as_mut().ok_or(AllReduceError::WrongState {
            call,
            phase: Phase::Closed,
        })?;
        let nonces: Vec<Option<u64>> =
            res.peers.agree(comm, step, &nonce.as_ref().ok().copied())?;
        let proof = match &nonce {
            Ok(_) => self.prove(call, &nonces),
            Err(_) => Ok(()),
        };
        Ok((nonce.map(drop), proof))
    }

    /// Reads every peer's announced nonce through the new mapping of its Signal block.
    fn prove(&self, call: &'static str, nonces: &[Option<u64>]) -> Result<()> {
        let res = self.resources(call)?;
        let memory = res.peers.backend();
        for (peer, expected) in nonces.iter().enumerate() {
            let Some(expected) = *expected else { continue };
            if peer == self.rank {
                continue;
            }
            let mapping = res.peers.peer(res.base, peer, SIGNAL)?;
            let mut raw = [0u8; 8];
            memory.read(mapping, self.backend.nonce_offset(), &mut raw)?;
            let found = u64::from_le_bytes(raw);
            if found != expected {
                return Err(AllReduceError::NonceMismatch {
                    peer,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }

    /// Records a failure from outside the driver (a wrapper's own collective step): the
    /// communicator is Failed from now on. An error that already is this communicator's
    /// failure is returned as it is.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn fail(&mut self, during: &'static str, cause: AllReduceError) -> AllReduceError {
        if self.lifecycle.phase() == Phase::Failed && matches!(cause, AllReduceError::Failed { .. })
        {
            return cause;
        }
        self.lifecycle.fail(during, cause)
    }

    /// Releases everything (mappings and local buffers) from any phase; later calls fail
    /// with a Closed error. **Not collective**: prefer [`close_with`](Self::close_with)
    /// whenever the communicator is at hand. Returns the first error closing met, after
    /// releasing everything anyway.
    ///
    /// What a peer may see after a non-collective close (or a drop) of this rank: every
    /// launch this rank issued has finished (it drains them first), and its last barrier
    /// proves that every peer has read this rank's input. A peer may still be copying its
    /// share of a two-stage result from this rank's temp buffer (that launch has no end
    /// barrier): on the host backend its mapping keeps those pages and their values (the
    /// buffers peers map are retired, [`PeerMemory::retire`], so no later buffer of this
    /// process is carved over them); on CUDA this is the case of the second item below. A peer that starts a launch this rank
    /// never joins writes into this rank's Signal block and reads its staging or temp buffer
    /// through its own mapping:
    /// - host backend: the peer's mapping keeps the memfd pages alive until the peer unmaps
    ///   them, so it reads stale but valid memory and its barrier times out naming this rank
    ///   ([`AllReduceError::Timeout`]);
    /// - CUDA: the memory is freed with `cuMemFree` while the peer still has it mapped,
    ///   which CUDA documents as undefined behaviour: the peer may read garbage, fault, or
    ///   time out. Close collectively.
    pub fn close(&mut self) -> Result<()> {
        self.release(false)
    }

    /// Drains, closes the mappings and frees this rank's buffers; `agreed`: every rank
    /// passed the Close step, so no peer reads or writes them any more. Otherwise the
    /// buffers peers map (Signal, staging, temp) are retired ([`PeerMemory::retire`]): a
    /// late peer finds what was there, not another buffer of this process.
    fn release(&mut self, agreed: bool) -> Result<()> {
        self.lifecycle.close();
        let Some(mut res) = self.res.take() else {
            return Ok(());
        };
        // Launches still in flight read these buffers: wait for them (bounded by the launch
        // timeout) before anything is freed. A suspend that released them drained first.
        if self.released == 0 {
            if let Err(e) = self.backend.synchronize(res.peers.backend(), &res.signal) {
                tracing::warn!(error = %e, "draining launches before close failed");
            }
        }
        let closed = res.peers.close_all().map(drop);
        let Resources {
            peers,
            signal,
            staging,
            temp,
            ..
        } = res;
        for buffer in [signal, staging, temp] {
            if agreed {
                drop(buffer);
            } else {
                peers.backend().retire(buffer);
            }
        }
        Ok(closed?)
    }

    /// Collective close, from any phase: drains this rank's launches, then a tagged step
    /// ([`Step::Close`](tpcomm_ipc::Step::Close)) that every rank joins after draining, and
    /// only then closes the mappings and frees the Signal, staging, temp buffers and tables:
    /// no peer can still be reading them. Every rank must call it (a peer that never does
    /// makes this rank's step fail at the transport timeout; a peer in another step is named
    /// in [`StepMismatch`](tpcomm_ipc::IpcError::StepMismatch)). Everything is released
    /// whatever fails; the first error is returned. A no-op when already Closed.
    pub fn close_with<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.check_communicator(comm)?;
        let Some(res) = self.res.as_mut() else {
            self.lifecycle.close();
            return Ok(());
        };
        let _span = tracing::debug_span!("allreduce_close", rank = self.rank).entered();
        // A suspend that released the buffers drained every launch before.
        let drained = if self.released == 0 {
            self.backend.synchronize(res.peers.backend(), &res.signal)
        } else {
            Ok(())
        };
        let agreed = res.peers.agree(comm, tpcomm_ipc::Step::Close, &());
        let closed = self.release(drained.is_ok() && agreed.is_ok());
        drained?;
        agreed?;
        closed
    }
}

impl<B: Backend> Drop for CustomAllReduce<B> {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "closing the custom all-reduce on drop failed");
        }
    }
}

/// Checks that the `k`-th region of exchange `id` (the `k`-th captured call) has the same
/// length on every rank; every rank sees every length, so every rank returns the same
/// verdict.
fn agree_captured_sizes<M: PeerMemory>(
    peers: &PeerMappings<M>,
    id: ExchangeId,
    rank: usize,
    world: usize,
    regions: &[Region],
) -> Result<()> {
    for (call, region) in regions.iter().enumerate() {
        for peer in 0..world {
            let peer_bytes = peers.region_len(id, peer, call)?;
            if peer_bytes != region.len {
                return Err(AllReduceError::CaptureMismatch {
                    call,
                    rank,
                    bytes: region.len,
                    peer,
                    peer_bytes,
                });
            }
        }
    }
    Ok(())
}

/// A nonce unlikely to repeat: time, rank and a per-process counter mixed.
fn fresh_nonce(rank: usize) -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let z = t
        ^ ((rank as u64) << 56)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    crate::backend::mix64(z) | 1
}

#[cfg(test)]
mod engine_capture;

#[cfg(test)]
mod agreement_tests {
    use super::*;

    #[test]
    fn a_peer_sending_more_settings_than_any_build_is_refused_before_they_are_compared() {
        let honest: Agreement = (None, vec![("max_bytes".into(), "8388608".into())]);
        let flood: Agreement = (
            None,
            (0..20_000)
                .map(|i| (format!("f{i}"), String::new()))
                .collect(),
        );
        match check_agreement(&[honest, flood]) {
            Err(AllReduceError::PeerSetup { rank: 1, reason }) => {
                assert!(reason.contains("20000 settings"), "{reason}")
            }
            other => panic!("expected PeerSetup naming rank 1, got {other:?}"),
        }
    }
}
