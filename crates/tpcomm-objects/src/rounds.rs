//! The round schedule: moving a dense, rank-ordered byte layout through calls of at most
//! `limit` bytes.
//!
//! The receive buffer is the concatenation of every rank's bytes in rank order. Round `k`
//! covers bytes `k * limit .. (k + 1) * limit` of that buffer: each rank sends the part of
//! its own bytes that falls in the window (0 when none does), and the counts and
//! displacements of the round are *relative to the window*, so they never exceed `limit`
//! (and so `max_count`) however large the whole buffer is. Because the window is a
//! contiguous slice of the final buffer, every round receives straight into it: no
//! per-round copy, one allocation.

use std::ops::Range;

/// One round of a schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Round {
    /// The window of the final buffer this round fills.
    pub(crate) window: Range<usize>,
    /// Bytes each rank sends this round.
    pub(crate) counts: Vec<usize>,
    /// Where each rank's bytes land, relative to `window.start` (0 for empty counts).
    pub(crate) displs: Vec<usize>,
    /// The part of each rank's own bytes it sends this round (empty when none).
    pub(crate) sources: Vec<Range<usize>>,
}

/// Offsets of each rank's bytes in the dense layout.
pub(crate) fn dense_offsets(lens: &[usize]) -> Vec<usize> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            let d = at;
            at += l;
            d
        })
        .collect()
}

/// Number of rounds for `total` bytes in windows of `limit` (at least 1, so that every
/// rank still meets once for an all-empty exchange).
pub(crate) fn round_count(total: usize, limit: usize) -> usize {
    total.div_ceil(limit).max(1)
}

/// Round `k` of the schedule of `lens` with window `limit`.
pub(crate) fn round(lens: &[usize], offsets: &[usize], limit: usize, k: usize) -> Round {
    let total: usize = lens.iter().sum();
    let start = k * limit;
    // Saturating: a total within one window of usize::MAX must not wrap (found by fuzzing).
    let end = start.saturating_add(limit).min(total);
    let mut counts = Vec::with_capacity(lens.len());
    let mut displs = Vec::with_capacity(lens.len());
    let mut sources = Vec::with_capacity(lens.len());
    for (&len, &off) in lens.iter().zip(offsets) {
        let lo = off.max(start);
        let hi = (off + len).min(end);
        if lo < hi {
            counts.push(hi - lo);
            displs.push(lo - start);
            sources.push(lo - off..hi - off);
        } else {
            counts.push(0);
            displs.push(0);
            sources.push(0..0);
        }
    }
    Round {
        window: start..end.max(start),
        counts,
        displs,
        sources,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Replaying the schedule into a buffer reproduces the dense layout exactly, every
        /// count and displacement stays within the limit, and nothing is sent twice.
        #[test]
        fn schedule_reassembles_the_dense_layout_within_the_limit(
            lens in prop::collection::vec(0usize..200, 1..9),
            limit in 1usize..70,
        ) {
            let offsets = dense_offsets(&lens);
            let total: usize = lens.iter().sum();
            let mut buf = vec![None; total];
            let mut sent = vec![0usize; lens.len()];
            for k in 0..round_count(total, limit) {
                let r = round(&lens, &offsets, limit, k);
                prop_assert!(r.window.len() <= limit);
                for rank in 0..lens.len() {
                    prop_assert!(r.counts[rank] <= limit && r.displs[rank] <= limit);
                    prop_assert_eq!(r.sources[rank].len(), r.counts[rank]);
                    prop_assert!(r.displs[rank] + r.counts[rank] <= r.window.len());
                    for (i, src) in r.sources[rank].clone().enumerate() {
                        let at = r.window.start + r.displs[rank] + i;
                        prop_assert!(buf[at].is_none(), "byte {} written twice", at);
                        buf[at] = Some((rank, src));
                    }
                    sent[rank] += r.counts[rank];
                }
            }
            prop_assert_eq!(&sent, &lens);
            let expected: Vec<_> = lens
                .iter()
                .enumerate()
                .flat_map(|(rank, &l)| (0..l).map(move |i| Some((rank, i))))
                .collect();
            prop_assert_eq!(buf, expected);
        }
    }

    #[test]
    fn an_empty_exchange_still_has_one_round() {
        assert_eq!(round_count(0, 10), 1);
        let r = round(&[0, 0], &[0, 0], 10, 0);
        assert_eq!(r.counts, vec![0, 0]);
        assert!(r.window.is_empty());
    }
}
