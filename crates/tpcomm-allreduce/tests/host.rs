//! The host custom all-reduce on the local group: correctness against an f64 reference,
//! capture/suspend/resume/replay with moved mappings, the lifecycle, timeouts.

use std::time::Duration;

use half::{bf16, f16};
use tpcomm_allreduce::{
    Algorithm, AllReduceError, Config, CustomAllReduce, DType, Element, FallbackReason,
    HostBackend, Phase,
};
use tpcomm_ipc::{FaultInjection, FaultPoint, HostMemory, IpcError, PeerMemory};
use tpcomm_transport::Communicator;

mod common;
mod holds;
use common::{
    chain, check, group, inputs, new_ar, read_f32, run_seed, unwrap_all, unwrap_world,
    with_timeout, R,
};

fn correctness_for<T: Element>(world: usize, sizes: &[usize], algorithm: Algorithm) {
    let seed = run_seed();
    let results = group(world).run(|comm| -> R<Vec<Vec<T>>> {
        let config = Config {
            algorithm: Some(algorithm),
            ..Config::default()
        };
        let mut ar = new_ar(&comm, config)?;
        let mut outs = Vec::new();
        for (k, &bytes) in sizes.iter().enumerate() {
            let count = bytes / T::DTYPE.size();
            let input = inputs::<T>(seed + k as u64, comm.rank(), count);
            let mut out = vec![T::from_f32(f32::NAN); count]; // poisoned
            let used = ar.all_reduce(&input, &mut out)?;
            assert_eq!(used, algorithm);
            outs.push(out);
        }
        Ok(outs)
    });
    let outs: Vec<Vec<Vec<T>>> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
    for (k, &bytes) in sizes.iter().enumerate() {
        check::<T>(seed + k as u64, world, &outs[0][k]).unwrap_or_else(|e| {
            panic!(
                "{:?} {algorithm:?} world {world}, {bytes} bytes: {e}",
                T::DTYPE
            )
        });
        for (rank, o) in outs.iter().enumerate() {
            let same =
                bytemuck::cast_slice::<T, u8>(&o[k]) == bytemuck::cast_slice::<T, u8>(&outs[0][k]);
            assert!(
                same,
                "rank {rank} differs bitwise from rank 0 ({bytes} bytes)"
            );
        }
    }
}

const SIZES: [usize; 5] = [16, 4096, 65_536 + 48, 1 << 20, 8 << 20];

#[test]
fn every_dtype_and_algorithm_matches_an_f64_reference_for_world_sizes_2_to_8() {
    for world in 2..=8 {
        let sizes: &[usize] = if world <= 4 { &SIZES } else { &SIZES[..4] };
        for algorithm in [Algorithm::OneStage, Algorithm::TwoStage] {
            correctness_for::<f32>(world, sizes, algorithm);
            correctness_for::<f16>(world, sizes, algorithm);
            correctness_for::<bf16>(world, sizes, algorithm);
        }
    }
}

#[test]
fn one_stage_and_two_stage_give_bitwise_identical_results() {
    let seed = run_seed();
    let results = group(3).run(|comm| -> R<(Vec<f32>, Vec<f32>)> {
        let input = inputs::<f32>(seed, comm.rank(), 4096);
        let mut one = vec![0f32; 4096];
        let mut two = vec![0f32; 4096];
        new_ar(
            &comm,
            Config {
                algorithm: Some(Algorithm::OneStage),
                ..Config::default()
            },
        )?
        .all_reduce(&input, &mut one)?;
        new_ar(
            &comm,
            Config {
                algorithm: Some(Algorithm::TwoStage),
                ..Config::default()
            },
        )?
        .all_reduce(&input, &mut two)?;
        Ok((one, two))
    });
    for r in results {
        let (one, two) = r.unwrap().unwrap();
        assert_eq!(
            bytemuck::cast_slice::<f32, u8>(&one),
            bytemuck::cast_slice::<f32, u8>(&two)
        );
    }
}

#[test]
fn a_single_rank_all_reduce_is_the_identity() {
    let results = group(1).run(|comm| -> R<Vec<f32>> {
        let mut out = vec![0f32; 16];
        new_ar(&comm, Config::default())?.all_reduce(&[1.5f32; 16], &mut out)?;
        Ok(out)
    });
    assert_eq!(
        results[0].as_ref().unwrap().as_ref().unwrap(),
        &vec![1.5f32; 16]
    );
}

