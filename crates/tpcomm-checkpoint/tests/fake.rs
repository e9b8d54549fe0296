//! The coordination against the fake driver, ranks as threads (`LocalGroup`): the order of
//! the driver calls across ranks, a failure at each step on each rank, ranks sharing a
//! process, an unusable driver, and imported CUDA IPC mappings. Each rank models its own
//! process (`CheckpointOptions::pid`) unless a test says otherwise.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend, Phase};
use tpcomm_checkpoint::fake::{Call, Event, FakeDriver};
use tpcomm_checkpoint::{
    check_support, checkpoint_group, BoxError, CheckpointError, CheckpointOptions,
    CheckpointReport, ObjectsLeft, ProcessState, Reason, Step, Suspendable,
};
use tpcomm_ipc::HostMemory;
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

const WORLDS: [usize; 3] = [2, 3, 4];

fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(20))
}

fn pid_of(rank: usize) -> u32 {
    1000 + rank as u32
}

fn options(rank: usize) -> CheckpointOptions {
    CheckpointOptions {
        pid: Some(pid_of(rank)),
        ..CheckpointOptions::default()
    }
}

/// A suspendable object that records what was called and fails where told. Its
/// transitions are collective (a barrier), like a real object's.
#[derive(Debug, Default)]
struct Probe {
    fail_prepare: bool,
    fail_reinit: bool,
    cannot_suspend: bool,
    prepared: usize,
    resumed: usize,
}

impl<C: Communicator + ?Sized> Suspendable<C> for Probe {
    fn name(&self) -> String {
        "probe".into()
    }
    fn suspend_support(&self) -> Result<(), String> {
        if self.cannot_suspend {
            Err("it holds device state it cannot release".into())
        } else {
            Ok(())
        }
    }
    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.prepared, self.fail_prepare, "prepare")
    }
    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.resumed, self.fail_reinit, "reinit")
    }
}

/// One collective step of a probe: a barrier, counted, failing after it when told to.
fn probe_step<C: Communicator + ?Sized>(
    comm: &C,
    count: &mut usize,
    fail: bool,
    what: &str,
) -> Result<(), BoxError> {
    comm.barrier()?;
    *count += 1;
    if fail {
        return Err(format!("injected {what} failure").into());
    }
    Ok(())
}

fn host_ar(comm: &LocalCommunicator) -> CustomAllReduce<HostBackend> {
    CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        Config::default(),
    )
    .expect("host all-reduce")
}

/// Index of the first / last event of `call` in the log.
fn first(log: &[Event], call: Call) -> Option<usize> {
    log.iter().position(|e| e.call == call)
}
fn last(log: &[Event], call: Call) -> Option<usize> {
    log.iter().rposition(|e| e.call == call)
}

/// The ordering rules on the log: every lock before any checkpoint; every restore before any
/// unlock.
fn assert_ordering(log: &[Event]) {
    if let (Some(l), Some(c)) = (last(log, Call::Lock), first(log, Call::Checkpoint)) {
        assert!(l < c, "a checkpoint before every lock: {log:?}");
    }
    if let (Some(r), Some(u)) = (last(log, Call::Restore), first(log, Call::Unlock)) {
        assert!(r < u, "an unlock before every restore: {log:?}");
    }
}

type Outcome = (Result<CheckpointReport, CheckpointError>, Probe);

