//! Every collective step of the lifecycle carries what it is: a peer in another step is
//! named, never paired silently; `close_with` frees nothing while a peer may still read it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod common;
use common::{chain, group, new_ar, unwrap_all, with_timeout, R};
use tpcomm_allreduce::{AllReduceError, Config, CustomAllReduce, HostBackend, Phase};
use tpcomm_ipc::{FaultInjection, FaultPoint, HostMemory, IpcError, Step, StepTag};
use tpcomm_objects::ObjectError;
use tpcomm_transport::{Communicator, LocalCommunicator};

type Faulty = CustomAllReduce<HostBackend<FaultInjection<HostMemory>>>;

/// The setup: a close fault on rank 0 during the suspend. Rank 0 ends Failed, rank 1
/// Suspended (fail-fast, no voting).
fn suspend_with_close_fault_on_rank_0(comm: &LocalCommunicator) -> Faulty {
    let mem = FaultInjection::new(HostMemory::new());
    let mut ar = CustomAllReduce::new(HostBackend::new(), mem.clone(), comm, Config::default())
        .expect("new");
    if comm.rank() == 0 {
        mem.arm(FaultPoint::Close, 1);
        let e = ar.prepare_for_suspend(comm).unwrap_err();
        assert!(chain(&e).contains("injected fault"), "{}", chain(&e));
        assert_eq!(ar.phase(), Phase::Failed);
    } else {
        ar.prepare_for_suspend(comm).expect("rank 1 suspends");
        assert_eq!(ar.phase(), Phase::Suspended);
    }
    ar
}

/// The step mismatch inside `e` (a transition's `Failed`, or a bare `Ipc`).
fn step_mismatch(e: &AllReduceError) -> (usize, StepTag, Option<StepTag>) {
    match e {
        AllReduceError::Failed { cause, .. } => step_mismatch(cause),
        AllReduceError::Ipc(ipc) => match &**ipc {
            IpcError::StepMismatch {
                rank,
                expected,
                found,
            } => (*rank, *expected, *found),
            other => panic!("not a step mismatch: {other:?}"),
        },
        other => panic!("not a step mismatch: {other:?}"),
    }
}

/// The scenario: rank 1's resume exchange paired with rank 0's next, unrelated
/// collective and decoded garbage ("264 bytes left over", "invalid utf-8"), then hung until
/// the transport timeout. Now rank 1 names rank 0 and says it is in no tpcomm step; rank 0's
/// own collective sees bytes it cannot decode; nobody waits.
#[test]
fn a_resume_paired_with_a_peers_unrelated_collective_names_the_rank_and_the_step() {
    let results = group(2).run(|comm| {
        let mut ar = suspend_with_close_fault_on_rank_0(&comm);
        if comm.rank() == 0 {
            // Failed: refused locally, without any collective (fail-fast) ...
            assert!(matches!(
                ar.reinit_after_resume(&comm),
                Err(AllReduceError::Failed {
                    during: "prepare_for_suspend",
                    ..
                })
            ));
            // ... and the application goes on with its own collective.
            let unrelated = tpcomm_objects::all_gather(&comm, &"unrelated".to_string());
            assert!(
                matches!(unrelated, Err(ObjectError::Decode { rank: 1, .. })),
                "{unrelated:?}"
            );
        } else {
            let e = ar.reinit_after_resume(&comm).unwrap_err();
            assert!(
                matches!(
                    e,
                    AllReduceError::Failed {
                        during: "reinit_after_resume",
                        ..
                    }
                ),
                "{e:?}"
            );
            let (rank, expected, found) = step_mismatch(&e);
            assert_eq!(rank, 0);
            assert_eq!(expected.step, Step::Reopen);
            assert_eq!(found, None, "rank 0 is in no tagged step");
            let message = chain(&e);
            assert!(
                message.contains("rank 0 is in a collective that is not a tagged tpcomm step")
                    && message.contains("PeerMappings::reopen_all"),
                "{message}"
            );
            assert_eq!(ar.phase(), Phase::Failed);
        }
        ar.close().ok();
    });
    for r in results {
        r.unwrap();
    }
}

