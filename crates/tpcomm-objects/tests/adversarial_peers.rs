//! Peers that lie in the header exchange, or call another collective of the same header
//! shape: nothing may panic, and a rank that can tell the exchange is wrong must say so
//! (`Corrupt`) instead of returning a value it never had; ranks that read the same header
//! must take the same decision.

mod common;

use std::time::Duration;

use common::{FailOn, Rewriting};
use serde_bytes::ByteBuf;
use tpcomm_objects::{
    all_gather, all_to_all, broadcast, exscan_with, scan_with, scatter, ObjectError,
};
use tpcomm_transport::{Communicator, LocalGroup, Result as TResult};

fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(5))
}

/// Runs `f` on `n` ranks over [`Rewriting`]; a panic on any rank fails the test.
fn run_rewritten<T: Send>(
    n: usize,
    rewrite: &(dyn Fn(usize, &mut [u8]) + Sync),
    f: impl Fn(&Rewriting<'_>) -> T + Sync,
) -> Vec<T> {
    group(n)
        .run(|inner| {
            f(&Rewriting {
                inner,
                headers: rewrite,
                payloads: &|_| {},
            })
        })
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect()
}

/// Sets the length word of `rank`'s 256-byte gather/broadcast entry.
fn set_entry_word(recv: &mut [u8], rank: usize, word: u64) {
    recv[rank * 256..rank * 256 + 8].copy_from_slice(&word.to_le_bytes());
}

/// A rank that failed to serialize sends the failure sentinel; when the exchange turns it
/// into a length, that rank has no bytes to send. It must say the header is corrupt, not
/// panic on the payload it does not have (and its peers must not wait for it forever).
#[test]
fn a_failed_ranks_sentinel_turned_into_a_length_is_corrupt_not_a_panic() {
    for len in [3u64, 300] {
        let rewrite = move |entry: usize, recv: &mut [u8]| {
            if entry == 256 {
                set_entry_word(recv, 1, len);
            }
        };
        let results = run_rewritten(3, &rewrite, |c| {
            let mine = FailOn {
                fail: c.rank() == 1,
                text: "x".repeat(250),
            };
            all_gather(c, &mine).map(drop)
        });
        assert!(
            matches!(results[1], Err(ObjectError::Corrupt(_))),
            "length {len}: rank 1: {:?}",
            results[1]
        );
        if len == 300 {
            for rank in [0, 2] {
                assert!(
                    matches!(results[rank], Err(ObjectError::Transport(_))),
                    "length {len}: rank {rank}: {:?}",
                    results[rank]
                );
            }
        }
    }
}

/// A broadcast root that passed no value announced `MissingInput`; when the exchange turns
/// its sentinel into a length, the root knows it had no value and must not return one.
#[test]
fn a_broadcast_root_without_a_value_never_returns_one() {
    for len in [1u64, 300] {
        let rewrite = move |entry: usize, recv: &mut [u8]| {
            if entry == 256 {
                set_entry_word(recv, 1, len);
            }
        };
        let results = run_rewritten(3, &rewrite, |c| broadcast::<_, u8>(c, 1, None));
        assert!(
            matches!(results[1], Err(ObjectError::Corrupt(_))),
            "length {len}: root: {:?}",
            results[1]
        );
    }
}

/// A broadcast root whose own length word changed (within the inline slot) decodes bytes
/// it never sent: it must notice, as a gather sender does.
#[test]
fn a_broadcast_root_notices_its_own_length_changed_on_the_small_path() {
    let rewrite = |entry: usize, recv: &mut [u8]| {
        if entry == 256 {
            set_entry_word(recv, 0, 2);
        }
    };
    let results = run_rewritten(2, &rewrite, |c| {
        let mine = (c.rank() == 0).then(|| vec![7u8, 7, 7]);
        broadcast(c, 0, mine.as_ref())
    });
    assert!(
        matches!(results[0], Err(ObjectError::Corrupt(_))),
        "root: {:?}",
        results[0]
    );
}

/// A scatter root whose lengths arrive permuted (same sum) would hand each rank a slice
/// cut at the wrong places. The root can tell: its own lengths are not the announced ones.
#[test]
fn a_scatter_root_notices_its_lengths_permuted_with_the_same_sum() {
    let size = 3;
    let block = 24 + 8 * size;
    let rewrite = move |entry: usize, recv: &mut [u8]| {
        if entry == block {
            // Root 0's words: lengths [2, 4, 6] become [6, 4, 2].
            let words: Vec<[u8; 8]> = (0..size)
                .map(|d| recv[24 + 8 * d..32 + 8 * d].try_into().unwrap())
                .collect();
            for d in 0..size {
                recv[24 + 8 * d..32 + 8 * d].copy_from_slice(&words[size - 1 - d]);
            }
        }
    };
    let results = run_rewritten(size, &rewrite, |c| {
        let shards: Vec<ByteBuf> = (0..size)
            .map(|d| ByteBuf::from(vec![d as u8; 2 * d + 1]))
            .collect();
        scatter(c, 0, (c.rank() == 0).then_some(&shards[..]))
    });
    assert!(
        matches!(results[0], Err(ObjectError::Corrupt(_))),
        "root: {:?}",
        results[0]
    );
    for (rank, r) in results.iter().enumerate().skip(1) {
        assert!(
            matches!(r, Err(ObjectError::Transport(_))),
            "rank {rank}: {r:?}"
        );
    }
}

/// A collective whose protocol differs from its peers' (an all-to-all against scans, whose
/// blocks have the same size) is an `OptionsMismatch` of `"collective"` on every rank: no
/// rank decodes the other's lengths as its own.
fn assert_collective_mismatch_everywhere<T: std::fmt::Debug>(
    what: &str,
    results: Vec<TResult<Result<T, ObjectError>>>,
) {
    let results: Vec<_> = results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}")))
        .collect();
    for (rank, r) in results.iter().enumerate() {
        assert!(
            matches!(
                r,
                Err(ObjectError::OptionsMismatch {
                    option: "collective",
                    ..
                })
            ),
            "{what}: rank {rank}: {r:?} (every rank: {results:?})"
        );
    }
}