/// Runs one checkpoint on `world` ranks with one probe each (set up by `probe`), every rank
/// a process of its own on `driver`.
fn run_probe(
    world: usize,
    driver: &FakeDriver,
    probe: impl Fn(usize) -> Probe + Sync,
) -> Vec<Outcome> {
    group(world)
        .run(|comm| {
            let mut p = probe(comm.rank());
            let out = checkpoint_group(&comm, driver, &mut [&mut p], &options(comm.rank()), |_| {
                Ok(())
            });
            (out, p)
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect()
}

fn failed(out: &Result<CheckpointReport, CheckpointError>) -> &CheckpointError {
    out.as_ref().expect_err("the checkpoint should have failed")
}

#[test]
fn every_process_is_locked_before_any_checkpoint_and_restored_before_any_unlock() {
    for world in WORLDS {
        let driver = FakeDriver::new();
        let paused = AtomicUsize::new(0);
        let outcomes: Vec<_> = group(world)
            .run(|comm| {
                let mut ar = host_ar(&comm);
                let mut probe = Probe::default();
                let report = checkpoint_group(
                    &comm,
                    &driver,
                    &mut [&mut ar, &mut probe],
                    &options(comm.rank()),
                    |p| {
                        // Every process is checkpointed while any rank pauses.
                        for r in 0..world {
                            assert_eq!(driver.state_of(pid_of(r)), ProcessState::Checkpointed);
                        }
                        assert_eq!(p.pid, pid_of(p.rank));
                        paused.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    },
                );
                // The all-reduce works after the resume.
                let mut out = [0f32; 64];
                ar.all_reduce(&[1f32; 64], &mut out)
                    .expect("all-reduce after");
                assert!(out.iter().all(|&v| v == world as f32));
                (report, ar.phase(), probe.prepared, probe.resumed)
            })
            .into_iter()
            .map(|r| r.expect("rank finished"))
            .collect();
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
        for r in 0..world {
            assert_eq!(driver.state_of(pid_of(r)), ProcessState::Running);
        }
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
                    let CheckpointError::Failed {
                        first, aftermath, ..
                    } = failed(out)
                    else {
                        panic!("{what}: rank {rank}: {:?}", out)
                    };
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
            let outcomes: Vec<_> = group(world)
                .run(|comm| {
                    let mut good = Probe::default();
                    let mut flaky = Probe {
                        fail_prepare: comm.rank() == bad,
                        ..Probe::default()
                    };
                    let out = checkpoint_group(
                        &comm,
                        &driver,
                        &mut [&mut good, &mut flaky],
                        &options(comm.rank()),
                        |_| panic!("no pause after a failed prepare"),
                    );
                    (out, good.resumed, flaky.prepared, flaky.resumed)
                })
                .into_iter()
                .map(|r| r.expect("rank finished"))
                .collect();
            assert!(driver.log().is_empty(), "{:?}", driver.log());
            for (out, good_resumed, flaky_prepared, flaky_resumed) in &outcomes {
                let CheckpointError::Failed {
                    first, aftermath, ..
                } = failed(out)
                else {
                    panic!("{out:?}")
                };
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
            let outcomes: Vec<_> = group(world)
                .run(|comm| {
                    let mut probe = Probe::default();
                    let out = checkpoint_group(
                        &comm,
                        &driver,
                        &mut [&mut probe],
                        &options(comm.rank()),
                        |p| {
                            if p.rank == bad {
                                Err("the dump failed".into())
                            } else {
                                Ok(())
                            }
                        },
                    );
                    (out, probe)
                })
                .into_iter()
                .map(|r| r.expect("rank finished"))
                .collect();
            for (out, probe) in &outcomes {
                let e = failed(out);
                assert_eq!((e.step(), e.rank()), (Step::Pause, bad));
                assert!(matches!(e.reason(), Some(Reason::Pause(m)) if m.contains("dump")));
                assert_eq!(probe.resumed, 1);
            }
            let log = driver.log();
            assert_eq!(log.len(), 4 * world);
            assert_ordering(&log);
            assert!((0..world).all(|r| driver.state_of(pid_of(r)) == ProcessState::Running));
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
            let e = failed(out);
            assert_eq!((e.step(), e.rank()), (Step::Reinit, bad));
        }
        assert!((0..3).all(|r| driver.state_of(pid_of(r)) == ProcessState::Running));
    }
}

#[test]
fn ranks_sharing_a_process_make_one_driver_call_per_process() {
    let driver = FakeDriver::new();
    // Ranks 0 and 1 in process 500, ranks 2 and 3 in process 600.
    let outcomes: Vec<_> = group(4)
        .run(|comm| {
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
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
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
            let outcomes: Vec<_> = group(3)
                .run(|comm| {
                    let driver = if comm.rank() == bad { &broken } else { &good };
                    let mut probe = Probe::default();
                    let out = checkpoint_group(
                        &comm,
                        driver,
                        &mut [&mut probe],
                        &options(comm.rank()),
                        |_| panic!("no pause"),
                    );
                    (out, probe)
                })
                .into_iter()
                .map(|r| r.expect("rank finished"))
                .collect();
            for (out, probe) in &outcomes {
                let CheckpointError::Failed {
                    first, aftermath, ..
                } = failed(out)
                else {
                    panic!("{out:?}")
                };
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
            let CheckpointError::Failed {
                first, aftermath, ..
            } = failed(out)
            else {
                panic!("{out:?}")
            };
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
        assert!((0..3).all(|r| driver.state_of(pid_of(r)) == ProcessState::Running));
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
        let e = failed(out);
        assert_eq!((e.step(), e.rank()), (Step::Check, 1));
        assert!(matches!(
            e.reason(),
            Some(Reason::CannotSuspend { object: 0, .. })
        ));
        assert_eq!(probe.prepared, 0);
    }
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
            let mut a = Probe::default();
            let mut b = Probe::default();
            let objects: &mut [&mut dyn Suspendable<LocalCommunicator>] = if comm.rank() == 0 {
                &mut [&mut a, &mut b]
            } else {
                &mut [&mut a]
            };
            checkpoint_group(&comm, &driver, objects, &options(comm.rank()), |_| Ok(()))
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    for out in &outcomes {
        let e = failed(out);
        assert_eq!((e.step(), e.rank()), (Step::Check, 1));
        assert!(
            matches!(e.reason(), Some(Reason::ObjectCountMismatch { counts }) if counts == &[2, 1])
        );
    }
    assert!(driver.log().is_empty());
}

#[test]
fn a_zero_lock_timeout_is_refused_and_the_timeout_reaches_the_driver() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
            let opts = CheckpointOptions {
                lock_timeout: Duration::ZERO,
                ..options(comm.rank())
            };
            checkpoint_group(&comm, &driver, &mut [], &opts, |_| Ok(()))
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    for out in &outcomes {
        assert!(matches!(
            failed(out).reason(),
            Some(Reason::InvalidOptions(_))
        ));
    }
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
            let opts = CheckpointOptions {
                lock_timeout: Duration::from_millis(250),
                ..options(comm.rank())
            };
            checkpoint_group(&comm, &driver, &mut [], &opts, |_| Ok(()))
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    assert!(outcomes.iter().all(Result::is_ok));
    assert_eq!(driver.lock_timeouts(), vec![Duration::from_millis(250); 2]);
}

#[test]
fn a_rank_panicking_in_the_pause_leaves_no_process_locked_or_checkpointed() {
    let driver = FakeDriver::new();
    let outcomes = group(3).run(|comm| {
        let mut probe = Probe::default();
        checkpoint_group(
            &comm,
            &driver,
            &mut [&mut probe],
            &options(comm.rank()),
            |p| {
                if p.rank == 1 {
                    panic!("the pause panicked");
                }
                Ok(())
            },
        )
    });
    assert!(outcomes[1].is_err(), "rank 1 panicked");
    for rank in [0, 2] {
        let out = outcomes[rank].as_ref().expect("rank finished");
        match out {
            Err(CheckpointError::Exchange { step, local, .. }) => {
                assert_eq!(*step, Step::Pause);
                assert!(local.contains("running"), "{local}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    // The panicking rank's guard rolled its process back while unwinding; the others
    // rolled back alone when the exchange failed.
    for r in 0..3 {
        assert_eq!(
            driver.state_of(pid_of(r)),
            ProcessState::Running,
            "rank {r}"
        );
    }
}

#[test]
fn a_process_locked_by_someone_else_is_not_unlocked_by_the_sequence() {
    use tpcomm_checkpoint::CheckpointDriver;
    let driver = FakeDriver::new();
    // Another tool holds the lock of rank 1's process.
    driver.lock(pid_of(1), Duration::from_secs(1)).unwrap();
    let outcomes = run_probe(2, &driver, |_| Probe::default());
    for (out, probe) in &outcomes {
        let CheckpointError::Failed {
            first, aftermath, ..
        } = failed(out)
        else {
            panic!("{out:?}")
        };
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
    assert_eq!(driver.state_of(pid_of(0)), ProcessState::Running);
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
        let CheckpointError::Failed {
            first, aftermath, ..
        } = failed(out)
        else {
            panic!("{out:?}")
        };
        assert_eq!((first.step, first.rank), (Step::Lock, 1));
        assert_eq!(aftermath.processes, [Some(ProcessState::Running); 2]);
        assert_eq!(aftermath.objects, ObjectsLeft::Resumed);
        assert_eq!(probe.resumed, 1);
    }
    assert_eq!(
        fake.state_of(pid_of(1)),
        ProcessState::Running,
        "left locked: {:?}",
        fake.log()
    );
    assert_ordering(&fake.log());
}

#[test]
fn ranks_of_separate_processes_with_the_same_pid_each_checkpoint_their_own() {
    // Two containers, each running its engine as pid 1 in its own PID namespace: each
    // process has a driver of its own (its own namespace), and the pid says nothing.
    let drivers = [FakeDriver::new(), FakeDriver::new()];
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
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
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
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
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
            let mut ar = host_ar(&comm);
            ar.close_with(&comm).expect("close");
            checkpoint_group(
                &comm,
                &driver,
                &mut [&mut ar],
                &options(comm.rank()),
                |_| Ok(()),
            )
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    for out in &outcomes {
        let CheckpointError::Failed { first, .. } = failed(out) else {
            panic!("{out:?}")
        };
        assert_eq!((first.step, first.rank), (Step::Check, 0));
        let Reason::CannotSuspend { object, why, .. } = &first.reason else {
            panic!("{out:?}")
        };
        assert_eq!(*object, 0);
        assert!(why.contains("closed"), "{why}");
    }
    assert!(driver.log().is_empty(), "{:?}", driver.log());
}

/// The fake driver with faults the fake itself does not model: `cuCheckpointProcessGetState`
/// always failing (unless `state_readable`), one call on one pid that does its work and
/// then fails anyway (a call that failed late), a pause before the unlocks of one pid, and
/// one pid whose CUDA IPC imports the driver cannot see (as the real driver cannot see
/// another process's).
struct Faulty {
    fake: FakeDriver,
    state_readable: bool,
    late: Option<(Call, u32)>,
    slow_unlock: Option<(u32, Duration)>,
    imports_unseen: Option<u32>,
}

impl Faulty {
    /// The fake with its state unreadable and nothing else changed.
    fn new(fake: &FakeDriver) -> Self {
        Self {
            fake: fake.clone(),
            state_readable: false,
            late: None,
            slow_unlock: None,
            imports_unseen: None,
        }
    }

    fn late(fake: &FakeDriver, call: Call, pid: u32) -> Self {
        Self {
            late: Some((call, pid)),
            ..Self::new(fake)
        }
    }

    /// `done`, or a failure when `call` on `pid` is the late one.
    fn outcome(
        &self,
        call: Call,
        pid: u32,
        done: Result<(), tpcomm_checkpoint::DriverError>,
    ) -> Result<(), tpcomm_checkpoint::DriverError> {
        done?;
        if self.late == Some((call, pid)) {
            return Err(tpcomm_checkpoint::DriverError {
                entry_point: "late".into(),
                pid,
                code: 909,
                name: "CUDA_ERROR_TIMEOUT".into(),
            });
        }
        Ok(())
    }
}

impl tpcomm_checkpoint::CheckpointDriver for Faulty {
    fn support(&self) -> Result<tpcomm_checkpoint::DriverInfo, tpcomm_checkpoint::Unsupported> {
        self.fake.support()
    }
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), tpcomm_checkpoint::DriverError> {
        self.outcome(Call::Lock, pid, self.fake.lock(pid, timeout))
    }
    fn checkpoint(&self, pid: u32) -> Result<(), tpcomm_checkpoint::DriverError> {
        self.outcome(Call::Checkpoint, pid, self.fake.checkpoint(pid))
    }
    fn restore(&self, pid: u32) -> Result<(), tpcomm_checkpoint::DriverError> {
        self.outcome(Call::Restore, pid, self.fake.restore(pid))
    }
    fn unlock(&self, pid: u32) -> Result<(), tpcomm_checkpoint::DriverError> {
        if let Some((slow, pause)) = self.slow_unlock {
            if slow == pid {
                std::thread::sleep(pause);
            }
        }
        self.outcome(Call::Unlock, pid, self.fake.unlock(pid))
    }
    fn state(&self, pid: u32) -> Result<ProcessState, tpcomm_checkpoint::DriverError> {
        if self.state_readable {
            return self.fake.state(pid);
        }
        Err(tpcomm_checkpoint::DriverError {
            entry_point: "cuCheckpointProcessGetState".into(),
            pid,
            code: 999,
            name: "CUDA_ERROR_UNKNOWN".into(),
        })
    }
    fn imported_ipc_mappings(&self, pid: u32) -> Option<usize> {
        if self.imports_unseen == Some(pid) {
            return None;
        }
        self.fake.imported_ipc_mappings(pid)
    }
}

/// Runs one checkpoint on two ranks (each its own process) with `driver`.
fn run_two(driver: &(dyn tpcomm_checkpoint::CheckpointDriver + Sync)) -> Vec<Outcome> {
    group(2)
        .run(|comm| {
            let mut probe = Probe::default();
            let out = checkpoint_group(
                &comm,
                driver,
                &mut [&mut probe],
                &options(comm.rank()),
                |_| Ok(()),
            );
            (out, probe)
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect()
}

#[test]
fn a_restore_that_failed_late_with_an_unreadable_state_is_still_unlocked() {
    let fake = FakeDriver::new();
    let outcomes = run_two(&Faulty::late(&fake, Call::Restore, pid_of(1)));
    for (out, _) in &outcomes {
        let e = failed(out);
        assert_eq!((e.step(), e.rank()), (Step::Restore, 1));
    }
    // The restore may have worked before it failed: the sequence tried the unlock, which
    // freed the process.
    assert_eq!(
        fake.state_of(pid_of(1)),
        ProcessState::Running,
        "{:?}",
        fake.log()
    );
    assert_ordering(&fake.log());
}

#[test]
fn a_checkpoint_that_failed_late_with_an_unreadable_state_is_still_restored_and_unlocked() {
    let fake = FakeDriver::new();
    let outcomes = run_two(&Faulty::late(&fake, Call::Checkpoint, pid_of(0)));
    for (out, _) in &outcomes {
        let e = failed(out);
        assert_eq!((e.step(), e.rank()), (Step::Checkpoint, 0));
    }
    let log = fake.log();
    assert!(
        log.iter()
            .any(|e| (e.call, e.pid) == (Call::Restore, pid_of(0))),
        "the checkpoint may have worked: a restore must be tried: {log:?}"
    );
    assert_eq!(fake.state_of(pid_of(0)), ProcessState::Running, "{log:?}");
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
            checkpoint_group(
                &comm,
                &driver,
                &mut [&mut probe],
                &options(comm.rank()),
                |_| Ok(()),
            )
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    match &outcomes[0] {
        Err(CheckpointError::Exchange { step, local, .. }) => {
            assert_eq!(*step, Step::Unlock);
            assert!(
                local.contains("running") && local.contains("rolled back"),
                "{local}"
            );
        }
        other => panic!("rank 0: {other:?}"),
    }
    assert_eq!(
        fake.state_of(pid_of(0)),
        ProcessState::Running,
        "{:?}",
        fake.log()
    );
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
        checkpoint_group(&comm, &driver, &mut [&mut probe], &opts, |p| {
            if p.rank == 2 {
                panic!("the pause panicked");
            }
            Ok(())
        })
    });
    match outcomes[1].as_ref().expect("rank 1 finished") {
        Err(CheckpointError::Exchange { step, local, .. }) => {
            assert_eq!(*step, Step::Pause);
            assert!(
                local.contains("rank 0") && !local.contains("as it was"),
                "{local}"
            );
        }
        other => panic!("rank 1: {other:?}"),
    }
    assert_eq!(driver.state_of(500), ProcessState::Running);
}

/// A suspendable object of another kind than [`Probe`] (its transitions are barriers too).
#[derive(Debug, Default)]
struct Other(usize);

impl<C: Communicator + ?Sized> Suspendable<C> for Other {
    fn name(&self) -> String {
        "other".into()
    }
    fn suspend_support(&self) -> Result<(), String> {
        Ok(())
    }
    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.0, false, "prepare")
    }
    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.0, false, "reinit")
    }
}

#[test]
fn ranks_registering_different_objects_in_the_same_number_are_refused_at_the_check() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
            let mut probe = Probe::default();
            let mut other = Other::default();
            let objects: &mut [&mut dyn Suspendable<LocalCommunicator>] = if comm.rank() == 0 {
                &mut [&mut probe, &mut other]
            } else {
                &mut [&mut other, &mut probe]
            };
            let out = checkpoint_group(&comm, &driver, objects, &options(comm.rank()), |_| Ok(()));
            (out, probe.prepared + other.0)
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    for (out, transitions) in &outcomes {
        let e = failed(out);
        assert_eq!((e.step(), e.rank()), (Step::Check, 1));
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
        let e = failed(out);
        assert_eq!((e.step(), e.rank()), (Step::Lock, 1));
        assert_eq!(e.reason(), Some(&Reason::ImportsUnknown { pid: pid_of(1) }));
    }
    let log = fake.log();
    assert!(log.iter().all(|e| e.pid != pid_of(1)), "{log:?}");
    assert_eq!(fake.state_of(pid_of(0)), ProcessState::Running);
}

#[test]
fn a_restore_that_failed_with_an_unreadable_state_is_reported_unreadable_not_locked() {
    // The restore fails before doing anything; the unlock the back half then tries (in case
    // it had) is refused, the process being still checkpointed; its state cannot be read.
    let fake = FakeDriver::new();
    fake.fail_next(Call::Restore, pid_of(1), 999);
    let driver = Faulty::new(&fake);
    for (out, probe) in &run_two(&driver) {
        let CheckpointError::Failed {
            first, aftermath, ..
        } = failed(out)
        else {
            panic!("{out:?}")
        };
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
        checkpoint_group(
            &comm,
            &driver,
            &mut [&mut probe],
            &options(comm.rank()),
            |p| {
                if p.rank == 1 {
                    panic!("the pause panicked");
                }
                Ok(())
            },
        )
    });
    match outcomes[0].as_ref().expect("rank 0 finished") {
        Err(CheckpointError::Exchange { step, local, .. }) => {
            assert_eq!(*step, Step::Pause);
            assert!(local.contains("running"), "{local}");
        }
        other => panic!("rank 0: {other:?}"),
    }
    assert_eq!(
        fake.state_of(pid_of(0)),
        ProcessState::Running,
        "{:?}",
        fake.log()
    );
}

