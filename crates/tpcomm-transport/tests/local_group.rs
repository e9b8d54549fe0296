//! Behaviour of the local group that the shared conformance suite cannot show: bounded
//! waits, failing ranks, mismatched calls, configuration.

mod common;

use std::time::Duration;

use common::{assert_count_too_large, rank_zero};
use proptest::prelude::*;
use tpcomm_transport::{
    dense_displacements, ArgumentError, Communicator, LocalGroup, Op, TransportError,
};

fn short() -> LocalGroup {
    LocalGroup::new(1).timeout(Duration::from_millis(300))
}

#[test]
fn timeout_names_the_ranks_that_never_arrived() {
    let results = LocalGroup::new(4)
        .timeout(Duration::from_millis(200))
        .run(|comm| {
            if comm.rank() >= 2 {
                // Ranks 2 and 3 hold their communicators but never join.
                std::thread::sleep(Duration::from_millis(800));
                return Ok(());
            }
            comm.barrier()
        });
    for (rank, result) in results.into_iter().enumerate().take(2) {
        match result.unwrap() {
            Err(TransportError::Timeout {
                op: Op::Barrier,
                rank: r,
                missing,
                ..
            }) => {
                assert_eq!(r, rank);
                assert_eq!(missing, vec![2, 3]);
            }
            other => panic!("rank {rank}: expected a timeout, got {other:?}"),
        }
    }
}

#[test]
fn every_call_after_a_timeout_fails_with_the_abort() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_millis(100))
        .run(|comm| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(400));
                // The group was aborted while this rank slept: joining late fails at once.
                return comm.barrier();
            }
            let first = comm.barrier();
            assert!(
                matches!(first, Err(TransportError::Timeout { .. })),
                "{first:?}"
            );
            comm.barrier()
        });
    for result in results {
        match result.unwrap() {
            Err(TransportError::Aborted { by: 0, reason, .. }) => {
                assert!(reason.contains("timed out"), "{reason}")
            }
            other => panic!("expected the abort by rank 0, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_drops_its_communicator_fails_its_waiting_peers_without_a_timeout() {
    let results = LocalGroup::new(3)
        .timeout(Duration::from_secs(120))
        .run(|comm| {
            if comm.rank() == 1 {
                return Ok(());
            }
            comm.barrier()
        });
    for rank in [0, 2] {
        match &results[rank] {
            Ok(Err(TransportError::Aborted { by: 1, .. })) => {}
            other => panic!("rank {rank}: expected an abort naming rank 1, got {other:?}"),
        }
    }
}

#[test]
fn a_panicking_rank_becomes_an_error_and_frees_its_peers() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(120))
        .run(|comm| {
            if comm.rank() == 1 {
                panic!("boom on rank 1");
            }
            comm.barrier()
        });
    match &results[1] {
        Err(TransportError::RankPanicked { rank: 1, message }) => assert!(message.contains("boom")),
        other => panic!("expected RankPanicked, got {other:?}"),
    }
    assert!(
        matches!(results[0], Ok(Err(TransportError::Aborted { by: 1, .. }))),
        "{:?}",
        results[0]
    );
}

#[test]
fn different_operations_at_the_same_point_abort_every_rank() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(30))
        .run(|comm| {
            if comm.rank() == 0 {
                comm.barrier()
            } else {
                comm.broadcast(0, &mut [0u8; 4])
            }
        });
    for result in results {
        match result.unwrap() {
            Err(TransportError::Aborted { reason, .. }) => {
                assert!(
                    reason.contains("barrier") && reason.contains("broadcast"),
                    "{reason}"
                )
            }
            other => panic!("expected an abort, got {other:?}"),
        }
    }
}

#[test]
fn inconsistent_varcount_counts_are_a_mismatch_on_every_rank() {
    let results = LocalGroup::new(2).run(|comm| {
        let counts = if comm.rank() == 0 {
            vec![2, 2]
        } else {
            vec![2, 3]
        };
        let (displs, total) = dense_displacements(&counts).unwrap();
        let send = vec![1u8; counts[comm.rank()]];
        comm.all_gather_varcount(&send, &mut vec![0u8; total], &counts, &displs)
    });
    for result in results {
        assert!(matches!(
            result.unwrap(),
            Err(TransportError::Mismatch {
                op: Op::AllGatherVarcount,
                ..
            })
        ));
    }
}

