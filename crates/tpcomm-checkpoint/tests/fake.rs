//! The coordination against the fake driver, ranks as threads (`LocalGroup`): the order of
//! the driver calls across ranks, a failure at each step on each rank, ranks sharing a
//! process, an unusable driver, and imported CUDA IPC mappings. Each rank models its own
//! process (`CheckpointOptions::pid`) unless a test says otherwise.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend, Phase};
use tpcomm_checkpoint::fake::{Call, FakeDriver};
use tpcomm_checkpoint::{
    check_support, checkpoint_group, CheckpointOptions, ObjectsLeft, ProcessState, Reason, Step,
    Suspendable,
};
use tpcomm_ipc::HostMemory;
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

mod common;

use common::*;

#[test]
fn every_process_is_locked_before_any_checkpoint_and_restored_before_any_unlock() {
    for world in WORLDS {
        let driver = FakeDriver::new();
        let paused = AtomicUsize::new(0);
        let outcomes: Vec<_> = every_rank(world, |comm| {
            let mut ar = host_ar(&comm);
            let mut probe = Probe::default();
            let report = checkpoint_own_process(&comm, &driver, &mut [&mut ar, &mut probe], |p| {
                // Every process is checkpointed while any rank pauses.
                for r in 0..world {
                    assert_eq!(driver.state_of(pid_of(r)), ProcessState::Checkpointed);
                }
                assert_eq!(p.pid, pid_of(p.rank));
                paused.fetch_add(1, Ordering::SeqCst);
                Ok(())
            });
            // The all-reduce works after the resume.
            let mut out = [0f32; 64];
            ar.all_reduce(&[1f32; 64], &mut out)
                .expect("all-reduce after");
            assert!(out.iter().all(|&v| v == world as f32));
            (report, ar.phase(), probe.prepared, probe.resumed)
        });
        assert_eq!(paused.load(Ordering::SeqCst), world);
        for (rank, (report, phase, prepared, resumed)) in outcomes.into_iter().enumerate() {
            let report = report.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            assert!(report.driver_rank);
            assert_eq!(report.pids, (0..world).map(pid_of).collect::<Vec<_>>());
            let steps: Vec<Step> = report.timings.iter().map(|t| t.step).collect();
            assert_eq!(steps, Step::ALL);
            assert_eq!((phase, prepared, resumed), (Phase::Active, 1, 1));
        }
        let log = driver.log();
        assert_eq!(log.len(), 4 * world, "{log:?}");
        assert!(log.iter().all(|e| e.code == 0));
        assert_ordering(&log);
        // Lock, checkpoint, restore, unlock: each a block of `world` calls.
        for (i, call) in [Call::Lock, Call::Checkpoint, Call::Restore, Call::Unlock]
            .into_iter()
            .enumerate()
        {
            assert!(log[i * world..][..world].iter().all(|e| e.call == call));
        }
        (0..world).for_each(|r| assert_running(&driver, r));
        assert_eq!(driver.lock_timeouts(), vec![Duration::from_secs(10); world]);
    }
}

