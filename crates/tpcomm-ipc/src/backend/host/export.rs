//! Exporting: the handle of a range inside one live buffer of this process, one region at a
//! time or many at once (a walk up the table of live buffers instead of a search each).

use std::ops::Bound::{Excluded, Unbounded};

use super::segment_table::{Exportable, SegmentTable};
use super::HostHandle;
use crate::error::{IpcError, Result};
use crate::memory::Region;

/// Exports `len` bytes at `addr`, which must lie inside one live buffer of `table`, as a
/// handle of process `pid`.
pub(super) fn export_from(
    table: &SegmentTable,
    pid: u32,
    addr: u64,
    len: usize,
) -> Result<HostHandle> {
    let below = usize::try_from(addr)
        .ok()
        .and_then(|a| table.by_addr.range(..=a).next_back());
    handle_in(below, pid, addr, len)
}

/// Exports every region of `regions` (in their order) from `table`. Regions are looked at
/// in address order, walking up the table from the buffer of the region before: a region
/// within `WALK` (8) buffers of it is found without a search (a registry's regions are
/// mostly buffers allocated one after the other; 1000 graph buffers in a table of 2000
/// buffers: 48-56 us against 66-72 us with a search each). The first region, in `regions`'
/// order, that is not exportable is the error.
pub(super) fn export_many(
    table: &SegmentTable,
    pid: u32,
    regions: &[Region],
) -> Result<Vec<HostHandle>> {
    /// Buffers a region's search walks up before it searches the table instead.
    const WALK: usize = 8;
    let mut order: Vec<usize> = (0..regions.len()).collect();
    order.sort_unstable_by_key(|&i| regions[i].addr);
    // Each region's buffer: the one with the highest base not above it (if any).
    let mut below: Vec<Option<(&usize, &Exportable)>> = vec![None; regions.len()];
    // The buffer of the previous region in address order, and the buffers above it.
    let mut held = None;
    let mut above = table.by_addr.range(..);
    for i in order {
        let Ok(a) = usize::try_from(regions[i].addr) else {
            // Not an address of this process: `handle_in` refuses it.
            continue;
        };
        for steps in 0..=WALK {
            let mut ahead = above.clone();
            match ahead.next() {
                Some(next) if *next.0 <= a && steps < WALK => {
                    held = Some(next);
                    above = ahead;
                }
                Some(next) if *next.0 <= a => {
                    held = table.by_addr.range(..=a).next_back();
                    above = table.by_addr.range((Excluded(a), Unbounded));
                }
                // Regions in address order: `held` is the highest base not above `a`.
                _ => break,
            }
        }
        below[i] = held;
    }
    regions
        .iter()
        .zip(below)
        .map(|(r, below)| handle_in(below, pid, r.addr, r.len))
        .collect()
}

/// The handle of `len` bytes at `addr` in `below`, the live buffer with the highest base
/// address not above `addr` (if any).
fn handle_in(
    below: Option<(&usize, &Exportable)>,
    pid: u32,
    addr: u64,
    len: usize,
) -> Result<HostHandle> {
    let not = |reason: &str| IpcError::NotExportable {
        addr,
        len,
        reason: reason.into(),
    };
    let a = usize::try_from(addr).map_err(|_| not("address out of range"))?;
    let (&base, buf) = below.ok_or_else(|| not("not inside a buffer of this backend"))?;
    let inside = a - base;
    if inside >= buf.len || len == 0 || inside.checked_add(len).is_none_or(|end| end > buf.len) {
        return Err(not("range not inside one buffer (or empty)"));
    }
    Ok(HostHandle {
        pid,
        fd: buf.fd,
        dev: buf.dev,
        inode: buf.inode,
        segment_len: buf.segment_len as u64,
        offset: (buf.offset + inside) as u64,
        len: len as u64,
    })
}
