//! Roots that differ between ranks.
//!
//! `broadcast`, `gather`, `scatter` and `reduce_with` take a root on every rank. Ranks that
//! pass different roots would, unchecked, finish with wrong results and no error on the small
//! path (each rank that took itself for the root would return its own value) and make an
//! erroneous transport call on the payload path (a broadcast or gather whose ranks name
//! different roots: a hang, a truncation or corrupt data under MPI). So every rank's root travels in
//! the header exchange that every collective makes first (an all-gather, whose size does not
//! depend on the root), and every rank returns the same `RootMismatch` naming every rank's
//! root before any payload moves, at no extra transport call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_bytes::ByteBuf;
use tpcomm_objects::{
    all_gather, all_to_all, broadcast, broadcast_into, broadcast_with, gather, gather_into,
    gather_with, reduce_with, reduce_with_options, scatter, scatter_with, ObjectError, Options,
};
use tpcomm_transport::testing::hooked::Hooked;
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

type R = Result<(), ObjectError>;

/// A group whose waits are bounded: a rank left waiting fails with a transport timeout
/// instead of hanging the test.
fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(10))
}

/// The value sizes each case runs with: one that travels inline in the header, one that
/// takes the payload path in one call, and one that takes it in several rounds.
#[derive(Debug, Clone, Copy)]
enum Path {
    Small,
    Payload,
    Rounds,
}

const PATHS: [Path; 3] = [Path::Small, Path::Payload, Path::Rounds];

impl Path {
    fn value(self, rank: usize) -> ByteBuf {
        let len = match self {
            Path::Small => 8,
            Path::Payload | Path::Rounds => 1000,
        };
        ByteBuf::from(vec![rank as u8; len])
    }

    fn options(self) -> Options {
        match self {
            Path::Rounds => Options {
                round_bytes: Some(100),
                ..Options::default()
            },
            Path::Small | Path::Payload => Options::default(),
        }
    }
}

/// Runs `f(comm, root)` on `roots.len()` ranks, rank `r` passing `roots[r]`, and returns every
/// rank's result (no rank may panic or hang).
fn run_with_roots(roots: &[usize], f: impl Fn(&LocalCommunicator, usize) -> R + Sync) -> Vec<R> {
    group(roots.len())
        .run(|comm| f(&comm, roots[comm.rank()]))
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank} died: {e}")))
        .collect()
}

/// Asserts that every rank returned `RootMismatch` naming exactly `want`.
fn assert_root_mismatch_everywhere(what: &str, results: &[R], want: &[Option<usize>]) {
    for (rank, r) in results.iter().enumerate() {
        assert!(
            matches!(r, Err(ObjectError::RootMismatch { roots }) if roots == want),
            "{what}: rank {rank} got {r:?}, expected RootMismatch naming {want:?}"
        );
    }
}

/// Runs `f` with `roots` (see [`run_with_roots`]) and asserts that every rank returned
/// `RootMismatch` naming each rank's root; `name` and `path` label a failure.
fn expect_root_mismatch(
    name: &str,
    path: Path,
    roots: &[usize],
    f: impl Fn(&LocalCommunicator, usize) -> R + Sync,
) {
    let results = run_with_roots(roots, f);
    assert_root_mismatch_everywhere(
        &format!("{name} {path:?} {roots:?}"),
        &results,
        &some(roots),
    );
}

/// Root patterns of 2 and 3 ranks: one rank against the others, every rank its own root,
/// and a root only one rank names.
const PATTERNS: [&[usize]; 4] = [&[0, 1], &[1, 0], &[0, 1, 1], &[2, 1, 0]];

fn some(roots: &[usize]) -> Vec<Option<usize>> {
    roots.iter().copied().map(Some).collect()
}

/// Runs `case(roots, path, options)` for every root pattern and every value path.
fn for_every_pattern_and_path(case: impl Fn(&[usize], Path, &Options)) {
    for roots in PATTERNS {
        for path in PATHS {
            case(roots, path, &path.options());
        }
    }
}