#[test]
fn a_driver_failure_at_each_step_on_each_rank_is_named_on_every_rank_and_rolled_back() {
    let steps = [
        (Call::Lock, Step::Lock),
        (Call::Checkpoint, Step::Checkpoint),
        (Call::Restore, Step::Restore),
        (Call::Unlock, Step::Unlock),
    ];
    for world in WORLDS {
        for (call, step) in steps {
            for bad in 0..world {
                let driver = FakeDriver::new();
                driver.fail_next(call, pid_of(bad), 999);
                let outcomes = run_probe(world, &driver, |_| Probe::default());
                let what = format!("world {world}, {step} failing on rank {bad}");
                for (rank, (out, probe)) in outcomes.iter().enumerate() {
                    let (first, aftermath) = agreed_failure(out);
                    assert_eq!((first.step, first.rank), (step, bad), "{what}");
                    let Reason::Driver(e) = &first.reason else {
                        panic!("{what}: {:?}", first.reason)
                    };
                    assert_eq!((e.code, e.pid), (999, pid_of(bad)), "{what}");
                    assert!(e.entry_point.starts_with("cuCheckpointProcess"), "{what}");
                    let text = failed(out).to_string();
                    assert!(text.contains(&format!("{step} on rank {bad}")), "{text}");
                    // What is left: the driver allows rolling back a failed lock or
                    // checkpoint completely; a failed restore leaves that process
                    // checkpointed, a failed unlock leaves it locked, and then no object
                    // is resumed anywhere (resuming runs CUDA in every process).
                    let (stuck, resumed) = match call {
                        Call::Lock | Call::Checkpoint => (None, true),
                        Call::Restore => (Some(ProcessState::Checkpointed), false),
                        Call::Unlock => (Some(ProcessState::Locked), false),
                    };
                    for r in 0..world {
                        let want = if r == bad {
                            stuck.unwrap_or(ProcessState::Running)
                        } else {
                            ProcessState::Running
                        };
                        assert_eq!(driver.state_of(pid_of(r)), want, "{what}: rank {r}");
                        assert_eq!(aftermath.processes[r], Some(want), "{what}: rank {r}");
                    }
                    let objects = if resumed {
                        ObjectsLeft::Resumed
                    } else {
                        ObjectsLeft::NotResumed
                    };
                    assert_eq!(aftermath.objects, objects, "{what}");
                    assert_eq!(probe.resumed, usize::from(resumed), "{what}: rank {rank}");
                }
                assert_ordering(&driver.log());
                // Never a checkpoint after a failed lock.
                if call == Call::Lock {
                    assert_eq!(first(&driver.log(), Call::Checkpoint), None, "{what}");
                }
            }
        }
    }
}

#[test]
fn a_failed_prepare_on_one_rank_locks_nothing_and_resumes_what_every_rank_suspended() {
    for world in WORLDS {
        for bad in 0..world {
            let driver = FakeDriver::new();
            let outcomes: Vec<_> = every_rank(world, |comm| {
                let mut good = Probe::default();
                let mut flaky = Probe {
                    fail_prepare: comm.rank() == bad,
                    ..Probe::default()
                };
                let out =
                    checkpoint_own_process(&comm, &driver, &mut [&mut good, &mut flaky], |_| {
                        panic!("no pause after a failed prepare")
                    });
                (out, good.resumed, flaky.prepared, flaky.resumed)
            });
            assert!(driver.log().is_empty(), "{:?}", driver.log());
            for (out, good_resumed, flaky_prepared, flaky_resumed) in &outcomes {
                let (first, aftermath) = agreed_failure(out);
                assert_eq!((first.step, first.rank), (Step::Prepare, bad));
                assert!(
                    matches!(&first.reason, Reason::Object { object: 1, message, .. } if message.contains("injected")),
                    "{:?}",
                    first.reason
                );
                assert_eq!(aftermath.objects, ObjectsLeft::Partial(vec![true, false]));
                assert_eq!(aftermath.processes, vec![None; world]);
                // Every rank joined every prepare; only the object every rank suspended is
                // resumed.
                assert_eq!((*good_resumed, *flaky_prepared, *flaky_resumed), (1, 1, 0));
            }
        }
    }
}

#[test]
fn a_failed_pause_restores_and_unlocks_every_process_and_resumes_the_objects() {
    for world in WORLDS {
        for bad in 0..world {
            let driver = FakeDriver::new();
            let outcomes: Vec<_> = every_rank(world, |comm| {
                let mut probe = Probe::default();
                let out = checkpoint_own_process(&comm, &driver, &mut [&mut probe], |p| {
                    if p.rank == bad {
                        Err("the dump failed".into())
                    } else {
                        Ok(())
                    }
                });
                (out, probe)
            });
            for (out, probe) in &outcomes {
                let e = failed_at(out, Step::Pause, bad);
                assert!(matches!(e.reason(), Some(Reason::Pause(m)) if m.contains("dump")));
                assert_eq!(probe.resumed, 1);
            }
            let log = driver.log();
            assert_eq!(log.len(), 4 * world);
            assert_ordering(&log);
            (0..world).for_each(|r| assert_running(&driver, r));
        }
    }
}

