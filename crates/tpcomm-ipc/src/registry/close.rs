//! `close_all`: every imported mapping closed (or, for a backend that keeps addresses,
//! detached with its range kept), local memory untouched.

use super::PeerMappings;
use crate::error::{IpcError, Result};
use crate::memory::PeerMemory;

impl<B: PeerMemory> PeerMappings<B> {
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
}
