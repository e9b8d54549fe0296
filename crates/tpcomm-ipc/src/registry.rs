//! [`PeerMappings`]: exchange handles, open every peer's once, close all, reopen all.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tpcomm_transport::Communicator;

use crate::error::{IpcError, Result};
use crate::memory::{PeerMemory, Region};
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

/// A peer region whose mapping would keep this process from being checkpointed and
/// restored with its peers ([`PeerMappings::checkpoint_blockers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointBlocker {
    /// The exchange that shared it.
    pub exchange: ExchangeId,
    /// The rank that shared it.
    pub rank: usize,
    /// Its index in the exchange.
    pub index: usize,
    /// Its length as the peer announced it.
    pub len: usize,
    /// Why (the backend's [`checkpoint_blocker`](PeerMemory::checkpoint_blocker)).
    pub reason: String,
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
    /// Reopens in which no rank's handles had changed, so that every rank reopened the
    /// handles it kept (see [`PeerMappings::reopen_all`]).
    pub reopens_in_place: u64,
    /// Reopens in which this rank did not export its regions again: the backend's
    /// [`export_stamp`](crate::PeerMemory::export_stamp) had not changed since they were
    /// last exported (nothing allocated or freed), so its handles were the ones it shared.
    pub exports_skipped: u64,
    /// Mappings a reopen put back at the address they had before the close (backends that
    /// [keep addresses](crate::PeerMemory::keeps_addresses)).
    pub kept_addresses: u64,
    /// Mappings of exchanged regions that a reopen put at another address although the
    /// backend keeps addresses: the fresh handle did not fit the kept range (another size),
    /// or the range was not kept.
    pub moved_addresses: u64,
}

#[derive(Debug)]
struct Exchange<H> {
    /// This rank's regions, re-exported on reopen.
    local: Vec<Region>,
    /// The handles this rank shared for `local` last time, compared with fresh ones on
    /// reopen.
    sent: Vec<H>,
    /// `slots[rank][index]`: the mapping slab index for each peer region (`None` for own).
    slots: Vec<Vec<Option<usize>>>,
    /// The backend's export stamp read before `sent` was last exported or found equal to a
    /// fresh export: while the stamp stays so, exporting `local` again gives `sent`.
    stamp: Option<u64>,
    /// [`PeerMappings::release`] ended it: it shares and maps nothing any more.
    released: bool,
}

/// One opened handle. Slots an exchange refers to keep their handle while closed, so that a
/// reopen whose handles did not change reopens them in place; `close_all` forgets the others
/// (opened by `import` only).
#[derive(Debug)]
struct Slot<B: PeerMemory> {
    handle: B::Handle,
    /// `None` while closed.
    mapping: Option<B::Mapping>,
    /// While closed, for a backend that keeps addresses: the mapping, detached, holding its
    /// address range for the reopen.
    detached: Option<B::Mapping>,
}

/// What a rank shares in `reopen_all`.
#[derive(Debug, Serialize, Deserialize)]
enum Reshare<H> {
    /// It could not export its regions (its error stays local).
    ExportFailed,
    /// Every handle it exports is the one it shared last time.
    Unchanged,
    /// Fresh handles of every exchange's regions, exchange by exchange.
    Fresh(Vec<Vec<Envelope<H>>>),
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
/// - With a backend that [keeps addresses](PeerMemory::keeps_addresses) (`CudaVmmMemory`,
///   `HostMemory::stable`), `close_all` detaches the mappings of exchanged regions instead
///   (their address ranges stay reserved) and `reopen_all` maps each region's fresh handle
///   back into its own range: every peer address is what it was
///   ([`Counters::kept_addresses`]). A fresh handle that does not fit its range (a peer
///   shared a region of another size) opens elsewhere ([`Counters::moved_addresses`]).
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
    exchanges: Vec<Exchange<B::Handle>>,
    /// Opened handles and their mappings; `None` once released (indices stay stable while
    /// the handles do).
    slab: Vec<Option<Slot<B>>>,
    /// Handle -> slab index, so a handle is opened once per process.
    memo: HashMap<B::Handle, usize>,
    closed: bool,
    counters: Counters,
    /// Tagged collective steps run so far (the next step's sequence number).
    sequence: u64,
}

