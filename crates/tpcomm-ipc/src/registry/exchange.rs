//! `exchange`: every rank exports its regions, the ranks all-gather the handles, and each
//! opens its peers' in one batch per peer; failures are agreed and rolled back on every rank.

use std::collections::HashMap;

use tpcomm_transport::Communicator;

use super::kept_ranges::{KeptRanges, KeptRow};
use super::{Envelope, Exchange, ExchangeId, PeerMappings};
use crate::error::{IpcError, Result};
use crate::memory::{PeerMemory, Region};
use crate::step::Step;

impl<B: PeerMemory> PeerMappings<B> {
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
    pub(super) fn envelopes(&self, handles: &[B::Handle]) -> Vec<Envelope<B::Handle>> {
        handles.iter().map(|h| self.envelope(h.clone())).collect()
    }

    /// Opens every peer's envelopes of `all` (one list per rank, the same length), then
    /// agrees under `verdict` whether every rank opened all of them; rolls back and fails on
    /// every rank when any rank failed. Returns the slots, `[rank][index]`.
    pub(super) fn open_shared<C: Communicator + ?Sized>(
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
}

/// Every rank shared as many regions as rank 0.
pub(super) fn check_counts<H>(all: &[Vec<Envelope<H>>]) -> Result<()> {
    let counts: Vec<usize> = all.iter().map(Vec::len).collect();
    if counts.iter().any(|&c| c != counts[0]) {
        return Err(IpcError::Mismatch(format!(
            "ranks shared different numbers of regions: {counts:?}"
        )));
    }
    Ok(())
}