#[test]
fn unsupported_inputs_are_sent_to_the_fallback_with_a_reason() {
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(
            &comm,
            Config {
                max_bytes: 4096,
                ..Config::default()
            },
        )?;
        let mut out = [0f32; 3];
        match ar.all_reduce(&[0f32; 3], &mut out) {
            Err(AllReduceError::Fallback(FallbackReason::SizeNotMultipleOf16 { bytes: 12 })) => {}
            other => panic!("{other:?}"),
        }
        let mut big = vec![0f32; 2048];
        match ar.all_reduce(&vec![0f32; 2048], &mut big) {
            Err(AllReduceError::Fallback(FallbackReason::TooLarge {
                bytes: 8192,
                max: 4096,
            })) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            ar.all_reduce(&[0f32; 8], &mut [0f32; 4]),
            Err(AllReduceError::InvalidArgument(_))
        ));
        assert_eq!(
            ar.phase(),
            Phase::Active,
            "refused inputs do not fail the communicator"
        );
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn registered_inputs_are_reduced_without_staging() {
    let results = group(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let mem = ar.memory()?.clone();
        let buf = mem.allocate(4096)?;
        mem.write(
            &buf,
            0,
            bytemuck::cast_slice(&[comm.rank() as f32 + 1.0; 1024]),
        )?;
        let input = ar.register_buffer(&comm, buf)?;
        let mut out = vec![0f32; 1024];
        ar.all_reduce_registered(&input, &mut out)?;
        Ok(out)
    });
    for r in results {
        assert_eq!(r.unwrap().unwrap(), vec![3.0f32; 1024]);
    }
}

/// A buffer registered after an unregister can land at the old one's address, in segments
/// the peers still map, so every peer address of its slot equals the old entry's. The
/// unregister zeroed the slot; the registration rewrites it (it skipped the write, taking
/// the entry for written, and the launch read null inputs).
#[test]
fn a_buffer_registered_where_an_unregistered_one_was_is_reduced_through_its_slot() {
    let results = group(2).run(|comm| -> R<Vec<Vec<f32>>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let mem = ar.memory()?.clone();
        let mut sums = Vec::new();
        let mut addresses = Vec::new();
        for round in 0..3 {
            let buf = mem.allocate(4096)?;
            addresses.push(tpcomm_ipc::MemoryRegion::addr(&buf));
            let value = (comm.rank() + 1) as f32 * (round + 1) as f32;
            mem.write(&buf, 0, bytemuck::cast_slice(&[value; 1024]))?;
            let input = ar.register_buffer(&comm, buf)?;
            let mut out = vec![0f32; 1024];
            ar.all_reduce_registered(&input, &mut out)?;
            sums.push(out);
            drop(ar.unregister(&comm, input)?);
        }
        assert!(
            addresses.windows(2).any(|w| w[0] == w[1]),
            "the test needs a buffer at a freed address: {addresses:x?}"
        );
        Ok(sums)
    });
    for r in results {
        let sums = r.unwrap().unwrap();
        for (round, out) in sums.iter().enumerate() {
            assert_eq!(out, &vec![3.0 * (round + 1) as f32; 1024], "round {round}");
        }
    }
}

/// The dispatcher picks by where the launch reads its input: an eager call (staged: two-stage
/// copies less of it) switches to two-stage at a smaller size than a registered input.
#[test]
fn eager_calls_switch_to_two_stage_before_registered_inputs_do() {
    let results = group(2).run(|comm| -> R<Vec<Algorithm>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let mem = ar.memory()?.clone();
        let input = ar.register_buffer(&comm, mem.allocate(8 << 10)?)?;
        let mut used = Vec::new();
        for count in [1024, 2048] {
            let data = vec![1.0f32; count];
            let mut out = vec![0f32; count];
            used.push(ar.all_reduce(&data, &mut out)?);
            assert_eq!(out, vec![2.0f32; count]);
            used.push(ar.all_reduce_registered(&input, &mut out)?);
        }
        Ok(used)
    });
    for r in results {
        assert_eq!(
            r.unwrap().unwrap(),
            [
                Algorithm::OneStage,
                Algorithm::OneStage,
                Algorithm::TwoStage,
                Algorithm::OneStage
            ]
        );
    }
}