#[test]
fn broadcast_into_a_buffer_of_another_length_is_a_mismatch_not_a_truncation() {
    let results = LocalGroup::new(2).run(|comm| {
        let mut buf = vec![7u8; 8 + comm.rank()];
        comm.broadcast(0, &mut buf).map(|()| buf)
    });
    assert_eq!(
        results[0].as_ref().unwrap().as_ref().unwrap(),
        &vec![7u8; 8]
    );
    match results[1].as_ref().unwrap() {
        Err(TransportError::Mismatch { detail, .. }) => {
            assert!(detail.contains("8 bytes"), "{detail}")
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn max_count_is_configurable_and_enforced() {
    let results = LocalGroup::new(2).max_count(16).run(|comm| {
        assert_eq!(comm.max_count(), 16);
        let ok = comm.all_gather(&[0u8; 16], &mut [0u8; 32]);
        let too_big = comm.all_gather(&[0u8; 17], &mut [0u8; 34]);
        (ok, too_big)
    });
    for result in results {
        let (ok, too_big) = result.unwrap();
        ok.unwrap();
        assert_count_too_large(too_big, 17, 16);
    }
}

#[test]
fn an_overflowing_region_is_rejected_not_wrapped() {
    let results = LocalGroup::new(1)
        .max_count(usize::MAX)
        .run(|comm| comm.all_gather_varcount(&[1], &mut [0u8; 4], &[1], &[usize::MAX]));
    assert!(matches!(
        results[0].as_ref().unwrap(),
        Err(TransportError::InvalidArgument {
            source: ArgumentError::Overflow { .. },
            ..
        })
    ));
}

#[test]
fn a_group_of_zero_ranks_or_zero_max_count_is_a_setup_error() {
    assert!(matches!(
        LocalGroup::new(0).communicators(),
        Err(TransportError::Setup(_))
    ));
    assert!(matches!(
        short().max_count(0).communicators(),
        Err(TransportError::Setup(_))
    ));
}

#[test]
fn communicators_can_be_driven_by_caller_owned_threads() {
    let comms = LocalGroup::new(3).communicators().unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 3];
                comm.all_gather(&[comm.rank() as u8], &mut buf)
                    .map(|()| buf)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().unwrap(), vec![0, 1, 2]);
    }
}

#[test]
fn a_spin_longer_than_the_timeout_still_times_out_naming_the_absent_rank() {
    // Two ranks: a group larger than the machine's CPUs would not spin at all.
    let results = LocalGroup::new(2)
        .timeout(Duration::from_millis(200))
        .spin(Duration::from_secs(30))
        .run(|comm| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(600));
                return Ok(());
            }
            comm.barrier()
        });
    match rank_zero(results) {
        Err(TransportError::Timeout { rank, missing, .. }) => {
            assert_eq!(rank, 0);
            assert_eq!(missing, vec![1]);
        }
        other => panic!("rank 0: expected a timeout, got {other:?}"),
    }
}

/// The values every rank contributes to call `i` of the sequences below: lengths change
/// from call to call, so that a reused post that kept old bytes would show.
fn contribution(rank: usize, i: usize) -> Vec<u8> {
    let len = (i * 7 + rank * 3) % 23;
    (0..len).map(|k| (rank * 31 + i * 5 + k) as u8).collect()
}

fn varcount_sequence(comm: &impl Communicator, calls: usize) -> Result<(), String> {
    let size = comm.size();
    for i in 0..calls {
        let counts: Vec<usize> = (0..size).map(|r| contribution(r, i).len()).collect();
        let (displs, total) = dense_displacements(&counts).unwrap();
        let mut recv = vec![0xEEu8; total];
        comm.all_gather_varcount(&contribution(comm.rank(), i), &mut recv, &counts, &displs)
            .map_err(|e| e.to_string())?;
        let want: Vec<u8> = (0..size).flat_map(|r| contribution(r, i)).collect();
        if recv != want {
            return Err(format!("call {i}: got {recv:?}, want {want:?}"));
        }
        // A root that runs ahead: rank 0 posts broadcasts nobody has taken yet.
        let mut buf = if comm.rank() == 0 {
            contribution(0, i + 1000)
        } else {
            vec![0u8; contribution(0, i + 1000).len()]
        };
        comm.broadcast(0, &mut buf).map_err(|e| e.to_string())?;
        if buf != contribution(0, i + 1000) {
            return Err(format!("broadcast {i}: got {buf:?}"));
        }
    }
    Ok(())
}

#[test]
fn long_sequences_of_collectives_deliver_every_call_exactly_whatever_the_spin() {
    for spin in [
        Duration::ZERO,
        Duration::from_micros(50),
        Duration::from_secs(1),
    ] {
        for size in [1, 2, 3, 5] {
            let results = LocalGroup::new(size)
                .spin(spin)
                .run(|comm| varcount_sequence(&comm, 300));
            for (rank, r) in results.into_iter().enumerate() {
                if let Err(e) = r.unwrap() {
                    panic!("spin {spin:?}, {size} ranks, rank {rank}: {e}");
                }
            }
        }
    }
}

