//! The stable tables (RankSignals, the RankData slots), written from the current mappings at
//! creation, registration and resume, and the limits every launch is checked against.

use tpcomm_ipc::{MemoryRegion, PeerMemory};

use super::{open, CustomAllReduce, SlotSource, SIGNAL, STAGING, TEMP};
use crate::backend::{Backend, RANK_DATA_BYTES, RANK_SIGNALS_BYTES};
use crate::error::{AllReduceError, Result};

/// Bytes every address written into the tables is aligned to: the kernels move 16-byte
/// packs, and the host reduction reads elements where they lie. Honest ranks share
/// page-aligned host buffers and device buffers aligned to at least this.
pub(super) const PEER_ALIGN: usize = 16;

/// `addr`, when rank `rank`'s `region` lies at an address every launch can read: a forged
/// handle could place it anywhere inside a genuine segment.
fn peer_aligned(rank: usize, region: &'static str, addr: u64) -> Result<u64> {
    if addr.is_multiple_of(PEER_ALIGN as u64) {
        return Ok(addr);
    }
    Err(AllReduceError::PeerMisaligned {
        rank,
        region,
        addr,
        align: PEER_ALIGN,
    })
}

impl<B: Backend> CustomAllReduce<B> {
    /// The address at which region `index` (0 Signal, 1 staging, 2 temp) of `rank` is
    /// mapped now.
    pub fn base_address(&self, rank: usize, index: usize) -> Result<u64> {
        let res = self.resources("base_address")?;
        Ok(res.peers.address(res.base, rank, index)?)
    }

    /// The address of this rank's RankSignals table (never changes).
    pub fn rank_signals_address(&self) -> Result<u64> {
        Ok(self.resources("rank_signals_address")?.rank_signals.addr())
    }

    /// The addresses RankData slot `slot` holds now, one per rank (read back from the
    /// table; zero for a slot never written).
    pub fn rank_data_slot(&self, slot: usize) -> Result<Vec<u64>> {
        if slot >= self.slots.len() {
            return Err(AllReduceError::InvalidArgument(format!(
                "slot {slot} is outside the pool of {}",
                self.slots.len()
            )));
        }
        let res = self.resources("rank_data_slot")?;
        let mut raw = [0u8; RANK_DATA_BYTES];
        res.peers
            .backend()
            .read(&res.rank_data, slot * RANK_DATA_BYTES, &mut raw)?;
        Ok(raw
            .chunks_exact(8)
            .take(self.world)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect())
    }

    /// Rewrites every RankSignals entry and every RankData slot from the current mappings.
    pub(super) fn write_tables(&mut self) -> Result<()> {
        let res = open(&self.res, "write_tables")?;
        let memory = res.peers.backend();
        let mut table = [0u8; RANK_SIGNALS_BYTES];
        let mut temp_limit = (usize::MAX, self.rank);
        for r in 0..self.world {
            // Launches access every rank's Signal block with this backend's layout.
            let signal_len = res.peers.region_len(res.base, r, SIGNAL)?;
            if signal_len < self.backend.signal_bytes() {
                return Err(AllReduceError::SignalTooSmall {
                    rank: r,
                    bytes: signal_len,
                    needed: self.backend.signal_bytes(),
                });
            }
            let signal = peer_aligned(r, "Signal block", res.peers.address(res.base, r, SIGNAL)?)?;
            let temp = peer_aligned(r, "temp buffer", res.peers.address(res.base, r, TEMP)?)?;
            let temp_len = res.peers.region_len(res.base, r, TEMP)?;
            if temp_len < temp_limit.0 {
                temp_limit = (temp_len, r);
            }
            table[8 * r..8 * r + 8].copy_from_slice(&signal.to_le_bytes());
            table[64 + 8 * r..64 + 8 * r + 8].copy_from_slice(&temp.to_le_bytes());
        }
        // The pool up to its last used slot, in one write (one device copy for CUDA): free
        // and pending slots hold zeros, as they did since the pool was allocated.
        let used = self
            .slots
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |s| s + 1);
        let mut pool = vec![0u8; used * RANK_DATA_BYTES];
        let mut limits = vec![(0, self.rank); self.slots.len()];
        for (slot, source) in self.slots[..used].iter().enumerate() {
            let (id, index) = match source {
                Some(SlotSource::Eager) => (res.base, STAGING),
                Some(SlotSource::Exchanged(id, index)) => (*id, *index),
                Some(SlotSource::Pending | SlotSource::Retired) | None => continue,
            };
            let entry = &mut pool[slot * RANK_DATA_BYTES..][..RANK_DATA_BYTES];
            let mut limit = (usize::MAX, self.rank);
            for r in 0..self.world {
                let addr = peer_aligned(r, "input", res.peers.address(id, r, index)?)?;
                entry[8 * r..8 * r + 8].copy_from_slice(&addr.to_le_bytes());
                let len = res.peers.region_len(id, r, index)?;
                if len < limit.0 {
                    limit = (len, r);
                }
            }
            limits[slot] = limit;
        }
        // Entries as the device holds them already need no write: a resume that kept every
        // peer address (stable addresses) leaves the tables alone. A failed write forgets
        // what the device holds, so the next rewrite writes everything.
        let unchanged = self
            .written
            .as_ref()
            .is_some_and(|(signals, data)| *signals == table && *data == pool);
        if !unchanged {
            self.written = None;
            self.backend
                .write_table(memory, &res.rank_signals, 0, &table)?;
            self.backend.write_table(memory, &res.rank_data, 0, &pool)?;
            self.table_writes += 1;
            self.written = Some((table.to_vec(), pool));
        }
        self.slot_limits = limits;
        self.temp_limit = temp_limit;
        Ok(())
    }

    /// How many times the stable tables were written to the backend: at creation, after a
    /// registration, and after a resume that moved a peer address. A resume whose every
    /// peer address was kept ([`PeerMemory::keeps_addresses`]) writes nothing.
    pub fn table_writes(&self) -> u64 {
        self.table_writes
    }

    pub(super) fn free_slot(&self) -> Result<usize> {
        self.slots
            .iter()
            .position(Option::is_none)
            .ok_or(AllReduceError::SlotsExhausted(self.slots.len()))
    }
}
