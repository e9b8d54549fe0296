//! The `_into` forms (`all_gather_into`, `gather_into`, `broadcast_into`,
//! `Gathered::decode_into`): the same
//! values as the plain forms whatever `out` held before, the allocations of `out` reused, and
//! a defined `out` after every kind of error.

use std::time::Duration;

use proptest::prelude::*;
use tpcomm_objects::{
    all_gather, all_gather_borrowed, all_gather_into, all_gather_into_with, broadcast,
    broadcast_into, broadcast_into_with, gather, gather_into, gather_into_with, DecodeError,
    ObjectError, Options,
};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::{Crafted, FailOn};

fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(30))
}

type R<T> = Result<T, ObjectError>;

/// A value with the containers an engine's per-step state has.
type Item = Vec<(String, Vec<u32>, Option<u16>)>;

/// The value of `rank` in case `seed`: `len` items of varied lengths.
fn item(rank: usize, len: usize, seed: u32) -> Item {
    (0..len)
        .map(|i| {
            let k = (i as u32).wrapping_mul(2_654_435_761) ^ seed ^ rank as u32;
            (
                "s".repeat((k % 40) as usize) + &rank.to_string(),
                (0..k % 9).map(|t| t ^ k).collect(),
                k.is_multiple_of(3).then_some(k as u16),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Whatever `out` held (more values than ranks, fewer, longer or shorter strings and
    /// vectors), it ends equal to the plain form's result, on the small, single and round
    /// paths.
    #[test]
    fn into_forms_equal_the_plain_forms_whatever_out_held_before(
        lens in prop::collection::vec(0usize..30, 1..=5),
        before in prop::collection::vec(0usize..30, 0..8),
        max_count in prop_oneof![Just(usize::MAX), 16usize..200],
        seed in any::<u32>(),
    ) {
        let n = lens.len();
        let opts = Options { small_slot_bytes: (seed % 2) as usize * 64, ..Options::default() };
        let results = group(n).max_count(max_count).run(|comm| -> R<()> {
            let me = comm.rank();
            let mine = item(me, lens[me], seed);
            let mut out: Vec<Item> = before.iter().map(|&l| item(9, l, !seed)).collect();
            all_gather_into_with(&comm, &mine, &mut out, &opts)?;
            assert_eq!(out, all_gather(&comm, &mine)?);
            let expected: Vec<Item> = (0..n).map(|r| item(r, lens[r], seed)).collect();
            assert_eq!(out, expected);
            for root in 0..n {
                let held: Vec<Item> = before.iter().map(|&l| item(8, l, seed)).collect();
                let mut gathered = held.clone();
                let filled = gather_into_with(&comm, root, &mine, &mut gathered, &opts)?;
                assert_eq!(filled, me == root);
                if me == root {
                    assert_eq!(gathered, expected);
                    assert_eq!(Some(gathered), gather(&comm, root, &mine)?);
                } else {
                    assert_eq!(gathered, held, "out is not touched off the root");
                    assert_eq!(None, gather(&comm, root, &mine)?);
                }
                let mut one = item(7, before.first().copied().unwrap_or(3), seed);
                let sent = (me == root).then_some(&mine);
                broadcast_into_with(&comm, root, sent, &mut one, &opts)?;
                assert_eq!(one, broadcast(&comm, root, sent)?);
                assert_eq!(one, expected[root]);
            }
            Ok(())
        });
        for (rank, r) in results.into_iter().enumerate() {
            prop_assert!(matches!(r, Ok(Ok(()))), "rank {}: {:?}", rank, r);
        }
    }
}

/// Strings no longer than the ones `out` held are written into the same allocations.
#[test]
fn into_forms_reuse_the_strings_out_already_holds() {
    let results = group(3).run(|comm| -> R<()> {
        let mut out: Vec<String> = Vec::new();
        all_gather_into(&comm, &"x".repeat(100), &mut out)?;
        let before: Vec<*const u8> = out.iter().map(|s| s.as_ptr()).collect();
        for step in 0..5 {
            let mine = format!("step {step} rank {}", comm.rank());
            all_gather_into(&comm, &mine, &mut out)?;
            let want: Vec<String> = (0..3).map(|r| format!("step {step} rank {r}")).collect();
            assert_eq!(out, want);
            let now: Vec<*const u8> = out.iter().map(|s| s.as_ptr()).collect();
            assert_eq!(
                now, before,
                "the strings of the first call hold every later one"
            );
        }
        let filled = gather_into(&comm, 1, &format!("late rank {}", comm.rank()), &mut out)?;
        if filled {
            assert_eq!(out, ["late rank 0", "late rank 1", "late rank 2"]);
            let now: Vec<*const u8> = out.iter().map(|s| s.as_ptr()).collect();
            assert_eq!(now, before, "gather_into reuses the root's strings too");
        }
        let mut one = "y".repeat(5000);
        let at = one.as_ptr();
        let root_has = (comm.rank() == 2).then(|| "z".repeat(3000));
        broadcast_into(&comm, 2, root_has.as_ref(), &mut one)?;
        assert_eq!(one, "z".repeat(3000));
        assert_eq!(one.as_ptr(), at, "a large broadcast reuses the string too");
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(matches!(r, Ok(Ok(()))), "rank {rank}: {r:?}");
    }
}

/// A string of 5 bytes that are not UTF-8, as postcard frames a string.
fn not_utf8() -> Crafted {
    Crafted(vec![5, 0xff, 0xfe, 0xfd, 0xfc, 0xfb])
}

const HOSTILE: usize = 1;

/// What an honest rank saw: `all_gather_into`'s result and `out`'s length after it,
/// `broadcast_into`'s result, `gather_into`'s result and `out`'s length after it.
type Outcomes = (R<()>, usize, R<()>, R<()>, usize);

/// Bytes that are no `T` from one rank: every honest rank gets `Decode` naming it, and its
/// `out` is empty, not half overwritten.
#[test]
fn a_decode_error_leaves_out_empty_and_names_the_rank() {
    for (size, len) in [(2, 50), (3, 5000)] {
        let results = group(size).run(|comm| -> Option<Outcomes> {
            if comm.rank() == HOSTILE {
                let bad = not_utf8();
                let _ = all_gather_borrowed(&comm, &bad);
                let _ = broadcast(&comm, HOSTILE, Some(&bad));
                let _ = gather(&comm, 0, &bad);
                return None;
            }
            let mut out = vec!["k".repeat(len); size + 2];
            let mine = "m".repeat(len);
            let gathered = all_gather_into(&comm, &mine, &mut out);
            let left = out.len();
            let mut one = "o".repeat(len);
            let broadcasted = broadcast_into::<_, String>(&comm, HOSTILE, None, &mut one);
            let mut at_root = vec!["k".repeat(len); size + 2];
            let rooted = gather_into(&comm, 0, &mine, &mut at_root).map(|_| ());
            Some((gathered, left, broadcasted, rooted, at_root.len()))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let Some((gathered, left, broadcasted, rooted, root_left)) = r.unwrap() else {
                continue;
            };
            if rank == 0 {
                assert!(
                    matches!(rooted, Err(ObjectError::Decode { rank: HOSTILE, .. })),
                    "root of {size}: {rooted:?}"
                );
                assert_eq!(root_left, 0, "the root's out is emptied by a decode error");
            } else {
                // Only the root decodes a gather: the others return, out untouched.
                assert!(
                    matches!(rooted, Ok(())),
                    "rank {rank} of {size}: {rooted:?}"
                );
                assert_eq!(root_left, size + 2, "rank {rank} of {size}");
            }
            for e in [&gathered, &broadcasted] {
                assert!(
                    matches!(
                        e,
                        Err(ObjectError::Decode {
                            rank: HOSTILE,
                            source: DecodeError::Postcard(_)
                        })
                    ),
                    "rank {rank} of {size}: {e:?}"
                );
            }
            assert_eq!(
                left, 0,
                "rank {rank} of {size}: out is emptied by a decode error"
            );
        }
    }
}

/// Errors decided before anything is decoded (a peer's serialization failure, a root
/// without input, a bad root) leave `out` exactly as it was, on every rank.
#[test]
fn an_error_before_decoding_leaves_out_as_it_was() {
    let results = group(3).run(|comm| -> Vec<(R<()>, bool)> {
        let held = |tag: &str| FailOn {
            fail: false,
            text: tag.into(),
        };
        let mut out = vec![held("a"), held("b")];
        let kept = out.clone();
        let mine = FailOn {
            fail: comm.rank() == 2,
            text: "new".into(),
        };
        let failed = all_gather_into(&comm, &mine, &mut out);
        let mut results = vec![(failed, out == kept)];
        let failed = gather_into(&comm, 1, &mine, &mut out).map(|_| ());
        results.push((failed, out == kept));
        let mut one = held("c");
        let missing = broadcast_into::<_, FailOn>(&comm, 0, None, &mut one);
        results.push((missing, one == held("c")));
        let bad_root = broadcast_into(&comm, 3, Some(&held("d")), &mut one);
        results.push((bad_root, one == held("c")));
        let bad_root = gather_into(&comm, 3, &held("e"), &mut out).map(|_| ());
        results.push((bad_root, out == kept));
        results
    });
    for (rank, r) in results.into_iter().enumerate() {
        let r = r.unwrap();
        assert!(
            matches!(&r[0].0, Err(ObjectError::PeerSerialization { ranks, .. }) if ranks == &[2]),
            "rank {rank}: {:?}",
            r[0].0
        );
        assert!(
            matches!(&r[1].0, Err(ObjectError::PeerSerialization { ranks, .. }) if ranks == &[2]),
            "rank {rank}: {:?}",
            r[1].0
        );
        assert!(
            matches!(r[2].0, Err(ObjectError::MissingInput { rank: 0 })),
            "rank {rank}: {:?}",
            r[2].0
        );
        for bad_root in [&r[3].0, &r[4].0] {
            assert!(
                matches!(bad_root, Err(ObjectError::InvalidArgument(_))),
                "rank {rank}: {bad_root:?}"
            );
        }
        for (i, (_, unchanged)) in r.iter().enumerate() {
            assert!(
                unchanged,
                "rank {rank}, case {i}: out was changed by an early error"
            );
        }
    }
}