#[test]
fn ranks_passing_different_roots_to_broadcast_get_a_root_mismatch_on_every_rank() {
    for_every_pattern_and_path(|roots, path, opts| {
        expect_root_mismatch("broadcast_with", path, roots, |comm, root| {
            let mine = path.value(comm.rank());
            let value = (comm.rank() == root).then_some(&mine);
            broadcast_with(comm, root, value, opts).map(drop)
        });
        expect_root_mismatch("broadcast_into", path, roots, |comm, root| {
            let mine = path.value(comm.rank());
            let mut out = ByteBuf::new();
            broadcast_into(comm, root, (comm.rank() == root).then_some(&mine), &mut out)
        });
    });
}

#[test]
fn ranks_passing_different_roots_to_gather_get_a_root_mismatch_on_every_rank() {
    for_every_pattern_and_path(|roots, path, opts| {
        expect_root_mismatch("gather_with", path, roots, |comm, root| {
            gather_with(comm, root, &path.value(comm.rank()), opts).map(drop)
        });
        expect_root_mismatch("gather_into", path, roots, |comm, root| {
            let mut out = Vec::new();
            gather_into(comm, root, &path.value(comm.rank()), &mut out).map(drop)
        });
    });
}

#[test]
fn ranks_passing_different_roots_to_scatter_get_a_root_mismatch_on_every_rank() {
    for_every_pattern_and_path(|roots, path, opts| {
        expect_root_mismatch("scatter_with", path, roots, |comm, root| {
            // Every rank offers values: a rank that takes itself for the root sends them.
            let shards: Vec<ByteBuf> = (0..comm.size()).map(|d| path.value(d)).collect();
            scatter_with(comm, root, Some(&shards[..]), opts).map(drop)
        });
    });
}

#[test]
fn ranks_passing_different_roots_to_reduce_get_a_root_mismatch_on_every_rank() {
    for_every_pattern_and_path(|roots, path, opts| {
        expect_root_mismatch("reduce_with_options", path, roots, |comm, root| {
            reduce_with_options(comm, root, &path.value(comm.rank()), opts, |mut a, b| {
                a.extend_from_slice(&b);
                a
            })
            .map(drop)
        });
    });
}

