//! `reopen_all`: fresh handles (or a byte saying none changed) exchanged in one step, then
//! every kept handle reopened in place, or every exchange opened afresh; a failure leaves
//! every rank closed.

use serde::{Deserialize, Serialize};
use tpcomm_transport::Communicator;

use super::exchange::check_counts;
use super::kept_ranges::KeptRanges;
use super::{Envelope, Exchange, PeerMappings};
use crate::error::{IpcError, Result};
use crate::memory::PeerMemory;
use crate::step::Step;

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

impl<B: PeerMemory> PeerMappings<B> {
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
    ///
    /// [`Counters::exports_skipped`]: super::Counters::exports_skipped
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
}
