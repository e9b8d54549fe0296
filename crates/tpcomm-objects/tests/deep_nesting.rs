//! A peer that sends a recursive value nested 10,000 or 30,000 levels deep (20 to 60 KB of
//! crafted bytes) through every collective. postcard decodes by recursion, so without a bound
//! each honest rank overflowed its stack and the process aborted; with `Options::max_depth`
//! every honest rank returns `Decode { rank, source: TooDeep }` naming the sender.
//!
//! Every rank runs on a thread with an explicit 2 MiB stack (the default of spawned threads,
//! set here so that `RUST_MIN_STACK` cannot hide an overflow).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tpcomm_objects::{
    all_gather, all_gather_borrowed, all_gather_into, all_reduce_with, all_to_all, broadcast,
    broadcast_into, decode_from, decode_from_with, gather, gather_into, scatter, DecodeError,
    ObjectError, Options,
};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

mod common;
use common::Crafted;

/// An enum holding `Vec<Self>`: postcard writes a node as `[1, 1]` (variant, one child).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Tree {
    Leaf,
    Node(Vec<Tree>),
}

/// An enum holding `Box<Self>`: postcard writes a link as `[1]`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Chain {
    End,
    Link(Box<Chain>),
}

/// `levels` nested nodes of `T` ending in its leaf, as postcard encodes them.
fn crafted(kind: Kind, levels: usize) -> Crafted {
    let mut b = match kind {
        Kind::VecOfSelf => [1u8, 1].repeat(levels),
        Kind::BoxOfSelf => vec![1u8; levels],
    };
    b.push(0);
    Crafted(b)
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    VecOfSelf,
    BoxOfSelf,
}

const HOSTILE: usize = 1;
const STACK: usize = 2 << 20;

/// Runs `f` on `n` ranks, each on its own thread with a 2 MiB stack.
fn run_on_small_stacks<T: Send>(n: usize, f: impl Fn(LocalCommunicator) -> T + Sync) -> Vec<T> {
    let comms = LocalGroup::new(n)
        .timeout(Duration::from_secs(30))
        .communicators()
        .expect("a local group");
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                std::thread::Builder::new()
                    .stack_size(STACK)
                    .spawn_scoped(scope, move || f(comm))
                    .expect("spawn a rank")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no rank panics"))
            .collect()
    })
}

/// What an honest rank must get: a decode error naming the hostile rank, because of depth.
fn assert_too_deep<T: std::fmt::Debug>(what: &str, rank: usize, r: &Result<T, ObjectError>) {
    assert!(
        matches!(
            r,
            Err(ObjectError::Decode {
                rank: HOSTILE,
                source: DecodeError::TooDeep { limit }
            }) if *limit == Options::DEFAULT_MAX_DEPTH
        ),
        "{what}: honest rank {rank} got {r:?}"
    );
}

