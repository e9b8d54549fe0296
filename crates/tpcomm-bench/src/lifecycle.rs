//! `tpcomm-bench lifecycle`: suspend and resume of the custom all-reduce (tpcomm-allreduce,
//! host backend) with N graph buffers registered, and all-reduce latency before and after
//! a resume.
//!
//! For each N (`--graph-buffers`), every rank builds a [`CustomAllReduce`] with N + 1
//! RankData slots, allocates N inputs and N outputs from its peer memory (`ar.memory()`),
//! captures N all-reduces (input i into output i, f32), and calls
//! `register_graph_buffers`: each rank then holds N graph-buffer mappings per peer besides
//! the Signal, staging and temp mappings. Then, collectively:
//!
//! 1. the plan is replayed and all N outputs checked;
//! 2. eager all-reduce latency (`--latency-bytes`, f32) is compared before and after a
//!    resume, in [`LATENCY_ROUNDS`] interleaved rounds so that drift of the machine cannot
//!    pass for an effect of the resume: each round times a block of all-reduces ("before";
//!    the first block precedes any suspend), runs one untimed suspend + resume, and times
//!    a block again ("after"); each iteration is lined up as in `tpcomm-bench allreduce`
//!    (barrier, untimed 16-byte all-reduce), and the result is checked after the last
//!    resume;
//! 3. suspend/resume cycles are timed: `prepare_for_suspend` and `reinit_after_resume`,
//!    each behind a barrier, and their sum per rank and iteration;
//! 4. the plan is replayed on fresh data and all N outputs checked again.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Serialize;
use tpcomm::allreduce::{Config, DType};
use tpcomm::ipc::{HostBuffer, PeerMemory};
use tpcomm::Communicator;

use crate::allreduce::{
    agree, check, expected, input, new_all_reduce, new_sync, time_synced, HostAllReduce,
};
use crate::error::BenchError;
use crate::launch::{self, PerRank, RunInfo};
use crate::report::{self, Column, Stats, Table, Verdict};
use crate::sweep::{format_bytes, parse_bytes, IterArgs};
use crate::timing::{elapsed_ns, median, slowest, time_once};
use crate::transport::Transport;

/// Issue 5's target: suspend + resume with this many graph buffers...
const TARGET_BUFFERS: usize = 1000;
/// ...in less than this (2 ranks).
const TARGET_TIME: Duration = Duration::from_millis(5);
/// "No measurable change" of latency after a resume, as this bench judges it: the median
/// after within this factor of the median before, either way.
const LATENCY_TOLERANCE: f64 = 1.10;
/// Rounds of the before/after latency comparison (one untimed suspend + resume each).
const LATENCY_ROUNDS: usize = 5;

/// Options of `tpcomm-bench lifecycle`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct LifecycleArgs {
    /// Ranks (threads) of the local group, 1 to 8 [default: 2]. Not with `--transport mpi`,
    /// where `mpirun -np` decides.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=8), value_name = "N")]
    pub(crate) ranks: Option<u32>,

    /// Transport under the all-reduce (handle exchanges, barriers).
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub(crate) transport: Transport,

    /// Graph buffers registered before suspending, comma-separated; one row group each.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,100,1000",
        value_parser = clap::value_parser!(u32).range(1..),
        value_name = "N,..."
    )]
    pub(crate) graph_buffers: Vec<u32>,

    /// Bytes of each graph buffer (input and output; a multiple of 16).
    #[arg(long, default_value = "4096", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) buffer_bytes: usize,

    /// Size of the eager f32 all-reduce timed before and after a resume (a multiple of 16).
    #[arg(long, default_value = "64KiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) latency_bytes: usize,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) iter: IterArgs,

    /// Also write every figure (and every iteration's time) to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

impl LifecycleArgs {
    fn validate(&self) -> Result<(), BenchError> {
        self.iter.validate()?;
        for (name, v) in [
            ("--buffer-bytes", self.buffer_bytes),
            ("--latency-bytes", self.latency_bytes),
        ] {
            if v == 0 || !v.is_multiple_of(16) {
                return Err(BenchError::Usage(format!(
                    "{name} ({v}) must be a positive multiple of 16 bytes"
                )));
            }
        }
        if self.graph_buffers.is_empty() {
            return Err(BenchError::Usage(
                "--graph-buffers needs at least one value".into(),
            ));
        }
        Ok(())
    }
}

