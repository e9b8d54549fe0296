//! Inputs found by the fuzz targets in `fuzz/` (`cargo xtask fuzz`), kept as tests.

use tpcomm_objects::fuzzing::{dense_offsets, round, round_count};

/// `fuzz/` target `round_schedule`, input `4a2a05ffffffffffffffff2a05`: one rank of
/// `usize::MAX` bytes in windows of 37. The last round computes `start + limit`, which
/// overflowed (a panic with overflow checks, an empty window without), so its bytes were
/// never scheduled; it saturates now. Reachable only with `Options::max_total_bytes` within
/// one window of `usize::MAX`.
#[test]
fn the_last_round_of_a_total_near_usize_max_covers_the_end_of_the_layout() {
    let lens = [usize::MAX];
    let limit = 37;
    let last = round_count(usize::MAX, limit) - 1;
    let r = round(&lens, &dense_offsets(&lens), limit, last);
    assert_eq!(r.window.end, usize::MAX);
    assert_eq!(r.counts, vec![r.window.len()]);
    assert!(!r.window.is_empty());
}
