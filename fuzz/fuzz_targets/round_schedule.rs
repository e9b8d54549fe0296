//! The round schedule given arbitrary lengths and window limits (`max_count`).
//!
//! Checked without materializing the buffer, so lengths may be huge: the windows tile
//! `0..total` in order, each at most `limit` bytes; in each window every rank's count and
//! displacement is at most `limit`, its bytes land exactly where the dense layout puts them,
//! continue where its previous round stopped, and the counts fill the window. Together
//! these say every byte is moved exactly once. Schedules of more than `MAX_WALK` rounds are
//! checked on their first, last and one chosen round instead of walked in full.
//!
//! The lengths respect what the collectives guarantee before scheduling: their sum fits
//! `usize` (checked by `within_cap`), and `limit >= 1`.
//!
//! Earlier finding, fixed: when the total came within `limit` of `usize::MAX`, the last
//! round's `start + limit` overflowed (regression test in
//! `crates/tpcomm-objects/tests/fuzz_regressions.rs`). `SKIP_KNOWN_OVERFLOW` stays as a
//! switch for the next such finding.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tpcomm_objects::fuzzing::{dense_offsets, round, round_count};

const MAX_WALK: usize = 4096;
const SKIP_KNOWN_OVERFLOW: bool = false;

/// Reads one length: a small one, or any `usize`, chosen by a tag byte.
fn read_usize(data: &mut &[u8]) -> Option<usize> {
    let (&tag, rest) = data.split_first()?;
    *data = rest;
    if tag & 1 == 0 {
        return Some(usize::from(tag >> 1));
    }
    let (bytes, rest) = data.split_at_checked(8)?;
    *data = rest;
    Some(usize::from_le_bytes(bytes.try_into().unwrap()))
}

fn check_round(lens: &[usize], offsets: &[usize], limit: usize, k: usize, sent: &mut [usize]) {
    let r = round(lens, offsets, limit, k);
    let total: usize = lens.iter().sum();
    assert_eq!(
        r.window.start,
        (k * limit).min(total),
        "round {k} starts elsewhere"
    );
    assert!(r.window.end <= total && r.window.len() <= limit);
    assert_eq!(r.counts.len(), lens.len());
    let mut filled = 0usize;
    for rank in 0..lens.len() {
        let (count, displ, src) = (r.counts[rank], r.displs[rank], r.sources[rank].clone());
        assert!(
            count <= limit && displ <= limit,
            "count/displacement over the limit"
        );
        assert_eq!(src.len(), count);
        assert!(src.end <= lens[rank]);
        if count == 0 {
            continue;
        }
        assert!(
            displ + count <= r.window.len(),
            "rank {rank} lands past the window"
        );
        assert_eq!(
            r.window.start + displ,
            offsets[rank] + src.start,
            "rank {rank}'s bytes land outside their place in the dense layout"
        );
        assert_eq!(src.start, sent[rank], "rank {rank} skips or repeats bytes");
        sent[rank] = src.end;
        filled += count;
    }
    assert_eq!(
        filled,
        r.window.len(),
        "round {k} leaves part of its window empty"
    );
}

fuzz_target!(|data: &[u8]| {
    let mut data = data;
    let Some(limit) = read_usize(&mut data) else {
        return;
    };
    let limit = limit.max(1);
    let Some(pick) = read_usize(&mut data) else {
        return;
    };
    let mut lens = Vec::new();
    let mut total = 0usize;
    while lens.len() < 64 {
        let Some(len) = read_usize(&mut data) else {
            break;
        };
        let Some(t) = total.checked_add(len) else {
            break;
        };
        total = t;
        lens.push(len);
    }
    if lens.is_empty() {
        return;
    }
    if SKIP_KNOWN_OVERFLOW && total > usize::MAX - limit {
        return;
    }
    let offsets = dense_offsets(&lens);
    let rounds = round_count(total, limit);
    assert!(rounds >= 1);
    assert!(
        rounds.saturating_sub(1).saturating_mul(limit) < total.max(1),
        "{rounds} rounds of {limit} for {total} bytes: one too many"
    );
    let mut sent = vec![0usize; lens.len()];
    if rounds <= MAX_WALK {
        for k in 0..rounds {
            check_round(&lens, &offsets, limit, k, &mut sent);
        }
        assert_eq!(sent, lens, "the schedule does not move every byte");
        return;
    }
    // Too many rounds to walk: check round 0, one chosen round and the last one, with
    // `sent` set to where each rank's bytes must stand before that round.
    for k in [0, pick % rounds, rounds - 1] {
        let start = k * limit;
        for rank in 0..lens.len() {
            sent[rank] = start.saturating_sub(offsets[rank]).min(lens[rank]);
        }
        check_round(&lens, &offsets, limit, k, &mut sent);
        if k == rounds - 1 {
            assert_eq!(sent, lens, "the last round does not finish every rank");
        }
    }
});