/// What a transition row times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum TransitionOp {
    #[serde(rename = "prepare_for_suspend")]
    Suspend,
    #[serde(rename = "reinit_after_resume")]
    Resume,
    #[serde(rename = "suspend+resume")]
    Both,
}

impl TransitionOp {
    fn name(self) -> &'static str {
        match self {
            TransitionOp::Suspend => "prepare_for_suspend",
            TransitionOp::Resume => "reinit_after_resume",
            TransitionOp::Both => "suspend+resume",
        }
    }
}

/// One line of either table (and of the JSON report).
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "table", rename_all = "snake_case")]
pub(crate) enum LifecycleRow {
    /// A suspend/resume timing.
    Transition {
        /// Graph buffers registered (per rank).
        graph_buffers: usize,
        /// Peer mappings each rank closes and reopens.
        mappings: usize,
        op: TransitionOp,
        iters: usize,
        warmup: usize,
        #[serde(flatten)]
        stats: Stats,
        /// Every iteration's time (slowest rank), nanoseconds, in the order they ran.
        samples_ns: Vec<u64>,
    },
    /// Eager all-reduce latency before or after a resume.
    Latency {
        graph_buffers: usize,
        bytes: usize,
        /// `"before"` (blocks just before a suspend + resume, the first before any) or
        /// `"after"` (blocks just after one).
        when: &'static str,
        iters: usize,
        warmup: usize,
        #[serde(flatten)]
        stats: Stats,
        /// `after median / before median` (on the "after" row).
        #[serde(skip_serializing_if = "Option::is_none")]
        after_over_before: Option<f64>,
        samples_ns: Vec<u64>,
    },
}

const TRANSITION_COLUMNS: [Column; 6] = [
    Column::new("graph", "buffers", 8),
    Column::new("mappings", "(per rank)", 11),
    Column::new("op", "", 20),
    Column::new("iters", "", 6),
    Column::new("median", "(us)", 11),
    Column::new("min", "(us)", 11),
];

const LATENCY_COLUMNS: [Column; 7] = [
    Column::new("graph", "buffers", 8),
    Column::new("size", "(B)", 9),
    Column::new("when", "", 7),
    Column::new("iters", "", 6),
    Column::new("median", "(us)", 10),
    Column::new("min", "(us)", 10),
    Column::new("ratio", "after/bef", 10),
];

fn print_row(table: &Table, row: &LifecycleRow) {
    match row {
        LifecycleRow::Transition {
            graph_buffers,
            mappings,
            op,
            iters,
            stats,
            ..
        } => table.cells(
            &TRANSITION_COLUMNS,
            &[
                graph_buffers.to_string(),
                mappings.to_string(),
                op.name().to_string(),
                iters.to_string(),
                format!("{:.2}", stats.median_us),
                format!("{:.2}", stats.min_us),
            ],
        ),
        LifecycleRow::Latency {
            graph_buffers,
            bytes,
            when,
            iters,
            stats,
            after_over_before,
            ..
        } => table.cells(
            &LATENCY_COLUMNS,
            &[
                graph_buffers.to_string(),
                bytes.to_string(),
                when.to_string(),
                iters.to_string(),
                format!("{:.2}", stats.median_us),
                format!("{:.2}", stats.min_us),
                after_over_before.map_or_else(|| "-".into(), |r| format!("{r:.3}x")),
            ],
        ),
    }
}

/// The graph buffers of one rank and their expected sums.
struct GraphBuffers<'m> {
    memory: &'m tpcomm::ipc::HostMemory,
    inputs: Vec<HostBuffer>,
    outputs: Vec<HostBuffer>,
    count: usize,
}

