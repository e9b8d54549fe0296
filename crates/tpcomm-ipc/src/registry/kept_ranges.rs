//! The address ranges a fresh reopen maps handles back into: each region takes the detached
//! mapping of the slot it had, found by its position in the exchange.

use super::Slot;
use crate::memory::PeerMemory;

/// The detached mappings of the slab that a fresh reopen replaces, found by the positions the
/// exchanges gave them: region `i` of rank `r` in an exchange takes back the range of the
/// slot it had there.
pub(super) struct KeptRanges<'a, B: PeerMemory> {
    pub(super) slab: &'a mut [Option<Slot<B>>],
    /// The exchange's old `slots[rank][index]`.
    pub(super) rows: &'a [Vec<Option<usize>>],
}

impl<B: PeerMemory> KeptRanges<'_, B> {
    pub(super) fn row(&mut self, rank: usize) -> KeptRow<'_, B> {
        KeptRow {
            slab: self.slab,
            slots: self.rows.get(rank).map_or(&[][..], Vec::as_slice),
        }
    }
}

/// One rank's row of [`KeptRanges`].
pub(super) struct KeptRow<'a, B: PeerMemory> {
    slab: &'a mut [Option<Slot<B>>],
    slots: &'a [Option<usize>],
}

impl<B: PeerMemory> KeptRow<'_, B> {
    /// The detached mapping of region `index`'s old slot, taken (a slot shared by several
    /// regions gives it to the first).
    pub(super) fn take(&mut self, index: usize) -> Option<B::Mapping> {
        let slot = (*self.slots.get(index)?)?;
        self.slab.get_mut(slot)?.as_mut()?.detached.take()
    }
}