/// Host memory whose peer handles a checkpoint cannot bring back, as legacy CUDA IPC
/// handles of another process cannot be opened again after a restore.
#[derive(Debug, Clone, Default)]
struct Unrestorable(HostMemory);

impl tpcomm_ipc::PeerMemory for Unrestorable {
    type Handle = tpcomm_ipc::HostHandle;
    type Buffer = tpcomm_ipc::HostBuffer;
    type Mapping = tpcomm_ipc::HostMapping;

    fn name(&self) -> &'static str {
        "host-unrestorable"
    }
    fn allocate(&self, bytes: usize) -> tpcomm_ipc::Result<Self::Buffer> {
        self.0.allocate(bytes)
    }
    fn allocate_private(&self, bytes: usize) -> tpcomm_ipc::Result<Self::Buffer> {
        self.0.allocate_private(bytes)
    }
    fn export(&self, addr: u64, len: usize) -> tpcomm_ipc::Result<Self::Handle> {
        self.0.export(addr, len)
    }
    fn open(&self, handle: &Self::Handle) -> tpcomm_ipc::Result<Self::Mapping> {
        self.0.open(handle)
    }
    fn close(&self, mapping: Self::Mapping) -> tpcomm_ipc::Result<()> {
        self.0.close(mapping)
    }
    fn write<R: tpcomm_ipc::MemoryRegion>(
        &self,
        region: &R,
        offset: usize,
        src: &[u8],
    ) -> tpcomm_ipc::Result<()> {
        self.0.write(region, offset, src)
    }
    fn read<R: tpcomm_ipc::MemoryRegion>(
        &self,
        region: &R,
        offset: usize,
        dst: &mut [u8],
    ) -> tpcomm_ipc::Result<()> {
        self.0.read(region, offset, dst)
    }
    fn checkpoint_blocker(&self, handle: &Self::Handle) -> Option<String> {
        Some(format!(
            "memory of process {} that cannot be opened again after a restore",
            handle.pid
        ))
    }
}