/// Eager two-stage stages only the parts that peers read and takes this rank's own part
/// straight from the caller's input, through both eager entry points (host slices, and
/// unregistered buffers of the backend's memory, apart and in place): calls with the same
/// size and other data must each see their own values, never the previous call's left in
/// the staging buffer.
#[test]
fn eager_two_stage_reads_its_own_part_from_the_input_never_a_stale_staging_copy() {
    let seed = run_seed() + 1000;
    const COUNT: usize = 16_384 + 12;
    const CALLS: u64 = 3;
    for world in [2, 3] {
        let results = group(world).run(|comm| -> R<Vec<(&'static str, Vec<f32>)>> {
            let config = Config {
                algorithm: Some(Algorithm::TwoStage),
                ..Config::default()
            };
            let mut ar = new_ar(&comm, config)?;
            let mem = ar.memory()?.clone();
            let input_buf = mem.allocate(COUNT * 4)?;
            let output_buf = mem.allocate(COUNT * 4)?;
            let mut outs = Vec::new();
            for k in 0..CALLS {
                let input = inputs::<f32>(seed + k, comm.rank(), COUNT);
                let mut out = vec![f32::NAN; COUNT];
                ar.all_reduce(&input, &mut out)?;
                outs.push(("all_reduce", out));
            }
            for k in 0..CALLS {
                let input = inputs::<f32>(seed + k, comm.rank(), COUNT);
                mem.write(&input_buf, 0, bytemuck::cast_slice(&input))?;
                ar.all_reduce_buffer(&input_buf, &output_buf, DType::F32, COUNT)?;
                outs.push(("all_reduce_buffer", read_f32(&mem, &output_buf, COUNT)));
            }
            for k in 0..CALLS {
                let input = inputs::<f32>(seed + k, comm.rank(), COUNT);
                mem.write(&input_buf, 0, bytemuck::cast_slice(&input))?;
                ar.all_reduce_buffer(&input_buf, &input_buf, DType::F32, COUNT)?;
                outs.push((
                    "all_reduce_buffer in place",
                    read_f32(&mem, &input_buf, COUNT),
                ));
            }
            Ok(outs)
        });
        for (rank, r) in results.into_iter().enumerate() {
            for (i, (call, out)) in r.unwrap().unwrap().iter().enumerate() {
                let k = i as u64 % CALLS;
                check::<f32>(seed + k, world, out)
                    .unwrap_or_else(|e| panic!("world {world}, rank {rank}, {call} call {k}: {e}"));
            }
        }
    }
}