#[test]
fn a_slow_receiver_sees_every_broadcast_of_a_root_that_ran_ahead() {
    let results = LocalGroup::new(2).run(|comm| {
        let mut got = Vec::new();
        for i in 0..50u8 {
            let mut buf = [i; 3];
            if comm.rank() == 1 {
                buf = [0; 3];
                if i == 0 {
                    // Let the root post many rounds before the first is taken.
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            comm.broadcast(0, &mut buf)?;
            got.push(buf);
        }
        Ok::<_, TransportError>(got)
    });
    let want: Vec<[u8; 3]> = (0..50u8).map(|i| [i; 3]).collect();
    for r in results {
        assert_eq!(r.unwrap().unwrap(), want);
    }
}

#[test]
fn nested_splits_form_independent_groups() {
    // 8 ranks -> 2 groups of 4 (tensor parallel) -> each split again into pairs.
    let results = LocalGroup::new(8).run(|comm| {
        let tp = comm
            .split(Some((comm.rank() / 4) as u32), comm.rank() as i32)?
            .unwrap();
        let pair = tp.split(Some((tp.rank() / 2) as u32), 0)?.unwrap();
        let mut got = [0u8; 2];
        pair.all_gather(&[comm.rank() as u8], &mut got)?;
        Ok::<_, TransportError>(got)
    });
    for (rank, result) in results.into_iter().enumerate() {
        let base = (rank / 2 * 2) as u8;
        assert_eq!(result.unwrap().unwrap(), [base, base + 1]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn all_gather_varcount_matches_a_serial_model(
        counts in prop::collection::vec(0usize..300, 1..=8),
        seed in any::<u8>(),
    ) {
        let n = counts.len();
        let (displs, total) = dense_displacements(&counts).unwrap();
        let expected: Vec<u8> = (0..n)
            .flat_map(|r| (0..counts[r]).map(move |i| (r as u8) ^ (i as u8) ^ seed))
            .collect();
        let results = LocalGroup::new(n).run(|comm| {
            let r = comm.rank();
            let send: Vec<u8> = (0..counts[r]).map(|i| (r as u8) ^ (i as u8) ^ seed).collect();
            let mut recv = vec![0u8; total];
            comm.all_gather_varcount(&send, &mut recv, &counts, &displs).map(|()| recv)
        });
        for result in results {
            prop_assert_eq!(result.unwrap().unwrap(), expected.clone());
        }
    }

    #[test]
    fn gather_to_any_root_matches_a_serial_model(
        counts in prop::collection::vec(0usize..300, 1..=8),
        root_pick in any::<usize>(),
    ) {
        let n = counts.len();
        let root = root_pick % n;
        let (displs, total) = dense_displacements(&counts).unwrap();
        let expected: Vec<u8> = (0..n).flat_map(|r| vec![r as u8 + 1; counts[r]]).collect();
        let results = LocalGroup::new(n).run(|comm| {
            let send = vec![comm.rank() as u8 + 1; counts[comm.rank()]];
            let mut recv = vec![0u8; total];
            let layout = (comm.rank() == root).then(|| tpcomm_transport::GatherRecv {
                recv: &mut recv,
                counts: &counts,
                displs: &displs,
            });
            comm.gather_varcount(root, &send, layout).map(|()| recv)
        });
        for (rank, result) in results.into_iter().enumerate() {
            let got = result.unwrap().unwrap();
            if rank == root {
                prop_assert_eq!(got, expected.clone());
            } else {
                prop_assert!(got.iter().all(|&b| b == 0), "non-roots receive nothing");
            }
        }
    }
}

/// Recurses `n` levels with a 1 KiB frame each (kept by `black_box`).
fn deep(n: u32) -> u32 {
    let frame = std::hint::black_box([1u8; 1024]);
    if n == 0 {
        u32::from(frame[0])
    } else {
        deep(n - 1) + u32::from(frame[1023])
    }
}

#[test]
fn a_larger_stack_runs_recursion_deeper_than_two_mebibytes() {
    // 8192 levels of at least 1 KiB: over 8 MiB of stack, four times the 2 MiB default.
    let results = LocalGroup::new(2).stack_size(64 << 20).run(|comm| {
        let d = deep(8192);
        comm.barrier()?;
        Ok::<_, TransportError>(d)
    });
    for r in results {
        assert_eq!(r.unwrap().unwrap(), 8193);
    }
}

#[test]
fn the_default_stack_size_is_two_mebibytes() {
    assert_eq!(
        tpcomm_transport::LocalGroupConfig::default().stack_size,
        2 << 20
    );
}

/// One rank's communicator used by two threads at once is a usage error (as with MPI, calls
/// on one communicator must be ordered), but it must not panic, hang or read another call's
/// bytes as its own: every call either succeeds with its peers' data or fails with an error.
#[test]
fn overlapping_calls_on_one_communicator_fail_cleanly_or_succeed() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(10))
        .run(|comm| {
            let calls = 2000;
            let run = |n: usize| -> Result<usize, TransportError> {
                let mut ok = 0;
                for _ in 0..n {
                    let mut all = [0u8; 2];
                    comm.all_gather(&[comm.rank() as u8 + 1], &mut all)?;
                    assert_eq!(all, [1, 2], "an all-gather returned bytes of no rank");
                    ok += 1;
                }
                Ok(ok)
            };
            if comm.rank() == 1 {
                return vec![run(calls)];
            }
            std::thread::scope(|s| {
                let a = s.spawn(|| run(calls / 2));
                let b = s.spawn(|| run(calls / 2));
                vec![a.join().unwrap(), b.join().unwrap()]
            })
        });
    for (rank, r) in results.into_iter().enumerate() {
        for outcome in r.unwrap() {
            if let Err(e) = outcome {
                assert!(
                    matches!(e, TransportError::Aborted { .. }),
                    "rank {rank}: {e:?}"
                );
            }
        }
    }
}

/// Every rank's result of one call, as the group saw it: each `Aborted` reason must say that
/// earlier calls differed.
fn assert_every_rank_learns_of_the_earlier_disagreement(results: Vec<Result<(), TransportError>>) {
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(TransportError::Aborted { reason, .. }) => assert!(
                reason.contains("calls before this one that differ"),
                "rank {rank}: {reason}"
            ),
            other => panic!("rank {rank}: expected an abort, got {other:?}"),
        }
    }
}