/// The same, with rank 0's next collective a tpcomm step of its own (a new communicator):
/// both ranks fail, each naming the other and its step.
#[test]
fn a_resume_paired_with_a_peers_new_communicator_fails_both_naming_each_others_step() {
    let results = group(2).run(|comm| {
        let mut ar = suspend_with_close_fault_on_rank_0(&comm);
        if comm.rank() == 0 {
            drop(ar);
            let e = new_ar(&comm, Config::default()).unwrap_err();
            let (rank, expected, found) = step_mismatch(&e);
            assert_eq!((rank, expected.step), (1, Step::Create));
            assert_eq!(found.map(|t| t.step), Some(Step::Reopen));
        } else {
            let e = ar.reinit_after_resume(&comm).unwrap_err();
            let (rank, expected, found) = step_mismatch(&e);
            assert_eq!((rank, expected.step), (0, Step::Reopen));
            assert_eq!(
                found,
                Some(StepTag {
                    step: Step::Create,
                    group: 0,
                    sequence: 0
                })
            );
            assert_eq!(ar.phase(), Phase::Failed);
        }
    });
    for r in results {
        r.unwrap();
    }
}

/// A transition barrier is a tagged step too: rank 0 closing while rank 1 suspends is named
/// on both ranks, and rank 0 still frees everything.
#[test]
fn close_with_and_a_suspend_on_the_peer_name_each_other() {
    let results = group(2).run(|comm| {
        let mut ar = new_ar(&comm, Config::default()).unwrap();
        if comm.rank() == 0 {
            let e = ar.close_with(&comm).unwrap_err();
            let (rank, expected, found) = step_mismatch(&e);
            assert_eq!((rank, expected.step), (1, Step::Close));
            assert_eq!(found.map(|t| t.step), Some(Step::SuspendDrained));
            assert_eq!(ar.phase(), Phase::Closed, "released anyway");
        } else {
            let e = ar.prepare_for_suspend(&comm).unwrap_err();
            let (rank, expected, found) = step_mismatch(&e);
            assert_eq!((rank, expected.step), (0, Step::SuspendDrained));
            assert_eq!(found.map(|t| t.step), Some(Step::Close));
            assert_eq!(ar.phase(), Phase::Failed);
            ar.close().unwrap();
        }
    });
    for r in results {
        r.unwrap();
    }
}

/// `close_with` frees the Signal, staging and temp buffers only after every rank joined it:
/// rank 1, still inside an all-reduce that rank 0 never joins (it times out), is done with
/// rank 0's memory before rank 0's `close_with` returns.
#[test]
fn close_with_frees_nothing_before_a_slower_peer_is_done_reading() {
    let done_reading = AtomicBool::new(false);
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, with_timeout(Duration::from_millis(300)))?;
        if comm.rank() == 0 {
            ar.close_with(&comm)?;
            assert!(
                done_reading.load(Ordering::SeqCst),
                "rank 0 freed its buffers while rank 1 was still in a launch reading them"
            );
        } else {
            // Reads rank 0's Signal block (and would read its staging) until the timeout.
            let e = ar.all_reduce(&[1f32; 64], &mut [0f32; 64]).unwrap_err();
            assert!(chain(&e).contains("rank 0 never arrived"), "{}", chain(&e));
            done_reading.store(true, Ordering::SeqCst);
            ar.close_with(&comm)?;
        }
        assert_eq!(ar.phase(), Phase::Closed);
        Ok(())
    });
    unwrap_all(results);
}

/// What a non-collective drop does to a peer on the host backend (documented on `close`):
/// the peer's own mappings keep the dropped rank's memory valid, so its next all-reduce
/// reads stale memory and times out naming the dropped rank, without crashing.
#[test]
fn a_peer_of_a_rank_dropped_without_close_with_times_out_naming_it() {
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, with_timeout(Duration::from_millis(300)))?;
        if comm.rank() == 0 {
            drop(ar);
            comm.barrier()?;
        } else {
            comm.barrier()?;
            match ar.all_reduce(&[1f32; 64], &mut [0f32; 64]) {
                Err(AllReduceError::Failed { cause, .. }) => assert!(
                    matches!(*cause, AllReduceError::Timeout { peer: 0, .. }),
                    "{cause:?}"
                ),
                other => panic!("{other:?}"),
            }
        }
        Ok(())
    });
    unwrap_all(results);
}

/// Collective close in the ordinary case: every phase, then every later call is refused.
#[test]
fn close_with_from_every_phase_releases_everything_on_every_rank() {
    let results = group(3).run(|comm| -> R<()> {
        for setup in 0..2 {
            let mut ar = new_ar(&comm, Config::default())?;
            if setup == 1 {
                ar.prepare_for_suspend(&comm)?;
            }
            ar.close_with(&comm)?;
            assert_eq!(ar.phase(), Phase::Closed);
            ar.close_with(&comm)?; // already Closed: a local no-op
            assert!(matches!(
                ar.all_reduce(&[1f32; 4], &mut [0f32; 4]),
                Err(AllReduceError::WrongState {
                    phase: Phase::Closed,
                    ..
                })
            ));
        }
        Ok(())
    });
    unwrap_all(results);
}
