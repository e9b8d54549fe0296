//! Capture and replay: a [`CapturedPlan`] replays through the tables; each captured call of
//! an unregistered input takes the next RankData slot, pending until `register_graph_buffers`;
//! a capture that does not complete gives its slots back ([`CaptureGuard`]).

use std::sync::{Arc, Weak};

use tpcomm_ipc::{ExchangeId, MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm_transport::Communicator;

use super::launch::check_no_alias;
use super::registration::Registering;
use super::{open_mut, CustomAllReduce, SlotSource};
use crate::backend::{Backend, Buffer};
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{AllReduceError, Result};

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
                false,
                None,
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

impl<B: Backend> CustomAllReduce<B> {
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
    pub(super) fn pending_slot(&mut self, region: Region) -> Result<usize> {
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
    pub(super) fn replace_abandoned_inputs(&mut self) -> Result<()> {
        let abandoned: Vec<(usize, ExchangeId, usize)> = (0..self.slots.len())
            .filter(|&slot| self.input_abandoned(slot))
            .filter_map(|slot| match self.slots[slot] {
                Some(SlotSource::Exchanged(id, index)) => Some((slot, id, index)),
                _ => None,
            })
            .collect();
        for (slot, id, index) in abandoned {
            let res = open_mut(&mut self.res, "reinit_after_resume")?;
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
    pub(super) fn give_back_pending(&mut self, slot: usize) {
        if self.pending.last().is_some_and(|(s, _)| *s == slot) {
            self.pending.pop();
            self.slots[slot] = None;
            self.captured[slot] = false;
            self.graph_owners[slot] = None;
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
        let res = open_mut(&mut self.res, "register_graph_buffers")?;
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
