//! Inputs one custom launch cannot serve go through the transport's numeric all-reduce with
//! `all_reduce_or_transport` under `Reproducibility::AnyOrder`, and through several custom
//! launches under `BitStable` (the default); a failed communicator's error chain says each
//! level once.

mod common;

use std::error::Error as _;
use std::time::Duration;

use common::new_ar;
use tpcomm_allreduce::dispatch::Reproducibility;
use tpcomm_allreduce::{AllReduceError, Config, FallbackReason, HostRoute};
use tpcomm_transport::{Communicator, LocalGroup};

/// Each rank's input: distinct per rank and element, exact in f32.
fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (rank * 1000 + i % 97) as f32).collect()
}

fn expected(world: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (0..world).map(|r| (r * 1000 + i % 97) as f32).sum())
        .collect()
}

/// Every rank's routes of `all_reduce_or_transport` for 16 f32 (64 B, served), 3 (12 B,
/// not a multiple of 16), 2048 (8 KiB, above `max_bytes`) and none, each result checked.
fn routes_on_three_ranks(reproducibility: Reproducibility) -> Vec<Vec<HostRoute>> {
    const WORLD: usize = 3;
    let config = Config {
        max_bytes: 4096,
        reproducibility,
        ..Config::default()
    };
    let results = LocalGroup::new(WORLD).timeout(Duration::from_secs(30)).run(
        move |comm| -> tpcomm_allreduce::Result<Vec<HostRoute>> {
            let mut ar = new_ar(&comm, config.clone())?;
            let mut routes = Vec::new();
            // 64 B (served), 12 B (not a multiple of 16), 8 KiB (above max_bytes), empty.
            for len in [16, 3, 2048, 0] {
                let mine = input(comm.rank(), len);
                let mut out = vec![f32::NAN; len];
                routes.push(ar.all_reduce_or_transport(&comm, &mine, &mut out)?);
                assert_eq!(out, expected(WORLD, len), "rank {} len {len}", comm.rank());
            }
            // The communicator is still usable on the custom path afterwards.
            let mine = input(comm.rank(), 16);
            let mut out = vec![0f32; 16];
            ar.all_reduce(&mine, &mut out)?;
            assert_eq!(out, expected(WORLD, 16));
            Ok(routes)
        },
    );
    results
        .into_iter()
        .map(|r| r.expect("rank thread").expect("all-reduces"))
        .collect()
}

#[test]
fn inputs_the_kernels_cannot_serve_are_summed_by_the_transport_and_say_why() {
    for routes in routes_on_three_ranks(Reproducibility::AnyOrder) {
        assert!(matches!(routes[0], HostRoute::Custom(_)), "{routes:?}");
        assert_eq!(
            &routes[1..],
            &[
                HostRoute::Transport(FallbackReason::SizeNotMultipleOf16 { bytes: 12 }),
                HostRoute::Transport(FallbackReason::TooLarge {
                    bytes: 8192,
                    max: 4096
                }),
                HostRoute::Transport(FallbackReason::Empty),
            ]
        );
    }
}

#[test]
fn bit_stable_inputs_one_launch_cannot_serve_run_in_several_custom_launches() {
    for routes in routes_on_three_ranks(Reproducibility::BitStable) {
        assert!(matches!(routes[0], HostRoute::Custom(_)), "{routes:?}");
        assert_eq!(
            &routes[1..],
            &[
                HostRoute::Chunked {
                    launches: 1,
                    reason: FallbackReason::SizeNotMultipleOf16 { bytes: 12 }
                },
                HostRoute::Chunked {
                    launches: 2,
                    reason: FallbackReason::TooLarge {
                        bytes: 8192,
                        max: 4096
                    }
                },
                HostRoute::Chunked {
                    launches: 0,
                    reason: FallbackReason::Empty
                },
            ]
        );
    }
}

#[test]
fn the_fallback_error_names_the_transport_all_reduce() {
    let e = AllReduceError::Fallback(FallbackReason::SizeNotMultipleOf16 { bytes: 12 });
    let text = e.to_string();
    assert!(text.contains("Communicator::all_reduce"), "{text}");
    assert!(text.contains("12"), "{text}");
}

#[test]
fn a_failed_communicators_error_chain_says_each_level_once() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(30))
        .run(|comm| {
            let mut ar = new_ar(&comm, Config::default())?;
            // Ranks reduce different counts: a launch mismatch fails the communicator.
            let len = if comm.rank() == 0 { 64 } else { 128 };
            let mine = input(comm.rank(), len);
            let mut out = vec![0f32; len];
            let first = ar.all_reduce(&mine, &mut out);
            assert!(first.is_err(), "rank {}: {first:?}", comm.rank());
            // Every later call returns the kept cause.
            ar.all_reduce(&mine, &mut out).map(drop)
        });
    for r in results {
        let err = r
            .expect("rank thread")
            .expect_err("a failed communicator refuses calls");
        let AllReduceError::Failed { during, cause } = &err else {
            panic!("expected Failed, got {err:?}");
        };
        assert_eq!(*during, "all_reduce");
        assert!(
            matches!(**cause, AllReduceError::LaunchMismatch { .. }),
            "{cause:?}"
        );
        let source = err.source().expect("the cause is the source");
        let (outer, inner) = (err.to_string(), source.to_string());
        assert_eq!(inner, cause.to_string());
        assert!(
            !outer.contains(&inner),
            "the message repeats its source: {outer:?} contains {inner:?}"
        );
    }
}
