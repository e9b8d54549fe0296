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
//!    a block again ("after"), each iteration lined up as in `tpcomm-bench allreduce`;
//! 3. suspend/resume cycles are timed by the harness, each step behind a barrier, in this
//!    order every iteration: a `replay` of the plan (steady state: every mapping already
//!    touched by the replays since the last resume),
//!    `prepare_for_suspend`, `reinit_after_resume`, and the `first replay` after the resume
//!    (reopened mappings touched for the first time); `suspend+resume` is the sum of the
//!    two transitions, and the first replay is compared with the steady one (after/before);
//!    then the kernel's floor of the transition ([`crate::peers::page_floor`]): `floor munmap` and
//!    `floor mmap+touch` of as many pages as this rank maps from its peers, right after a
//!    replay as the transition is, their sum `floor suspend+resume` the peer of
//!    `suspend+resume`;
//! 4. the plan is replayed on fresh data and all N outputs checked again.
//!
//! [`CustomAllReduce`]: tpcomm::allreduce::CustomAllReduce

use std::time::Duration;

use clap::Args;
use serde::Serialize;
use tpcomm::allreduce::{Config, DType};
use tpcomm::ipc::{HostBuffer, PeerMemory};
use tpcomm::Communicator;

use crate::data::elements::{check, expected, input};
use crate::engine::error::BenchError;
use crate::engine::launch::{Bench, RunArgs};
use crate::engine::lineup::{new_all_reduce, new_sync, time_synced, HostAllReduce};
use crate::engine::row::{link_peers, Row};
use crate::engine::session::Session;
use crate::engine::sweep::{format_bytes, parse_bytes, BufferArgs, IterArgs};
use crate::engine::table::{col, Column};
use crate::engine::targets::{floor_bound, within, Target};
use crate::engine::timing::{elapsed_ns, iteration_count, slowest, time_once, Order, Spec};
use crate::engine::verify::agree;
use crate::peers::page_floor::{resident_pages, PageFloor};

/// The target: suspend + resume with this many graph buffers...
const TARGET_BUFFERS: usize = 1000;
/// ...in less than this (2 ranks).
const TARGET_TIME: Duration = Duration::from_millis(1);
/// The first replay after a resume (with [`TARGET_BUFFERS`] graph buffers) at most this many
/// times the steady replay.
const FIRST_REPLAY_RATIO: f64 = 1.2;
/// "No measurable change" of latency after a resume, as this bench judges it: the median
/// after within this factor of the median before, either way.
const LATENCY_TOLERANCE: f64 = 1.10;
/// Rounds of the before/after latency comparison (one untimed suspend + resume each).
const LATENCY_ROUNDS: usize = 5;
/// The timed steps of a cycle, in running order; the sums of the transitions and of the
/// floor's two steps are rows too.
pub(crate) const STEPS: [&str; 6] = [
    "replay",
    "prepare_for_suspend",
    "reinit_after_resume",
    "first replay",
    "floor munmap",
    "floor mmap+touch",
];
/// The rows that are sums of two steps: the transition, and its floor
/// ([`crate::peers::page_floor`]), which the transition is compared with.
const SUMS: [(&str, usize, usize); 2] = [("suspend+resume", 1, 2), (FLOOR, 4, 5)];
const FLOOR: &str = "floor suspend+resume";
const TRANSITION_TABLE: &str = "suspend/resume";
const LATENCY_TABLE: &str = "latency";

/// Options of `tpcomm-bench lifecycle`.
#[derive(Debug, Clone, Args, Serialize)]
#[command(mut_arg("buffers", |a| a.long("graph-buffers")
    .help("Graph buffers registered before suspending, comma-separated; one row group each")))]
#[command(mut_arg("buffer_bytes", |a| a
    .help("Bytes of each graph buffer (input and output; a multiple of 16)")))]
pub(crate) struct LifecycleArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) buffers: BufferArgs,

    /// Size of the eager f32 all-reduce timed before and after a resume (a multiple of 16).
    #[arg(long, default_value = "64KiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) latency_bytes: usize,
}