#[test]
fn a_failed_reinit_on_one_rank_is_named_after_every_process_runs_again() {
    for bad in 0..3 {
        let driver = FakeDriver::new();
        let outcomes = run_probe(3, &driver, |rank| Probe {
            fail_reinit: rank == bad,
            ..Probe::default()
        });
        for (out, _) in &outcomes {
            failed_at(out, Step::Reinit, bad);
        }
        (0..3).for_each(|r| assert_running(&driver, r));
    }
}

#[test]
fn ranks_sharing_a_process_make_one_driver_call_per_process() {
    let driver = FakeDriver::new();
    // Ranks 0 and 1 in process 500, ranks 2 and 3 in process 600.
    let outcomes: Vec<_> = every_rank(4, |comm| {
        let pid = if comm.rank() < 2 { 500 } else { 600 };
        let opts = CheckpointOptions {
            pid: Some(pid),
            ..CheckpointOptions::default()
        };
        let mut probe = Probe::default();
        checkpoint_group(&comm, &driver, &mut [&mut probe], &opts, |p| {
            assert_eq!(p.driver_rank, p.rank % 2 == 0);
            Ok(())
        })
    });
    for (rank, out) in outcomes.into_iter().enumerate() {
        let report = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(report.driver_rank, rank % 2 == 0, "rank {rank}");
        assert_eq!(report.pids, vec![500, 500, 600, 600]);
    }
    let log = driver.log();
    assert_eq!(log.len(), 8, "two processes, four calls each: {log:?}");
    for pid in [500, 600] {
        let calls: Vec<Call> = log
            .iter()
            .filter(|e| e.pid == pid)
            .map(|e| e.call)
            .collect();
        assert_eq!(
            calls,
            [Call::Lock, Call::Checkpoint, Call::Restore, Call::Unlock]
        );
    }
    assert_ordering(&log);
}

#[test]
fn an_absent_or_too_old_driver_is_refused_on_every_rank_before_anything_is_touched() {
    let absent = check_support(
        None,
        Some("libcuda.so.1: cannot open shared object file"),
        &[],
        None,
    )
    .unwrap_err();
    let old = check_support(Some(12040), None, &[], Some("550.54.15".into())).unwrap_err();
    for (why, needle) in [(absent, "libcuda.so.1"), (old, "12040")] {
        for bad in 0..3 {
            // Only rank `bad` has the unusable driver; the others a good one.
            let good = FakeDriver::new();
            let broken = FakeDriver::unsupported(why.clone());
            let outcomes: Vec<_> = every_rank(3, |comm| {
                let driver = if comm.rank() == bad { &broken } else { &good };
                let mut probe = Probe::default();
                let out = checkpoint_own_process(&comm, driver, &mut [&mut probe], |_| {
                    panic!("no pause")
                });
                (out, probe)
            });
            for (out, probe) in &outcomes {
                let (first, aftermath) = agreed_failure(out);
                assert_eq!((first.step, first.rank), (Step::Check, bad));
                assert!(
                    matches!(&first.reason, Reason::Unsupported(u) if u.reason.contains(needle))
                );
                assert_eq!(aftermath.objects, ObjectsLeft::Untouched);
                assert_eq!((probe.prepared, probe.resumed), (0, 0));
            }
            assert!(good.log().is_empty() && broken.log().is_empty());
        }
    }
}

