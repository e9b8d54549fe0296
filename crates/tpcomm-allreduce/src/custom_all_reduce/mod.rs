//! [`CustomAllReduce`], the front door of the custom all-reduce: the type, its state, the
//! accessors every mechanism shares and the lifecycle's failure path. Each mechanism has a
//! file: `config` (the settings and their agreement), `setup` (creation), `tables` (the
//! stable tables), `nonce` (the proof of fresh mappings), `launch` (the launch every entry
//! point ends in), `eager`, `registration` and `caller_memory` (the entry points), `chunked`
//! (inputs one launch cannot take, in several), `capture`
//! (plans, captured inputs, replay) and `device_graph` (CUDA graphs), `suspend`
//! (suspend/resume), `close`.

mod caller_memory;
mod capture;
mod chunked;
mod close;
mod config;
#[cfg(feature = "cuda")]
mod device_graph;
mod eager;
mod launch;
mod nonce;
mod registration;
mod setup;
mod suspend;
mod tables;

#[cfg(test)]
mod engine_capture;

use std::collections::HashMap;
use std::sync::Weak;

use tpcomm_ipc::{ExchangeId, PeerMappings, Region};
use tpcomm_transport::Communicator;

#[cfg(feature = "nccl")]
pub(crate) use caller_memory::output_holds;
pub use capture::{Capture, CapturedPlan};
pub use config::Config;
#[cfg(feature = "cuda")]
pub use device_graph::{CaptureMark, DeviceGraph};
pub use eager::HostRoute;
pub use registration::RegisteredInput;
use registration::Registration;

use crate::backend::{Backend, Buffer};
use crate::dispatch::DispatchTable;
use crate::error::{AllReduceError, Result};
use crate::lifecycle::{Lifecycle, Phase};

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

/// The resources of a communicator that is not closed, or the Closed refusal of `call`. A
/// function of the field alone, so that the caller keeps the use of the other fields.
fn open<'a, B: Backend>(
    res: &'a Option<Resources<B>>,
    call: &'static str,
) -> Result<&'a Resources<B>> {
    res.as_ref().ok_or(AllReduceError::WrongState {
        call,
        phase: Phase::Closed,
    })
}

/// [`open`], for a change.
fn open_mut<'a, B: Backend>(
    res: &'a mut Option<Resources<B>>,
    call: &'static str,
) -> Result<&'a mut Resources<B>> {
    res.as_mut().ok_or(AllReduceError::WrongState {
        call,
        phase: Phase::Closed,
    })
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
    /// The dispatch table in use, for this world size only (agreed at creation).
    dispatch: DispatchTable,
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
    /// Per slot taken by a captured input, what made the capture
    /// ([`CaptureOwner`](capture::CaptureOwner)) while the input may be shared: once it is
    /// gone, staging bytes are shared in its place. `None` for registered buffers (the
    /// communicator keeps them alive), for inputs of an engine's own capture (its graph's
    /// lifetime is unknown here: the input must live as long as the slot, `docs/gpu.md`)
    /// and once replaced.
    graph_owners: Vec<Option<Weak<()>>>,
    /// The owner of the capture running now ([`CaptureGuard`](capture::CaptureGuard)), if any.
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
    /// Fails unless an operation may run now (Active).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check_operation(&self, call: &'static str) -> Result<()> {
        self.lifecycle.check_operation(call)
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

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The settings it was created with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The dispatch table this communicator chooses algorithms with: its rows for this
    /// world size, from [`Config::dispatch`], the file named by
    /// [`DISPATCH_TABLE_ENV`](crate::dispatch::DISPATCH_TABLE_ENV) or the backend's
    /// built-in table ([`DispatchTable::origin`] says which). Every rank uses the same
    /// (agreed at creation).
    pub fn dispatch_table(&self) -> &DispatchTable {
        &self.dispatch
    }

    /// The peer-memory backend (to allocate inputs that can be registered or captured).
    pub fn memory(&self) -> Result<&B::Memory> {
        Ok(self.resources("memory")?.peers.backend())
    }

    /// The registry of peer mappings (for counters and tests).
    pub fn peer_mappings(&self) -> Result<&PeerMappings<B::Memory>> {
        Ok(&self.resources("peer_mappings")?.peers)
    }

    fn resources(&self, call: &'static str) -> Result<&Resources<B>> {
        open(&self.res, call)
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

    /// Records a failure from outside this type (a wrapper's own collective step): the
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
}
