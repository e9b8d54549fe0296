//! The check of a counts/displacements table against its buffer: right lengths, counts and
//! displacements within `max_count`, regions in bounds and (for receive layouts) disjoint;
//! a short loop accepts the common layout, the full check names the first problem.

use super::Shape;
use crate::error::{ArgumentError, Result};

impl Shape {
    /// Checks one counts/displacements table against a buffer of `buffer_len` bytes.
    ///
    /// A valid layout whose non-empty regions are in rank order (the common case) is
    /// accepted by [`layout_fits`](Self::layout_fits), a short loop that builds nothing;
    /// anything else goes through [`layout_detail`](Self::layout_detail), which accepts
    /// exactly the same layouts and names the first problem of the others.
    #[inline(always)]
    pub(super) fn layout(
        &self,
        which: &'static str,
        counts: &[usize],
        displs: &[usize],
        buffer_len: usize,
        reject_overlap: bool,
    ) -> Result<()> {
        if self.layout_fits(counts, displs, buffer_len, reject_overlap) {
            return Ok(());
        }
        self.layout_detail(which, counts, displs, buffer_len, reject_overlap)
    }

    /// True when [`layout_detail`](Self::layout_detail) is sure to accept the layout: right
    /// table lengths, every count and displacement at most `max_count`, every region inside
    /// the buffer, and (when overlap is rejected) the non-empty regions in ascending order
    /// without overlap. A `false` only means "look closer".
    #[inline(always)]
    pub(super) fn layout_fits(
        &self,
        counts: &[usize],
        displs: &[usize],
        buffer_len: usize,
        reject_overlap: bool,
    ) -> bool {
        if counts.len() != self.size || displs.len() != self.size {
            return false;
        }
        let mut ascending = true;
        let mut prev_end = 0;
        for (&count, &displacement) in counts.iter().zip(displs) {
            if count > self.max_count || displacement > self.max_count {
                return false;
            }
            let Some(end) = displacement.checked_add(count) else {
                return false;
            };
            if end > buffer_len {
                return false;
            }
            if count != 0 {
                ascending &= displacement >= prev_end;
                prev_end = end;
            }
        }
        ascending || !reject_overlap
    }

    /// The full check behind [`layout`](Self::layout): the first problem in table, then
    /// rank, order; regions not in rank order are sorted (allocating) to look for
    /// overlaps.
    #[cold]
    #[inline(never)]
    pub(super) fn layout_detail(
        &self,
        which: &'static str,
        counts: &[usize],
        displs: &[usize],
        buffer_len: usize,
        reject_overlap: bool,
    ) -> Result<()> {
        let (counts_name, displs_name) = match which {
            "send" => ("send counts", "send displacements"),
            _ => ("counts", "displacements"),
        };
        for (name, table) in [(counts_name, counts), (displs_name, displs)] {
            if table.len() != self.size {
                return Err(self.err(ArgumentError::TableLength {
                    which: name,
                    expected: self.size,
                    actual: table.len(),
                }));
            }
        }
        for (index, (&count, &displacement)) in counts.iter().zip(displs).enumerate() {
            self.count(counts_name, index, count)?;
            self.count(displs_name, index, displacement)?;
            let end = displacement.checked_add(count).ok_or_else(|| {
                self.err(ArgumentError::Overflow {
                    what: "displacement + count",
                })
            })?;
            if end > buffer_len {
                return Err(self.err(ArgumentError::OutOfBounds {
                    which,
                    index,
                    displacement,
                    count,
                    buffer_len,
                }));
            }
        }
        if reject_overlap && !ascending_disjoint(counts, displs) {
            let mut regions: Vec<(usize, usize, usize)> = counts
                .iter()
                .zip(displs)
                .enumerate()
                .filter(|(_, (&c, _))| c > 0)
                .map(|(i, (&c, &d))| (d, d + c, i))
                .collect();
            regions.sort_unstable();
            for pair in regions.windows(2) {
                if pair[1].0 < pair[0].1 {
                    return Err(self.err(ArgumentError::Overlap {
                        which,
                        first: pair[0].2,
                        second: pair[1].2,
                    }));
                }
            }
        }
        Ok(())
    }
}

/// True when the non-empty regions, taken in rank order, each start at or after the end of
/// the previous one: the common (dense, rank-ordered) layout, proved disjoint without
/// allocating or sorting. Regions must already be known to be in bounds (no overflow).
fn ascending_disjoint(counts: &[usize], displs: &[usize]) -> bool {
    let mut end = 0;
    for (&c, &d) in counts.iter().zip(displs) {
        if c == 0 {
            continue;
        }
        if d < end {
            return false;
        }
        end = d + c;
    }
    true
}
