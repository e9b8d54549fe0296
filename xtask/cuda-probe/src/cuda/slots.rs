//! The VMM mapping slots (the own allocation, the import, the second mapping): what is
//! mapped where, its data read and written, and its release with the reservation kept.

use cudarc::driver::sys;

use super::calls::Calls;
use super::{Cuda, Slot, Which};

impl Cuda {
    fn slot(&mut self, which: Which) -> &mut Slot {
        match which {
            Which::Own => &mut self.own,
            Which::Import => &mut self.import,
            Which::Second => &mut self.second,
        }
    }

    fn mapped_at(&mut self, c: &mut Calls<'_>, which: Which) -> Option<sys::CUdeviceptr> {
        let slot = self.slot(which);
        match (slot.mapped, slot.reservation) {
            (true, Some((va, _))) => Some(va),
            _ => {
                c.note(
                    "map",
                    false,
                    "NOT_MAPPED",
                    format!("nothing is mapped in the {which:?} slot"),
                );
                None
            }
        }
    }

    pub(super) fn slot_read(&mut self, c: &mut Calls<'_>, which: Which, seed: u8) {
        if let Some(va) = self.mapped_at(c, which) {
            self.read_check(c, which.describe(), va, seed);
        }
    }

    pub(super) fn slot_write(&mut self, c: &mut Calls<'_>, which: Which, seed: u8) {
        if let Some(va) = self.mapped_at(c, which) {
            self.write_pattern(c, which.describe(), va, seed);
        }
    }

    /// Unmaps and releases what the slot holds and closes its descriptors; the reservation
    /// stays.
    pub(super) fn slot_release(&mut self, c: &mut Calls<'_>, which: Which) {
        let slot = self.slot(which);
        let (reservation, mapped, handle) = (slot.reservation, slot.mapped, slot.handle);
        if let (true, Some((va, size))) = (mapped, reservation) {
            // SAFETY: the range is this process's mapping; nothing reads it after this.
            let r = unsafe { sys::cuMemUnmap(va, size) };
            let ok = c.cu(
                "cuMemUnmap",
                r,
                format!("{} at {va:#x} (reservation kept)", which.describe()),
            );
            if ok {
                self.slot(which).mapped = false;
            }
        }
        if let Some(h) = handle {
            // SAFETY: a handle this process created or imported, released once.
            let r = unsafe { sys::cuMemRelease(h) };
            if c.cu(
                "cuMemRelease",
                r,
                format!("the handle of {}", which.describe()),
            ) {
                self.slot(which).handle = None;
            }
        }
        let fds = std::mem::take(&mut self.slot(which).fds);
        if !fds.is_empty() {
            let n = fds.len();
            drop(fds);
            c.note(
                "close",
                true,
                "OK",
                format!("{n} descriptor(s) of {} closed", which.describe()),
            );
        }
    }
}
