//! Cases only MPI can run (feature `mpi`): what an MPI communicator does when ranks call a
//! collective with counts that disagree, on the blocking path and on the timed
//! (nonblocking, deadline-polled) path. `mpi-conformance` runs them after the shared suite.
//!
//! Every case works on fresh splits of the communicator it is given, because a collective
//! that failed leaves its communicator unusable; the given communicator stays in step.

use std::time::{Duration, Instant};

use tpcomm::transport::{Communicator, GatherRecv, MpiCommunicator, TransportError};

use crate::{agree, filled, CaseReport, CaseResult};

/// The timeout of the timed splits: far above what the cases take, so it never fires.
const TIMEOUT: Duration = Duration::from_secs(60);

/// `MPI_ERR_TRUNCATE` (the error class of a message longer than its receive count).
const ERR_TRUNCATE: i32 = mpi::ffi::MPI_ERR_TRUNCATE as i32;

/// Runs every MPI-only case on `comm`; the verdicts are the same on every rank.
pub fn run_mpi_cases(comm: &MpiCommunicator) -> Vec<CaseReport> {
    type Case = (&'static str, fn(&MpiCommunicator) -> CaseResult);
    let cases: [Case; 7] = [
        (
            "mpi_truncation_is_returned_as_a_typed_error_on_the_blocking_and_timed_paths",
            truncation_is_returned_on_both_paths,
        ),
        (
            "mpi_a_sender_sending_more_than_agreed_gets_the_timed_root_a_typed_error_not_a_corrupt_heap",
            lying_sender_gets_the_timed_root_a_typed_error,
        ),
        (
            "mpi_a_timed_split_waits_no_longer_than_the_timeout_and_a_broken_communicator_refuses_split",
            timed_split_is_bounded_and_refused_once_broken,
        ),
        (
            "mpi_a_timed_split_against_a_peer_in_barrier_is_bounded",
            timed_split_against_a_barrier_is_bounded,
        ),
        (
            "mpi_a_split_color_out_of_range_on_one_rank_fails_every_rank_and_keeps_them_in_step",
            invalid_split_color_fails_every_rank,
        ),
        (
            "mpi_a_timed_collective_names_the_peer_that_is_not_in_it_as_silent_and_not_those_waiting",
            timed_collective_names_the_absent_peer_as_silent,
        ),
        (
            "mpi_ranks_stopped_past_their_deadline_wait_for_the_roll_call_and_name_only_the_absent_peer",
            stopped_past_the_deadline_names_only_the_absent_peer,
        ),
    ];
    cases
        .into_iter()
        .map(|(name, case)| agree(comm, name, case(comm)))
        .collect()
}

/// The cases of `mpi-single-copy-off`, a program that called
/// `MpiCommunicator::disable_single_copy_before_init` (with result `disabled`) before
/// initializing MPI.
pub fn run_single_copy_off_cases(
    comm: &MpiCommunicator,
    disabled: &Result<(), TransportError>,
) -> Vec<CaseReport> {
    let was_disabled = match disabled {
        Ok(()) => Ok(()),
        Err(e) => Err(format!("disable_single_copy_before_init failed: {e}")),
    };
    let after_init = match MpiCommunicator::disable_single_copy_before_init() {
        Err(TransportError::Setup(_)) => Ok(()),
        other => Err(format!(
            "disable_single_copy_before_init after MPI_Init gave {other:?}"
        )),
    };
    vec![
        agree(
            comm,
            "mpi_single_copy_is_disabled_before_init",
            was_disabled.clone(),
        ),
        agree(
            comm,
            "mpi_disabling_single_copy_after_init_is_refused",
            after_init,
        ),
        agree(
            comm,
            "mpi_a_sender_sending_more_than_agreed_gets_the_blocking_root_a_typed_error_without_single_copy",
            // Without single copy disabled this case would overwrite the root's heap.
            was_disabled.and_then(|()| lying_sender_gets_the_blocking_root_a_typed_error(comm)),
        ),
    ]
}

/// A split of `comm` with every rank, in the same order.
fn fresh_split(comm: &MpiCommunicator) -> Result<MpiCommunicator, String> {
    comm.split(Some(0), comm.rank() as i32)
        .map_err(|e| format!("split: {e}"))?
        .ok_or_else(|| "split with a color returned None".to_string())
}

/// A fresh split whose collectives run on the timed path.
fn timed_split(comm: &MpiCommunicator) -> Result<MpiCommunicator, String> {
    fresh_split(comm)?
        .with_timeout(TIMEOUT)
        .map_err(|e| format!("with_timeout: {e}"))
}

/// A fresh split whose collectives time out after [`SHORT_TIMEOUT`].
fn short_timed_split(comm: &MpiCommunicator) -> Result<MpiCommunicator, String> {
    fresh_split(comm)?
        .with_timeout(SHORT_TIMEOUT)
        .map_err(|e| format!("with_timeout: {e}"))
}

/// Expects `MPI_ERR_TRUNCATE` as [`TransportError::Mpi`], with the raw code kept.
fn expect_truncate(what: &str, r: Result<(), TransportError>) -> CaseResult {
    match r {
        Err(TransportError::Mpi { class, code, .. }) if class == ERR_TRUNCATE && code != 0 => {
            Ok(())
        }
        Err(e) => Err(format!("{what}: wrong error: {e}")),
        Ok(()) => Err(format!(
            "{what}: succeeded although the message was truncated"
        )),
    }
}

/// Rank 0's side of a gather to rank 0 of `expected` bytes from every rank (its own block
/// the pattern `tag`): expects `MPI_ERR_TRUNCATE`.
fn root_gathers_truncated(
    sub: &MpiCommunicator,
    tag: usize,
    expected: usize,
    what: &str,
) -> CaseResult {
    let counts = vec![expected; sub.size()];
    let displs: Vec<usize> = (0..sub.size()).map(|r| r * expected).collect();
    let mut recv = vec![0u8; expected * sub.size()];
    let send = filled(sub.rank(), tag, expected);
    let layout = GatherRecv {
        recv: &mut recv,
        counts: &counts,
        displs: &displs,
    };
    expect_truncate(what, sub.gather_varcount(0, &send, Some(layout)))
}

/// A gather to rank 0 where every other rank sends `sent` bytes and the root expects
/// `expected` from each of them (its own block agrees). The root must get
/// `MPI_ERR_TRUNCATE`; the senders complete.
fn mismatched_gather(
    sub: &MpiCommunicator,
    sent: usize,
    expected: usize,
    what: &str,
) -> CaseResult {
    let me = sub.rank();
    if me == 0 {
        root_gathers_truncated(sub, 7, expected, what)
    } else {
        let send = filled(me, 7, sent);
        sub.gather_varcount(0, &send, None)
            .map_err(|e| format!("{what}: the sender failed: {e}"))
    }
}

/// Errors that complete in `MPI_Test` on the timed path are raised on `MPI_COMM_WORLD`'s
/// handler, fatal by default (the job aborts with exit code 15), unless tpcomm completes
/// the request itself; both paths must return them. Messages of 64 bytes (eager) into 8-byte receives.
///
/// Runs on ranks 0 and 1 only (the others return at once): once the root has failed on one
/// sender's message, MPI leaves the communicator undefined, and with more senders one of
/// them may stay blocked in the failed gather (seen at 4 ranks), which no later step of this
/// case could then meet.
fn truncation_is_returned_on_both_paths(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    let in_pair = comm.rank() < 2;
    let Some(pair) = comm
        .split(in_pair.then_some(0), comm.rank() as i32)
        .map_err(|e| format!("split: {e}"))?
    else {
        return Ok(());
    };
    let comm = &pair;
    // Blocking path (unless `comm` itself is timed: then its splits are too).
    let blocking = fresh_split(comm)?;
    let path = if blocking.timeout().is_some() {
        "timed (inherited)"
    } else {
        "blocking"
    };
    mismatched_gather(&blocking, 64, 8, &format!("{path} gather"))?;
    drop(blocking);

    let timed = timed_split(comm)?;
    mismatched_gather(&timed, 64, 8, "timed gather")?;
    if timed.rank() == 0 {
        // The failed collective broke the timed communicator: the next one is refused.
        match timed.barrier() {
            Err(TransportError::Aborted { .. }) => {}
            other => return Err(format!("timed barrier after the failure gave {other:?}")),
        }
    }
    Ok(())
}

/// The timeout of the split that a late peer leaves waiting.
const SHORT_TIMEOUT: Duration = Duration::from_millis(300);
/// How late the peers come to that split.
const LATE: Duration = Duration::from_millis(1500);

/// `split` on a timed communicator: `MPI_Comm_split` has no nonblocking form, so a split
/// meets every rank in a bounded barrier first. Rank 0 splits while its peers are
/// [`LATE`]: it must get `Unresponsive` within about [`SHORT_TIMEOUT`] (before, it blocked
/// in `MPI_Comm_split` until they came and returned `Ok`), and its next split must be
/// refused at once with `Aborted`, as every collective of a broken communicator is. The
/// peers then meet rank 0's abandoned barrier with one of their own.
fn timed_split_is_bounded_and_refused_once_broken(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    let sub = short_timed_split(comm)?;
    if sub.rank() != 0 {
        std::thread::sleep(LATE);
        return sub
            .barrier()
            .map_err(|e| format!("rank {}: the late barrier failed: {e}", sub.rank()));
    }
    let begun = Instant::now();
    let first = sub.split(Some(0), 0);
    let took = begun.elapsed();
    if !matches!(first, Err(TransportError::Unresponsive { .. })) {
        return Err(format!(
            "a split with its peers {LATE:?} late gave {first:?} after {took:?}"
        ));
    }
    if took >= LATE {
        return Err(format!(
            "the split waited {took:?}, for the late peers, not {SHORT_TIMEOUT:?}"
        ));
    }
    match sub.split(Some(0), 0) {
        Err(TransportError::Aborted { .. }) => Ok(()),
        other => Err(format!("a split of the broken communicator gave {other:?}")),
    }
}

/// Every rank but the last waits in a timed barrier while the last one is [`LATE`] (alive,
/// but not in a collective: as a stopped process, or one on a host cut off): each waiting
/// rank must get `Unresponsive` within about [`SHORT_TIMEOUT`] naming the last rank as
/// silent (it answered no roll call) and no other (the waiting ranks answer each other's
/// roll calls), and nobody as gone. The late rank's barrier then meets the abandoned ones.
fn timed_collective_names_the_absent_peer_as_silent(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    let sub = short_timed_split(comm)?;
    let late = sub.size() - 1;
    if sub.rank() == late {
        std::thread::sleep(LATE);
        return sub
            .barrier()
            .map_err(|e| format!("rank {late}: the late barrier failed: {e}"));
    }
    let begun = Instant::now();
    let outcome = sub.barrier();
    let took = begun.elapsed();
    match outcome {
        Err(TransportError::Unresponsive {
            ref gone,
            ref silent,
            ..
        }) if gone.is_empty() && **silent == [late] && took < LATE => Ok(()),
        other => Err(format!(
            "rank {}: a barrier without rank {late} gave {other:?} after {took:?}",
            sub.rank()
        )),
    }
}

/// Ranks 0 and 1 (on one host) wait in a timed barrier for the last rank, which is [`LATE`];
/// a helper process stops both (SIGSTOP) shortly after they enter it and continues them
/// only well past their deadline, 30 ms apart, as a frozen host's processes are. Each must
/// then call the roll and wait for answers before naming anyone: the other one runs again
/// and answers, so each names the last rank alone as silent (rank 0, deciding at once, named
/// rank 1 too).
fn stopped_past_the_deadline_names_only_the_absent_peer(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 3 {
        return Ok(());
    }
    let sub = short_timed_split(comm)?;
    let hosts = tpcomm::transport::hosts::hosts(&sub).map_err(|e| format!("hosts: {e}"))?;
    let late = sub.size() - 1;
    if hosts.host_of(0) != hosts.host_of(1) {
        // Ranks 0 and 1 on two hosts: rank 0 cannot stop rank 1. The peers still meet.
        return sub.barrier().map_err(|e| format!("barrier: {e}"));
    }
    if sub.rank() == late {
        std::thread::sleep(LATE);
        return sub
            .barrier()
            .map_err(|e| format!("rank {late}: the late barrier failed: {e}"));
    }
    let pids: Vec<String> = [0, 1]
        .iter()
        .filter_map(|&r| hosts.identity(r).map(|id| id.pid().to_string()))
        .collect();
    let helper = if sub.rank() == 0 {
        let stop = SHORT_TIMEOUT / 3;
        let resume = SHORT_TIMEOUT * 3;
        // Continued one after the other, as the processes of a frozen host are: the first
        // one runs alone for a moment, past its deadline.
        let script = format!(
            "sleep {:.3}; kill -STOP {pids}; sleep {:.3}; kill -CONT {first}; sleep 0.03; \
             kill -CONT {pids}",
            stop.as_secs_f64(),
            resume.as_secs_f64(),
            pids = pids.join(" "),
            first = pids.first().map_or("", String::as_str),
        );
        let child = std::process::Command::new("sh")
            .args(["-c", &script])
            .spawn()
            .map_err(|e| format!("cannot start the helper: {e}"))?;
        Some(child)
    } else {
        None
    };
    let outcome = sub.barrier();
    if let Some(mut helper) = helper {
        let _ = helper.wait();
    }
    match outcome {
        Err(TransportError::Unresponsive {
            ref gone,
            ref silent,
            ..
        }) if sub.rank() > 1 || (gone.is_empty() && **silent == [late]) => Ok(()),
        other => Err(format!(
            "rank {}: a barrier stopped past its deadline gave {other:?}",
            sub.rank()
        )),
    }
}

/// Rank 0 splits while its peers call `barrier`, which matches the split's bounded barrier:
/// the split must still end within about [`SHORT_TIMEOUT`] with an error (before, rank 0
/// went on into `MPI_Comm_split` and waited there for good), and the peers' barrier
/// completes.
fn timed_split_against_a_barrier_is_bounded(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    let sub = short_timed_split(comm)?;
    if sub.rank() != 0 {
        return sub
            .barrier()
            .map_err(|e| format!("rank {}: the barrier failed: {e}", sub.rank()));
    }
    let begun = Instant::now();
    let split = sub.split(Some(0), 0);
    let took = begun.elapsed();
    match split {
        Err(TransportError::Unresponsive { .. } | TransportError::Mismatch { .. })
            if took < LATE =>
        {
            Ok(())
        }
        other => Err(format!(
            "a split against peers in a barrier gave {other:?} after {took:?}"
        )),
    }
}

/// One rank passes a color MPI cannot take (2^31, a valid `u32`), on the blocking and the
/// timed path: that rank gets `InvalidArgument`, every other rank `Mismatch` (before, they
/// waited in `MPI_Comm_split` for it), and a split with valid colors then works on every
/// rank.
fn invalid_split_color_fails_every_rank(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    for sub in [fresh_split(comm)?, timed_split(comm)?] {
        let what = if sub.timeout().is_some() {
            "timed"
        } else {
            "blocking"
        };
        let color = if sub.rank() == 1 { 1 << 31 } else { 0 };
        let outcome = sub.split(Some(color), 0);
        let expected = if sub.rank() == 1 {
            matches!(outcome, Err(TransportError::InvalidArgument { .. }))
        } else {
            matches!(outcome, Err(TransportError::Mismatch { .. }))
        };
        if !expected {
            return Err(format!(
                "{what}: rank {}: an invalid color on rank 1 gave {outcome:?}",
                sub.rank()
            ));
        }
        let again = sub
            .split(Some(0), sub.rank() as i32)
            .map_err(|e| format!("{what}: the split after it failed: {e}"))?;
        if again.map(|c| c.size()) != Some(sub.size()) {
            return Err(format!("{what}: the split after it has the wrong size"));
        }
    }
    Ok(())
}

/// A rank that sends 8 MiB where 16 bytes were agreed: Open MPI's shared-memory single-copy
/// path (CMA) copies the sender's length into the receive buffer. On the timed path the
/// receive buffer ends at a guard page, so the copy fails with `EFAULT` inside the kernel
/// and the root gets `MPI_ERR_TRUNCATE`; before, the 16-byte-per-rank heap buffer was
/// overrun by 8 MiB (SIGSEGV or a corrupted heap).
fn lying_sender_gets_the_timed_root_a_typed_error(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    let timed = timed_split(comm)?;
    lying_gather(&timed)
}

/// The same lie on the blocking path, which receives into the caller's buffer: safe only
/// with the single-copy mechanism turned off
/// (`MpiCommunicator::disable_single_copy_before_init`), as `mpi-single-copy-off` does.
fn lying_sender_gets_the_blocking_root_a_typed_error(comm: &MpiCommunicator) -> CaseResult {
    if comm.size() < 2 {
        return Ok(());
    }
    let blocking = fresh_split(comm)?;
    if blocking.timeout().is_some() {
        return Err("the blocking case needs a communicator without a timeout".into());
    }
    lying_gather(&blocking)
}

/// A gather to rank 0 of 16 bytes per rank, where rank 1 sends 8 MiB (far past the eager
/// limit: the single-copy path). The root must get `MPI_ERR_TRUNCATE`, the senders
/// complete, and every rank's heap still works afterwards.
fn lying_gather(sub: &MpiCommunicator) -> CaseResult {
    let me = sub.rank();
    let expected = 16;
    let result = if me == 0 {
        root_gathers_truncated(sub, 9, expected, "gather from a lying rank 1")
    } else {
        let len = if me == 1 { 8 << 20 } else { expected };
        let send = filled(me, 9, len);
        sub.gather_varcount(0, &send, None)
            .map_err(|e| format!("rank {me} (sender) failed: {e}"))
    };
    // The heap still works: allocate, write and check blocks of a few sizes.
    for size in [24usize, 4096, 1 << 20] {
        let block = filled(me, size, size);
        if block.len() != size
            || block
                .iter()
                .enumerate()
                .any(|(i, &b)| b != crate::pattern(me, size, i))
        {
            return Err(format!(
                "a {size}-byte allocation after the gather is wrong"
            ));
        }
    }
    result
}