#[test]
fn an_all_to_all_against_scans_is_a_collective_mismatch_on_every_rank() {
    let results = group(3).run(|comm| {
        if comm.rank() == 2 {
            let out: Vec<String> = (0..3).map(|d| format!("2->{d}")).collect();
            all_to_all(&comm, &out).map(|_| String::new())
        } else {
            scan_with(&comm, &format!("r{}", comm.rank()), |a, b| a + &b)
        }
    });
    assert_collective_mismatch_everywhere("all_to_all / scan", results);
}

#[test]
fn ranks_mixing_scan_and_exscan_get_a_collective_mismatch_on_every_rank() {
    let results = group(3).run(|comm| {
        let mine = format!("r{}", comm.rank());
        if comm.rank() == 0 {
            scan_with(&comm, &mine, |a, b| a + &b).map(Some)
        } else {
            exscan_with(&comm, &mine, |a, b| a + &b)
        }
    });
    assert_collective_mismatch_everywhere("scan / exscan", results);
}

/// In a scan, every rank reads every rank's lengths: a sender whose lengths do not fit a
/// scan (here rank 2 runs an all-to-all, but its header claims a scan) is refused by every
/// rank that reads them, before any payload moves, instead of by the ranks that receive
/// its bytes while it returns a result.
#[test]
fn a_sender_that_breaks_the_scan_pattern_is_refused_by_every_scanning_rank() {
    let size = 3;
    let block = 24 + 8 * size;
    let scan_magic = 0xB5;
    let rewrite = move |entry: usize, recv: &mut [u8]| {
        if entry == block {
            recv[2 * block] = scan_magic;
        }
    };
    let results = run_rewritten(size, &rewrite, |c| {
        if c.rank() == 2 {
            let out: Vec<String> = (0..size).map(|d| format!("2->{d}")).collect();
            all_to_all(c, &out).map(|_| String::new())
        } else {
            scan_with(c, &format!("r{}", c.rank()), |a, b| a + &b)
        }
    });
    // The all-to-all rank checks no scan shape, but sees its own field arrive changed
    // (before that check it failed in the transport once its peers refused, and before the
    // scan check it completed with `Ok`).
    assert!(
        matches!(&results[2], Err(ObjectError::Corrupt(m)) if m.contains("options field")),
        "rank 2: {:?}",
        results[2]
    );
    // The scanning ranks refuse from the header. One that is slow to read it may instead
    // find the group aborted by the other, which left after refusing (the local group
    // aborts every waiting rank when a rank drops its communicator).
    let refused = |r: &Result<String, ObjectError>| matches!(r, Err(ObjectError::Corrupt(m)) if m.contains("rank 2"));
    assert!(
        results[..2].iter().any(refused)
            && results[..2]
                .iter()
                .all(|r| refused(r) || matches!(r, Err(ObjectError::Transport(_)))),
        "every rank: {results:?}"
    );
}

