//! Forgetting or replacing one exchange's regions: `release` closes the mappings only it
//! uses, `replace_region` swaps what the next reopen exports.

use super::{ExchangeId, PeerMappings};
use crate::error::{IpcError, Result};
use crate::memory::{PeerMemory, Region};

impl<B: PeerMemory> PeerMappings<B> {
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
