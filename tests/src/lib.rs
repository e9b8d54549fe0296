//! # tpcomm-conformance
//!
//! One behavioural suite that every [`Communicator`] backend must pass: the local group runs
//! it in-process for 1..=8 ranks (`cargo test`), and the `mpi-conformance` program runs the
//! very same cases under `mpirun -np 2` and `-np 4` (launched by `cargo xtask test`).
//!
//! Every case is collective: all ranks run the cases in the same order. Sizes are random
//! but drawn from a generator seeded identically on every rank, so all ranks agree on them.
//! After each case the ranks all-gather a pass flag, so a case passes only if it passed on
//! every rank, and every rank reports the same verdicts.

pub mod agreement;
pub mod allreduce;
pub mod ipc;
pub mod misreported;
#[cfg(feature = "mpi")]
pub mod mpi_cases;
#[cfg(feature = "mpi")]
pub mod multihost;
pub mod numeric;
pub mod objects;
pub mod queue;

use tpcomm::transport::{
    dense_displacements, ArgumentError, Communicator, GatherRecv, Layout, TransportError,
};

/// The verdict of one case, the same on every rank.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// The case's name (what it proves).
    pub name: &'static str,
    /// True when the case passed on every rank.
    pub passed: bool,
    /// This rank's failure message, or the ranks that failed.
    pub detail: String,
}

/// What one case returns on one rank.
pub type CaseResult = Result<(), String>;

/// SplitMix64: small, deterministic, the same sequence on every rank for the same seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (`bound > 0`).
    pub fn below(&mut self, bound: usize) -> usize {
        (self.next_u64() % bound as u64) as usize
    }

    /// A size with a bias to the edges: 0, 1, small, and up to `max`.
    pub fn size(&mut self, max: usize) -> usize {
        match self.below(6) {
            0 => 0,
            1 => 1,
            2 => self.below(16),
            _ => self.below(max + 1),
        }
    }
}

/// The byte rank `rank` puts at index `i` of its contribution `tag`.
pub fn pattern(rank: usize, tag: usize, i: usize) -> u8 {
    (rank.wrapping_mul(131) ^ tag.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8
}

/// `len` bytes of [`pattern`] for `rank` and `tag`.
pub fn filled(rank: usize, tag: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern(rank, tag, i)).collect()
}