/// `broadcast` and `gather` (the same root, the same options) exchange headers of the same
/// size and shape: ranks that call one against the other must all fail before any payload
/// call (which would be a broadcast against a gather: an erroneous MPI program), not some
/// return values while the others fail.
#[test]
fn a_broadcast_against_a_gather_fails_every_rank() {
    for len in [8, 1000] {
        let results = group(3).run(|comm| {
            let mine = ByteBuf::from(vec![comm.rank() as u8; len]);
            if comm.rank() == 0 {
                tpcomm_objects::gather(&comm, 0, &mine).map(drop)
            } else {
                broadcast::<_, ByteBuf>(&comm, 0, None).map(drop)
            }
        });
        assert_collective_mismatch_everywhere(&format!("gather / broadcast, {len} bytes"), results);
    }
}

/// Rank 1 calls `gather` with root 1, the others with root 0, and the exchange replaces
/// rank 1's options field with rank 0's: every field rank 1 receives agrees with every
/// other, but not with what it sent. It took that for agreement and returned the values as
/// their root, with no error anywhere.
#[test]
fn a_rank_whose_own_options_field_arrives_changed_says_corrupt() {
    let rewrite = |entry: usize, recv: &mut [u8]| {
        if entry == 256 {
            let rank0: Vec<u8> = recv[8..32].to_vec();
            recv[256 + 8..256 + 32].copy_from_slice(&rank0);
        }
    };
    let results = run_rewritten(3, &rewrite, |c| {
        let root = if c.rank() == 1 { 1 } else { 0 };
        tpcomm_objects::gather(c, root, &(c.rank() as u32))
    });
    match &results[1] {
        Err(ObjectError::Corrupt(why)) => assert!(why.contains("options field"), "{why}"),
        other => panic!("rank 1: expected Corrupt, got {other:?}"),
    }
    // Ranks 0 and 2 read fields that all agree with theirs: they cannot tell.
    assert_eq!(
        results[0].as_ref().unwrap().as_deref(),
        Some(&[0u32, 1, 2][..])
    );
    assert_eq!(results[2].as_ref().unwrap(), &None);
}

/// A broadcast root of 5 MiB (a call whose ranks agree on their receive buffers) finds
/// its own length changed in the header: it says `Corrupt`, and its peers, which were
/// left waiting for its payload until the transport's timeout, now learn it in the
/// one-byte agreement.
#[test]
fn a_large_broadcast_whose_root_lost_its_length_fails_every_rank_in_step() {
    let rewrite = |entry: usize, recv: &mut [u8]| {
        if entry == 256 {
            let word = u64::from_le_bytes(recv[0..8].try_into().unwrap());
            set_entry_word(recv, 0, word + 1);
        }
    };
    let results = run_rewritten(3, &rewrite, |c| {
        let value = ByteBuf::from(vec![c.rank() as u8; 5 << 20]);
        let out = broadcast(c, 0, (c.rank() == 0).then_some(&value)).map(drop);
        // Still in step: a collective after it pairs.
        (out, c.barrier())
    });
    for (rank, (out, next)) in results.into_iter().enumerate() {
        match (rank, out) {
            (0, Err(ObjectError::Corrupt(_))) => {}
            (_, Err(ObjectError::PeerAllocation { ranks })) => assert_eq!(ranks, [0]),
            (rank, other) => panic!("rank {rank}: {other:?}"),
        }
        next.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}
