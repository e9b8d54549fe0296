//! Options that differ between ranks, and options out of range.
//!
//! Every option shapes the wire (inline path, round schedule, cap decision) or the decode,
//! so ranks passing different options would, unchecked, hang, fail in the transport on some
//! ranks only, or return wrong data. Each rank's options travel in the header entry that every
//! collective exchanges first, and every rank returns `OptionsMismatch` naming the option
//! and the ranks. Options out of range are `InvalidArgument` on the rank that passed them
//! (before anything sized by them is allocated) and `PeerInvalidOptions` on the others,
//! which are never left waiting.

use std::sync::atomic::Ordering;
use std::time::Duration;

mod common;
use common::{serial, PeakAlloc, LARGEST};

use serde_bytes::ByteBuf;
use tpcomm_objects::{
    all_gather_borrowed_with, all_gather_bytes_with, all_gather_with, all_reduce_with_options,
    all_to_all_with, broadcast_with, decode_from_with, gather_with, scatter_with, ObjectError,
    Options,
};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

type R = Result<(), ObjectError>;

/// Every collective once, with `opts`: values large enough for the payload path (and, with
/// small `round_bytes`, several rounds), so that options that shape the wire matter.
const COLLECTIVES: [&str; 8] = [
    "all_gather",
    "all_gather_borrowed",
    "all_gather_bytes",
    "gather",
    "broadcast",
    "scatter",
    "all_to_all",
    "all_reduce",
];

fn value(rank: usize) -> ByteBuf {
    ByteBuf::from(vec![rank as u8; 300 + 10 * rank])
}

fn run_collective(name: &str, comm: &LocalCommunicator, opts: &Options) -> R {
    let (me, n) = (comm.rank(), comm.size());
    let v = value(me);
    let many: Vec<ByteBuf> = (0..n).map(value).collect();
    match name {
        "all_gather" => all_gather_with(comm, &v, opts).map(drop),
        "all_gather_borrowed" => all_gather_borrowed_with(comm, &v, opts).map(drop),
        "all_gather_bytes" => all_gather_bytes_with(comm, &v, opts).map(drop),
        "gather" => gather_with(comm, 0, &v, opts).map(drop),
        "broadcast" => broadcast_with(comm, 1, Some(&v), opts).map(drop),
        "scatter" => scatter_with(comm, 2, Some(&many[..]), opts).map(drop),
        "all_to_all" => all_to_all_with(comm, &many, opts).map(drop),
        "all_reduce" => all_reduce_with_options(comm, &v, opts, |a, _| a).map(drop),
        other => unreachable!("{other}"),
    }
}

/// Runs `name` on 3 ranks, rank `r` with `opts(r)`, and returns every rank's result.
fn run(name: &str, opts: impl Fn(usize) -> Options + Sync) -> Vec<R> {
    LocalGroup::new(3)
        .timeout(Duration::from_secs(20))
        .run(|comm| run_collective(name, &comm, &opts(comm.rank())))
        .into_iter()
        .map(|r| r.expect("no rank panics"))
        .collect()
}

fn small_rounds() -> Options {
    Options {
        round_bytes: Some(128),
        ..Options::default()
    }
}

#[test]
fn equal_options_still_work_through_every_collective() {
    for name in COLLECTIVES {
        for r in run(name, |_| small_rounds()) {
            assert!(r.is_ok(), "{name}: {r:?}");
        }
    }
}

/// Rank 1 changes one option; every rank of every collective must name it and rank 1.
fn assert_mismatch_named(option: &str, change: impl Fn(&mut Options) + Sync) {
    for name in COLLECTIVES {
        let results = run(name, |rank| {
            let mut o = small_rounds();
            if rank == 1 {
                change(&mut o);
            }
            o
        });
        for (rank, r) in results.iter().enumerate() {
            assert!(
                matches!(
                    r,
                    Err(ObjectError::OptionsMismatch { option: o, reference: 0, ranks })
                        if *o == option && ranks == &vec![1]
                ),
                "{name}, different {option} on rank 1: rank {rank} got {r:?}"
            );
        }
    }
}

#[test]
fn a_different_round_bytes_is_an_options_mismatch_on_every_rank() {
    assert_mismatch_named("round_bytes", |o| o.round_bytes = Some(97));
}

#[test]
fn a_default_round_bytes_against_an_explicit_one_is_an_options_mismatch() {
    assert_mismatch_named("round_bytes", |o| o.round_bytes = None);
}