impl GraphBuffers<'_> {
    fn salt(base: u64, i: usize) -> u64 {
        base ^ ((i as u64) << 24)
    }

    /// Writes fresh inputs for `salt` and garbage into the outputs.
    fn fill(&self, rank: usize, salt: u64) -> Result<(), BenchError> {
        let nan = vec![f32::NAN; self.count];
        for (i, (inp, out)) in self.inputs.iter().zip(&self.outputs).enumerate() {
            let values: Vec<f32> = input(rank, self.count, Self::salt(salt, i));
            self.memory.write(inp, 0, bytemuck::cast_slice(&values))?;
            self.memory.write(out, 0, bytemuck::cast_slice(&nan))?;
        }
        Ok(())
    }

    /// What is wrong with the outputs after a replay on data of `salt`, if anything.
    fn check(&self, ranks: usize, salt: u64) -> Result<Option<String>, BenchError> {
        let mut got = vec![0f32; self.count];
        for (i, out) in self.outputs.iter().enumerate() {
            self.memory
                .read(out, 0, bytemuck::cast_slice_mut(&mut got))?;
            let want = expected(ranks, self.count, Self::salt(salt, i));
            if let Some(p) = check(&got, &want) {
                return Ok(Some(format!("graph buffer {i}: {p}")));
            }
        }
        Ok(None)
    }
}

/// One eager all-reduce of `data`, timed with [`time_synced`].
fn timed_all_reduce<C: Communicator>(
    comm: &C,
    sync: &mut HostAllReduce,
    ar: &mut HostAllReduce,
    data: &[f32],
    out: &mut [f32],
) -> Result<u64, BenchError> {
    time_synced(comm, sync, || {
        ar.all_reduce(data, out)?;
        Ok(())
    })
}

/// The eager f32 all-reduce of `bytes` timed just before and just after a resume, in
/// [`LATENCY_ROUNDS`] rounds (see the module documentation); verified before the first
/// round and after the last resume. Returns the slowest-rank samples before, after, and
/// the warm-up count.
fn latency<C: Communicator>(
    comm: &C,
    sync: &mut HostAllReduce,
    ar: &mut HostAllReduce,
    bytes: usize,
    iter: &IterArgs,
    salt: u64,
) -> Result<(Vec<u64>, Vec<u64>, usize), BenchError> {
    let count = bytes / 4;
    let data: Vec<f32> = input(comm.rank(), count, salt);
    let want = expected(comm.size(), count, salt);
    let mut out = vec![f32::NAN; count];
    ar.all_reduce(&data, &mut out)?;
    agree(
        comm,
        check(&out, &want),
        "tpcomm-allreduce",
        "eager all_reduce",
        bytes,
    )?;

    let warmup = iter.warmup_for(bytes);
    let mut warm = Vec::with_capacity(warmup);
    for _ in 0..warmup {
        warm.push(timed_all_reduce(comm, sync, ar, &data, &mut out)?);
    }
    let estimate = median(&slowest(comm, &warm)?);
    let block = iter
        .iters_for(Duration::from_nanos(estimate))
        .div_ceil(LATENCY_ROUNDS)
        .max(1);
    let (mut before, mut after) = (Vec::new(), Vec::new());
    for _ in 0..LATENCY_ROUNDS {
        for _ in 0..block {
            before.push(timed_all_reduce(comm, sync, ar, &data, &mut out)?);
        }
        ar.prepare_for_suspend(comm)?;
        ar.reinit_after_resume(comm)?;
        out.fill(f32::NAN);
        for _ in 0..block {
            after.push(timed_all_reduce(comm, sync, ar, &data, &mut out)?);
        }
    }
    agree(
        comm,
        check(&out, &want),
        "tpcomm-allreduce",
        "eager all_reduce after resume",
        bytes,
    )?;
    Ok((slowest(comm, &before)?, slowest(comm, &after)?, warmup))
}

fn latency_row(
    n: usize,
    bytes: usize,
    when: &'static str,
    samples_ns: Vec<u64>,
    warmup: usize,
    before: Option<f64>,
) -> Result<LifecycleRow, BenchError> {
    let stats =
        Stats::of(&samples_ns).ok_or_else(|| BenchError::Usage("no timed iterations".into()))?;
    Ok(LifecycleRow::Latency {
        graph_buffers: n,
        bytes,
        when,
        iters: samples_ns.len(),
        warmup,
        stats,
        after_over_before: before.filter(|&b| b > 0.0).map(|b| stats.median_us / b),
        samples_ns,
    })
}