#[test]
fn imported_ipc_mappings_are_refused_before_their_process_is_locked() {
    for bad in 0..3 {
        let driver = FakeDriver::new();
        driver.set_imported(pid_of(bad), 3);
        let outcomes = run_probe(3, &driver, |_| Probe::default());
        for (out, probe) in &outcomes {
            let (first, aftermath) = agreed_failure(out);
            assert_eq!((first.step, first.rank), (Step::Lock, bad));
            assert_eq!(
                first.reason,
                Reason::ImportedMappings {
                    pid: pid_of(bad),
                    count: 3
                }
            );
            assert_eq!(aftermath.objects, ObjectsLeft::Resumed);
            assert_eq!(probe.resumed, 1);
        }
        let log = driver.log();
        assert!(log.iter().all(|e| e.pid != pid_of(bad)), "{log:?}");
        assert_eq!(first(&log, Call::Checkpoint), None);
        // The others were locked and are unlocked again.
        (0..3).for_each(|r| assert_running(&driver, r));
    }
}

/// Without the refusal the driver model does what driver 580 does: the importer's restore
/// fails and leaves it checkpointed. (This is why the refusal exists.)
#[test]
fn the_fake_driver_models_the_importers_failed_restore() {
    use tpcomm_checkpoint::CheckpointDriver;
    let driver = FakeDriver::new();
    driver.set_imported(7, 1);
    driver.lock(7, Duration::from_secs(1)).unwrap();
    driver.checkpoint(7).unwrap();
    let e = driver.restore(7).unwrap_err();
    assert_eq!(e.code, tpcomm_checkpoint::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(driver.state_of(7), ProcessState::Checkpointed);
    // And the measured ILLEGAL_STATE answers.
    assert_eq!(driver.unlock(7).unwrap_err().code, 401);
    let other = FakeDriver::new();
    assert_eq!(other.checkpoint(8).unwrap_err().code, 401);
}

#[test]
fn an_object_that_cannot_suspend_or_a_differing_object_count_is_refused_at_the_check() {
    let driver = FakeDriver::new();
    let outcomes = run_probe(2, &driver, |rank| Probe {
        cannot_suspend: rank == 1,
        ..Probe::default()
    });
    for (out, probe) in &outcomes {
        let e = failed_at(out, Step::Check, 1);
        assert!(matches!(
            e.reason(),
            Some(Reason::CannotSuspend { object: 0, .. })
        ));
        assert_eq!(probe.prepared, 0);
    }
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let mut a = Probe::default();
        let mut b = Probe::default();
        let objects: &mut [&mut dyn Suspendable<LocalCommunicator>] = if comm.rank() == 0 {
            &mut [&mut a, &mut b]
        } else {
            &mut [&mut a]
        };
        checkpoint_own_process(&comm, &driver, objects, |_| Ok(()))
    });
    for out in &outcomes {
        let e = failed_at(out, Step::Check, 1);
        assert!(
            matches!(e.reason(), Some(Reason::ObjectCountMismatch { counts }) if counts == &[2, 1])
        );
    }
    assert!(driver.log().is_empty());
}

#[test]
fn a_zero_lock_timeout_is_refused_and_the_timeout_reaches_the_driver() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let opts = CheckpointOptions {
            lock_timeout: Duration::ZERO,
            ..options(comm.rank())
        };
        checkpoint_group(&comm, &driver, &mut [], &opts, |_| Ok(()))
    });
    for out in &outcomes {
        assert!(matches!(
            failed(out).reason(),
            Some(Reason::InvalidOptions(_))
        ));
    }
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let opts = CheckpointOptions {
            lock_timeout: Duration::from_millis(250),
            ..options(comm.rank())
        };
        checkpoint_group(&comm, &driver, &mut [], &opts, |_| Ok(()))
    });
    assert!(outcomes.iter().all(Result::is_ok));
    assert_eq!(driver.lock_timeouts(), vec![Duration::from_millis(250); 2]);
}