pub(crate) fn expect_bytes(what: &str, got: &[u8], want: &[u8]) -> CaseResult {
    if got == want {
        return Ok(());
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Err(format!(
        "{what}: {} bytes received, {} expected; first difference at byte {at}",
        got.len(),
        want.len()
    ))
}

pub(crate) fn ok<T>(what: &str, r: Result<T, TransportError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: unexpected error: {e}"))
}

/// True on every rank when `ok` is true on every rank (one all-gather of a flag); false
/// also when the exchange itself fails.
pub fn all_ranks_ok<C: Communicator>(comm: &C, ok: bool) -> bool {
    let mut flags = vec![0u8; comm.size()];
    comm.all_gather(&[u8::from(ok)], &mut flags).is_ok() && flags.iter().all(|&f| f == 1)
}

/// Ends a rank of a fault program: every survivor has lost a peer, and `MPI_Finalize` after a
/// peer died is not safe with Open MPI 4.1 even under `--enable-recovery` (it waits in a fence
/// that includes the dead rank, and hung in about one run in seven). So the process exits
/// without finalizing (what a real program should do after `Unresponsive`), saying so.
#[cfg(feature = "mpi")]
pub fn exit_without_finalize(
    universe: mpi::environment::Universe,
    rank: usize,
    ok: bool,
) -> std::process::ExitCode {
    std::mem::forget(universe);
    println!("rank {rank}: exiting without MPI_Finalize");
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// The frame of the MPI programs xtask launches: initializes MPI, runs `body` on a
/// duplicate of `MPI_COMM_WORLD`, drops the communicator before MPI is finalized, and exits
/// with success when `body` returned true. With `TPCOMM_MPI_TIMEOUT_MS` set, the
/// communicator bounds every collective by that timeout (`MpiCommunicator::with_timeout`).
#[cfg(feature = "mpi")]
pub fn mpi_program(
    name: &str,
    body: impl FnOnce(&tpcomm::transport::MpiCommunicator) -> bool,
) -> std::process::ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("{name}: MPI was already initialized");
        return std::process::ExitCode::FAILURE;
    };
    let timeout = std::env::var("TPCOMM_MPI_TIMEOUT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(std::time::Duration::from_millis);
    let comm = tpcomm::transport::MpiCommunicator::world(&universe).and_then(|c| match timeout {
        Some(t) => c.with_timeout(t),
        None => Ok(c),
    });
    let ok = match comm {
        Ok(comm) => body(&comm),
        Err(e) => {
            eprintln!("{name}: cannot create the communicator: {e}");
            false
        }
    };
    // A communicator kept past the universe (nothing in the types prevents it): once MPI is
    // finalized its collectives must return an error, and its drop must not call MPI
    // (Open MPI aborts the process on a call after MPI_Finalize).
    let late = tpcomm::transport::MpiCommunicator::world(&universe);
    drop(universe);
    let ok = ok && after_finalize(name, late);
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// The case of [`mpi_program`] run after MPI is finalized: every collective of `late` is
/// refused with an error, then it is dropped. Rank 0 prints its `case` line (counted by
/// xtask); a failure on any rank is printed to stderr and fails the program.
#[cfg(feature = "mpi")]
fn after_finalize(
    name: &str,
    late: tpcomm::transport::Result<tpcomm::transport::MpiCommunicator>,
) -> bool {
    const CASE: &str = "mpi_collectives_after_finalize_return_an_error";
    let late = match late {
        Ok(late) => late,
        Err(e) => {
            eprintln!("{name}: {CASE}: cannot create the communicator: {e}");
            return false;
        }
    };
    let mut all = vec![0u8; late.size()];
    let mut data = [1.0f32; 4];
    let outcomes = [
        ("barrier", late.barrier()),
        ("all_gather", late.all_gather(&[1], &mut all)),
        (
            "all_reduce",
            late.all_reduce_in_place(&mut data, tpcomm::transport::ReduceOp::Sum),
        ),
        ("split", late.split(Some(0), 0).map(drop)),
    ];
    let wrong: Vec<String> = outcomes
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(call, _)| format!("{call} succeeded"))
        .collect();
    let rank = late.rank();
    drop(late);
    if !wrong.is_empty() {
        eprintln!("{name}: rank {rank}: {CASE} FAILED: {}", wrong.join(", "));
        return false;
    }
    if rank == 0 {
        println!("case {CASE} ... ok");
    }
    true
}

/// Prints the reports of an MPI program the way xtask counts them: on rank 0 one line per
/// case, `case NAME ... ok` or `case NAME ... FAILED: detail`, then `PROGRAM (N ranks): N
/// passed, N failed`; other ranks print their own failures to stderr. True when every case
/// passed.
pub fn print_reports<C: Communicator>(program: &str, comm: &C, reports: &[CaseReport]) -> bool {
    let failed = reports.iter().filter(|r| !r.passed).count();
    if comm.rank() == 0 {
        for r in reports {
            if r.passed {
                println!("case {} ... ok", r.name);
            } else {
                println!("case {} ... FAILED: {}", r.name, r.detail);
            }
        }
        println!(
            "{program} ({} ranks): {} passed, {} failed",
            comm.size(),
            reports.len() - failed,
            failed
        );
    } else {
        for r in reports.iter().filter(|r| !r.passed) {
            eprintln!("rank {}: case {} failed: {}", comm.rank(), r.name, r.detail);
        }
    }
    failed == 0
}

/// A named case: run collectively by every rank.
type Case<C> = (&'static str, fn(&C) -> CaseResult);

/// Runs every case on `comm` and returns the verdicts (the same on every rank). On a group
/// whose ranks are on several hosts, the cases that share memory run on each host's ranks.
pub fn run_all<C: Communicator>(comm: &C) -> Vec<CaseReport> {
    let cases: Vec<Case<C>> = vec![
        (
            "barrier_completes_on_every_rank",
            barrier_completes_on_every_rank,
        ),
        (
            "all_gather_delivers_every_block_for_random_sizes",
            all_gather_random_sizes,
        ),
        (
            "all_gather_varcount_honours_counts_and_gaps",
            all_gather_varcount_random_layouts,
        ),
        (
            "gather_varcount_delivers_to_every_root",
            gather_varcount_every_root,
        ),
        ("broadcast_from_every_root", broadcast_every_root),
        (
            "all_to_all_varcount_routes_every_pair",
            all_to_all_varcount_random,
        ),
        ("one_mebibyte_all_gather_is_intact", one_mebibyte_all_gather),
        (
            "split_orders_ranks_by_key_and_groups_run_concurrently",
            split_groups_run_concurrently,
        ),
        (
            "split_without_color_returns_none",
            split_without_color_returns_none,
        ),
        (
            "argument_errors_are_typed_and_lose_nothing",
            argument_errors_are_typed,
        ),
        (
            "a_wrapper_reporting_another_rank_or_size_gets_a_typed_error",
            misreported::misreported_group_gets_a_typed_error,
        ),
        (
            "all_reduce_matches_the_reference_for_every_type_op_and_placement",
            numeric::all_reduce_matches_reference,
        ),
        (
            "typed_all_reduce_works_on_split_sub_groups",
            numeric::typed_all_reduce_on_split_groups,
        ),
        (
            "objects_classic_values_through_every_collective_and_root",
            objects::classic_values_everywhere,
        ),
        (
            "objects_round_path_with_random_sizes",
            objects::round_path_with_random_sizes,
        ),
        (
            "objects_serialization_failure_is_agreed_by_every_rank",
            objects::serialization_failure_is_agreed,
        ),
        (
            "objects_reduce_scan_exscan_fold_in_rank_order_with_agreed_failures",
            objects::folds_in_rank_order_with_agreed_failures,
        ),
        (
            "objects_cap_violation_is_agreed_by_every_rank",
            objects::cap_violation_is_agreed,
        ),
        (
            "objects_work_on_split_sub_groups",
            objects::work_on_split_sub_groups,
        ),
        (
            "objects_different_round_bytes_is_an_options_mismatch_on_every_rank",
            objects::different_round_bytes_is_an_options_mismatch,
        ),
        (
            "objects_invalid_options_on_one_rank_are_reported_by_every_rank",
            objects::invalid_options_on_one_rank_are_reported_by_every_rank,
        ),
        (
            "objects_deep_nesting_from_a_peer_is_a_decode_error",
            objects::deep_nesting_from_a_peer_is_a_decode_error,
        ),
        (
            "ipc_host_peers_read_patterns_across_close_and_reopen",
            ipc::host_peers_read_patterns_across_reopen,
        ),
        (
            "allreduce_host_matches_reference_and_survives_suspend_resume",
            allreduce::host_matches_reference_and_survives_suspend_resume,
        ),
        (
            "allreduce_host_launches_of_different_sizes_fail_on_every_rank",
            allreduce::host_launches_of_different_sizes_fail_on_every_rank,
        ),
        (
            "allreduce_mismatched_config_is_refused_on_every_rank",
            agreement::mismatched_config_is_refused_on_every_rank,
        ),
        (
            "allreduce_resume_paired_with_another_step_names_the_rank",
            agreement::resume_paired_with_another_step_names_the_rank,
        ),
        (
            "queue_delivers_every_message_on_the_ring_and_the_transport",
            queue::delivers_every_message_on_the_ring_and_the_transport,
        ),
        (
            "queue_keeps_messages_across_suspend_and_resume",
            queue::keeps_messages_across_suspend_and_resume,
        ),
        (
            "queue_two_queues_on_split_sub_groups_run_side_by_side",
            queue::queues_on_split_sub_groups_run_side_by_side,
        ),
        (
            "queue_a_transport_reader_waits_no_longer_than_the_queue_timeout",
            queue::a_transport_reader_waits_no_longer_than_the_queue_timeout,
        ),
    ];
    // What shares memory (peer memory, the host all-reduce) works within one host: on a
    // group that spans hosts these cases run on each host's ranks (their refusal across
    // hosts is a case of its own in `mpi-multihost`).
    let one_host = match tpcomm::transport::hosts::hosts(comm) {
        Ok(hosts) if hosts.spans_hosts() => Some(tpcomm::transport::hosts::split_by_host(comm)),
        Ok(_) => None,
        Err(e) => Some(Err(e)),
    };
    let mut reports = Vec::with_capacity(cases.len());
    for (name, case) in cases {
        let mine = match &one_host {
            Some(here) if ONE_HOST_CASES.contains(&name) => match here {
                Ok(here) => case(here),
                Err(e) => Err(format!("the split by host failed: {e}")),
            },
            _ => case(comm),
        };
        reports.push(agree(comm, name, mine));
    }
    reports
}

/// The cases of [`run_all`] that need every rank on one host (they share memory).
const ONE_HOST_CASES: [&str; 5] = [
    "ipc_host_peers_read_patterns_across_close_and_reopen",
    "allreduce_host_matches_reference_and_survives_suspend_resume",
    "allreduce_host_launches_of_different_sizes_fail_on_every_rank",
    "allreduce_mismatched_config_is_refused_on_every_rank",
    "allreduce_resume_paired_with_another_step_names_the_rank",
];

/// All-gathers the pass flag of one case so every rank reports the same verdict.
pub(crate) fn agree<C: Communicator>(comm: &C, name: &'static str, mine: CaseResult) -> CaseReport {
    let mut flags = vec![0u8; comm.size()];
    let flag = [u8::from(mine.is_ok())];
    if let Err(e) = comm.all_gather(&flag, &mut flags) {
        return CaseReport {
            name,
            passed: false,
            detail: format!("verdict exchange failed: {e}; own result: {mine:?}"),
        };
    }
    let failed: Vec<usize> = (0..comm.size()).filter(|&r| flags[r] == 0).collect();
    let detail = match (&mine, failed.is_empty()) {
        (Err(e), _) => format!("rank {}: {e}", comm.rank()),
        (Ok(()), false) => format!("failed on ranks {failed:?}"),
        (Ok(()), true) => String::new(),
    };
    CaseReport {
        name,
        passed: failed.is_empty(),
        detail,
    }
}

fn barrier_completes_on_every_rank<C: Communicator>(comm: &C) -> CaseResult {
    for _ in 0..5 {
        ok("barrier", comm.barrier())?;
    }
    Ok(())
}

fn all_gather_random_sizes<C: Communicator>(comm: &C) -> CaseResult {
    let mut rng = Rng::new(1);
    let n = comm.size();
    for tag in 0..24 {
        let len = rng.size(4096);
        let send = filled(comm.rank(), tag, len);
        let mut recv = vec![0xAAu8; len * n];
        ok("all_gather", comm.all_gather(&send, &mut recv))?;
        for r in 0..n {
            expect_bytes(
                &format!("all_gather block {r} of {len} bytes"),
                &recv[r * len..(r + 1) * len],
                &filled(r, tag, len),
            )?;
        }
    }
    Ok(())
}

/// Random counts (zeros included), placed with random gaps in a random rank order.
fn random_layout(rng: &mut Rng, n: usize, max: usize) -> (Vec<usize>, Vec<usize>, usize) {
    let counts: Vec<usize> = (0..n).map(|_| rng.size(max)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut displs = vec![0; n];
    let mut at = 0;
    for &r in &order {
        at += rng.below(8);
        displs[r] = at;
        at += counts[r];
    }
    (counts, displs, at + rng.below(8))
}

fn all_gather_varcount_random_layouts<C: Communicator>(comm: &C) -> CaseResult {
    let mut rng = Rng::new(2);
    let n = comm.size();
    for tag in 0..24 {
        let (counts, displs, total) = random_layout(&mut rng, n, 3000);
        let send = filled(comm.rank(), tag, counts[comm.rank()]);
        let mut recv = vec![0xEEu8; total];
        ok(
            "all_gather_varcount",
            comm.all_gather_varcount(&send, &mut recv, &counts, &displs),
        )?;
        for r in 0..n {
            let region = &recv[displs[r]..displs[r] + counts[r]];
            expect_bytes(
                &format!("varcount region of rank {r}"),
                region,
                &filled(r, tag, counts[r]),
            )?;
        }
        // Gaps are untouched.
        let mut covered = vec![false; total];
        for r in 0..n {
            covered[displs[r]..displs[r] + counts[r]]
                .iter_mut()
                .for_each(|c| *c = true);
        }
        if let Some(i) = (0..total).find(|&i| !covered[i] && recv[i] != 0xEE) {
            return Err(format!("byte {i} outside every region was overwritten"));
        }
    }
    Ok(())
}

fn gather_varcount_every_root<C: Communicator>(comm: &C) -> CaseResult {
    let mut rng = Rng::new(3);
    let n = comm.size();
    for root in 0..n {
        for tag in 0..4 {
            let (counts, displs, total) = random_layout(&mut rng, n, 2000);
            let send = filled(comm.rank(), tag, counts[comm.rank()]);
            if comm.rank() == root {
                let mut recv = vec![0u8; total];
                let layout = GatherRecv {
                    recv: &mut recv,
                    counts: &counts,
                    displs: &displs,
                };
                ok(
                    "gather_varcount (root)",
                    comm.gather_varcount(root, &send, Some(layout)),
                )?;
                for r in 0..n {
                    expect_bytes(
                        &format!("gather to root {root}, region of rank {r}"),
                        &recv[displs[r]..displs[r] + counts[r]],
                        &filled(r, tag, counts[r]),
                    )?;
                }
            } else {
                ok("gather_varcount", comm.gather_varcount(root, &send, None))?;
            }
        }
    }
    Ok(())
}

fn broadcast_every_root<C: Communicator>(comm: &C) -> CaseResult {
    let mut rng = Rng::new(4);
    for root in 0..comm.size() {
        for tag in 0..4 {
            let len = rng.size(5000);
            let mut buf = if comm.rank() == root {
                filled(root, tag, len)
            } else {
                vec![0u8; len]
            };
            ok("broadcast", comm.broadcast(root, &mut buf))?;
            expect_bytes(
                &format!("broadcast from root {root}"),
                &buf,
                &filled(root, tag, len),
            )?;
        }
    }
    Ok(())
}

fn all_to_all_varcount_random<C: Communicator>(comm: &C) -> CaseResult {
    let mut rng = Rng::new(5);
    let n = comm.size();
    let me = comm.rank();
    for tag in 0..12 {
        // matrix[s][d]: bytes rank s sends to rank d; every rank draws the same matrix.
        let matrix: Vec<Vec<usize>> = (0..n)
            .map(|_| (0..n).map(|_| rng.size(700)).collect())
            .collect();
        let send_counts = matrix[me].clone();
        let (send_displs, send_total) = dense_displacements(&send_counts).expect("small");
        let mut send = vec![0u8; send_total];
        for d in 0..n {
            let region = &mut send[send_displs[d]..send_displs[d] + send_counts[d]];
            region.copy_from_slice(&filled(me, tag * 64 + d, send_counts[d]));
        }
        let recv_counts: Vec<usize> = (0..n).map(|s| matrix[s][me]).collect();
        let (recv_displs, recv_total) = dense_displacements(&recv_counts).expect("small");
        let mut recv = vec![0u8; recv_total];
        ok(
            "all_to_all_varcount",
            comm.all_to_all_varcount(
                layout(&send, &send_counts, &send_displs),
                layout(&mut recv, &recv_counts, &recv_displs),
            ),
        )?;
        for s in 0..n {
            expect_bytes(
                &format!("all_to_all bytes from rank {s}"),
                &recv[recv_displs[s]..recv_displs[s] + recv_counts[s]],
                &filled(s, tag * 64 + me, recv_counts[s]),
            )?;
        }
    }
    Ok(())
}

fn one_mebibyte_all_gather<C: Communicator>(comm: &C) -> CaseResult {
    let len = 1 << 20;
    let send = filled(comm.rank(), 99, len);
    let mut recv = vec![0u8; len * comm.size()];
    ok("all_gather 1 MiB", comm.all_gather(&send, &mut recv))?;
    for r in 0..comm.size() {
        expect_bytes(
            &format!("1 MiB block {r}"),
            &recv[r * len..(r + 1) * len],
            &filled(r, 99, len),
        )?;
    }
    Ok(())
}

fn split_groups_run_concurrently<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let color = (me % 2) as u32;
    // Reverse order inside each group: the highest parent rank gets sub-rank 0.
    let key = -(me as i32);
    let sub =
        ok("split", comm.split(Some(color), key))?.ok_or("split with a color returned None")?;
    let members: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).rev().collect();
    if sub.size() != members.len() {
        return Err(format!(
            "sub-group size {} != {}",
            sub.size(),
            members.len()
        ));
    }
    let expected_rank = members
        .iter()
        .position(|&r| r == me)
        .expect("member of own color");
    if sub.rank() != expected_rank {
        return Err(format!(
            "sub-rank {} != {expected_rank} (ordered by key)",
            sub.rank()
        ));
    }
    // Sibling groups run different numbers of collectives with different sizes at the same
    // time; neither may see the other's bytes.
    let rounds = if color == 0 { 7 } else { 11 };
    for tag in 0..rounds {
        let len = 100 + tag * (color as usize + 1);
        let send = filled(me, tag + 1000 * color as usize, len);
        let mut recv = vec![0u8; len * sub.size()];
        ok("sub-group all_gather", sub.all_gather(&send, &mut recv))?;
        for (sr, &parent) in members.iter().enumerate() {
            expect_bytes(
                &format!("sub-group block {sr} (parent rank {parent})"),
                &recv[sr * len..(sr + 1) * len],
                &filled(parent, tag + 1000 * color as usize, len),
            )?;
        }
    }
    // The parent still works after the sub-groups were used.
    let mut all = vec![0u8; n];
    ok(
        "parent all_gather after split",
        comm.all_gather(&[me as u8], &mut all),
    )?;
    expect_bytes(
        "parent after split",
        &all,
        &(0..n).map(|r| r as u8).collect::<Vec<_>>(),
    )
}

fn split_without_color_returns_none<C: Communicator>(comm: &C) -> CaseResult {
    let me = comm.rank();
    let color = (me != 0).then_some(7);
    let sub = ok("split", comm.split(color, 0))?;
    match (me, sub) {
        (0, Some(_)) => Err("rank 0 passed no color but got a sub-group".into()),
        (0, None) => Ok(()),
        (_, None) => Err("a colored rank got no sub-group".into()),
        (_, Some(sub)) => {
            if sub.size() != comm.size() - 1 || sub.rank() != me - 1 {
                return Err(format!(
                    "sub-group rank {}/{} wrong",
                    sub.rank(),
                    sub.size()
                ));
            }
            ok("barrier in sub-group", sub.barrier())
        }
    }
}

/// An all-gather of every rank's number after calls refused before anything was sent: the
/// ranks are still in step.
pub(crate) fn still_in_step<C: Communicator>(comm: &C, what: &str) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let mine = [me as u8; 4];
    let mut recv = vec![0u8; 4 * n];
    ok(what, comm.all_gather(&mine, &mut recv))?;
    let want: Vec<u8> = (0..n).flat_map(|r| [r as u8; 4]).collect();
    expect_bytes(what, &recv, &want)
}