/// The whole measurement for `n` graph buffers: transition rows, then latency rows.
fn bench_buffers<C: Communicator>(
    comm: &C,
    n: usize,
    args: &LifecycleArgs,
) -> Result<(Vec<LifecycleRow>, Vec<LifecycleRow>), BenchError> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let config = Config {
        max_bytes: args.latency_bytes.max(args.buffer_bytes),
        slots: n + 1,
        ..Config::default()
    };
    let mut ar = new_all_reduce(comm, config)?;
    let mut sync = new_sync(comm)?;
    let memory = ar.memory()?.clone();
    let allocate = || -> Result<Vec<HostBuffer>, BenchError> {
        (0..n)
            .map(|_| Ok(memory.allocate(args.buffer_bytes)?))
            .collect()
    };
    let buffers = GraphBuffers {
        memory: &memory,
        inputs: allocate()?,
        outputs: allocate()?,
        count: args.buffer_bytes / 4,
    };
    let plan = ar.capture(|cap| {
        for (inp, out) in buffers.inputs.iter().zip(&buffers.outputs) {
            cap.all_reduce(inp, out, DType::F32, buffers.count)?;
        }
        Ok(())
    })?;
    let registered = ar.register_graph_buffers(comm)?;
    if registered != n {
        return Err(BenchError::Usage(format!(
            "register_graph_buffers registered {registered} buffers, expected {n}"
        )));
    }
    let verify_plan = |ar: &mut HostAllReduce, salt: u64, when| {
        buffers.fill(rank, salt)?;
        plan.replay(ar)?;
        let problem = buffers.check(ranks, salt)?;
        agree(comm, problem, "tpcomm-allreduce", when, args.buffer_bytes)
    };
    verify_plan(&mut ar, 0x11fe ^ n as u64, "replay before suspend")?;
    let mappings = ar.peer_mappings()?.counters().open;

    let (before, after, lat_warmup) =
        latency(comm, &mut sync, &mut ar, args.latency_bytes, &args.iter, 7)?;

    let cycle = |ar: &mut HostAllReduce| -> Result<(u64, u64), BenchError> {
        let s = time_once(comm, |start| {
            ar.prepare_for_suspend(comm)?;
            Ok(elapsed_ns(start))
        })?;
        let r = time_once(comm, |start| {
            ar.reinit_after_resume(comm)?;
            Ok(elapsed_ns(start))
        })?;
        Ok((s, r))
    };
    let warmup = args.iter.warmup_for(0);
    let mut warm = Vec::with_capacity(warmup);
    for _ in 0..warmup {
        let (s, r) = cycle(&mut ar)?;
        warm.push(s + r);
    }
    let estimate = median(&slowest(comm, &warm)?);
    let iters = args.iter.iters_for(Duration::from_nanos(estimate));
    let (mut suspend, mut resume, mut both) = (
        Vec::with_capacity(iters),
        Vec::with_capacity(iters),
        Vec::with_capacity(iters),
    );
    for _ in 0..iters {
        let (s, r) = cycle(&mut ar)?;
        suspend.push(s);
        resume.push(r);
        both.push(s + r);
    }

    verify_plan(&mut ar, 0x22fe ^ n as u64, "replay after resume")?;
    let reopened = ar.peer_mappings()?.counters().open;
    if reopened != mappings {
        return Err(BenchError::Usage(format!(
            "{reopened} peer mappings open after the cycles, {mappings} before"
        )));
    }
    drop(plan);
    ar.close()?;

    let mut transitions = Vec::with_capacity(3);
    for (op, local) in [
        (TransitionOp::Suspend, suspend),
        (TransitionOp::Resume, resume),
        (TransitionOp::Both, both),
    ] {
        let samples_ns = slowest(comm, &local)?;
        let stats = Stats::of(&samples_ns)
            .ok_or_else(|| BenchError::Usage("no timed iterations".into()))?;
        transitions.push(LifecycleRow::Transition {
            graph_buffers: n,
            mappings,
            op,
            iters,
            warmup,
            stats,
            samples_ns,
        });
    }
    let before = latency_row(n, args.latency_bytes, "before", before, lat_warmup, None)?;
    let before_median = match &before {
        LifecycleRow::Latency { stats, .. } => Some(stats.median_us),
        LifecycleRow::Transition { .. } => None,
    };
    let after = latency_row(
        n,
        args.latency_bytes,
        "after",
        after,
        lat_warmup,
        before_median,
    )?;
    Ok((transitions, vec![before, after]))
}