/// Each rooted collective once, every rank passing `root`.
fn each_rooted_collective(comm: &LocalCommunicator, root: usize) -> [(&'static str, R); 4] {
    let me = comm.rank();
    let mine = ByteBuf::from(vec![me as u8; 600]);
    let shards: Vec<ByteBuf> = (0..comm.size()).map(|_| mine.clone()).collect();
    [
        (
            "broadcast",
            broadcast(comm, root, (me == root).then_some(&mine)).map(drop),
        ),
        ("gather", gather(comm, root, &mine).map(drop)),
        (
            "scatter",
            scatter(comm, root, (me == root).then_some(&shards[..])).map(drop),
        ),
        ("reduce", reduce_with(comm, root, &mine, |a, _| a).map(drop)),
    ]
}

/// Runs [`each_rooted_collective`] on 3 ranks, rank `r` passing `roots[r]` (no rank may
/// panic), and hands every result to `check(name, rank, result)`.
fn check_each_rooted_collective(roots: [usize; 3], check: impl Fn(&str, usize, &R)) {
    let results = group(3)
        .run(|comm| each_rooted_collective(&comm, roots[comm.rank()]))
        .into_iter()
        .map(|r| r.expect("no rank panics"))
        .collect::<Vec<_>>();
    for (rank, per_rank) in results.iter().enumerate() {
        for (name, r) in per_rank {
            check(name, rank, r);
        }
    }
}

/// A rank whose root is out of range still joins the header exchange (returning
/// `InvalidArgument` on its own before it would leave the others waiting there, a hang
/// without a timeout), and every rank sees the disagreement.
#[test]
fn a_rank_passing_an_out_of_range_root_never_leaves_the_others_waiting() {
    let roots = [0, 7, 0];
    check_each_rooted_collective(roots, |name, rank, r| {
        assert!(
            matches!(r, Err(ObjectError::RootMismatch { roots: got }) if got == &some(&roots)),
            "{name}: rank {rank} got {r:?}"
        );
    });
}

#[test]
fn every_rank_passing_the_same_out_of_range_root_gets_an_invalid_argument() {
    for root in [
        3,
        1000,
        u32::MAX as usize - 1,
        u32::MAX as usize,
        usize::MAX,
    ] {
        check_each_rooted_collective([root; 3], |name, rank, r| {
            assert!(
                matches!(r, Err(ObjectError::InvalidArgument(msg)) if msg.contains("root")),
                "{name}, root {root}: rank {rank} got {r:?}"
            );
        });
    }
}

/// Ranks that call a rooted collective while others call one without a root, over a header
/// of the same size (gather against all_gather, scatter against all_to_all), are told apart
/// by the header: unchecked, they would return wrong values on the small path and hang on
/// the payload path.
#[test]
fn a_rooted_collective_against_one_without_a_root_is_a_root_mismatch_on_every_rank() {
    for len in [8, 1000] {
        let results = run_with_roots(&[0, 0, 0], |comm, root| {
            let mine = ByteBuf::from(vec![comm.rank() as u8; len]);
            if comm.rank() == 2 {
                all_gather(comm, &mine).map(drop)
            } else {
                gather(comm, root, &mine).map(drop)
            }
        });
        assert_root_mismatch_everywhere(
            &format!("gather / all_gather, {len} bytes"),
            &results,
            &[Some(0), Some(0), None],
        );
        let results = run_with_roots(&[1, 1, 1], |comm, root| {
            let shards: Vec<ByteBuf> = (0..comm.size())
                .map(|d| ByteBuf::from(vec![d as u8; len]))
                .collect();
            if comm.rank() == 0 {
                all_to_all(comm, &shards).map(drop)
            } else {
                scatter(comm, root, Some(&shards[..])).map(drop)
            }
        });
        assert_root_mismatch_everywhere(
            &format!("all_to_all / scatter, {len} bytes"),
            &results,
            &[None, Some(1), Some(1)],
        );
    }
}

/// After a root mismatch, every rank is back in step: the next collective (with agreed
/// roots) works on every rank.
#[test]
fn after_a_root_mismatch_the_next_collective_still_works_on_every_rank() {
    let results = group(3).run(|comm| {
        let me = comm.rank();
        let mine = ByteBuf::from(vec![me as u8; 1000]);
        let mismatch = gather(&comm, me % 2, &mine).map(drop);
        let next = broadcast(&comm, 2, (me == 2).then_some(&mine));
        (mismatch, next)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (mismatch, next) = r.expect("no rank panics");
        assert!(
            matches!(mismatch, Err(ObjectError::RootMismatch { .. })),
            "rank {rank}: {mismatch:?}"
        );
        assert_eq!(next.unwrap().as_ref(), &[2u8; 1000][..], "rank {rank}");
    }
}

#[test]
fn a_root_mismatch_names_every_ranks_root_in_its_message() {
    let e = ObjectError::RootMismatch {
        roots: vec![Some(0), Some(1), None],
    };
    assert_eq!(
        e.to_string(),
        "ranks passed different roots (root per rank: 0, 1, none)"
    );
}

/// The roots ride in the header exchange: a small broadcast, gather or reduce is still one
/// transport call (the header carries the values), a scatter (which has no inline path) and
/// every payload one still two (header, then one payload call), on every rank.
#[test]
fn agreeing_on_the_root_takes_no_extra_transport_call() {
    for (len, small) in [(8, true), (1000, false)] {
        let results = group(3).run(|inner| {
            let calls = AtomicUsize::new(0);
            let comm = Hooked::new(&inner, |_op| {
                calls.fetch_add(1, Ordering::Relaxed);
                Ok(())
            });
            let me = comm.rank();
            let mine = ByteBuf::from(vec![me as u8; len]);
            let shards: Vec<ByteBuf> = (0..3).map(|_| mine.clone()).collect();
            let mut counts = Vec::new();
            let mut count = |name: &str, r: R| {
                r.unwrap_or_else(|e| panic!("{name}: {e}"));
                counts.push((name.to_string(), calls.swap(0, Ordering::Relaxed)));
            };
            count(
                "broadcast",
                broadcast(&comm, 1, (me == 1).then_some(&mine)).map(drop),
            );
            count("gather", gather(&comm, 1, &mine).map(drop));
            count(
                "scatter",
                scatter(&comm, 1, (me == 1).then_some(&shards[..])).map(drop),
            );
            count("reduce", reduce_with(&comm, 1, &mine, |a, _| a).map(drop));
            counts
        });
        for (rank, r) in results.into_iter().enumerate() {
            for (name, calls) in r.expect("no rank panics") {
                let want = if small && name != "scatter" { 1 } else { 2 };
                assert_eq!(calls, want, "{name} of {len} bytes, rank {rank}");
            }
        }
    }
}