#[test]
fn a_rank_panicking_in_the_pause_leaves_no_process_locked_or_checkpointed() {
    let driver = FakeDriver::new();
    let outcomes = group(3).run(|comm| {
        let mut probe = Probe::default();
        checkpoint_own_process(&comm, &driver, &mut [&mut probe], pause_panicking_on(1))
    });
    assert!(outcomes[1].is_err(), "rank 1 panicked");
    for rank in [0, 2] {
        let out = outcomes[rank].as_ref().expect("rank finished");
        let (step, local) = exchange_failure(out);
        assert_eq!(step, Step::Pause);
        assert!(local.contains("running"), "{local}");
    }
    // The panicking rank's guard rolled its process back while unwinding; the others
    // rolled back alone when the exchange failed.
    (0..3).for_each(|r| assert_running(&driver, r));
}

#[test]
fn a_process_locked_by_someone_else_is_not_unlocked_by_the_sequence() {
    use tpcomm_checkpoint::CheckpointDriver;
    let driver = FakeDriver::new();
    // Another tool holds the lock of rank 1's process.
    driver.lock(pid_of(1), Duration::from_secs(1)).unwrap();
    let outcomes = run_probe(2, &driver, |_| Probe::default());
    for (out, probe) in &outcomes {
        let (first, aftermath) = agreed_failure(out);
        assert_eq!((first.step, first.rank), (Step::Lock, 1));
        assert!(matches!(&first.reason, Reason::Driver(e) if e.code == 401));
        assert_eq!(
            aftermath.processes,
            [Some(ProcessState::Running), Some(ProcessState::Locked)]
        );
        assert_eq!(aftermath.objects, ObjectsLeft::NotResumed);
        assert_eq!(probe.resumed, 0);
    }
    // Its lock is still the other tool's; ours on rank 0 was undone.
    assert_eq!(driver.state_of(pid_of(1)), ProcessState::Locked);
    assert_running(&driver, 0);
    let unlocks = driver
        .log()
        .iter()
        .filter(|e| e.call == Call::Unlock)
        .count();
    assert_eq!(unlocks, 1, "{:?}", driver.log());
}

#[test]
fn a_lock_that_failed_but_left_the_process_locked_is_unlocked() {
    use tpcomm_checkpoint::fake::LOCK_TIMEOUT_KEEPS_LOCK;
    let driver = FakeDriver::new();
    driver.fail_next(Call::Lock, pid_of(1), LOCK_TIMEOUT_KEEPS_LOCK);
    assert_rank_1s_failed_lock_was_undone(&run_probe(2, &driver, |_| Probe::default()), &driver);
}

/// Two ranks whose sequence failed at rank 1's lock, and the lock was undone: every rank
/// names it, the unlock's success shows the process running again, and only then are the
/// objects resumed.
fn assert_rank_1s_failed_lock_was_undone(outcomes: &[Outcome], fake: &FakeDriver) {
    for (out, probe) in outcomes {
        let (first, aftermath) = agreed_failure(out);
        assert_eq!((first.step, first.rank), (Step::Lock, 1));
        assert_eq!(aftermath.processes, [Some(ProcessState::Running); 2]);
        assert_eq!(aftermath.objects, ObjectsLeft::Resumed);
        assert_eq!(probe.resumed, 1);
    }
    assert_running(fake, 1);
    assert_ordering(&fake.log());
}