/// Fails unless `comm` is rank `rank` of `size` ([`IpcError::WrongCommunicator`]).
fn same_group<C: Communicator + ?Sized>(rank: usize, size: usize, comm: &C) -> Result<()> {
    if comm.rank() == rank && comm.size() == size {
        return Ok(());
    }
    Err(IpcError::WrongCommunicator {
        rank,
        size,
        comm_rank: comm.rank(),
        comm_size: comm.size(),
    })
}

/// A per-process random-enough id (of a group, a queue): time, pid and a stack address
/// mixed. Not secret: it tells honest peers' objects apart, nothing more.
pub fn fresh_group_id() -> u64 {
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
        self.check_communicator(comm)?;
        let tag = self.next_tag(step);
        tagged_all_gather(comm, tag, value)
    }

    /// Fails unless `comm` is rank `rank` of `size`, as the group this registry was created
    /// for: every collective indexes its results by rank.
    pub fn check_communicator<C: Communicator + ?Sized>(&self, comm: &C) -> Result<()> {
        same_group(self.rank, self.size, comm)
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
        self.check_communicator(comm)?;
        let _span =
            tracing::debug_span!("peer_exchange", rank = self.rank, regions = regions.len())
                .entered();
        let stamp = self.backend.export_stamp();
        let (sent, all) = self.share(comm, regions)?;
        let slots = self.open_shared(comm, &all, Step::ExchangeVerdict, None)?;
        self.exchanges.push(Exchange {
            local: regions.to_vec(),
            sent,
            slots,
            stamp,
            released: false,
        });
        Ok(ExchangeId(self.exchanges.len() - 1))
    }

    /// Exports and all-gathers this rank's handles of `regions`: the handles and every
    /// rank's envelopes, or a failure agreed by every rank.
    #[allow(clippy::type_complexity)]
    fn share<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        regions: &[Region],
    ) -> Result<(Vec<B::Handle>, Vec<Vec<Envelope<B::Handle>>>)> {
        // Export failures are agreed too: a rank that cannot export sends no handles, which
        // every rank sees as a failure naming it.
        let (sent, export_error) = match self.backend.export_all(regions) {
            Ok(handles) => (Some(handles), None),
            Err(e) => (None, Some(e)),
        };
        let mine = sent.as_ref().map(|h| self.envelopes(h));
        let all: Vec<Option<Vec<Envelope<B::Handle>>>> = self.agree(comm, Step::Exchange, &mine)?;
        let failed_export: Vec<usize> = (0..self.size).filter(|&r| all[r].is_none()).collect();
        if !failed_export.is_empty() {
            return Err(IpcError::PeerOpenFailed {
                ranks: failed_export,
                local: export_error.map(Box::new),
            });
        }
        let all: Vec<Vec<Envelope<B::Handle>>> = all.into_iter().flatten().collect();
        check_counts(&all)?;
        Ok((sent.unwrap_or_default(), all))
    }

    /// This rank's envelopes of `handles`.
    fn envelopes(&self, handles: &[B::Handle]) -> Vec<Envelope<B::Handle>> {
        handles.iter().map(|h| self.envelope(h.clone())).collect()
    }

    /// Opens every peer's envelopes of `all` (one list per rank, the same length), then
    /// agrees under `verdict` whether every rank opened all of them; rolls back and fails on
    /// every rank when any rank failed. Returns the slots, `[rank][index]`.
    fn open_shared<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        all: &[Vec<Envelope<B::Handle>>],
        verdict: Step,
        mut kept: Option<KeptRanges<'_, B>>,
    ) -> Result<Vec<Vec<Option<usize>>>> {
        let count = all.first().map_or(0, Vec::len);
        let mut opened_here = Vec::new();
        let mut slots = vec![vec![None; count]; self.size];
        let mut local_error = None;
        for (r, envelopes) in all.iter().enumerate() {
            if r == self.rank {
                continue;
            }
            match self.open_batch(r, envelopes, kept.as_mut().map(|k| k.row(r))) {
                Ok(batch) => {
                    for (i, (slot, fresh)) in batch.into_iter().enumerate() {
                        slots[r][i] = Some(slot);
                        if fresh {
                            opened_here.push(slot);
                        }
                    }
                }
                Err(e) => {
                    local_error = Some(e);
                    break;
                }
            }
        }
        let ok: bool = local_error.is_none();
        let failure = match self.agree::<_, bool>(comm, verdict, &ok) {
            Ok(verdicts) => {
                let failed: Vec<usize> = (0..self.size).filter(|&r| !verdicts[r]).collect();
                if failed.is_empty() {
                    return Ok(slots);
                }
                IpcError::PeerOpenFailed {
                    ranks: failed,
                    local: local_error.map(Box::new),
                }
            }
            // The verdict step itself failed (a peer in another step, a transport error):
            // no rank keeps what it opened either.
            Err(e) => e,
        };
        for slot in opened_here {
            if let Err(e) = self.close_slot(slot) {
                tracing::warn!(error = %e, slot, "closing a mapping while rolling back failed");
            }
        }
        Err(failure)
    }

    /// Opens the envelopes rank `from` shared, in one batch of the backend: the slab index
    /// of each and whether it was opened now (the first occurrence of a handle not open
    /// before). Nothing is opened unless every envelope is of this group and of `from`.
    fn open_batch(
        &mut self,
        from: usize,
        envelopes: &[Envelope<B::Handle>],
        mut kept: Option<KeptRow<'_, B>>,
    ) -> Result<Vec<(usize, bool)>> {
        /// Where an envelope's mapping comes from.
        enum Source {
            Open(usize),
            Reattached(usize),
            Batch(usize),
        }
        for env in envelopes {
            self.check_envelope(from, env)?;
        }
        let mut to_open: Vec<&B::Handle> = Vec::new();
        let mut in_batch: HashMap<&B::Handle, usize> = HashMap::new();
        let mut plan = Vec::with_capacity(envelopes.len());
        let mut reattached = Vec::new();
        for (i, env) in envelopes.iter().enumerate() {
            if let Some(&slot) = self.memo.get(&env.handle) {
                plan.push(Source::Open(slot));
                continue;
            }
            if !in_batch.contains_key(&env.handle) {
                if let Some(mut mapping) = kept.as_mut().and_then(|k| k.take(i)) {
                    match self.backend.reattach(&mut mapping, &env.handle) {
                        Ok(()) => {
                            self.counters.kept_addresses += 1;
                            let slot = self.add_slot(env.handle.clone(), mapping);
                            reattached.push(slot);
                            plan.push(Source::Reattached(slot));
                            continue;
                        }
                        // The range is given up: the handle opens elsewhere.
                        Err(IpcError::AddressNotKept { .. } | IpcError::Unsupported { .. }) => {
                            self.counters.moved_addresses += 1;
                        }
                        Err(e) => {
                            self.close_reattached(reattached);
                            return Err(e);
                        }
                    }
                } else if kept.is_some() && self.backend.keeps_addresses() {
                    self.counters.moved_addresses += 1;
                }
            }
            let next = to_open.len();
            let k = *in_batch.entry(&env.handle).or_insert(next);
            if k == next {
                to_open.push(&env.handle);
            }
            plan.push(Source::Batch(k));
        }
        let mappings = match self.backend.open_all(&to_open) {
            Ok(mappings) => mappings,
            Err(e) => {
                self.close_reattached(reattached);
                return Err(e);
            }
        };
        let first = self.slab.len();
        for (handle, mapping) in to_open.into_iter().zip(mappings) {
            self.add_slot(handle.clone(), mapping);
        }
        let mut seen = vec![false; self.slab.len() - first];
        Ok(plan
            .into_iter()
            .map(|source| match source {
                Source::Open(slot) => (slot, false),
                Source::Reattached(slot) => (slot, true),
                Source::Batch(k) => (first + k, !std::mem::replace(&mut seen[k], true)),
            })
            .collect())
    }

    /// Closes the slots a failed batch reattached (their kept ranges go with them).
    fn close_reattached(&mut self, slots: Vec<usize>) {
        for slot in slots {
            if let Err(e) = self.close_slot(slot) {
                tracing::warn!(error = %e, slot, "closing a reattached mapping failed");
            }
        }
    }

    /// Opens one handle received by other means (not through [`exchange`](Self::exchange)),
    /// after checking that it belongs to this group and comes from rank `from`. Memoized like
    /// exchanged handles, and closed by [`close_all`](Self::close_all) (but not reopened,
    /// unless an exchange names the same handle).
    pub fn import(&mut self, from: usize, env: &Envelope<B::Handle>) -> Result<&B::Mapping> {
        if self.closed {
            return Err(IpcError::Closed);
        }
        let (slot, _) = self.open_memoized(from, env)?;
        self.slab[slot]
            .as_ref()
            .and_then(|s| s.mapping.as_ref())
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
        self.check_envelope(from, env)?;
        if let Some(&slot) = self.memo.get(&env.handle) {
            return Ok((slot, false));
        }
        let mapping = self.backend.open(&env.handle)?;
        Ok((self.add_slot(env.handle.clone(), mapping), true))
    }

    /// Records a mapping just opened from `handle` in a new slot (memoized, counted);
    /// returns its index.
    fn add_slot(&mut self, handle: B::Handle, mapping: B::Mapping) -> usize {
        let slot = self.slab.len();
        self.memo.insert(handle.clone(), slot);
        self.slab.push(Some(Slot {
            handle,
            mapping: Some(mapping),
            detached: None,
        }));
        self.counters.open += 1;
        self.counters.opens += 1;
        slot
    }

    /// An envelope of this group, from rank `from`, or the error that says which it is not.
    fn check_envelope(&self, from: usize, env: &Envelope<B::Handle>) -> Result<()> {
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
        Ok(())
    }

    /// Removes one slot, closing its mapping; `Ok(false)` when it was not open. The slot is
    /// gone either way.
    fn close_slot(&mut self, slot: usize) -> Result<bool> {
        let Some(removed) = self.slab.get_mut(slot).and_then(Option::take) else {
            return Ok(false);
        };
        self.memo.remove(&removed.handle);
        // A detached mapping's reservation goes with it.
        drop(removed.detached);
        self.close_mapping(removed.mapping)
    }

    /// Closes a slot's mapping, if open; `Ok(false)` when it was not.
    fn close_mapping(&mut self, mapping: Option<B::Mapping>) -> Result<bool> {
        let Some(mapping) = mapping else {
            return Ok(false);
        };
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
        self.slab[slot]
            .as_ref()
            .and_then(|s| s.mapping.as_ref())
            .ok_or_else(missing)
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

    /// Per slab index, whether some exchange refers to it.
    fn referenced_slots(&self) -> Vec<bool> {
        let mut referenced = vec![false; self.slab.len()];
        for &i in self
            .exchanges
            .iter()
            .flat_map(|x| x.slots.iter().flatten().flatten())
        {
            if let Some(r) = referenced.get_mut(i) {
                *r = true;
            }
        }
        referenced
    }

    /// Closes every imported mapping; local memory is untouched. Returns how many were
    /// closed. Repeating it is a no-op returning 0.
    ///
    /// Every mapping is closed (and unreachable) even when some close fails; the first
    /// failure is then returned. The handles exchanges refer to are kept for
    /// [`reopen_all`](Self::reopen_all); the others (opened by [`import`](Self::import)
    /// only) are forgotten.
    pub fn close_all(&mut self) -> Result<usize> {
        let _span = tracing::debug_span!("peer_close_all", rank = self.rank).entered();
        let referenced = self.referenced_slots();
        let mut closed = 0;
        let mut first_error = None;
        for slot in 0..self.slab.len() {
            let outcome = match self.slab[slot].as_mut() {
                None => continue,
                Some(s) if referenced[slot] && self.backend.keeps_addresses() => {
                    match s.mapping.take() {
                        None => Ok(false),
                        Some(mut mapping) => {
                            self.counters.open -= 1;
                            self.counters.closes += 1;
                            match self.backend.detach(&mut mapping) {
                                Ok(()) => {
                                    s.detached = Some(mapping);
                                    Ok(true)
                                }
                                // A mapping of a kind that keeps no address (legacy CUDA IPC
                                // beside virtual memory): closed, reopened elsewhere.
                                Err(IpcError::Unsupported { .. }) => {
                                    self.backend.close(mapping).map(|()| true)
                                }
                                // Closed for good: the reopen maps it elsewhere.
                                Err(e) => self.backend.close(mapping).and(Err(e)),
                            }
                        }
                    }
                }
                Some(s) if referenced[slot] => {
                    let mapping = s.mapping.take();
                    self.close_mapping(mapping)
                }
                Some(_) => self.close_slot(slot),
            };
            match outcome {
                Ok(was_open) => closed += usize::from(was_open),
                Err(e) => {
                    closed += 1;
                    first_error.get_or_insert(e);
                }
            }
        }
        self.closed = true;
        // Every peer opened what it needs (a close follows the exchanges' verdicts): what
        // the backend holds open for them can go.
        let mut own = self.exchanges.iter().flat_map(|x| x.local.iter().copied());
        self.backend.close_exports(&mut own);
        tracing::debug!(closed, "peer mappings closed");
        match first_error {
            Some(e) => Err(e),
            None => Ok(closed),
        }
    }

    /// Collective: exports fresh handles for every region of every exchange, exchanges and
    /// reopens them (new addresses are likely). A no-op when not closed.
    ///
    /// One step carries every exchange's handles. A rank whose fresh handles are all the
    /// ones it shared before (host memory: always; CUDA: unless the process was
    /// checkpointed) says so in a byte instead; when every rank does, each reopens the
    /// handles it kept, in one batch of the backend. A rank whose backend's
    /// [`export_stamp`](PeerMemory::export_stamp) has not changed since its handles were
    /// last exported knows them unchanged without exporting again (host memory with nothing
    /// allocated or freed since: [`Counters::exports_skipped`]). A failure leaves the
    /// registry closed, on every rank.
    pub fn reopen_all<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.check_communicator(comm)?;
        if !self.closed {
            return Ok(());
        }
        let _span = tracing::debug_span!(
            "peer_reopen_all",
            rank = self.rank,
            exchanges = self.exchanges.len()
        )
        .entered();
        // Read before exporting: a change made during the export makes the next reopen
        // export again.
        let stamp = self.backend.export_stamp();
        let known_unchanged = stamp.is_some() && self.exchanges.iter().all(|x| x.stamp == stamp);
        let (mine, export_error) = if known_unchanged {
            // Nothing allocated or freed since every `sent` was exported: an export now
            // would give the same handles.
            self.counters.exports_skipped += 1;
            (Reshare::Unchanged, None)
        } else {
            let fresh: Result<Vec<Vec<B::Handle>>> = self
                .exchanges
                .iter()
                .map(|x| self.backend.export_all(&x.local))
                .collect();
            match fresh {
                Ok(fresh) if fresh.iter().zip(&self.exchanges).all(|(f, x)| *f == x.sent) => {
                    (Reshare::Unchanged, None)
                }
                Ok(fresh) => (
                    Reshare::Fresh(fresh.iter().map(|f| self.envelopes(f)).collect()),
                    None,
                ),
                Err(e) => (Reshare::ExportFailed, Some(e)),
            }
        };
        let all: Vec<Reshare<B::Handle>> = self.agree(comm, Step::Reopen, &mine)?;
        let failed_export: Vec<usize> = (0..self.size)
            .filter(|&r| matches!(all[r], Reshare::ExportFailed))
            .collect();
        if !failed_export.is_empty() {
            return Err(IpcError::PeerOpenFailed {
                ranks: failed_export,
                local: export_error.map(Box::new),
            });
        }
        let result = if all.iter().all(|r| matches!(r, Reshare::Unchanged)) {
            self.reopen_in_place(comm)
        } else {
            self.reopen_fresh(comm, all)
        };
        match result {
            Ok(()) => {
                self.closed = false;
                // Every `sent` is what an export at `stamp` gave (or the same handles).
                for x in &mut self.exchanges {
                    x.stamp = stamp;
                }
                Ok(())
            }
            Err(e) => {
                // Leave a consistent closed state: nothing half-open.
                if let Err(e) = self.close_all() {
                    tracing::warn!(error = %e, "closing after a failed reopen failed");
                }
                Err(e)
            }
        }
    }

    /// Every rank's handles are unchanged: reopens every kept handle in one batch, then
    /// agrees the verdict.
    fn reopen_in_place<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        // Detached mappings go back into their kept ranges first; the rest (and any whose
        // range cannot take its handle again) open in one batch.
        let mut reattached = Vec::new();
        let mut to_open = Vec::new();
        let mut failure = None;
        for i in 0..self.slab.len() {
            if failure.is_some() {
                break;
            }
            let Some(s) = self.slab[i].as_mut() else {
                continue;
            };
            let Some(mut mapping) = s.detached.take() else {
                to_open.push(i);
                continue;
            };
            match self.backend.reattach(&mut mapping, &s.handle) {
                Ok(()) => reattached.push((i, mapping)),
                // The range is given up: the handle opens elsewhere.
                Err(IpcError::AddressNotKept { .. } | IpcError::Unsupported { .. }) => {
                    to_open.push(i)
                }
                Err(e) => {
                    s.detached = Some(mapping);
                    failure = Some(e);
                }
            }
        }
        let opened = match failure {
            Some(e) => Err(e),
            None => {
                let handles: Vec<&B::Handle> = to_open
                    .iter()
                    .filter_map(|&i| self.slab[i].as_ref().map(|s| &s.handle))
                    .collect();
                self.backend.open_all(&handles)
            }
        };
        let verdicts: Vec<bool> = self.agree(comm, Step::ReopenVerdict, &opened.is_ok())?;
        let failed: Vec<usize> = (0..self.size).filter(|&r| !verdicts[r]).collect();
        let kept = reattached.len() as u64;
        let (opened_now, local): (Vec<(usize, B::Mapping)>, _) = match opened {
            Ok(mappings) => (to_open.into_iter().zip(mappings).collect(), None),
            Err(e) => (Vec::new(), Some(e)),
        };
        // Installed either way: on failure the caller's `close_all` detaches (or closes)
        // them again, so that kept ranges survive a failed reopen.
        for (slot, mapping) in reattached.into_iter().chain(opened_now) {
            if let Some(s) = self.slab[slot].as_mut() {
                s.mapping = Some(mapping);
                self.counters.open += 1;
                self.counters.opens += 1;
            }
        }
        if !failed.is_empty() {
            return Err(IpcError::PeerOpenFailed {
                ranks: failed,
                local: local.map(Box::new),
            });
        }
        self.count_addresses(kept);
        self.counters.reopens_in_place += 1;
        Ok(())
    }

    /// Counts a reopen's kept and moved addresses: of the mappings exchanges refer to,
    /// `kept` went back to their ranges; the rest moved (for a backend that keeps them).
    fn count_addresses(&mut self, kept: u64) {
        if !self.backend.keeps_addresses() {
            return;
        }
        let referenced = self.referenced_slots().iter().filter(|&&r| r).count() as u64;
        self.counters.kept_addresses += kept;
        self.counters.moved_addresses += referenced.saturating_sub(kept);
    }

    /// Some rank shared fresh handles: forgets every kept handle and opens every exchange's
    /// handles anew (fresh ones, or those kept of the ranks whose handles did not change).
    fn reopen_fresh<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        all: Vec<Reshare<B::Handle>>,
    ) -> Result<()> {
        // A list per exchange, in order: a rank with more or fewer is refused on every rank
        // (each rank sees every list), never matched by position with the wrong exchange.
        for (r, shared) in all.iter().enumerate() {
            if let Reshare::Fresh(fresh) = shared {
                if fresh.len() != self.exchanges.len() {
                    return Err(IpcError::Mismatch(format!(
                        "rank {r} reshared {} exchanges, this rank has {}",
                        fresh.len(),
                        self.exchanges.len()
                    )));
                }
            }
        }
        let mut lists = Vec::with_capacity(self.exchanges.len());
        for (k, x) in self.exchanges.iter().enumerate() {
            let mut per_rank = Vec::with_capacity(self.size);
            for (r, shared) in all.iter().enumerate() {
                per_rank.push(match shared {
                    // Every list has one entry per exchange (checked above).
                    Reshare::Fresh(fresh) => fresh[k].clone(),
                    Reshare::Unchanged if r == self.rank => self.envelopes(&x.sent),
                    _ => self.kept_envelopes(x, r)?,
                });
            }
            check_counts(&per_rank)?;
            lists.push(per_rank);
        }
        // Every mapping is closed: the new slab starts empty. The kept one comes back if the
        // reopen fails, so that a later one can still rely on it.
        let mut kept_slab = std::mem::take(&mut self.slab);
        let kept_memo = std::mem::take(&mut self.memo);
        let mut reopened = Vec::with_capacity(lists.len());
        let mut result = Ok(());
        for (k, per_rank) in lists.iter().enumerate() {
            // Each region's fresh handle goes back into the range its old slot kept.
            let rows = self.exchanges[k].slots.clone();
            let kept = KeptRanges {
                slab: &mut kept_slab,
                rows: &rows,
            };
            match self.open_shared(comm, per_rank, Step::ReopenVerdict, Some(kept)) {
                Ok(slots) => reopened.push(slots),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_err() {
            for slot in 0..self.slab.len() {
                if let Err(e) = self.close_slot(slot) {
                    tracing::warn!(error = %e, slot, "closing after a failed reopen failed");
                }
            }
            self.slab = kept_slab;
            self.memo = kept_memo;
            return result;
        }
        for ((x, slots), per_rank) in self.exchanges.iter_mut().zip(reopened).zip(&lists) {
            x.slots = slots;
            x.sent = per_rank[self.rank]
                .iter()
                .map(|e| e.handle.clone())
                .collect();
        }
        Ok(())
    }

    /// The envelopes rank `r` shared last time for exchange `x`, from the kept handles.
    fn kept_envelopes(
        &self,
        x: &Exchange<B::Handle>,
        r: usize,
    ) -> Result<Vec<Envelope<B::Handle>>> {
        let row = x.slots.get(r).map_or(&[][..], Vec::as_slice);
        row.iter()
            .map(|slot| {
                let kept = slot.and_then(|i| self.slab.get(i)).and_then(Option::as_ref);
                kept.map(|s| Envelope {
                    group: self.group,
                    rank: r as u32,
                    handle: s.handle.clone(),
                })
                .ok_or_else(|| IpcError::NoSuchMapping(format!("kept handle of rank {r}")))
            })
            .collect()
    }

    /// Every peer region of every exchange whose mapping would keep this process from being
    /// checkpointed and restored with its peers, as the backend judges its handle
    /// ([`PeerMemory::checkpoint_blocker`]); empty when none would. Open or closed alike (the
    /// handles are kept through a close). Regions opened by [`import`](Self::import) only
    /// are not looked at.
    pub fn checkpoint_blockers(&self) -> Vec<CheckpointBlocker> {
        let mut found = Vec::new();
        for (x, exchange) in self.exchanges.iter().enumerate() {
            for (rank, row) in exchange.slots.iter().enumerate() {
                for (index, slot) in row.iter().enumerate() {
                    let Some(s) = slot.and_then(|i| self.slab.get(i)).and_then(Option::as_ref)
                    else {
                        continue;
                    };
                    if let Some(reason) = self.backend.checkpoint_blocker(&s.handle) {
                        use crate::memory::MemoryRegion;
                        let len = s
                            .mapping
                            .as_ref()
                            .or(s.detached.as_ref())
                            .map_or(0, MemoryRegion::len);
                        found.push(CheckpointBlocker {
                            exchange: ExchangeId(x),
                            rank,
                            index,
                            len,
                            reason,
                        });
                    }
                }
            }
        }
        found
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

    /// Replaces this rank's region `index` of exchange `id` (local only): the next
    /// [`reopen_all`](Self::reopen_all) exports `region` in its place, and peers open that
    /// instead. Until then peers keep the mapping they have. For a region whose memory is
    /// about to go (its owner was dropped) while peers must still find a region of the same
    /// length there: a reopen would fail to export freed memory. Fails with
    /// [`IpcError::Mismatch`] when the length differs (peers checked the old one) and with
    /// [`IpcError::NoSuchMapping`] for an unknown exchange or index.
    pub fn replace_region(&mut self, id: ExchangeId, index: usize, region: Region) -> Result<()> {
        let x = self
            .exchanges
            .get_mut(id.0)
            .ok_or_else(|| IpcError::NoSuchMapping(format!("exchange {}", id.0)))?;
        let old = x.local.get_mut(index).ok_or_else(|| {
            IpcError::NoSuchMapping(format!("exchange {}, own region {index}", id.0))
        })?;
        if old.len != region.len {
            return Err(IpcError::Mismatch(format!(
                "region {index} of exchange {} is {} bytes, its replacement {}",
                id.0, old.len, region.len
            )));
        }
        *old = region;
        // Exported again at the next reopen (the export stamp may not have moved).
        x.stamp = None;
        Ok(())
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
        if std::mem::replace(&mut x.released, true) {
            return Err(IpcError::NoSuchMapping(format!(
                "exchange {} was released already",
                id.0
            )));
        }
        x.local.clear();
        // What a fresh export of the released exchange gives: a rank that reopens without
        // exporting must announce the same as a peer that exported.
        x.sent.clear();
        let slots: Vec<usize> = std::mem::take(&mut x.slots)
            .into_iter()
            .flatten()
            .flatten()
            .collect();
        // The memo shares a mapping between exchanges of the same handle: keep it while
        // another exchange still names it.
        let referenced = self.referenced_slots();
        let mut closed = 0;
        let mut first_error = None;
        for slot in slots {
            if referenced.get(slot).copied().unwrap_or(false) {
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

/// The detached mappings of the slab that a fresh reopen replaces, found by the positions the
/// exchanges gave them: region `i` of rank `r` in an exchange takes back the range of the
/// slot it had there.
struct KeptRanges<'a, B: PeerMemory> {
    slab: &'a mut [Option<Slot<B>>],
    /// The exchange's old `slots[rank][index]`.
    rows: &'a [Vec<Option<usize>>],
}

impl<B: PeerMemory> KeptRanges<'_, B> {
    fn row(&mut self, rank: usize) -> KeptRow<'_, B> {
        KeptRow {
            slab: self.slab,
            slots: self.rows.get(rank).map_or(&[][..], Vec::as_slice),
        }
    }
}

/// One rank's row of [`KeptRanges`].
struct KeptRow<'a, B: PeerMemory> {
    slab: &'a mut [Option<Slot<B>>],
    slots: &'a [Option<usize>],
}

impl<B: PeerMemory> KeptRow<'_, B> {
    /// The detached mapping of region `index`'s old slot, taken (a slot shared by several
    /// regions gives it to the first).
    fn take(&mut self, index: usize) -> Option<B::Mapping> {
        let slot = (*self.slots.get(index)?)?;
        self.slab.get_mut(slot)?.as_mut()?.detached.take()
    }
}

/// Every rank shared as many regions as rank 0.
fn check_counts<H>(all: &[Vec<Envelope<H>>]) -> Result<()> {
    let counts: Vec<usize> = all.iter().map(Vec::len).collect();
    if counts.iter().any(|&c| c != counts[0]) {
        return Err(IpcError::Mismatch(format!(
            "ranks shared different numbers of regions: {counts:?}"
        )));
    }
    Ok(())
}