#[test]
fn ranks_that_each_took_themselves_for_a_broadcasts_root_fail_at_their_next_call() {
    // Roots 0, 1, 1: ranks 0 and 1 read nothing, rank 2 reads rank 1's post (root 1, as it
    // expects); nobody can see the disagreement in the broadcast itself.
    let results = LocalGroup::new(3)
        .timeout(Duration::from_secs(30))
        .run(|comm| {
            let root = comm.rank().min(1);
            let mut buf = [comm.rank() as u8; 4];
            let first = comm.broadcast(root, &mut buf);
            (first, comm.barrier())
        });
    let (firsts, nexts): (Vec<_>, Vec<_>) = results.into_iter().map(Result::unwrap).unzip();
    assert!(firsts.iter().all(Result::is_ok), "{firsts:?}");
    assert_every_rank_learns_of_the_earlier_disagreement(nexts);
}

#[test]
fn gather_senders_naming_different_roots_fail_at_their_next_call() {
    // Roots 1, 2, 0: no rank takes itself for the root, so nobody reads in the gather.
    let results = LocalGroup::new(3)
        .timeout(Duration::from_secs(30))
        .run(|comm| {
            let root = (comm.rank() + 1) % 3;
            let first = comm.gather_varcount(root, &[7u8; 8], None);
            let mut all = [0u8; 3];
            (first, comm.all_gather(&[1], &mut all))
        });
    let (firsts, nexts): (Vec<_>, Vec<_>) = results.into_iter().map(Result::unwrap).unzip();
    assert!(firsts.iter().all(Result::is_ok), "{firsts:?}");
    assert_every_rank_learns_of_the_earlier_disagreement(nexts);
}

#[test]
fn a_disagreement_seen_only_a_ring_of_calls_later_is_still_caught() {
    // Two ranks that each take themselves for the root of 100 broadcasts (each runs up to
    // a ring ahead, reading nothing), then meet in a barrier.
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(30))
        .run(|comm| {
            let mut buf = [0u8; 4];
            for _ in 0..100 {
                comm.broadcast(comm.rank(), &mut buf)?;
            }
            comm.barrier()
        });
    assert_every_rank_learns_of_the_earlier_disagreement(
        results.into_iter().map(Result::unwrap).collect(),
    );
}

#[test]
fn agreeing_rooted_calls_with_every_root_pass_the_history_check() {
    let results = LocalGroup::new(3).run(|comm| {
        for i in 0..200usize {
            let root = i % 3;
            let mut buf = [(root * 10) as u8; 4];
            comm.broadcast(root, &mut buf)?;
            assert_eq!(buf, [(root * 10) as u8; 4]);
            if i % 7 == 0 {
                comm.barrier()?;
            }
        }
        comm.barrier()
    });
    for result in results {
        result.unwrap().unwrap();
    }
}