/// The layout of `buf`: `counts[peer]` bytes at `displs[peer]`.
pub(crate) fn layout<'a, B>(buf: B, counts: &'a [usize], displs: &'a [usize]) -> Layout<'a, B> {
    Layout {
        buf,
        counts,
        displs,
    }
}

/// Expects `r` to be an `InvalidArgument` whose source satisfies `is`.
fn expect_arg_error(
    what: &str,
    r: Result<(), TransportError>,
    is: impl Fn(&ArgumentError) -> bool,
) -> CaseResult {
    match r {
        Err(TransportError::InvalidArgument { source, .. }) if is(&source) => Ok(()),
        Err(e) => Err(format!("{what}: wrong error: {e}")),
        Ok(()) => Err(format!("{what}: accepted")),
    }
}

fn argument_errors_are_typed<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let max = comm.max_count();
    let counts = vec![4usize; n];
    let (displs, total) = dense_displacements(&counts).expect("small");
    let send = [1u8; 4];
    let mut recv = vec![0u8; total];

    expect_arg_error(
        "all_gather with a short receive buffer",
        comm.all_gather(&send, &mut recv[..total - 1]),
        |e| matches!(e, ArgumentError::RecvLength { expected, actual } if *expected == total && *actual == total - 1),
    )?;
    expect_arg_error(
        "varcount with one count missing",
        comm.all_gather_varcount(&send, &mut recv, &counts[..n - 1], &displs),
        |e| {
            matches!(
                e,
                ArgumentError::TableLength {
                    which: "counts",
                    ..
                }
            )
        },
    )?;
    expect_arg_error(
        "varcount with one displacement too many",
        comm.all_gather_varcount(
            &send,
            &mut recv,
            &counts,
            &[displs.clone(), vec![0]].concat(),
        ),
        |e| {
            matches!(
                e,
                ArgumentError::TableLength {
                    which: "displacements",
                    ..
                }
            )
        },
    )?;
    expect_arg_error(
        "varcount with a send buffer not matching counts[rank]",
        comm.all_gather_varcount(&send[..3], &mut recv, &counts, &displs),
        |e| {
            matches!(
                e,
                ArgumentError::SendLength {
                    expected: 4,
                    actual: 3
                }
            )
        },
    )?;
    if n > 1 {
        // Moving the last region back by two bytes makes it overlap the one before.
        let mut overlapping = displs.clone();
        overlapping[n - 1] -= 2;
        expect_arg_error(
            "varcount with overlapping regions",
            comm.all_gather_varcount(&send, &mut recv, &counts, &overlapping),
            |e| matches!(e, ArgumentError::Overlap { first, second, .. } if *first == n - 2 && *second == n - 1),
        )?;
    }
    let mut past_end = displs.clone();
    past_end[n - 1] = total - 1;
    expect_arg_error(
        "varcount with a region past the end",
        comm.all_gather_varcount(&send, &mut recv, &counts, &past_end),
        |e| matches!(e, ArgumentError::OutOfBounds { index, .. } if *index == n - 1),
    )?;
    if max < usize::MAX {
        let mut huge = counts.clone();
        huge[0] = max + 1;
        expect_arg_error(
            "varcount with a count over max_count",
            comm.all_gather_varcount(&send, &mut recv, &huge, &displs),
            |e| {
                matches!(
                    e,
                    ArgumentError::CountTooLarge {
                        which: "counts",
                        index: 0,
                        ..
                    }
                )
            },
        )?;
        let mut far = displs.clone();
        far[0] = max + 1;
        expect_arg_error(
            "varcount with a displacement over max_count",
            comm.all_gather_varcount(&send, &mut recv, &counts, &far),
            |e| {
                matches!(
                    e,
                    ArgumentError::CountTooLarge {
                        which: "displacements",
                        index: 0,
                        ..
                    }
                )
            },
        )?;
    }
    let mut buf = [0u8; 8];
    expect_arg_error(
        "broadcast from a root out of range",
        comm.broadcast(n, &mut buf),
        |e| matches!(e, ArgumentError::RootOutOfRange { root, size } if *root == n && *size == n),
    )?;
    expect_arg_error(
        "gather to a root out of range",
        comm.gather_varcount(n + 3, &send, None),
        |e| matches!(e, ArgumentError::RootOutOfRange { .. }),
    )?;
    if me == 0 {
        expect_arg_error(
            "gather root without a receive layout",
            comm.gather_varcount(0, &send, None),
            |e| matches!(e, ArgumentError::MissingRootReceive),
        )?;
    }
    let a2a_counts = vec![2usize; n];
    let (a2a_displs, a2a_total) = dense_displacements(&a2a_counts).expect("small");
    let a2a_send = vec![0u8; a2a_total];
    let mut a2a_recv = vec![0u8; a2a_total];
    expect_arg_error(
        "all_to_all with a send buffer too short for its layout",
        comm.all_to_all_varcount(
            layout(&a2a_send[..a2a_total - 1], &a2a_counts, &a2a_displs),
            layout(&mut a2a_recv, &a2a_counts, &a2a_displs),
        ),
        |e| matches!(e, ArgumentError::OutOfBounds { which: "send", .. }),
    )?;
    expect_arg_error(
        "all_to_all with a receive table of the wrong length",
        comm.all_to_all_varcount(
            layout(&a2a_send, &a2a_counts, &a2a_displs),
            layout(&mut a2a_recv, &a2a_counts[1..], &a2a_displs),
        ),
        |e| {
            matches!(
                e,
                ArgumentError::TableLength {
                    which: "counts",
                    ..
                }
            )
        },
    )?;
    let mut self_mismatch = a2a_counts.clone();
    self_mismatch[me] = 1;
    expect_arg_error(
        "all_to_all sending to itself a count it does not expect",
        comm.all_to_all_varcount(
            layout(&a2a_send, &a2a_counts, &a2a_displs),
            layout(&mut a2a_recv, &self_mismatch, &a2a_displs),
        ),
        |e| matches!(e, ArgumentError::SendLength { .. }),
    )?;

    // Nothing was sent by the rejected calls: the ranks are still in step.
    still_in_step(comm, "all_gather after rejected calls")
}