/// A two-stage output in registered memory: written part by part as it is reduced when it
/// is apart from the input, after the mid barrier when it is the input itself (peers read
/// the input until then). Both give the sum.
#[test]
fn two_stage_outputs_apart_from_and_in_place_of_a_registered_input_both_hold_the_sum() {
    let seed = run_seed() + 2000;
    const COUNT: usize = 8192;
    let results = group(3).run(|comm| -> R<(Vec<f32>, Vec<f32>)> {
        let config = Config {
            algorithm: Some(Algorithm::TwoStage),
            ..Config::default()
        };
        let mut ar = new_ar(&comm, config)?;
        let mem = ar.memory()?.clone();
        let data = inputs::<f32>(seed, comm.rank(), COUNT);
        let buf = mem.allocate(COUNT * 4)?;
        mem.write(&buf, 0, bytemuck::cast_slice(&data))?;
        let input = ar.register_buffer(&comm, buf)?;
        let apart = mem.allocate(COUNT * 4)?;
        ar.all_reduce_buffer(input.buffer(), &apart, DType::F32, COUNT)?;
        let apart = read_f32(&mem, &apart, COUNT);
        ar.all_reduce_buffer(input.buffer(), input.buffer(), DType::F32, COUNT)?;
        let in_place = read_f32(&mem, input.buffer(), COUNT);
        Ok((apart, in_place))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (apart, in_place) = r.unwrap().unwrap();
        check::<f32>(seed, 3, &apart).unwrap_or_else(|e| panic!("rank {rank}, apart: {e}"));
        check::<f32>(seed, 3, &in_place).unwrap_or_else(|e| panic!("rank {rank}, in place: {e}"));
    }
}

/// The central test: a plan captured before a suspend replays correctly after the resume,
/// although every peer mapping moved.
#[test]
fn a_plan_captured_before_suspend_replays_correctly_after_resume_at_new_addresses() {
    for world in [2, 4] {
        let results = group(world).run(|comm| -> R<()> {
            let me = comm.rank();
            let mut ar = new_ar(&comm, Config::default())?;
            let mem = ar.memory()?.clone();
            let small_in = mem.allocate(4096)?;
            let big_in = mem.allocate(2 << 20)?;
            let small_out = mem.allocate(4096)?;
            let big_out = mem.allocate(2 << 20)?;
            let fill = |scale: f32| -> R<()> {
                mem.write(
                    &small_in,
                    0,
                    bytemuck::cast_slice(&vec![(me as f32 + 1.0) * scale; 1024]),
                )?;
                mem.write(
                    &big_in,
                    0,
                    bytemuck::cast_slice(&vec![(me as f32 + 1.0) * scale; 512 << 10]),
                )?;
                Ok(())
            };
            let plan = ar.capture(|cap| {
                assert_eq!(
                    cap.all_reduce(&small_in, &small_out, DType::F32, 1024)?,
                    Algorithm::OneStage
                );
                assert_eq!(
                    cap.all_reduce(&big_in, &big_out, DType::F32, 512 << 10)?,
                    Algorithm::TwoStage
                );
                Ok(())
            })?;
            assert!(matches!(
                plan.replay(&mut ar),
                Err(AllReduceError::UnregisteredGraphBuffers)
            ));
            assert_eq!(ar.register_graph_buffers(&comm)?, 2);
            let expected = |scale: f32| (1..=world).map(|r| r as f32 * scale).sum::<f32>();
            fill(1.0)?;
            plan.replay(&mut ar)?;
            assert!(read_f32(&mem, &small_out, 1024)
                .iter()
                .all(|&v| v == expected(1.0)));
            assert!(read_f32(&mem, &big_out, 512 << 10)
                .iter()
                .all(|&v| v == expected(1.0)));

            let peer = (me + 1) % world;
            let table = ar.rank_signals_address()?;
            // Hold the old addresses so the reopened mappings must land elsewhere.
            let mut old = Vec::new();
            let holds = holds::suspend_holding(&comm, &mut ar, |ar| {
                old = (0..3).map(|i| ar.base_address(peer, i)).collect::<R<_>>()?;
                Ok(old.clone())
            })?;
            assert_eq!(ar.phase(), Phase::Suspended);
            ar.reinit_after_resume(&comm)?;
            for (i, &a) in old.iter().enumerate() {
                assert_ne!(
                    ar.base_address(peer, i)?,
                    a,
                    "region {i} of rank {peer} moved"
                );
            }
            assert_eq!(
                ar.rank_signals_address()?,
                table,
                "the stable table never moves"
            );
            drop(holds);

            fill(2.0)?;
            plan.replay(&mut ar)?;
            assert!(read_f32(&mem, &small_out, 1024)
                .iter()
                .all(|&v| v == expected(2.0)));
            assert!(read_f32(&mem, &big_out, 512 << 10)
                .iter()
                .all(|&v| v == expected(2.0)));
            Ok(())
        });
        unwrap_world(world, results);
    }
}

#[test]
fn the_pointer_tables_share_no_segment_with_what_peers_map() {
    // A peer that maps this rank's Signal block, staging or temp buffer maps the whole
    // segment around it; the tables of peer addresses this rank trusts must lie outside
    // every such segment, and must not be exportable at all.
    let results = group(3).run(|comm| -> R<()> {
        let mem = HostMemory::new();
        let ar = CustomAllReduce::new(HostBackend::new(), mem.clone(), &comm, Config::default())?;
        let table = ar.rank_signals_address()?;
        for region in 0..3 {
            let addr = ar.base_address(comm.rank(), region)?;
            let handle = mem.export(addr, 8)?;
            let segment = addr - handle.offset..addr - handle.offset + handle.segment_len;
            assert!(
                !segment.contains(&table),
                "the table at {table:#x} lies in the segment {segment:x?} of region {region}"
            );
        }
        assert!(
            matches!(mem.export(table, 8), Err(IpcError::NotExportable { .. })),
            "the table can be exported"
        );
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn repeated_transitions_are_no_ops_and_use_while_suspended_is_refused() {
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        ar.reinit_after_resume(&comm)?; // Active: no-op
        ar.prepare_for_suspend(&comm)?;
        ar.prepare_for_suspend(&comm)?; // Suspended: no-op
        assert_eq!(ar.peer_mappings()?.counters().open, 0);
        let mut out = [0f32; 4];
        match ar.all_reduce(&[1f32; 4], &mut out) {
            Err(AllReduceError::WrongState {
                phase: Phase::Suspended,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(
            ar.phase(),
            Phase::Suspended,
            "a refused call changes nothing"
        );
        ar.reinit_after_resume(&comm)?;
        ar.reinit_after_resume(&comm)?;
        ar.all_reduce(&[1f32; 4], &mut out)?;
        assert_eq!(out, [2f32; 4]);
        Ok(())
    });
    unwrap_all(results);
}

/// Injects a fault at `point` on rank 0 during `transition` (0 suspend, 1 resume) and
/// returns every rank's outcome of the transition and of a later call.
fn with_fault(point: FaultPoint, during_resume: bool) -> Vec<(R<()>, R<()>, Phase)> {
    group(2)
        .timeout(Duration::from_secs(5))
        .run(|comm| {
            let mem = FaultInjection::new(HostMemory::new());
            let mut ar = CustomAllReduce::new(
                HostBackend::<FaultInjection<HostMemory>>::new(),
                mem.clone(),
                &comm,
                Config::default(),
            )
            .unwrap();
            if during_resume {
                ar.prepare_for_suspend(&comm).unwrap();
            }
            if comm.rank() == 0 {
                mem.arm(point, 1);
            }
            let outcome = if during_resume {
                ar.reinit_after_resume(&comm)
            } else {
                ar.prepare_for_suspend(&comm)
            };
            let later = ar.all_reduce(&[1f32; 4], &mut [0f32; 4]).map(drop);
            let phase = ar.phase();
            ar.close().ok();
            (outcome, later, phase)
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

fn is_injected(e: &AllReduceError) -> bool {
    chain(e).contains("injected fault")
}

#[test]
fn a_failed_close_during_suspend_fails_that_rank_for_good_and_frees_its_peer() {
    let out = with_fault(FaultPoint::Close, false);
    let (outcome, later, phase) = &out[0];
    assert!(
        matches!(outcome, Err(e @ AllReduceError::Failed { during: "prepare_for_suspend", .. }) if is_injected(e))
    );
    assert!(
        matches!(later, Err(e @ AllReduceError::Failed { .. }) if is_injected(e)),
        "{later:?}"
    );
    assert_eq!(*phase, Phase::Failed);
    // The peer is not left waiting: its suspend completes.
    let (outcome, later, phase) = &out[1];
    assert!(outcome.is_ok(), "{outcome:?}");
    assert!(
        matches!(
            later,
            Err(AllReduceError::WrongState {
                phase: Phase::Suspended,
                ..
            })
        ),
        "{later:?}"
    );
    assert_eq!(*phase, Phase::Suspended);
}

#[test]
fn a_failed_export_or_open_during_resume_fails_every_rank() {
    for point in [FaultPoint::Export, FaultPoint::Open] {
        for (rank, (outcome, later, phase)) in with_fault(point, true).into_iter().enumerate() {
            assert!(
                matches!(&outcome, Err(AllReduceError::Failed { during: "reinit_after_resume", cause })
                    if matches!(&**cause, AllReduceError::Ipc(e) if matches!(**e, IpcError::PeerOpenFailed { .. }))),
                "{point:?} rank {rank}: {outcome:?}"
            );
            assert!(
                matches!(later, Err(AllReduceError::Failed { .. })),
                "{later:?}"
            );
            assert_eq!(phase, Phase::Failed, "{point:?} rank {rank}");
        }
    }
}

#[test]
fn close_works_from_every_phase_and_is_final() {
    let results = group(2).run(|comm| -> R<()> {
        for setup in 0..3 {
            let mut ar = new_ar(&comm, with_timeout(Duration::from_millis(200)))?;
            match setup {
                1 => ar.prepare_for_suspend(&comm)?,
                // Rank 1 never joins: rank 0 fails with a timeout, rank 1 is untouched.
                2 if comm.rank() == 0 => {
                    assert!(ar.all_reduce(&[1f32; 4], &mut [0f32; 4]).is_err());
                    assert_eq!(ar.phase(), Phase::Failed);
                }
                _ => {}
            }
            ar.close()?;
            assert_eq!(ar.phase(), Phase::Closed);
            assert!(ar.close().is_ok(), "closing twice is harmless");
            assert!(matches!(
                ar.all_reduce(&[1f32; 4], &mut [0f32; 4]),
                Err(AllReduceError::WrongState {
                    phase: Phase::Closed,
                    ..
                })
            ));
            assert!(ar.reinit_after_resume(&comm).is_err());
            comm.barrier()?;
        }
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_rank_that_stops_responding_mid_barrier_is_named_in_a_timeout() {
    let results = group(3).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, with_timeout(Duration::from_millis(300)))?;
        comm.barrier()?;
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(1500)); // never launches
            return Ok(());
        }
        match ar.all_reduce(&[1f32; 4], &mut [0f32; 4]) {
            Err(AllReduceError::Failed {
                during: "all_reduce",
                cause,
            }) => match &*cause {
                AllReduceError::Timeout {
                    peer: 2,
                    barrier: "start",
                    ..
                } => Ok(()),
                other => panic!("rank {}: {other:?}", comm.rank()),
            },
            other => panic!("rank {}: {other:?}", comm.rank()),
        }
    });
    unwrap_all(results);
}