/// Issue 5's suspend/resume target and the latency check, from the rows of the largest N
/// (the target's N when measured).
fn verdicts(rows: &[LifecycleRow], binding: bool) -> Vec<Verdict> {
    let mut out = Vec::new();
    let both = rows.iter().find_map(|r| match r {
        LifecycleRow::Transition {
            graph_buffers,
            op: TransitionOp::Both,
            stats,
            mappings,
            ..
        } if *graph_buffers == TARGET_BUFFERS => Some((stats.median_us, *mappings)),
        _ => None,
    });
    if let Some((median_us, mappings)) = both {
        out.push(Verdict {
            target: format!(
                "suspend + resume with {TARGET_BUFFERS} graph buffers under {} ms (2 ranks)",
                TARGET_TIME.as_millis()
            ),
            met: median_us < TARGET_TIME.as_secs_f64() * 1e6,
            detail: format!(
                "median {:.3} ms, {mappings} peer mappings per rank",
                median_us / 1e3
            ),
            binding,
        });
    }
    let ratios: Vec<(usize, f64)> = rows
        .iter()
        .filter_map(|r| match r {
            LifecycleRow::Latency {
                graph_buffers,
                after_over_before: Some(x),
                ..
            } => Some((*graph_buffers, *x)),
            _ => None,
        })
        .collect();
    // The ratio farthest from 1, either way.
    let distance = |x: f64| x.max(1.0 / x);
    if let Some(&(_, worst)) = ratios
        .iter()
        .max_by(|a, b| distance(a.1).total_cmp(&distance(b.1)))
    {
        let detail: Vec<String> = ratios
            .iter()
            .map(|(n, x)| format!("N={n}: {x:.3}x"))
            .collect();
        out.push(Verdict {
            target: format!(
                "all-reduce latency unchanged after a resume (after/before median within \
                 {LATENCY_TOLERANCE:.2}x either way, this bench's tolerance)"
            ),
            met: distance(worst) <= LATENCY_TOLERANCE,
            detail: detail.join(", "),
            binding,
        });
    }
    out
}

/// The per-rank job of the subcommand.
struct LifecycleJob<'a> {
    args: &'a LifecycleArgs,
}

impl PerRank for LifecycleJob<'_> {
    type Output = ();

    fn run<C: Communicator>(&self, comm: &C, info: &RunInfo) -> Result<Option<()>, BenchError> {
        let args = self.args;
        let table = report::rank0_table(comm.rank(), args.json.as_deref(), |t| {
            preamble(t, args, info, comm.size());
            t.header_with(
                "suspend/resume: prepare_for_suspend, reinit_after_resume, and their sum",
                &TRANSITION_COLUMNS,
            );
        })?;
        let printer = table.as_ref();
        let mut transitions = Vec::new();
        let mut latencies = Vec::new();
        for &n in &args.graph_buffers {
            let (t_rows, l_rows) = bench_buffers(comm, n as usize, args)?;
            if let Some(t) = printer {
                t_rows.iter().for_each(|r| print_row(t, r));
            }
            transitions.extend(t_rows);
            latencies.extend(l_rows);
        }
        let Some(t) = printer else {
            return Ok(None);
        };
        t.header_with(
            &format!(
                "eager f32 all-reduce of {}: blocks just before and just after a suspend + \
                 resume, {LATENCY_ROUNDS} rounds interleaved",
                format_bytes(args.latency_bytes)
            ),
            &LATENCY_COLUMNS,
        );
        latencies.iter().for_each(|r| print_row(t, r));
        let rows: Vec<LifecycleRow> = transitions.into_iter().chain(latencies).collect();
        let verdicts = verdicts(&rows, comm.size() == 2);
        t.note("");
        if comm.size() != 2 {
            t.note("issue 5 states its target for 2 ranks: the verdicts below are indicative only");
        }
        for v in &verdicts {
            v.print(t);
        }
        if let Some(path) = &args.json {
            info.write_report(t, path, "lifecycle", comm.size(), args, &rows, &verdicts)?;
        }
        Ok(Some(()))
    }
}

