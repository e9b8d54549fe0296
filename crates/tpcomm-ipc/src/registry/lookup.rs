//! What the exchanges hold, looked up: a peer's mapping, an address, a region's length, and
//! the regions whose mappings would keep a process checkpoint from restoring.

use super::{CheckpointBlocker, ExchangeId, PeerMappings};
use crate::error::{IpcError, Result};
use crate::memory::{PeerMemory, Region};

impl<B: PeerMemory> PeerMappings<B> {
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
            return self.own_region(id, index).map(|r| r.addr);
        }
        self.peer(id, rank, index).map(MemoryRegion::addr)
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
            return self.own_region(id, index).map(|r| r.len);
        }
        self.peer(id, rank, index).map(MemoryRegion::len)
    }

    /// This rank's region `index` of exchange `id`, as it shared it.
    fn own_region(&self, id: ExchangeId, index: usize) -> Result<Region> {
        let x = self
            .exchanges
            .get(id.0)
            .ok_or_else(|| IpcError::NoSuchMapping(format!("exchange {}", id.0)))?;
        x.local.get(index).copied().ok_or_else(|| {
            IpcError::NoSuchMapping(format!("exchange {}, own region {index}", id.0))
        })
    }
}
