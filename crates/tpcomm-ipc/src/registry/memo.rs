//! The slab of opened handles and its memo by handle: a handle is opened once per process
//! however often it is shared, imported out of band or not, and closed with its slot.

use super::{Envelope, PeerMappings, Slot};
use crate::error::{IpcError, Result};
use crate::memory::PeerMemory;

impl<B: PeerMemory> PeerMappings<B> {
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
    pub(super) fn add_slot(&mut self, handle: B::Handle, mapping: B::Mapping) -> usize {
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

    /// An envelope of this group, from rank `from` on this host, or the error that says
    /// which it is not. Nothing of the handle is looked at before these checks.
    pub(super) fn check_envelope(&self, from: usize, env: &Envelope<B::Handle>) -> Result<()> {
        if let (Some(me), Some(peer)) = (self.hosts.identity(self.rank), self.hosts.identity(from))
        {
            if me.on_another_host(peer) {
                return Err(IpcError::OtherHost {
                    rank: from,
                    host: peer.describe_host(),
                    this_host: me.describe_host(),
                });
            }
        }
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
    pub(super) fn close_slot(&mut self, slot: usize) -> Result<bool> {
        let Some(removed) = self.slab.get_mut(slot).and_then(Option::take) else {
            return Ok(false);
        };
        self.memo.remove(&removed.handle);
        // A detached mapping's reservation goes with it.
        drop(removed.detached);
        self.close_mapping(removed.mapping)
    }

    /// Closes a slot's mapping, if open; `Ok(false)` when it was not.
    pub(super) fn close_mapping(&mut self, mapping: Option<B::Mapping>) -> Result<bool> {
        let Some(mapping) = mapping else {
            return Ok(false);
        };
        self.counters.open -= 1;
        self.counters.closes += 1;
        self.backend.close(mapping).map(|()| true)
    }

    /// Per slab index, whether some exchange refers to it.
    pub(super) fn referenced_slots(&self) -> Vec<bool> {
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
}
