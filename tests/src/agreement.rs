//! Agreement cases of the conformance suite: settings that differ across ranks, and a
//! transition paired with a peer's other step, give a typed error on every rank (threads of
//! the local group, or processes under MPI), and the communicator stays usable.

use tpcomm::allreduce::{AllReduceError, Config, CustomAllReduce, HostBackend, Phase};
use tpcomm::ipc::{FaultInjection, FaultPoint, HostMemory, IpcError, Step};
use tpcomm::transport::Communicator;

use crate::CaseResult;

/// The last rank asks for a smaller `max_bytes`: every rank gets `ConfigMismatch` naming the
/// field and that rank's value (before, the others' all-reduces read past its staging
/// mapping); a matching creation right after works.
pub(crate) fn mismatched_config_is_refused_on_every_rank<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Ok(());
    }
    let config = |max_bytes| Config {
        max_bytes,
        slots: 8,
        ..Config::default()
    };
    let mine = if me == n - 1 { 4096 } else { 64 << 10 };
    match CustomAllReduce::new(HostBackend::new(), HostMemory::new(), comm, config(mine)) {
        Err(AllReduceError::ConfigMismatch { field, values }) => {
            if field != "max_bytes" || values.len() != n || values[n - 1].1 != "4096" {
                return Err(format!("wrong mismatch: {field} {values:?}"));
            }
        }
        Err(e) => return Err(format!("new: wrong error: {e}")),
        Ok(_) => return Err("new accepted different max_bytes".into()),
    }
    let mut x = CustomAllReduce::new(HostBackend::new(), HostMemory::new(), comm, config(65536))
        .map_err(|e| format!("new after the refusal: {e}"))?;
    let mut out = vec![0f32; 16];
    x.all_reduce(&[1f32; 16], &mut out)
        .map_err(|e| format!("all_reduce: {e}"))?;
    if out != vec![n as f32; 16] {
        return Err(format!("all_reduce gave {out:?}"));
    }
    x.close_with(comm).map_err(|e| format!("close_with: {e}"))
}

/// The scenario: a close fault on rank 0 during the suspend leaves rank 0 Failed and
/// the others Suspended; the others' resume then pairs with rank 0's next collective (here a
/// new communicator). Every rank fails naming the rank in the other step, nobody waits for a
/// timeout, and the transport is still in step afterwards.
pub(crate) fn resume_paired_with_another_step_names_the_rank<C: Communicator>(
    comm: &C,
) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Ok(());
    }
    let mem = FaultInjection::new(HostMemory::new());
    let mut x = CustomAllReduce::new(HostBackend::new(), mem.clone(), comm, Config::default())
        .map_err(|e| format!("new: {e}"))?;
    if me == 0 {
        mem.arm(FaultPoint::Close, 1);
    }
    let suspended = x.prepare_for_suspend(comm);
    let as_expected = if me == 0 {
        suspended.is_err() && x.phase() == Phase::Failed
    } else {
        suspended.is_ok() && x.phase() == Phase::Suspended
    };
    if !as_expected {
        return Err(format!("suspend: {suspended:?} -> {}", x.phase()));
    }
    let (outcome, expected_step, expected_rank, found_step) = if me == 0 {
        drop(x);
        let created = CustomAllReduce::new(
            HostBackend::new(),
            HostMemory::new(),
            comm,
            Config::default(),
        );
        (created.map(drop), Step::Create, 1, Step::Reopen)
    } else {
        let resumed = x.reinit_after_resume(comm);
        x.close().ok();
        (resumed, Step::Reopen, 0, Step::Create)
    };
    let mismatch = match &outcome {
        Err(AllReduceError::Failed { cause, .. }) => match &**cause {
            AllReduceError::Ipc(e) => Some(e.clone()),
            _ => None,
        },
        Err(AllReduceError::Ipc(e)) => Some(e.clone()),
        _ => None,
    };
    match mismatch.as_deref() {
        Some(IpcError::StepMismatch {
            rank,
            expected,
            found: Some(found),
        }) if *rank == expected_rank
            && expected.step == expected_step
            && found.step == found_step => {}
        _ => return Err(format!("wrong outcome: {outcome:?}")),
    }
    comm.barrier()
        .map_err(|e| format!("barrier after the mismatch: {e}"))
}