/// The ratio of a row to its peer: after / before, suspend+resume / its floor.
const RATIO: Column = Column::new("ratio", "vs peer", 10, |r, _| {
    r.vs_peer.map_or_else(|| "-".into(), |x| format!("{x:.3}x"))
});

const TRANSITION_COLUMNS: [Column; 7] = [
    Column::new("graph", "buffers", 8, |r, _| r.case.clone()),
    Column::fact("mappings", "(per rank)", 11, "mappings"),
    col::variant("op", 20),
    col::iters(),
    col::time::<2>("median", 11),
    col::min::<2>(11),
    RATIO,
];

const LATENCY_COLUMNS: [Column; 7] = [
    Column::new("graph", "buffers", 8, |r, _| r.case.clone()),
    col::size(9),
    col::variant("when", 7),
    col::iters(),
    col::time::<2>("median", 10),
    col::min::<2>(10),
    RATIO,
];

fn targets() -> Vec<Target> {
    vec![
        Target {
            what: format!(
                "suspend + resume with {TARGET_BUFFERS} graph buffers under {} ms (2 ranks)",
                TARGET_TIME.as_millis()
            ),
            why: "an engine suspends and resumes between requests (weights offloaded, GPU \
                  shared); the transition must stay well below a request's latency",
            line: None,
            judge: Box::new(|rows: &[Row]| {
                let both = rows.iter().find(|r| {
                    r.table == TRANSITION_TABLE
                        && r.case == TARGET_BUFFERS.to_string()
                        && r.is("suspend+resume")
                })?;
                let target_us = TARGET_TIME.as_secs_f64() * 1e6;
                let floor = rows
                    .iter()
                    .find(|r| r.table == TRANSITION_TABLE && r.case == both.case && r.is(FLOOR));
                let bound = floor.map_or_else(String::new, |f| {
                    floor_bound(
                        &format!("the kernel's floor for its {} pages", f.text("floor_pages")),
                        &format!("it at {:.3} ms", f.stats.median_us / 1e3),
                        f.stats.median_us < target_us,
                        "",
                    )
                });
                Some((
                    both.stats.median_us < target_us,
                    format!(
                        "median {:.3} ms, {} peer mappings per rank{bound}",
                        both.stats.median_us / 1e3,
                        both.text("mappings")
                    ),
                ))
            }),
        },
        Target {
            what: format!(
                "first replay after a resume within {FIRST_REPLAY_RATIO:.1}x of the steady \
                 replay ({TARGET_BUFFERS} graph buffers)"
            ),
            why: "reopened mappings are touched for the first time by the first replay; a slow \
                  first step after every resume would add to the latency the resume saved",
            line: None,
            judge: within(
                |r| {
                    r.table == TRANSITION_TABLE
                        && r.case == TARGET_BUFFERS.to_string()
                        && r.is("first replay")
                },
                |x| x,
                FIRST_REPLAY_RATIO,
            ),
        },
        Target {
            what: format!(
                "all-reduce latency unchanged after a resume (after/before median within \
                 {LATENCY_TOLERANCE:.2}x either way)"
            ),
            why: "a resume rewrites the stable tables in place; a kernel reading them must run \
                  exactly as fast as before (the tolerance is this machine's noise)",
            line: None,
            // The ratio farthest from 1, either way.
            judge: within(
                |r| r.table == LATENCY_TABLE,
                |x| x.max(1.0 / x),
                LATENCY_TOLERANCE,
            ),
        },
    ]
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

/// The eager f32 all-reduce of `bytes` timed just before and just after a resume, in
/// [`LATENCY_ROUNDS`] rounds (see the module documentation); verified before the first
/// round and after the last resume. Returns the "before" and "after" rows of case `n`.
fn latency<C: Communicator>(
    comm: &C,
    sync: &mut HostAllReduce,
    ar: &mut HostAllReduce,
    n: usize,
    bytes: usize,
    iter: &IterArgs,
) -> Result<Vec<Row>, BenchError> {
    let count = bytes / 4;
    let data: Vec<f32> = input(comm.rank(), count, 7);
    let want = expected(comm.size(), count, 7);
    let mut out = vec![f32::NAN; count];
    let verify = |ar: &mut HostAllReduce, out: &mut [f32], when: &str| {
        out.fill(f32::NAN);
        ar.all_reduce(&data, out)?;
        agree(comm, check(out, &want), || {
            format!("eager all_reduce {when}")
        })
    };
    verify(ar, &mut out, "before the suspend")?;
    let mut timed = |ar: &mut HostAllReduce, out: &mut [f32]| {
        time_synced(comm, sync, || {
            ar.all_reduce(&data, out)?;
            Ok(())
        })
    };
    let warmup = iter.warmup_for(bytes);
    let mut warm = Vec::with_capacity(warmup);
    for _ in 0..warmup {
        warm.push(timed(ar, &mut out)?);
    }
    let block = iteration_count(comm, iter, &[warm])?
        .div_ceil(LATENCY_ROUNDS)
        .max(1);
    let (mut before, mut after) = (Vec::new(), Vec::new());
    for _ in 0..LATENCY_ROUNDS {
        for _ in 0..block {
            before.push(timed(ar, &mut out)?);
        }
        ar.prepare_for_suspend(comm)?;
        ar.reinit_after_resume(comm)?;
        for _ in 0..block {
            after.push(timed(ar, &mut out)?);
        }
    }
    verify(ar, &mut out, "after resume")?;
    let spec = Spec {
        peer: Some("before"),
        ..Spec::new(LATENCY_TABLE, n.to_string(), bytes, &["before", "after"])
    };
    let samples = vec![slowest(comm, &before)?, slowest(comm, &after)?];
    Ok(spec.rows(comm.size(), warmup, samples))
}

/// Pages this rank maps from its peers now (steady state, after replays): the resident
/// pages of every mapping that holds a peer's Signal, staging or temp region or one of its
/// graph buffers (RankData slots `0..=n`). Each rank counts its own.
fn peer_pages<C: Communicator>(
    comm: &C,
    ar: &HostAllReduce,
    n: usize,
) -> Result<usize, BenchError> {
    let peers = || (0..comm.size()).filter(|&r| r != comm.rank());
    let mut addresses = Vec::new();
    for r in peers() {
        for region in 0..3 {
            addresses.push(ar.base_address(r, region)?);
        }
    }
    for slot in 0..=n {
        let held = ar.rank_data_slot(slot)?;
        addresses.extend(peers().map(|r| held[r]).filter(|&a| a != 0));
    }
    resident_pages(&addresses)
}

/// The whole measurement for `n` graph buffers: transition rows, then latency rows.
fn bench_buffers<C: Communicator>(
    s: &Session<'_>,
    comm: &C,
    n: usize,
    args: &LifecycleArgs,
) -> Result<(Vec<Row>, Vec<Row>), BenchError> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let config = Config {
        max_bytes: args.latency_bytes.max(args.buffers.buffer_bytes),
        slots: n + 1,
        ..Config::default()
    };
    let mut ar = new_all_reduce(comm, config)?;
    let mut sync = new_sync(comm)?;
    let memory = ar.memory()?.clone();
    let allocate = || -> Result<Vec<HostBuffer>, BenchError> {
        (0..n)
            .map(|_| Ok(memory.allocate(args.buffers.buffer_bytes)?))
            .collect()
    };
    let buffers = GraphBuffers {
        memory: &memory,
        inputs: allocate()?,
        outputs: allocate()?,
        count: args.buffers.buffer_bytes / 4,
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
    let verify_plan = |ar: &mut HostAllReduce, salt: u64, when: &str| {
        buffers.fill(rank, salt)?;
        plan.replay(ar)?;
        agree(comm, buffers.check(ranks, salt)?, || format!("plan {when}"))
    };
    verify_plan(&mut ar, 0x11fe ^ n as u64, "replay before suspend")?;
    let mappings = ar.peer_mappings()?.counters().open;

    let latency_rows = latency(comm, &mut sync, &mut ar, n, args.latency_bytes, &s.iter)?;
    let mut floor = PageFloor::new(peer_pages(comm, &ar, n)?)?;
    let spec = Spec {
        order: Order::Fixed,
        sums: &SUMS,
        ..Spec::new(TRANSITION_TABLE, n.to_string(), 0, &STEPS)
            .with("mappings", mappings)
            .with("floor_pages", floor.pages())
    };
    let mut transitions = s.measure(comm, &spec, &mut ar, |ar, v| {
        time_once(comm, |start| {
            match v {
                1 => ar.prepare_for_suspend(comm)?,
                2 => ar.reinit_after_resume(comm)?,
                4 => floor.unmap()?,
                5 => floor.map()?,
                _ => plan.replay(ar)?,
            };
            Ok(elapsed_ns(start))
        })
    })?;
    link_peers(&mut transitions, |r| {
        (r.is("first replay").then_some("replay"))
            .or(r.is("suspend+resume").then_some(FLOOR))
            .map(Into::into)
    });
    verify_plan(&mut ar, 0x22fe ^ n as u64, "replay after resume")?;
    let reopened = ar.peer_mappings()?.counters().open;
    if reopened != mappings {
        return Err(BenchError::Usage(format!(
            "{reopened} peer mappings open after the cycles, {mappings} before"
        )));
    }
    drop(plan);
    ar.close()?;
    Ok((transitions, latency_rows))
}

/// The closing line of the first replays: after/before per N.
fn first_replay_line(rows: &[Row]) -> Option<String> {
    let per: Vec<String> = rows
        .iter()
        .filter(|r| r.table == TRANSITION_TABLE && r.is("first replay"))
        .filter_map(|r| {
            Some(format!(
                "N={} {:.2}x ({:.1} us)",
                r.case, r.vs_peer?, r.stats.median_us
            ))
        })
        .collect();
    (!per.is_empty()).then(|| {
        format!(
            "first replay after a resume / steady-state replay: {}",
            per.join(", ")
        )
    })
}

impl Bench for LifecycleArgs {
    const NAME: &'static str = "lifecycle";

    fn run_args(&self) -> &RunArgs {
        &self.run
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.run.at_most(8)?;
        for (name, v) in [
            ("--buffer-bytes", self.buffers.buffer_bytes),
            ("--latency-bytes", self.latency_bytes),
        ] {
            if v == 0 || !v.is_multiple_of(16) {
                return Err(BenchError::Usage(format!(
                    "{name} ({v}) must be a positive multiple of 16 bytes"
                )));
            }
        }
        if self.buffers.buffers.is_empty() {
            return Err(BenchError::Usage(
                "--graph-buffers needs at least one value".into(),
            ));
        }
        Ok(())
    }

    fn preamble(&self, _mpi: bool) -> Vec<String> {
        vec![
            format!(
                "tpcomm-allreduce host backend; N graph buffers = N captured f32 all-reduces of \
                 distinct {} inputs from ar.memory(), then register_graph_buffers",
                format_bytes(self.buffers.buffer_bytes)
            ),
            "time: median over iterations of the slowest rank; a barrier before each step; \
             before each latency iteration a barrier and an untimed 16-byte all-reduce"
                .into(),
            "mappings: peer mappings open on each rank (Signal, staging, temp and graph buffers \
             of every peer), all closed by prepare_for_suspend and reopened by reinit_after_resume"
                .into(),
            "per cycle: replay (the plan, steady state: its mappings touched since the last \
             resume), prepare_for_suspend, \
             reinit_after_resume, first replay after it; suspend+resume: the sum of the two \
             transitions per iteration; ratio: first replay / steady replay"
                .into(),
            "floor: the kernel's work alone, on a memfd of as many pages as the rank maps from \
             its peers (resident pages of those mappings): munmap, then mmap and a read of a \
             byte per page; ratio of suspend+resume: over its floor"
                .into(),
            "the plan is replayed and every output checked before the first suspend and after \
             the last resume"
                .into(),
        ]
    }

    fn targets(&self) -> Vec<Target> {
        targets()
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        s.header(
            "suspend/resume cycles: steady replay, prepare_for_suspend, reinit_after_resume, \
             first replay, and the kernel's floor of the transition",
            &TRANSITION_COLUMNS,
        );
        s.progress.plan(self.buffers.buffers.len());
        let mut latencies = Vec::new();
        for &n in &self.buffers.buffers {
            let (transitions, latency) = bench_buffers(s, comm, n as usize, self)?;
            s.rows(&TRANSITION_COLUMNS, transitions, |_| true);
            latencies.extend(latency);
        }
        s.header(
            &format!(
                "eager f32 all-reduce of {}: blocks just before and just after a suspend + \
                 resume, {LATENCY_ROUNDS} rounds interleaved",
                format_bytes(self.latency_bytes)
            ),
            &LATENCY_COLUMNS,
        );
        s.rows(&LATENCY_COLUMNS, latencies, |_| true);
        s.closing(first_replay_line(s.kept()).into_iter().collect());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::targets::judge;

    fn parse(extra: &[&str]) -> LifecycleArgs {
        parse!(Lifecycle, [&["lifecycle"], extra].concat())
    }

    #[test]
    fn defaults_are_1_100_1000_buffers_and_64_kib_latency() {
        let args = parse(&[]);
        assert_eq!(args.buffers.buffers, vec![1, 100, 1000]);
        assert_eq!(
            (args.buffers.buffer_bytes, args.latency_bytes),
            (4096, 64 << 10)
        );
        assert!(args.validate().is_ok());
        assert!(parse(&["--latency-bytes", "1000"]).validate().is_err());
    }

    #[test]
    fn the_targets_judge_suspend_plus_resume_of_1000_and_latency_either_way() {
        let both = |us| Row::of_us(TRANSITION_TABLE, "1000", "suspend+resume", us);
        let after = |ratio| Row::of_us(LATENCY_TABLE, "1", "after", 1.0).vs(ratio);
        assert!(judge(&targets(), &[both(999.0)])[0].met);
        assert!(!judge(&targets(), &[both(1_000.0)])[0].met);
        let floor = |us| Row::of_us(TRANSITION_TABLE, "1000", FLOOR, us).with("floor_pages", 1056);
        let within_reach = &judge(&targets(), &[both(1_500.0), floor(450.0)])[0];
        assert!(!within_reach.met);
        assert!(
            within_reach
                .detail
                .ends_with("1056 pages bounds it at 0.450 ms"),
            "{}",
            within_reach.detail
        );
        let beyond = &judge(&targets(), &[both(1_500.0), floor(1_200.0)])[0];
        assert!(beyond
            .detail
            .ends_with("1.200 ms: out of reach on this machine"));
        assert!(judge(&targets(), &[after(1.05), after(0.95)])[0].met);
        assert!(!judge(&targets(), &[after(1.05), after(0.5)])[0].met);
    }

    #[test]
    fn the_first_replay_of_1000_buffers_is_judged_from_its_ratio_to_the_steady_replay() {
        let first =
            |case, ratio| crate::engine::row::row_vs(TRANSITION_TABLE, case, "first replay", ratio);
        let met = judge(&targets(), &[first("1000", 1.2)]);
        assert_eq!(met.len(), 1);
        assert!(met[0].met && met[0].target.starts_with("first replay"));
        assert!(!judge(&targets(), &[first("1000", 1.21)])[0].met);
        assert!(
            judge(&targets(), &[first("100", 3.0)]).is_empty(),
            "only the 1000-buffer case is judged"
        );
    }
}