#[test]
fn ranks_of_separate_processes_with_the_same_pid_each_checkpoint_their_own() {
    // Two containers, each running its engine as pid 1 in its own PID namespace: each
    // process has a driver of its own (its own namespace), and the pid says nothing.
    let drivers = [FakeDriver::new(), FakeDriver::new()];
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let rank = comm.rank();
        let opts = CheckpointOptions {
            pid: Some(1),
            process: Some(100 + rank as u64),
            ..CheckpointOptions::default()
        };
        let mut ar = host_ar(&comm);
        let out = checkpoint_group(&comm, &drivers[rank], &mut [&mut ar], &opts, |p| {
            assert!(
                p.driver_rank,
                "rank {}: not its process's driver rank",
                p.rank
            );
            Ok(())
        });
        (out, ar.phase())
    });
    for (rank, (out, phase)) in outcomes.into_iter().enumerate() {
        let report = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(report.driver_rank, "rank {rank}");
        assert_eq!(report.pids, [1, 1]);
        assert_eq!(phase, Phase::Active, "rank {rank}");
    }
    for (rank, driver) in drivers.iter().enumerate() {
        let calls: Vec<(Call, u32)> = driver.log().iter().map(|e| (e.call, e.pid)).collect();
        assert_eq!(
            calls,
            [
                (Call::Lock, 1),
                (Call::Checkpoint, 1),
                (Call::Restore, 1),
                (Call::Unlock, 1)
            ],
            "rank {rank}'s process"
        );
    }
}

#[test]
fn a_failed_lock_whose_state_cannot_be_read_is_unlocked_and_never_reported_running_unseen() {
    use tpcomm_checkpoint::fake::LOCK_TIMEOUT_KEEPS_LOCK;
    let fake = FakeDriver::new();
    fake.fail_next(Call::Lock, pid_of(1), LOCK_TIMEOUT_KEEPS_LOCK);
    // The state cannot be read: the sequence assumed its lock might hold and unlocked.
    assert_rank_1s_failed_lock_was_undone(&run_two(&Faulty::new(&fake)), &fake);
}

#[test]
fn a_closed_all_reduce_is_refused_at_the_check_on_every_rank() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let mut ar = host_ar(&comm);
        ar.close_with(&comm).expect("close");
        checkpoint_own_process(&comm, &driver, &mut [&mut ar], |_| Ok(()))
    });
    for out in &outcomes {
        let (first, _) = agreed_failure(out);
        assert_eq!((first.step, first.rank), (Step::Check, 0));
        let Reason::CannotSuspend { object, why, .. } = &first.reason else {
            panic!("{out:?}")
        };
        assert_eq!(*object, 0);
        assert!(why.contains("closed"), "{why}");
    }
    assert!(driver.log().is_empty(), "{:?}", driver.log());
}

#[test]
fn a_restore_that_failed_late_with_an_unreadable_state_is_still_unlocked() {
    let fake = FakeDriver::new();
    let outcomes = run_two(&Faulty::late(&fake, Call::Restore, pid_of(1)));
    for (out, _) in &outcomes {
        failed_at(out, Step::Restore, 1);
    }
    // The restore may have worked before it failed: the sequence tried the unlock, which
    // freed the process.
    assert_running(&fake, 1);
    assert_ordering(&fake.log());
}

#[test]
fn a_checkpoint_that_failed_late_with_an_unreadable_state_is_still_restored_and_unlocked() {
    let fake = FakeDriver::new();
    let outcomes = run_two(&Faulty::late(&fake, Call::Checkpoint, pid_of(0)));
    for (out, _) in &outcomes {
        failed_at(out, Step::Checkpoint, 0);
    }
    let log = fake.log();
    assert!(
        log.iter()
            .any(|e| (e.call, e.pid) == (Call::Restore, pid_of(0))),
        "the checkpoint may have worked: a restore must be tried: {log:?}"
    );
    assert_running(&fake, 0);
}

