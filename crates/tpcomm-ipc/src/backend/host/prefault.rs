//! Prefaulting: the pages of small peer mappings are mapped when they are opened, by
//! reading a byte of each, rather than at their first use after a resume.

use std::sync::atomic::{AtomicU8, Ordering};

use super::segment::page_size;
use super::{HostMapping, HostMemory};
use crate::memory::MemoryRegion;

/// Maps the pages of the small mappings among `mappings` (at most
/// [`HostMemory::CARVE_MAX_BYTES`]: Signal blocks, tables, graph buffers) now, by reading a
/// byte of each of their pages, rather than at first use.
///
/// A fresh mapping costs a page-table entry per page whenever it is made: after a resume
/// that is the first replay of an engine's graph, 1.27-1.35x the steady one with 1000
/// graph buffers (`tpcomm-bench lifecycle`), against 1.04-1.10x when the pages are mapped here
/// (at about the same cost, paid by `reinit_after_resume`). A read fault on a shared
/// mapping maps the page writable, and with it the neighbours already in the file (the
/// kernel's fault-around, 16 pages), so the flag writes do not fault and a run of pages
/// takes one fault per 16. Touching was measured 25-50% faster than `MADV_POPULATE_READ`,
/// which walks every page through `get_user_pages` (1000 pages of a memfd: 240-420 against
/// 405-720 us on a 2-vCPU VM). Large buffers (staging, temp) are left to fault in when used:
/// mapping them would cost every resume, and allocate memory for peers' pages never touched.
pub(super) fn prefault(mappings: &[HostMapping]) {
    let page = page_size();
    let mut ranges: Vec<(usize, usize)> = mappings
        .iter()
        .filter(|m| m.len <= HostMemory::CARVE_MAX_BYTES)
        .map(|m| {
            let start = m.addr() as usize;
            // Whole pages of the segment's mapping, which is whole pages itself.
            (start - start % page, (start + m.len).next_multiple_of(page))
        })
        .collect();
    ranges.sort_unstable();
    let mut next = 0;
    for (start, end) in ranges {
        // Ranges sorted by start: a page below `next` was read already.
        for addr in (start.max(next)..end).step_by(page) {
            // SAFETY: `addr` is the first byte of a page inside a live mapping of this
            // backend (held by `mappings`), whose segment is sealed against shrinking, so
            // the read cannot fault past its end; an atomic load is defined whatever peers
            // write there at the same time, and changes no byte.
            let byte = unsafe { AtomicU8::from_ptr(addr as *mut u8) };
            std::hint::black_box(byte.load(Ordering::Relaxed));
        }
        next = next.max(end);
    }
}