fn preamble(t: &Table, args: &LifecycleArgs, info: &RunInfo, ranks: usize) {
    info.preamble_header(t, "lifecycle", ranks);
    t.note(&format!(
        "tpcomm-allreduce host backend; N graph buffers = N captured f32 all-reduces of \
         distinct {} inputs from ar.memory(), then register_graph_buffers",
        format_bytes(args.buffer_bytes)
    ));
    t.note(&args.iter.describe());
    t.note(
        "time: median over iterations of the slowest rank; a barrier before each transition; \
         before each latency iteration a barrier and an untimed 16-byte all-reduce",
    );
    t.note(
        "mappings: peer mappings open on each rank (Signal, staging, temp and graph buffers \
         of every peer), all closed by prepare_for_suspend and reopened by reinit_after_resume",
    );
    t.note("the plan is replayed and every output checked before the first suspend and after the last resume");
    if std::env::var_os("RUST_LOG").is_some() {
        t.note("RUST_LOG is set: tracing spans enabled by it add to tpcomm's times");
    }
}

/// Runs the subcommand.
pub(crate) fn run(args: &LifecycleArgs) -> Result<(), BenchError> {
    args.validate()?;
    launch::launch(args.transport, args.ranks, &LifecycleJob { args }).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tpcomm::transport::LocalGroup;

    use crate::{Cli, Command};

    #[test]
    fn defaults_are_1_100_1000_buffers_and_64_kib_latency() {
        let Command::Lifecycle(args) = Cli::try_parse_from(["tpcomm-bench", "lifecycle"])
            .unwrap()
            .command
        else {
            panic!("not the lifecycle subcommand")
        };
        assert_eq!(args.graph_buffers, vec![1, 100, 1000]);
        assert_eq!((args.buffer_bytes, args.latency_bytes), (4096, 64 << 10));
        assert!(args.validate().is_ok());
        let Command::Lifecycle(odd) =
            Cli::try_parse_from(["tpcomm-bench", "lifecycle", "--latency-bytes", "1000"])
                .unwrap()
                .command
        else {
            panic!("not the lifecycle subcommand")
        };
        assert!(odd.validate().is_err());
    }

    #[test]
    fn cycles_verify_and_time_on_three_local_ranks() {
        let args = LifecycleArgs {
            ranks: None,
            transport: Transport::Local,
            graph_buffers: vec![3],
            buffer_bytes: 256,
            latency_bytes: 1024,
            iter: IterArgs {
                iters: Some(2),
                warmup: Some(1),
            },
            json: None,
        };
        let results = LocalGroup::new(3).run(|comm| bench_buffers(&comm, 3, &args));
        let (transitions, latencies) = launch::first_rank_output(results).unwrap();
        assert_eq!(transitions.len(), 3);
        // Signal, staging, temp and 3 graph buffers of each of 2 peers.
        assert!(transitions.iter().all(|r| matches!(
            r,
            LifecycleRow::Transition {
                mappings: 12,
                iters: 2,
                ..
            }
        )));
        assert!(matches!(
            latencies[1],
            LifecycleRow::Latency {
                when: "after",
                after_over_before: Some(_),
                ..
            }
        ));
    }

    #[test]
    fn the_target_is_judged_on_suspend_plus_resume_of_1000() {
        let row = |median_us| LifecycleRow::Transition {
            graph_buffers: 1000,
            mappings: 1003,
            op: TransitionOp::Both,
            iters: 1,
            warmup: 0,
            stats: Stats {
                median_us,
                min_us: median_us,
                max_us: median_us,
            },
            samples_ns: Vec::new(),
        };
        assert!(verdicts(&[row(4_999.0)], true)[0].met);
        assert!(!verdicts(&[row(5_000.0)], true)[0].met);
    }

    #[test]
    fn a_latency_change_counts_either_way() {
        let after = |ratio| LifecycleRow::Latency {
            graph_buffers: 1,
            bytes: 64,
            when: "after",
            iters: 1,
            warmup: 0,
            stats: Stats {
                median_us: 1.0,
                min_us: 1.0,
                max_us: 1.0,
            },
            after_over_before: Some(ratio),
            samples_ns: Vec::new(),
        };
        assert!(verdicts(&[after(1.05), after(0.95)], true)[0].met);
        assert!(!verdicts(&[after(1.05), after(0.5)], true)[0].met);
        assert!(!verdicts(&[after(1.2)], true)[0].met);
    }
}