#[test]
fn an_exchange_lost_after_a_failed_unlock_unlocks_again_and_says_so() {
    // Rank 0's unlock fails (once); rank 1's unlock takes longer than the exchange's
    // timeout, so rank 0's exchange of the unlock step fails while its process is locked.
    let fake = FakeDriver::new();
    fake.fail_next(Call::Unlock, pid_of(0), 999);
    let driver = Faulty {
        slow_unlock: Some((pid_of(1), Duration::from_secs(6))),
        ..Faulty::new(&fake)
    };
    let outcomes: Vec<_> = LocalGroup::new(2)
        .timeout(Duration::from_secs(2))
        .run(|comm| {
            let mut probe = Probe::default();
            checkpoint_own_process(&comm, &driver, &mut [&mut probe], |_| Ok(()))
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    let (step, local) = exchange_failure(&outcomes[0]);
    assert_eq!(step, Step::Unlock);
    assert!(
        local.contains("running") && local.contains("rolled back"),
        "{local}"
    );

    assert_running(&fake, 0);
}

#[test]
fn a_rank_sharing_its_process_names_the_driver_rank_when_its_exchange_fails() {
    let driver = FakeDriver::new();
    // Ranks 0 and 1 in process 500, rank 2 in 600; rank 2's pause panics.
    let outcomes = group(3).run(|comm| {
        let opts = CheckpointOptions {
            pid: Some(if comm.rank() < 2 { 500 } else { 600 }),
            ..CheckpointOptions::default()
        };
        let mut probe = Probe::default();
        checkpoint_group(
            &comm,
            &driver,
            &mut [&mut probe],
            &opts,
            pause_panicking_on(2),
        )
    });
    let (step, local) = exchange_failure(outcomes[1].as_ref().expect("rank 1 finished"));
    assert_eq!(step, Step::Pause);
    assert!(
        local.contains("rank 0") && !local.contains("as it was"),
        "{local}"
    );

    assert_eq!(driver.state_of(500), ProcessState::Running);
}

#[test]
fn ranks_registering_different_objects_in_the_same_number_are_refused_at_the_check() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let mut probe = Probe::default();
        let mut other = Other::default();
        let objects: &mut [&mut dyn Suspendable<LocalCommunicator>] = if comm.rank() == 0 {
            &mut [&mut probe, &mut other]
        } else {
            &mut [&mut other, &mut probe]
        };
        let out = checkpoint_own_process(&comm, &driver, objects, |_| Ok(()));
        (out, probe.prepared + other.0)
    });
    for (out, transitions) in &outcomes {
        let e = failed_at(out, Step::Check, 1);
        match e.reason() {
            Some(Reason::ObjectMismatch { object: 0, names }) => {
                assert_eq!(names, &["probe", "other"]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(*transitions, 0, "nothing was prepared");
    }
    assert!(driver.log().is_empty());
}

#[test]
fn a_process_whose_imports_the_driver_cannot_see_is_never_locked() {
    let fake = FakeDriver::new();
    let outcomes = run_two(&Faulty {
        state_readable: true,
        imports_unseen: Some(pid_of(1)),
        ..Faulty::new(&fake)
    });
    for (out, _) in &outcomes {
        let e = failed_at(out, Step::Lock, 1);
        assert_eq!(e.reason(), Some(&Reason::ImportsUnknown { pid: pid_of(1) }));
    }
    let log = fake.log();
    assert!(log.iter().all(|e| e.pid != pid_of(1)), "{log:?}");
    assert_running(&fake, 0);
}

#[test]
fn a_restore_that_failed_with_an_unreadable_state_is_reported_unreadable_not_locked() {
    // The restore fails before doing anything; the unlock the back half then tries (in case
    // it had) is refused, the process being still checkpointed; its state cannot be read.
    let fake = FakeDriver::new();
    fake.fail_next(Call::Restore, pid_of(1), 999);
    let driver = Faulty::new(&fake);
    for (out, probe) in &run_two(&driver) {
        let (first, aftermath) = agreed_failure(out);
        assert_eq!((first.step, first.rank), (Step::Restore, 1));
        assert_eq!(
            aftermath.processes,
            [Some(ProcessState::Running), Some(ProcessState::UNREADABLE)]
        );
        assert_ne!(aftermath.objects, ObjectsLeft::Resumed);
        assert_eq!(probe.resumed, 0);
    }
    assert_eq!(fake.state_of(pid_of(1)), ProcessState::Checkpointed);
}

#[test]
fn a_rollback_whose_restore_failed_late_with_an_unreadable_state_still_unlocks() {
    // Rank 1's pause panics, so rank 0 rolls its checkpointed process back alone; its
    // restore does its work and then fails, and the state cannot be read. The rollback
    // stopped there and left the process locked.
    let fake = FakeDriver::new();
    let driver = Faulty::late(&fake, Call::Restore, pid_of(0));
    let outcomes = group(2).run(|comm| {
        let mut probe = Probe::default();
        checkpoint_own_process(&comm, &driver, &mut [&mut probe], pause_panicking_on(1))
    });
    let (step, local) = exchange_failure(outcomes[0].as_ref().expect("rank 0 finished"));
    assert_eq!(step, Step::Pause);
    assert!(local.contains("running"), "{local}");

    assert_running(&fake, 0);
}

#[test]
fn an_all_reduce_mapping_memory_a_restore_cannot_bring_back_is_refused_naming_the_buffer() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let mut ar = CustomAllReduce::new(
            HostBackend::<Unrestorable>::new(),
            Unrestorable::default(),
            &comm,
            Config::default(),
        )
        .expect("all-reduce");
        let out = checkpoint_own_process(&comm, &driver, &mut [&mut ar], |_| Ok(()));
        // Refused before anything was touched: the communicator is still usable.
        let mut sum = [0f32; 4];
        ar.all_reduce(&[1.0; 4], &mut sum).expect("still Active");
        (out, sum)
    });
    for (out, sum) in &outcomes {
        assert_eq!(*sum, [2.0; 4]);
        let (first, _) = agreed_failure(out);
        assert_eq!((first.step, first.rank), (Step::Check, 0));
        let Reason::CannotSuspend { why, .. } = &first.reason else {
            panic!("{out:?}")
        };
        assert!(
            why.contains("rank 1's Signal block") && why.contains("cannot be opened again"),
            "{why}"
        );
    }
    assert!(
        driver.log().is_empty(),
        "nothing was locked: {:?}",
        driver.log()
    );
}

