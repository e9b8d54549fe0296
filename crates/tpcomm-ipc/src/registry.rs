//! [`PeerMappings`]: exchange handles, open every peer's once, close all, reopen all.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tpcomm_transport::Communicator;

use crate::error::{IpcError, Result};
use crate::memory::PeerMemory;
use crate::step::{tagged_all_gather, tagged_all_gather_as, Step, StepTag};

/// A handle as it travels: tagged with the group that exchanged it and its exporter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope<H> {
    /// The group id agreed by the registry's ranks.
    pub group: u64,
    /// Rank (in that group) of the exporter.
    pub rank: u32,
    /// The backend handle.
    pub handle: H,
}

/// Identifies one exchange of a [`PeerMappings`] (the regions shared in one call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExchangeId(usize);

/// One address range this rank shares, as passed to [`PeerMappings::exchange`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Start address (inside one exportable allocation of the backend).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

/// Open/close counters, for tests and tracing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Mappings open now.
    pub open: usize,
    /// Mappings opened since creation.
    pub opens: u64,
    /// Mappings closed since creation.
    pub closes: u64,
}

#[derive(Debug)]
struct Exchange {
    /// This rank's regions, re-exported on reopen.
    local: Vec<Region>,
    /// `slots[rank][index]`: the mapping slab index for each peer region (`None` for own).
    slots: Vec<Vec<Option<usize>>>,
}