#[test]
fn an_all_reduce_mapping_memory_a_restore_cannot_bring_back_is_refused_naming_the_buffer() {
    let driver = FakeDriver::new();
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
            let mut ar = CustomAllReduce::new(
                HostBackend::<Unrestorable>::new(),
                Unrestorable::default(),
                &comm,
                Config::default(),
            )
            .expect("all-reduce");
            let out = checkpoint_group(
                &comm,
                &driver,
                &mut [&mut ar],
                &options(comm.rank()),
                |_| Ok(()),
            );
            // Refused before anything was touched: the communicator is still usable.
            let mut sum = [0f32; 4];
            ar.all_reduce(&[1.0; 4], &mut sum).expect("still Active");
            (out, sum)
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    for (out, sum) in &outcomes {
        assert_eq!(*sum, [2.0; 4]);
        let CheckpointError::Failed { first, .. } = failed(out) else {
            panic!("{out:?}")
        };
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
    let outcomes: Vec<_> = group(2)
        .run(|comm| {
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
            checkpoint_group(
                &comm,
                &driver,
                &mut [&mut ar],
                &options(comm.rank()),
                |_| {
                    // While every process is checkpointed, this rank's Signal, staging and
                    // temp buffers have no memory behind them (nothing to export).
                    released_in_pause = own.iter().all(|&a| {
                        matches!(memory.export(a, 8), Err(IpcError::NotExportable { .. }))
                    });
                    Ok(())
                },
            )
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
        })
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect();
    for (released, same, unwritten, sum) in outcomes {
        assert!(released, "a buffer kept its memory through the checkpoint");
        assert!(same, "a peer address moved");
        assert!(unwritten, "the tables were written again");
        assert_eq!(sum, [2.0; 64]);
    }
}