#[test]
fn a_checkpoint_of_an_all_reduce_on_stable_memory_releases_its_buffers_and_keeps_every_address() {
    use tpcomm_ipc::{IpcError, PeerMemory};
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = every_rank(2, |comm| {
        let memory = HostMemory::stable();
        let mut ar =
            CustomAllReduce::new(HostBackend::new(), memory.clone(), &comm, Config::default())
                .expect("all-reduce");
        let peer = 1 - comm.rank();
        let before: Vec<u64> = (0..3).map(|i| ar.base_address(peer, i).unwrap()).collect();
        let own: Vec<u64> = (0..3)
            .map(|i| ar.base_address(comm.rank(), i).unwrap())
            .collect();
        let writes = ar.table_writes();
        let mut released_in_pause = false;
        checkpoint_own_process(&comm, &driver, &mut [&mut ar], |_| {
            // While every process is checkpointed, this rank's Signal, staging and
            // temp buffers have no memory behind them (nothing to export).
            released_in_pause = own
                .iter()
                .all(|&a| matches!(memory.export(a, 8), Err(IpcError::NotExportable { .. })));
            Ok(())
        })
        .expect("checkpoint");
        let after: Vec<u64> = (0..3).map(|i| ar.base_address(peer, i).unwrap()).collect();
        let mut sum = [0f32; 64];
        ar.all_reduce(&[1.0; 64], &mut sum).expect("resumed");
        (
            released_in_pause,
            before == after,
            ar.table_writes() == writes,
            sum,
        )
    });
    for (released, same, unwritten, sum) in outcomes {
        assert!(released, "a buffer kept its memory through the checkpoint");
        assert!(same, "a peer address moved");
        assert!(unwritten, "the tables were written again");
        assert_eq!(sum, [2.0; 64]);
    }
}