#[test]
fn a_different_small_slot_is_an_options_mismatch_on_every_rank() {
    assert_mismatch_named("small_slot_bytes", |o| o.small_slot_bytes = 16);
}

#[test]
fn a_different_cap_is_an_options_mismatch_on_every_rank() {
    assert_mismatch_named("max_total_bytes", |o| o.max_total_bytes = 1 << 20);
}

#[test]
fn a_different_max_depth_is_an_options_mismatch_on_every_rank() {
    assert_mismatch_named("max_depth", |o| o.max_depth = 8);
}

#[test]
fn several_differing_ranks_are_all_named() {
    let results = run("all_gather", |rank| Options {
        small_slot_bytes: if rank == 0 { 224 } else { 100 + rank },
        ..Options::default()
    });
    for r in results {
        assert!(
            matches!(
                &r,
                Err(ObjectError::OptionsMismatch { option: "small_slot_bytes", reference: 0, ranks })
                    if ranks == &vec![1, 2]
            ),
            "{r:?}"
        );
    }
}

/// Each invalid option, on every rank: `InvalidArgument` everywhere, and nothing sized by
/// the option allocated.
#[test]
fn out_of_range_options_are_invalid_arguments_before_anything_is_allocated() {
    let _serial = serial();
    let invalid = [
        Options {
            small_slot_bytes: 1 << 40,
            ..Options::default()
        },
        Options {
            small_slot_bytes: 1 << 32,
            ..Options::default()
        },
        Options {
            small_slot_bytes: Options::MAX_SMALL_SLOT_BYTES + 1,
            ..Options::default()
        },
        Options {
            round_bytes: Some(0),
            ..Options::default()
        },
        Options {
            max_depth: 0,
            ..Options::default()
        },
        Options {
            max_depth: Options::MAX_DEPTH + 1,
            ..Options::default()
        },
        Options {
            max_total_bytes: usize::MAX,
            ..Options::default()
        },
    ];
    for opts in invalid {
        LARGEST.store(0, Ordering::Relaxed);
        for name in COLLECTIVES {
            for (rank, r) in run(name, |_| opts).iter().enumerate() {
                assert!(
                    matches!(r, Err(ObjectError::InvalidArgument(_))),
                    "{name} with {opts:?}: rank {rank} got {r:?}"
                );
            }
        }
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(
            largest < 1 << 20,
            "{opts:?}: an allocation of {largest} bytes"
        );
    }
}

#[test]
fn round_bytes_of_zero_is_refused_not_clamped() {
    let results = run("all_gather", |_| Options {
        round_bytes: Some(0),
        ..Options::default()
    });
    for r in results {
        let Err(ObjectError::InvalidArgument(msg)) = r else {
            panic!("expected InvalidArgument, got {r:?}");
        };
        assert!(msg.contains("round_bytes"), "{msg}");
    }
}

/// Only rank 1's options are invalid: it still joins the header exchange (flagging itself),
/// so its peers return `PeerInvalidOptions` naming it instead of waiting for it.
#[test]
fn invalid_options_on_one_rank_never_leave_the_others_waiting() {
    let _serial = serial();
    LARGEST.store(0, Ordering::Relaxed);
    for name in COLLECTIVES {
        let results = run(name, |rank| {
            if rank == 1 {
                Options {
                    small_slot_bytes: 1 << 40,
                    ..Options::default()
                }
            } else {
                Options::default()
            }
        });
        for (rank, r) in results.iter().enumerate() {
            if rank == 1 {
                assert!(
                    matches!(r, Err(ObjectError::InvalidArgument(msg)) if msg.contains("small_slot_bytes")),
                    "{name}: rank 1 got {r:?}"
                );
            } else {
                assert!(
                    matches!(r, Err(ObjectError::PeerInvalidOptions { ranks }) if ranks == &vec![1]),
                    "{name}: rank {rank} got {r:?}"
                );
            }
        }
    }
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < 1 << 20, "an allocation of {largest} bytes");
}

#[test]
fn decode_with_invalid_options_is_an_invalid_argument() {
    let opts = Options {
        max_depth: 0,
        ..Options::default()
    };
    assert!(matches!(
        decode_from_with::<u8>(0, &[1], &opts),
        Err(ObjectError::InvalidArgument(_))
    ));
}