/// Runs the attack for both recursive types at both depths: the hostile rank sends the
/// crafted bytes with `hostile`, the honest ranks run `honest_tree` / `honest_chain` and must
/// all get `TooDeep` naming the hostile rank.
fn attack<A, B>(
    what: &str,
    hostile: impl Fn(&LocalCommunicator, &Crafted) + Sync,
    honest_tree: impl Fn(&LocalCommunicator) -> Result<A, ObjectError> + Sync,
    honest_chain: impl Fn(&LocalCommunicator) -> Result<B, ObjectError> + Sync,
) where
    A: std::fmt::Debug + Send,
    B: std::fmt::Debug + Send,
{
    for levels in [10_000, 30_000] {
        for kind in [Kind::VecOfSelf, Kind::BoxOfSelf] {
            let bytes = crafted(kind, levels);
            let results = run_on_small_stacks(3, |comm| {
                if comm.rank() == HOSTILE {
                    hostile(&comm, &bytes);
                    None
                } else {
                    Some(match kind {
                        Kind::VecOfSelf => honest_tree(&comm).map(|v| format!("{v:?}")),
                        Kind::BoxOfSelf => honest_chain(&comm).map(|v| format!("{v:?}")),
                    })
                }
            });
            for (rank, r) in results.iter().enumerate() {
                if let Some(r) = r {
                    assert_too_deep(&format!("{what}, {kind:?}, {levels} levels"), rank, r);
                }
            }
        }
    }
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_all_gather() {
    attack(
        "all_gather",
        |c, bytes| drop(all_gather(c, bytes)),
        |c| all_gather(c, &Tree::Leaf),
        |c| all_gather(c, &Chain::End),
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_borrowed_decode() {
    attack(
        "all_gather_borrowed",
        |c, bytes| drop(all_gather_borrowed(c, bytes)),
        |c| all_gather_borrowed(c, &Tree::Leaf)?.decode::<Tree>(),
        |c| all_gather_borrowed(c, &Chain::End)?.decode::<Chain>(),
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_all_gather_into() {
    attack(
        "all_gather_into",
        |c, bytes| drop(all_gather(c, bytes)),
        |c| {
            let mut out: Vec<Tree> = (0..5).map(|_| Tree::Node(vec![Tree::Leaf])).collect();
            all_gather_into(c, &Tree::Leaf, &mut out).map(|()| out)
        },
        |c| {
            let mut out: Vec<Chain> = (0..5).map(|_| Chain::Link(Box::new(Chain::End))).collect();
            all_gather_into(c, &Chain::End, &mut out).map(|()| out)
        },
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_broadcast_into() {
    attack(
        "broadcast_into",
        |c, bytes| drop(broadcast(c, HOSTILE, Some(bytes))),
        |c| {
            let mut out = Tree::Node(vec![Tree::Leaf]);
            broadcast_into(c, HOSTILE, None, &mut out).map(|()| out)
        },
        |c| {
            let mut out = Chain::Link(Box::new(Chain::End));
            broadcast_into(c, HOSTILE, None, &mut out).map(|()| out)
        },
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_gather() {
    // Rank 0 is the root; rank 2 gets `Ok(None)` and is checked below instead.
    for levels in [10_000, 30_000] {
        let bytes = crafted(Kind::VecOfSelf, levels);
        let results = run_on_small_stacks(3, |comm| {
            if comm.rank() == HOSTILE {
                gather(&comm, 0, &bytes).map(|_| None)
            } else {
                gather::<_, Tree>(&comm, 0, &Tree::Leaf).map(|v| v.map(|v| v.len()))
            }
        });
        assert_too_deep("gather", 0, &results[0]);
        assert!(matches!(results[2], Ok(None)), "{:?}", results[2]);
    }
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_gather_into() {
    // As for `gather`: rank 0, the root, decodes over its values; rank 2 returns `false`.
    for levels in [10_000, 30_000] {
        let bytes = crafted(Kind::VecOfSelf, levels);
        let results = run_on_small_stacks(3, |comm| {
            if comm.rank() == HOSTILE {
                return gather(&comm, 0, &bytes).map(|_| None);
            }
            let mut out: Vec<Tree> = (0..5).map(|_| Tree::Node(vec![Tree::Leaf])).collect();
            let filled = gather_into(&comm, 0, &Tree::Leaf, &mut out)?;
            Ok(Some((filled, out.len())))
        });
        assert_too_deep("gather_into", 0, &results[0]);
        assert!(
            matches!(results[2], Ok(Some((false, 5)))),
            "{:?}",
            results[2]
        );
    }
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_broadcast() {
    attack(
        "broadcast",
        |c, bytes| drop(broadcast(c, HOSTILE, Some(bytes))),
        |c| broadcast::<_, Tree>(c, HOSTILE, None),
        |c| broadcast::<_, Chain>(c, HOSTILE, None),
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_scatter() {
    attack(
        "scatter",
        |c, bytes| {
            drop(scatter(
                c,
                HOSTILE,
                Some(&vec![bytes.clone(); c.size()][..]),
            ))
        },
        |c| scatter::<_, Tree>(c, HOSTILE, None),
        |c| scatter::<_, Chain>(c, HOSTILE, None),
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_all_to_all() {
    attack(
        "all_to_all",
        |c, bytes| drop(all_to_all(c, &vec![bytes.clone(); c.size()])),
        |c| all_to_all(c, &[Tree::Leaf, Tree::Leaf, Tree::Leaf]),
        |c| all_to_all(c, &[Chain::End, Chain::End, Chain::End]),
    );
}

#[test]
fn deep_nesting_from_a_peer_is_a_decode_error_in_all_reduce() {
    attack(
        "all_reduce_with",
        |c, bytes| drop(all_reduce_with(c, bytes, |a, _| a)),
        |c| all_reduce_with(c, &Tree::Leaf, |a, _| a),
        |c| all_reduce_with(c, &Chain::End, |a, _| a),
    );
}

#[test]
fn decode_from_bounds_depth_on_a_small_stack() {
    let out = run_on_small_stacks(1, |_| {
        let tree = crafted(Kind::VecOfSelf, 30_000).0;
        let chain = crafted(Kind::BoxOfSelf, 30_000).0;
        (
            decode_from::<Tree>(4, &tree).map(drop),
            decode_from::<Chain>(4, &chain).map(drop),
        )
    });
    let (tree, chain) = &out[0];
    for r in [tree, chain] {
        assert!(
            matches!(
                r,
                Err(ObjectError::Decode {
                    rank: 4,
                    source: DecodeError::TooDeep { .. }
                })
            ),
            "{r:?}"
        );
    }
}

/// The largest `max_depth` is safe on a 2 MiB stack (debug builds included): values nested
/// up to it decode, one level more is refused.
#[test]
fn the_deepest_allowed_nesting_decodes_on_a_2_mib_stack() {
    let opts = Options {
        max_depth: Options::MAX_DEPTH,
        ..Options::default()
    };
    let out = run_on_small_stacks(1, |_| {
        // A link is one level (its enum), the end one more.
        let chain = crafted(Kind::BoxOfSelf, Options::MAX_DEPTH - 1).0;
        let ok = decode_from_with::<Chain>(0, &chain, &opts).map(drop);
        let deeper = crafted(Kind::BoxOfSelf, Options::MAX_DEPTH).0;
        let refused = decode_from_with::<Chain>(0, &deeper, &opts).map(drop);
        // A node is two levels (its enum and its Vec), the leaf one more.
        let tree = crafted(Kind::VecOfSelf, (Options::MAX_DEPTH - 1) / 2).0;
        let tree_ok = decode_from_with::<Tree>(0, &tree, &opts).map(drop);
        (ok, refused, tree_ok)
    });
    let (ok, refused, tree_ok) = &out[0];
    assert!(ok.is_ok(), "{ok:?}");
    assert!(tree_ok.is_ok(), "{tree_ok:?}");
    assert!(
        matches!(
            refused,
            Err(ObjectError::Decode {
                source: DecodeError::TooDeep { limit },
                ..
            }) if *limit == Options::MAX_DEPTH
        ),
        "{refused:?}"
    );
}

#[test]
fn honest_nesting_within_the_bound_still_round_trips() {
    let results = run_on_small_stacks(2, |comm| {
        let mut t = Tree::Leaf;
        for _ in 0..100 {
            t = Tree::Node(vec![t, Tree::Leaf]);
        }
        let all = all_gather(&comm, &t)?;
        Ok::<_, ObjectError>(all.len() == 2 && all[0] == t)
    });
    for r in results {
        assert!(matches!(r, Ok(true)), "{r:?}");
    }
}