/// The registry of every peer mapping of one group of ranks.
///
/// - [`exchange`](Self::exchange) (collective): every rank exports handles for its regions,
///   all-gathers them through `tpcomm-objects` over the caller's communicator and opens every
///   peer's; a memo keyed by handle guarantees a handle is opened once per process. Opening
///   failures are agreed: every rank fails together and the exchange is rolled back.
/// - [`close_all`](Self::close_all) closes every imported mapping and leaves local memory
///   alone; [`reopen_all`](Self::reopen_all) (collective) exports fresh handles of the same
///   regions, exchanges and reopens. Addresses may change: [`peer`](Self::peer) hands out
///   borrows tied to `&self`, so no mapping can be reached after it was closed.
/// - Every collective step carries a [`StepTag`] (operation, group id, sequence number of
///   the step in the group): a rank that is in another step (it skipped one, or runs another
///   collective on the same communicator) is reported by every rank as
///   [`IpcError::StepMismatch`] naming it and its step, before anything it sent is decoded.
///   [`agree`](Self::agree) lets the layer above tag its own steps in the same sequence.
///
/// ```
/// use tpcomm_ipc::{HostMemory, MemoryRegion, PeerMappings, PeerMemory, Region};
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<Vec<u8>> {
///     let mem = HostMemory::new();
///     let mine = mem.allocate(4096)?;
///     mem.write(&mine, 0, &[comm.rank() as u8 + 1; 8])?;
///     let mut peers = PeerMappings::new(mem, &comm)?;
///     let id = peers.exchange(&comm, &[Region { addr: mine.addr(), len: 4096 }])?;
///     let other = 1 - comm.rank();
///     let mut got = vec![0u8; 8];
///     peers.backend().read(peers.peer(id, other, 0)?, 0, &mut got)?;
///     peers.close_all()?;
///     Ok(got)
/// });
/// assert_eq!(results[0].as_ref().unwrap().as_ref().unwrap(), &vec![2u8; 8]);
/// ```
#[derive(Debug)]
pub struct PeerMappings<B: PeerMemory> {
    backend: B,
    rank: usize,
    size: usize,
    group: u64,
    exchanges: Vec<Exchange>,
    /// Open mappings with the handle each was opened from; `None` once closed (indices stay
    /// stable within an open period).
    slab: Vec<Option<(B::Mapping, B::Handle)>>,
    /// Handle -> slab index, so a handle is opened once per process.
    memo: HashMap<B::Handle, usize>,
    closed: bool,
    counters: Counters,
    /// Tagged collective steps run so far (the next step's sequence number).
    sequence: u64,
}

/// A per-process random-enough group id: time, pid and a stack address mixed.
fn fresh_group_id() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let mut z = t ^ (u64::from(std::process::id()) << 32) ^ (&local as *const u8 as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<B: PeerMemory> PeerMappings<B> {
    /// Collective: creates the registry of this group; rank 0's fresh group id is agreed so
    /// that handles from any other group are recognised and refused.
    pub fn new<C: Communicator + ?Sized>(backend: B, comm: &C) -> Result<Self> {
        Ok(Self::new_agreeing(backend, comm, &())?.0)
    }

    /// [`new`](Self::new), all-gathering `value` in the same (tagged) collective: a layer
    /// above checks its settings across ranks at no extra round trip. Returns every rank's
    /// value, in rank order; comparing them is the caller's business.
    pub fn new_agreeing<C, T>(backend: B, comm: &C, value: &T) -> Result<(Self, Vec<T>)>
    where
        C: Communicator + ?Sized,
        T: Serialize + DeserializeOwned,
    {
        let tag = StepTag {
            step: Step::Create,
            group: 0,
            sequence: 0,
        };
        let all: Vec<(u64, T)> = tagged_all_gather_as(comm, tag, &(fresh_group_id(), value))?;
        let mut values = all.into_iter();
        let (group, first) = values.next().expect("a communicator has at least one rank");
        let values = std::iter::once(first)
            .chain(values.map(|(_, v)| v))
            .collect();
        let registry = Self {
            backend,
            rank: comm.rank(),
            size: comm.size(),
            group,
            exchanges: Vec::new(),
            slab: Vec::new(),
            memo: HashMap::new(),
            closed: false,
            counters: Counters::default(),
            sequence: 1,
        };
        Ok((registry, values))
    }

    /// Collective: all-gathers `value` as the next tagged step `step` of this group (see
    /// [`StepTag`]); every rank's value in rank order. A rank in another step fails it on
    /// every rank in a tagged step with [`IpcError::StepMismatch`]. For the collective steps
    /// of a layer built on the registry (a transition's barriers), so that they are
    /// sequenced and checked with the registry's own.
    pub fn agree<C, T>(&mut self, comm: &C, step: Step, value: &T) -> Result<Vec<T>>
    where
        C: Communicator + ?Sized,
        T: Serialize + DeserializeOwned,
    {
        let tag = self.next_tag(step);
        tagged_all_gather(comm, tag, value)
    }

    /// The tag of the next step; the sequence advances whatever the step's outcome.
    fn next_tag(&mut self, step: Step) -> StepTag {
        let tag = StepTag {
            step,
            group: self.group,
            sequence: self.sequence,
        };
        self.sequence += 1;
        tag
    }

    /// The backend (for allocations and copies).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// This group's id (carried by every exchanged handle).
    pub fn group(&self) -> u64 {
        self.group
    }

    /// The counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// True between [`close_all`](Self::close_all) and a successful
    /// [`reopen_all`](Self::reopen_all).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Collective: shares `regions` (the same number on every rank) with every peer and opens
    /// theirs. Returns the id under which [`peer`](Self::peer) finds them.
    pub fn exchange<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        regions: &[Region],
    ) -> Result<ExchangeId> {
        if self.closed {
            return Err(IpcError::Closed);
        }
        let _span =
            tracing::debug_span!("peer_exchange", rank = self.rank, regions = regions.len())
                .entered();
        let slots = self.share_and_open(comm, regions, [Step::Exchange, Step::ExchangeVerdict])?;
        self.exchanges.push(Exchange {
            local: regions.to_vec(),
            slots,
        });
        Ok(ExchangeId(self.exchanges.len() - 1))
    }

    /// Exports, all-gathers, validates and opens; rolls back and fails on every rank when
    /// any rank fails. `steps` tag the handle exchange and the verdict exchange.
    fn share_and_open<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        regions: &[Region],
        steps: [Step; 2],
    ) -> Result<Vec<Vec<Option<usize>>>> {
        // Export failures are agreed too: a rank that cannot export sends no handles, which
        // every rank sees as a count mismatch naming it.
        let exported: Result<Vec<Envelope<B::Handle>>> = regions
            .iter()
            .map(|r| {
                let handle = self.backend.export(r.addr, r.len)?;
                Ok(Envelope {
                    group: self.group,
                    rank: self.rank as u32,
                    handle,
                })
            })
            .collect();
        let (mine, export_error) = match exported {
            Ok(v) => (Some(v), None),
            Err(e) => (None, Some(e)),
        };
        let all: Vec<Option<Vec<Envelope<B::Handle>>>> = self.agree(comm, steps[0], &mine)?;
        let failed_export: Vec<usize> = (0..self.size).filter(|&r| all[r].is_none()).collect();
        if !failed_export.is_empty() {
            return Err(IpcError::PeerOpenFailed {
                ranks: failed_export,
                local: export_error.map(Box::new),
            });
        }
        let counts: Vec<usize> = all.iter().map(|v| v.as_ref().map_or(0, Vec::len)).collect();
        if counts.iter().any(|&c| c != counts[0]) {
            return Err(IpcError::Mismatch(format!(
                "ranks shared different numbers of regions: {counts:?}"
            )));
        }

        let mut opened_here = Vec::new();
        let mut slots = vec![vec![None; counts[0]]; self.size];
        let mut local_error = None;
        'peers: for (r, envelopes) in all.iter().enumerate() {
            if r == self.rank {
                continue;
            }
            for (i, env) in envelopes.iter().flatten().enumerate() {
                match self.open_memoized(r, env) {
                    Ok((slot, fresh)) => {
                        slots[r][i] = Some(slot);
                        if fresh {
                            opened_here.push(slot);
                        }
                    }
                    Err(e) => {
                        local_error = Some(e);
                        break 'peers;
                    }
                }
            }
        }
        let ok: bool = local_error.is_none();
        let verdicts: Vec<bool> = self.agree(comm, steps[1], &ok)?;
        let failed: Vec<usize> = (0..self.size).filter(|&r| !verdicts[r]).collect();
        if failed.is_empty() {
            return Ok(slots);
        }
        for slot in opened_here {
            if let Err(e) = self.close_slot(slot) {
                tracing::warn!(error = %e, slot, "closing a mapping while rolling back failed");
            }
        }
        Err(IpcError::PeerOpenFailed {
            ranks: failed,
            local: local_error.map(Box::new),
        })
    }

    /// Opens one handle received by other means (not through [`exchange`](Self::exchange)),
    /// after checking that it belongs to this group and comes from rank `from`. Memoized like
    /// exchanged handles, and closed by [`close_all`](Self::close_all) (but not reopened).
    pub fn import(&mut self, from: usize, env: &Envelope<B::Handle>) -> Result<&B::Mapping> {
        if self.closed {
            return Err(IpcError::Closed);
        }
        let (slot, _) = self.open_memoized(from, env)?;
        self.slab[slot]
            .as_ref()
            .map(|(m, _)| m)
            .ok_or_else(|| IpcError::NoSuchMapping(format!("slot {slot}")))
    }

    /// Wraps a handle exported by this rank for sending it out of band (see
    /// [`import`](Self::import)).
    pub fn envelope(&self, handle: B::Handle) -> Envelope<B::Handle> {
        Envelope {
            group: self.group,
            rank: self.rank as u32,
            handle,
        }
    }

    /// Opens `env` unless its handle is already open; returns the slab index and whether it
    /// was opened now.
    fn open_memoized(&mut self, from: usize, env: &Envelope<B::Handle>) -> Result<(usize, bool)> {
        if env.group != self.group {
            return Err(IpcError::ForeignHandle {
                expected: self.group,
                found: env.group,
            });
        }
        if env.rank as usize != from {
            return Err(IpcError::InvalidHandle(format!(
                "rank {from} sent a handle labelled rank {}",
                env.rank
            )));
        }
        if let Some(&slot) = self.memo.get(&env.handle) {
            return Ok((slot, false));
        }
        let mapping = self.backend.open(&env.handle)?;
        self.slab.push(Some((mapping, env.handle.clone())));
        let slot = self.slab.len() - 1;
        self.memo.insert(env.handle.clone(), slot);
        self.counters.open += 1;
        self.counters.opens += 1;
        Ok((slot, true))
    }

    /// Closes one slot; `Ok(false)` when it was not open. The slot is gone either way.
    fn close_slot(&mut self, slot: usize) -> Result<bool> {
        let Some((mapping, handle)) = self.slab.get_mut(slot).and_then(Option::take) else {
            return Ok(false);
        };
        self.memo.remove(&handle);
        self.counters.open -= 1;
        self.counters.closes += 1;
        self.backend.close(mapping).map(|()| true)
    }

    /// The mapping of region `index` of `rank` in exchange `id`.
    ///
    /// Fails with [`IpcError::Closed`] while closed, and for this rank's own regions (use
    /// the local buffer) or unknown ids with [`IpcError::NoSuchMapping`].
    pub fn peer(&self, id: ExchangeId, rank: usize, index: usize) -> Result<&B::Mapping> {
        if self.closed {
            return Err(IpcError::Closed);
        }
        let missing =
            || IpcError::NoSuchMapping(format!("exchange {}, rank {rank}, region {index}", id.0));
        let slot = self
            .exchanges
            .get(id.0)
            .and_then(|x| x.slots.get(rank))
            .and_then(|s| s.get(index).copied())
            .flatten()
            .ok_or_else(missing)?;
        self.slab[slot].as_ref().map(|(m, _)| m).ok_or_else(missing)
    }

    /// The address of region `index` of `rank` in exchange `id`: the peer mapping's address
    /// for peers, this rank's own region address for itself.
    pub fn address(&self, id: ExchangeId, rank: usize, index: usize) -> Result<u64> {
        use crate::memory::MemoryRegion;
        if rank == self.rank {
            let x = self
                .exchanges
                .get(id.0)
                .ok_or_else(|| IpcError::NoSuchMapping(format!("exchange {}", id.0)))?;
            return x.local.get(index).map(|r| r.addr).ok_or_else(|| {
                IpcError::NoSuchMapping(format!("exchange {}, own region {index}", id.0))
            });
        }
        self.peer(id, rank, index).map(MemoryRegion::addr)
    }

    /// Closes every imported mapping; local memory is untouched. Returns how many were
    /// closed. Repeating it is a no-op returning 0.
    ///
    /// Every mapping is closed (and unreachable) even when some close fails; the first
    /// failure is then returned.
    pub fn close_all(&mut self) -> Result<usize> {
        let _span = tracing::debug_span!("peer_close_all", rank = self.rank).entered();
        let mut closed = 0;
        let mut first_error = None;
        for slot in 0..self.slab.len() {
            match self.close_slot(slot) {
                Ok(was_open) => closed += usize::from(was_open),
                Err(e) => {
                    closed += 1;
                    first_error.get_or_insert(e);
                }
            }
        }
        self.slab.clear();
        self.memo.clear();
        self.closed = true;
        tracing::debug!(closed, "peer mappings closed");
        match first_error {
            Some(e) => Err(e),
            None => Ok(closed),
        }
    }

    /// Collective: exports fresh handles for every region of every exchange, exchanges and
    /// reopens them (new addresses are likely). A no-op when not closed.
    pub fn reopen_all<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        if !self.closed {
            return Ok(());
        }
        let _span = tracing::debug_span!(
            "peer_reopen_all",
            rank = self.rank,
            exchanges = self.exchanges.len()
        )
        .entered();
        let mut exchanges = std::mem::take(&mut self.exchanges);
        self.closed = false;
        let mut result = Ok(());
        for x in &mut exchanges {
            match self.share_and_open(comm, &x.local, [Step::Reopen, Step::ReopenVerdict]) {
                Ok(slots) => x.slots = slots,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.exchanges = exchanges;
        if result.is_err() {
            // Leave a consistent closed state: nothing half-open.
            if let Err(e) = self.close_all() {
                tracing::warn!(error = %e, "closing after a failed reopen failed");
            }
        }
        result
    }

    /// The length in bytes of region `index` of `rank` in exchange `id`: the length this
    /// rank shared for itself, the length of the peer's mapping (as its handle announced it
    /// and the backend checked on open) for a peer.
    pub fn region_len(&self, id: ExchangeId, rank: usize, index: usize) -> Result<usize> {
        use crate::memory::MemoryRegion;
        if rank == self.rank {
            let x = self
                .exchanges
                .get(id.0)
                .ok_or_else(|| IpcError::NoSuchMapping(format!("exchange {}", id.0)))?;
            return x.local.get(index).map(|r| r.len).ok_or_else(|| {
                IpcError::NoSuchMapping(format!("exchange {}, own region {index}", id.0))
            });
        }
        self.peer(id, rank, index).map(MemoryRegion::len)
    }

    /// Forgets exchange `id` on this rank: closes the peer mappings only it uses and empties
    /// it, so that [`reopen_all`](Self::reopen_all) exports nothing for it and
    /// [`peer`](Self::peer) no longer finds its regions. Returns how many mappings were
    /// closed. Not collective itself, but every rank must release the same exchanges (a
    /// reopen exchanges every exchange's regions in order): callers agree on it first.
    ///
    /// The mappings are unreachable afterwards even when a close fails; the first failure
    /// is then returned.
    pub fn release(&mut self, id: ExchangeId) -> Result<usize> {
        let Some(x) = self.exchanges.get_mut(id.0) else {
            return Err(IpcError::NoSuchMapping(format!("exchange {}", id.0)));
        };
        x.local.clear();
        let slots: Vec<usize> = std::mem::take(&mut x.slots)
            .into_iter()
            .flatten()
            .flatten()
            .collect();
        let mut closed = 0;
        let mut first_error = None;
        for slot in slots {
            // The memo shares a mapping between exchanges of the same handle: keep it while
            // another exchange still names it.
            let shared = self
                .exchanges
                .iter()
                .any(|other| other.slots.iter().flatten().any(|&s| s == Some(slot)));
            if shared {
                continue;
            }
            match self.close_slot(slot) {
                Ok(was_open) => closed += usize::from(was_open),
                Err(e) => {
                    closed += 1;
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(closed),
        }
    }
}

impl<B: PeerMemory> Drop for PeerMappings<B> {
    fn drop(&mut self) {
        for slot in 0..self.slab.len() {
            if let Err(e) = self.close_slot(slot) {
                tracing::warn!(error = %e, slot, "closing a peer mapping on drop failed");
            }
        }
    }
}
