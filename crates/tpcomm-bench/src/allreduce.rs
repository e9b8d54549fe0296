//! `tpcomm-bench allreduce`: the graph-safe custom all-reduce (tpcomm-allreduce, host
//! backend) in nccl-tests columns, and `MPI_Allreduce` of the same data under `mpirun`.
//!
//! Every rank builds one [`CustomAllReduce`] per algorithm row: one forced to one-stage,
//! one forced to two-stage (`Config::algorithm`), and one left to the dispatcher (`auto`).
//! Rows per size and element type:
//!
//! - `1stage`, `2stage`, `auto`: the eager path, `all_reduce(&input, &mut output)` on Rust
//!   slices (the input is copied into the staging buffer, the result written to `output`);
//!   `auto` shows the algorithm the dispatcher chose;
//! - `replay`: a plan captured on the `auto` instance (inputs and outputs in peer memory,
//!   registered with `register_graph_buffers`) replayed: zero-copy, the host equivalent of
//!   a CUDA graph launch;
//! - `MPI_Allreduce` (`--transport mpi`, f32 only): rsmpi's `all_reduce_into` with
//!   `SystemOperation::sum()` on `MPI_COMM_WORLD`, the same input.
//!
//! Per size: every path is verified once on fresh data (exact small integers, so every
//! algorithm and element type must match the reference bit for bit), then warm-up and
//! timed iterations, the paths interleaved and their order rotated each iteration. Each
//! iteration is a barrier, an untimed 16-byte custom all-reduce that lines the ranks up
//! (its flag barrier spins; the local group's barrier wakes sleeping threads, tens of
//! microseconds apart on a busy machine), then one timed all-reduce; the iteration's time
//! is the slowest rank's, and a row's time is the median over iterations. `busbw = algbw * 2(n-1)/n`
//! (nccl-tests' all-reduce factor).
//!
//! After each table: where two-stage becomes faster than one-stage (next to the
//! dispatcher's threshold, `dispatch::ONE_STAGE_MAX_BYTES`); under `mpirun`, issue 5's
//! targets against `MPI_Allreduce` (2 ranks, f32).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use half::{bf16, f16};
use serde::Serialize;
use tpcomm::allreduce::dispatch::ONE_STAGE_MAX_BYTES;
use tpcomm::allreduce::{
    Algorithm, CapturedPlan, Config, CustomAllReduce, DType, Element, HostBackend,
};
use tpcomm::ipc::{HostBuffer, HostMemory, PeerMemory};
use tpcomm::Communicator;

use crate::error::BenchError;
use crate::launch::{self, PerRank, RunInfo};
use crate::report::{self, Column, Stats, Table, Verdict};
use crate::sweep::{format_bytes, parse_bytes, IterArgs, SweepArgs};
use crate::timing::{elapsed_ns, median, ranks_flagging, slowest, time_once};
use crate::transport::{splitmix64, Transport};

/// The custom all-reduce on the host backend.
pub(crate) type HostAllReduce = CustomAllReduce<HostBackend>;

/// Issue 5's targets (2 MPI ranks, f32): at least this much faster than `MPI_Allreduce`
/// as a geometric mean...
const SPEEDUP_TARGET: f64 = 1.5;
/// ...over these sizes...
const GEOMEAN_SIZES: (usize, usize) = (8 << 10, 8 << 20);
/// ...and at this size...
const SMALL_SIZE: usize = 1 << 10;
/// ...at most this factor slower.
const SMALL_RATIO_TARGET: f64 = 1.2;
/// The summary calls the dispatcher's choice wrong at a size only when it is slower than
/// the other algorithm by more than this factor (medians closer than that are noise here).
const AUTO_MARGIN: f64 = 1.05;

/// Options of `tpcomm-bench allreduce`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct AllReduceArgs {
    /// Ranks (threads) of the local group, 1 to 8 [default: 2]. Not with `--transport mpi`,
    /// where `mpirun -np` decides.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=8), value_name = "N")]
    pub(crate) ranks: Option<u32>,

    /// Transport under the all-reduce (handle exchanges, barriers between iterations).
    /// With `mpi`, `MPI_Allreduce` of the same f32 data is timed too.
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub(crate) transport: Transport,

    /// Element types, comma-separated; one table each.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "f32",
        value_name = "DTYPES"
    )]
    pub(crate) dtypes: Vec<DTypeArg>,

    /// Custom all-reduce rows per size, comma-separated (`MPI_Allreduce` is added under
    /// `--transport mpi`).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "1stage,2stage,auto,replay",
        value_name = "PATHS"
    )]
    pub(crate) paths: Vec<PathArg>,

    /// Smallest size in bytes (a multiple of 16); suffixes K/KiB, M/MiB, G/GiB.
    #[arg(long, default_value = "1KiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) min_bytes: usize,

    /// Largest size in bytes (sizes the staging and temp buffers).
    #[arg(long, default_value = "8MiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) max_bytes: usize,

    /// Each size is the previous one times this factor.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..))]
    pub(crate) factor: u32,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) iter: IterArgs,

    /// Also write every figure (and every iteration's time) to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

impl AllReduceArgs {
    /// The size sweep, in the shared sweep's terms.
    fn sweep(&self) -> SweepArgs {
        SweepArgs {
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iter: self.iter.clone(),
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.sweep().validate()?;
        if !self.min_bytes.is_multiple_of(16) {
            return Err(BenchError::Usage(format!(
                "--min-bytes ({}) must be a multiple of 16 bytes: the custom all-reduce moves \
                 16-byte packs",
                self.min_bytes
            )));
        }
        if self.dtypes.is_empty() || self.paths.is_empty() {
            return Err(BenchError::Usage(
                "--dtypes and --paths need at least one value".into(),
            ));
        }
        Ok(())
    }
}

/// An element type on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    pub(crate) fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::Bf16,
        }
    }
}

/// A custom all-reduce row on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub(crate) enum PathArg {
    /// Eager, forced one-stage.
    #[value(name = "1stage")]
    #[serde(rename = "1stage")]
    OneStage,
    /// Eager, forced two-stage.
    #[value(name = "2stage")]
    #[serde(rename = "2stage")]
    TwoStage,
    /// Eager, the dispatcher's choice.
    #[value(name = "auto")]
    #[serde(rename = "auto")]
    Auto,
    /// A captured plan (registered graph buffers) replayed; the dispatcher's choice.
    #[value(name = "replay")]
    #[serde(rename = "replay")]
    Replay,
}

/// One row kind of the table: a custom path, or `MPI_Allreduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathKind {
    Custom(PathArg),
    Mpi,
}

impl PathKind {
    fn name(self) -> &'static str {
        match self {
            PathKind::Custom(PathArg::OneStage) => "1stage",
            PathKind::Custom(PathArg::TwoStage) => "2stage",
            PathKind::Custom(PathArg::Auto) => "auto",
            PathKind::Custom(PathArg::Replay) => "replay",
            PathKind::Mpi => "MPI_Allreduce",
        }
    }
}

/// One line of an allreduce table (and of the JSON report).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct AllReduceRow {
    /// Bytes per rank (input size).
    pub(crate) bytes: usize,
    /// Elements.
    pub(crate) count: usize,
    #[serde(rename = "type")]
    pub(crate) dtype: &'static str,
    /// `1stage`, `2stage`, `auto`, `replay` or `MPI_Allreduce`.
    pub(crate) path: &'static str,
    /// The algorithm the custom all-reduce ran (`None` for MPI).
    pub(crate) algorithm: Option<&'static str>,
    /// Timed iterations.
    pub(crate) iters: usize,
    /// Untimed iterations before them.
    pub(crate) warmup: usize,
    /// Median, minimum and maximum over iterations of the slowest rank's time.
    #[serde(flatten)]
    pub(crate) stats: Stats,
    /// `bytes / median`, GB/s.
    pub(crate) algbw_gbps: f64,
    /// `algbw * 2(n-1)/n`, GB/s.
    pub(crate) busbw_gbps: f64,
    /// `median / MPI_Allreduce's median` at the same size (custom rows, f32, MPI mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) vs_mpi: Option<f64>,
    /// Every iteration's time (slowest rank), nanoseconds, in the order they ran.
    pub(crate) samples_ns: Vec<u64>,
}

impl AllReduceRow {
    /// `1stage`, `auto (1stage)`, `MPI_Allreduce`: the printed algorithm cell.
    fn label(&self) -> String {
        match self.algorithm {
            Some(a) if a != self.path => format!("{} ({a})", self.path),
            _ => self.path.to_string(),
        }
    }
}

const COLUMNS: [Column; 9] = [
    Column::new("size", "(B)", 10),
    Column::new("count", "(elements)", 10),
    Column::new("type", "", 5),
    Column::new("algorithm", "", 15),
    Column::new("iters", "", 6),
    Column::new("time", "(us)", 10),
    Column::new("min", "(us)", 10),
    Column::new("algbw", "(GB/s)", 7),
    Column::new("busbw", "(GB/s)", 7),
];
const MPI_COLUMN: Column = Column::new("vs MPI", "cust/MPI", 8);

fn columns(with_mpi: bool) -> Vec<Column> {
    let mut c = COLUMNS.to_vec();
    if with_mpi {
        c.push(MPI_COLUMN);
    }
    c
}

fn print_row(table: &Table, row: &AllReduceRow, with_mpi: bool) {
    let mut cells = vec![
        row.bytes.to_string(),
        row.count.to_string(),
        row.dtype.to_string(),
        row.label(),
        row.iters.to_string(),
        format!("{:.2}", row.stats.median_us),
        format!("{:.2}", row.stats.min_us),
        format!("{:.3}", row.algbw_gbps),
        format!("{:.3}", row.busbw_gbps),
    ];
    if with_mpi {
        cells.push(
            row.vs_mpi
                .map_or_else(|| "-".into(), |r| format!("{r:.2}x")),
        );
    }
    table.cells(&columns(with_mpi), &cells);
}

/// nccl-tests' bus factor of all-reduce, `2(n-1)/n`.
fn bus_factor(ranks: usize) -> f64 {
    if ranks == 0 {
        0.0
    } else {
        2.0 * (ranks - 1) as f64 / ranks as f64
    }
}

/// Element `i` of rank `rank`'s input for verification `salt`: an integer in -8..=7, so
/// sums over up to 8 ranks are exact in f32, f16 and bf16 whatever the order.
pub(crate) fn input_value(rank: usize, i: usize, salt: u64) -> f32 {
    (splitmix64(salt ^ ((rank as u64) << 48) ^ i as u64) % 16) as f32 - 8.0
}

/// This rank's input of `count` elements for `salt`.
pub(crate) fn input<T: Element>(rank: usize, count: usize, salt: u64) -> Vec<T> {
    (0..count)
        .map(|i| T::from_f32(input_value(rank, i, salt)))
        .collect()
}

/// The exact sum over `ranks` of [`input`].
pub(crate) fn expected(ranks: usize, count: usize, salt: u64) -> Vec<f32> {
    (0..count)
        .map(|i| (0..ranks).map(|r| input_value(r, i, salt)).sum())
        .collect()
}

/// What is wrong with `got` against `want`, if anything.
pub(crate) fn check<T: Element>(got: &[T], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, expected {}", got.len(), want.len()));
    }
    let bad = got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_f32().to_bits() != w.to_bits())?;
    Some(format!(
        "element {bad} is {}, expected {}",
        got[bad].to_f32(),
        want[bad]
    ))
}

/// Collective: fails on every rank when any rank's `problem` is set, naming the ranks.
pub(crate) fn agree<C: Communicator>(
    comm: &C,
    problem: Option<String>,
    path: &'static str,
    op: &'static str,
    bytes: usize,
) -> Result<(), BenchError> {
    let bad_ranks = ranks_flagging(comm, problem.is_some())?;
    let Some(&first) = bad_ranks.first() else {
        return Ok(());
    };
    Err(BenchError::WrongData {
        path,
        op,
        bytes,
        rank: if problem.is_some() {
            comm.rank()
        } else {
            first
        },
        detail: problem.unwrap_or_else(|| format!("see rank {first}")),
        bad_ranks,
    })
}

/// A new host all-reduce (collective).
pub(crate) fn new_all_reduce<C: Communicator>(
    comm: &C,
    config: Config,
) -> Result<HostAllReduce, BenchError> {
    Ok(CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        config,
    )?)
}

/// `MPI_Allreduce` through rsmpi on `MPI_COMM_WORLD`.
#[cfg(feature = "mpi")]
struct MpiDirect(mpi::topology::SimpleCommunicator);

#[cfg(feature = "mpi")]
impl MpiDirect {
    /// In MPI mode, the world communicator.
    fn for_run(info: &RunInfo) -> Option<Self> {
        (info.transport == "mpi").then(|| Self(mpi::topology::SimpleCommunicator::world()))
    }

    fn all_reduce(&self, input: &[f32], output: &mut [f32]) {
        use mpi::collective::{CommunicatorCollectives as _, SystemOperation};
        self.0
            .all_reduce_into(input, output, SystemOperation::sum());
    }
}

/// Without the `mpi` feature there is no direct path.
#[cfg(not(feature = "mpi"))]
enum MpiDirect {}

#[cfg(not(feature = "mpi"))]
impl MpiDirect {
    fn for_run(_: &RunInfo) -> Option<Self> {
        None
    }

    fn all_reduce(&self, _: &[f32], _: &mut [f32]) {
        match *self {}
    }
}

/// This rank's all-reduce instances, one per kind of row.
struct Instances {
    one: Option<HostAllReduce>,
    two: Option<HostAllReduce>,
    /// The dispatcher's choice; also runs the replayed plans.
    auto: Option<HostAllReduce>,
}

impl Instances {
    /// Builds the instances `paths` need (collective: every rank passes the same paths).
    fn new<C: Communicator>(
        comm: &C,
        paths: &[PathArg],
        max_bytes: usize,
    ) -> Result<Self, BenchError> {
        let config = |algorithm| Config {
            max_bytes,
            algorithm,
            ..Config::default()
        };
        let wants = |p: &[PathArg]| p.iter().any(|x| paths.contains(x));
        let build = |wanted: bool, algorithm| -> Result<Option<HostAllReduce>, BenchError> {
            wanted
                .then(|| new_all_reduce(comm, config(algorithm)))
                .transpose()
        };
        Ok(Self {
            one: build(wants(&[PathArg::OneStage]), Some(Algorithm::OneStage))?,
            two: build(wants(&[PathArg::TwoStage]), Some(Algorithm::TwoStage))?,
            auto: build(wants(&[PathArg::Auto, PathArg::Replay]), None)?,
        })
    }

    fn get(&mut self, path: PathArg) -> Result<&mut HostAllReduce, BenchError> {
        let ar = match path {
            PathArg::OneStage => self.one.as_mut(),
            PathArg::TwoStage => self.two.as_mut(),
            PathArg::Auto | PathArg::Replay => self.auto.as_mut(),
        };
        ar.ok_or_else(|| BenchError::Usage(format!("no instance for {path:?}")))
    }
}

/// The peer-memory buffers the replayed plans read and write, and the plans.
struct Replay<'b> {
    memory: HostMemory,
    input: &'b HostBuffer,
    output: &'b HostBuffer,
    /// `plans[dtype index][size index]`: the plan and the algorithm it recorded.
    plans: Vec<Vec<(CapturedPlan<'b, HostBackend>, Algorithm)>>,
}

/// The buffers of one size and element type on one rank.
struct Case<T> {
    bytes: usize,
    count: usize,
    input: Vec<T>,
    output: Vec<T>,
    /// The same input as f32 for `MPI_Allreduce` (empty unless f32 in MPI mode).
    mpi_input: Vec<f32>,
    mpi_output: Vec<f32>,
    /// Indices of the replayed plan in [`Replay::plans`].
    plan: (usize, usize),
}

/// Runs `path` once on `case`; returns the algorithm the custom all-reduce used.
fn run_path<T: Element>(
    instances: &mut Instances,
    replay: Option<&Replay<'_>>,
    mpi: Option<&MpiDirect>,
    path: PathKind,
    case: &mut Case<T>,
) -> Result<Option<Algorithm>, BenchError> {
    match path {
        PathKind::Custom(PathArg::Replay) => {
            let replay = replay
                .ok_or_else(|| BenchError::Usage("replay path without captured plans".into()))?;
            let (plan, algorithm) = &replay.plans[case.plan.0][case.plan.1];
            plan.replay(instances.get(PathArg::Replay)?)?;
            Ok(Some(*algorithm))
        }
        PathKind::Custom(p) => {
            let ar = instances.get(p)?;
            Ok(Some(ar.all_reduce(&case.input, &mut case.output)?))
        }
        PathKind::Mpi => {
            let mpi = mpi.ok_or_else(|| BenchError::Usage("MPI path outside MPI mode".into()))?;
            mpi.all_reduce(&case.mpi_input, &mut case.mpi_output);
            Ok(None)
        }
    }
}

/// A small all-reduce used only to line the ranks up before each timed iteration.
pub(crate) fn new_sync<C: Communicator>(comm: &C) -> Result<HostAllReduce, BenchError> {
    new_all_reduce(
        comm,
        Config {
            max_bytes: 16,
            slots: 1,
            ..Config::default()
        },
    )
}

/// One timed iteration, its ranks lined up more tightly than by [`time_once`]'s barrier
/// alone: the transport's barrier, then an untimed 16-byte all-reduce on `sync` (whose
/// flag barrier spins, so the ranks leave it within about a microsecond even where the
/// transport's barrier wakes sleeping threads, as the local group's does), then `work`,
/// timed. Nanoseconds on this rank.
pub(crate) fn time_synced<C: Communicator>(
    comm: &C,
    sync: &mut HostAllReduce,
    work: impl FnOnce() -> Result<(), BenchError>,
) -> Result<u64, BenchError> {
    time_once(comm, |_| {
        let mut out = [0f32; 4];
        sync.all_reduce(&[0f32; 4], &mut out)?;
        let start = Instant::now();
        work()?;
        Ok(elapsed_ns(start))
    })
}

/// Everything a rank runs the paths with.
struct Runner<'r, 'b, C> {
    comm: &'r C,
    sync: HostAllReduce,
    instances: &'r mut Instances,
    replay: Option<&'r Replay<'b>>,
    mpi: Option<&'r MpiDirect>,
}

impl<C: Communicator> Runner<'_, '_, C> {
    /// Runs `path` once on `case`; returns the algorithm the custom all-reduce used.
    fn run_once<T: Element>(
        &mut self,
        path: PathKind,
        case: &mut Case<T>,
    ) -> Result<Option<Algorithm>, BenchError> {
        run_path(self.instances, self.replay, self.mpi, path, case)
    }

    /// One timed iteration of `path` ([`time_synced`]); nanoseconds on this rank.
    fn time<T: Element>(&mut self, path: PathKind, case: &mut Case<T>) -> Result<u64, BenchError> {
        let (instances, replay, mpi) = (&mut *self.instances, self.replay, self.mpi);
        time_synced(self.comm, &mut self.sync, || {
            run_path(instances, replay, mpi, path, case).map(drop)
        })
    }

    /// Runs `path` on fresh data and checks the result on every rank (collective).
    fn verify<T: Element>(
        &mut self,
        path: PathKind,
        case: &mut Case<T>,
        salt: u64,
    ) -> Result<Option<Algorithm>, BenchError> {
        let (rank, size) = (self.comm.rank(), self.comm.size());
        let want = expected(size, case.count, salt);
        let garbage = T::from_f32(f32::NAN);
        case.input = input(rank, case.count, salt);
        case.output.fill(garbage);
        if !case.mpi_input.is_empty() {
            case.mpi_input = input(rank, case.count, salt);
            case.mpi_output.fill(f32::NAN);
        }
        if let (PathKind::Custom(PathArg::Replay), Some(r)) = (path, self.replay) {
            r.memory
                .write(r.input, 0, bytemuck::cast_slice(&case.input))?;
            let nan = vec![garbage; case.count];
            r.memory.write(r.output, 0, bytemuck::cast_slice(&nan))?;
        }
        let algorithm = self.run_once(path, case)?;
        let problem = match path {
            PathKind::Mpi => check(&case.mpi_output, &want),
            PathKind::Custom(PathArg::Replay) => {
                let r = self
                    .replay
                    .ok_or_else(|| BenchError::Usage("replay without plans".into()))?;
                let mut got = vec![garbage; case.count];
                r.memory
                    .read(r.output, 0, bytemuck::cast_slice_mut(&mut got))?;
                check(&got, &want)
            }
            PathKind::Custom(_) => check(&case.output, &want),
        };
        let who = if path == PathKind::Mpi {
            "rsmpi"
        } else {
            "tpcomm-allreduce"
        };
        agree(self.comm, problem, who, path.name(), case.bytes)?;
        Ok(algorithm)
    }
}

/// The per-rank job.
struct AllReduceJob<'a> {
    args: &'a AllReduceArgs,
}

impl PerRank for AllReduceJob<'_> {
    type Output = ();

    fn run<C: Communicator>(&self, comm: &C, info: &RunInfo) -> Result<Option<()>, BenchError> {
        let args = self.args;
        let mpi = MpiDirect::for_run(info);
        let table = report::rank0_table(comm.rank(), args.json.as_deref(), |t| {
            preamble(t, args, info, comm.size());
        })?;
        let printer = table.as_ref();
        let sizes = args.sweep().sizes();
        let max_bytes = sizes.last().copied().unwrap_or(args.max_bytes);
        let sync = new_sync(comm)?;
        let mut instances = Instances::new(comm, &args.paths, max_bytes)?;

        // Replay: one plan per (element type, size), captured up front on the auto
        // instance, registered in one collective call.
        let memory = match &instances.auto {
            Some(ar) => Some(ar.memory()?.clone()),
            None => None,
        };
        let replay_buffers = match (&memory, args.paths.contains(&PathArg::Replay)) {
            (Some(m), true) => Some((m.allocate(max_bytes)?, m.allocate(max_bytes)?)),
            _ => None,
        };
        let replay = match (&memory, &replay_buffers) {
            (Some(memory), Some((rin, rout))) => {
                let ar = instances.get(PathArg::Replay)?;
                let mut plans = Vec::with_capacity(args.dtypes.len());
                for d in &args.dtypes {
                    let dtype = d.dtype();
                    let mut row = Vec::with_capacity(sizes.len());
                    for &bytes in &sizes {
                        let mut algorithm = None;
                        let plan = ar.capture(|cap| {
                            algorithm =
                                Some(cap.all_reduce(rin, rout, dtype, bytes / dtype.size())?);
                            Ok(())
                        })?;
                        let algorithm = algorithm.ok_or_else(|| {
                            BenchError::Usage("the capture recorded nothing".into())
                        })?;
                        row.push((plan, algorithm));
                    }
                    plans.push(row);
                }
                ar.register_graph_buffers(comm)?;
                Some(Replay {
                    memory: memory.clone(),
                    input: rin,
                    output: rout,
                    plans,
                })
            }
            _ => None,
        };
        let mut runner = Runner {
            comm,
            sync,
            instances: &mut instances,
            replay: replay.as_ref(),
            mpi: mpi.as_ref(),
        };

        let mut rows = Vec::new();
        let mut summaries = Vec::new();
        for (di, &d) in args.dtypes.iter().enumerate() {
            let with_mpi = mpi.is_some() && d == DTypeArg::F32;
            let dtype_rows = match d {
                DTypeArg::F32 => bench_dtype::<f32, C>(&mut runner, args, di, with_mpi, printer),
                DTypeArg::F16 => bench_dtype::<f16, C>(&mut runner, args, di, with_mpi, printer),
                DTypeArg::Bf16 => bench_dtype::<bf16, C>(&mut runner, args, di, with_mpi, printer),
            }?;
            if let Some(t) = printer {
                summaries.push(summarize(t, &dtype_rows, comm.size()));
            }
            rows.extend(dtype_rows);
        }
        let Some(t) = printer else {
            return Ok(None);
        };
        let verdicts = targets(&rows, comm.size() == 2);
        t.note("");
        if mpi.is_none() {
            t.note(
                "issue 5's targets compare with MPI_Allreduce: run under mpirun with \
                 --transport mpi (2 ranks) to check them",
            );
        } else if comm.size() != 2 {
            t.note(
                "issue 5 states its targets for 2 ranks: the verdicts below are indicative only",
            );
        }
        for v in &verdicts {
            v.print(t);
        }
        if let Some(path) = &args.json {
            let settings = &Settings {
                args,
                crossovers: &summaries,
            };
            info.write_report(
                t,
                path,
                "allreduce",
                comm.size(),
                &settings,
                &rows,
                &verdicts,
            )?;
        }
        Ok(Some(()))
    }
}

/// The `settings` of the JSON report: the options, and the crossovers measured.
#[derive(Debug, Serialize)]
struct Settings<'a> {
    #[serde(flatten)]
    args: &'a AllReduceArgs,
    crossovers: &'a [Crossover],
}

/// Verifies and times every path at every size for one element type; rank 0 prints.
fn bench_dtype<T: Element, C: Communicator>(
    runner: &mut Runner<'_, '_, C>,
    args: &AllReduceArgs,
    dtype_index: usize,
    with_mpi: bool,
    printer: Option<&Table>,
) -> Result<Vec<AllReduceRow>, BenchError> {
    let comm = runner.comm;
    let ranks = comm.size();
    let name = T::DTYPE.name();
    if let Some(t) = printer {
        t.header_with(
            &format!(
                "all_reduce sum, {name}, {ranks} ranks: size = bytes per rank; \
                 busbw = algbw * 2(n-1)/n"
            ),
            &columns(with_mpi),
        );
    }
    let mut paths: Vec<PathKind> = args.paths.iter().map(|&p| PathKind::Custom(p)).collect();
    if with_mpi {
        paths.push(PathKind::Mpi);
    }
    let mut rows = Vec::new();
    for (size_index, &bytes) in args.sweep().sizes().iter().enumerate() {
        let count = bytes / T::DTYPE.size();
        let mut case = Case {
            bytes,
            count,
            input: vec![T::from_f32(0.0); count],
            output: vec![T::from_f32(0.0); count],
            mpi_input: if with_mpi {
                vec![0.0; count]
            } else {
                Vec::new()
            },
            mpi_output: if with_mpi {
                vec![0.0; count]
            } else {
                Vec::new()
            },
            plan: (dtype_index, size_index),
        };
        let salt = ((dtype_index as u64) << 40) ^ ((size_index as u64) << 20) ^ 0x5eed;
        let mut algorithms = Vec::with_capacity(paths.len());
        for (k, &p) in paths.iter().enumerate() {
            algorithms.push(runner.verify(p, &mut case, salt ^ ((k as u64) << 56))?);
        }

        let warmup = args.iter.warmup_for(bytes);
        let mut warm = vec![Vec::with_capacity(warmup); paths.len()];
        for i in 0..warmup {
            for k in rotation(paths.len(), i) {
                warm[k].push(runner.time(paths[k], &mut case)?);
            }
        }
        let mut estimate = 0;
        for w in &warm {
            estimate = estimate.max(median(&slowest(comm, w)?));
        }
        let iters = args.iter.iters_for(Duration::from_nanos(estimate));
        let mut times = vec![Vec::with_capacity(iters); paths.len()];
        for i in 0..iters {
            for k in rotation(paths.len(), i) {
                times[k].push(runner.time(paths[k], &mut case)?);
            }
        }

        let mut size_rows = Vec::with_capacity(paths.len());
        for (k, &p) in paths.iter().enumerate() {
            let samples_ns = slowest(comm, &times[k])?;
            let stats = Stats::of(&samples_ns)
                .ok_or_else(|| BenchError::Usage("no timed iterations".into()))?;
            let algbw = if stats.median_us > 0.0 {
                bytes as f64 / stats.median_us / 1e3
            } else {
                0.0
            };
            size_rows.push(AllReduceRow {
                bytes,
                count,
                dtype: name,
                path: p.name(),
                algorithm: algorithms[k].map(Algorithm::name),
                iters,
                warmup,
                stats,
                algbw_gbps: algbw,
                busbw_gbps: algbw * bus_factor(ranks),
                vs_mpi: None,
                samples_ns,
            });
        }
        let mpi_median = size_rows
            .iter()
            .find(|r| r.path == PathKind::Mpi.name())
            .map(|r| r.stats.median_us)
            .filter(|&m| m > 0.0);
        if let Some(m) = mpi_median {
            for r in size_rows.iter_mut().filter(|r| r.algorithm.is_some()) {
                r.vs_mpi = Some(r.stats.median_us / m);
            }
        }
        if let Some(t) = printer {
            size_rows.iter().for_each(|r| print_row(t, r, with_mpi));
        }
        rows.extend(size_rows);
    }
    Ok(rows)
}

/// The order of the `n` paths in iteration `i`: rotated by one each iteration, so that
/// no path always follows the same one.
fn rotation(n: usize, i: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |k| (k + i) % n.max(1))
}

/// Where two-stage overtakes one-stage for one element type, as measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Crossover {
    #[serde(rename = "type")]
    dtype: &'static str,
    ranks: usize,
    /// The smallest size from which two-stage is faster at every larger size measured
    /// (`None`: one-stage is faster at the largest size).
    two_stage_faster_from: Option<usize>,
    /// The first size at which two-stage is faster (may be below a later reversal).
    first_two_stage_faster: Option<usize>,
    /// The dispatcher's last one-stage size for this world size.
    dispatcher_one_stage_max: Option<usize>,
    /// `(size, 2stage median / 1stage median)` per size.
    ratios: Vec<(usize, f64)>,
}

/// `(size, one-stage median, two-stage median)` -> the crossover sizes: from which size on
/// two-stage stays faster, and the first size where it is faster.
fn crossover(points: &[(usize, f64, f64)]) -> (Option<usize>, Option<usize>) {
    let first = points.iter().find(|p| p.2 < p.1).map(|p| p.0);
    let mut from = None;
    for p in points.iter().rev() {
        if p.2 < p.1 {
            from = Some(p.0);
        } else {
            break;
        }
    }
    (from, first)
}

/// Prints the closing lines of one element type's table; returns its crossover.
fn summarize(table: &Table, rows: &[AllReduceRow], ranks: usize) -> Crossover {
    let dtype = rows.first().map_or("", |r| r.dtype);
    let median_of = |path: &str, bytes: usize| {
        rows.iter()
            .find(|r| r.path == path && r.bytes == bytes)
            .map(|r| r.stats.median_us)
    };
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.bytes).collect();
    sizes.dedup();
    let points: Vec<(usize, f64, f64)> = sizes
        .iter()
        .filter_map(|&b| Some((b, median_of("1stage", b)?, median_of("2stage", b)?)))
        .collect();
    let (from, first) = crossover(&points);
    let dispatcher = ONE_STAGE_MAX_BYTES.get(ranks).copied();
    let out = Crossover {
        dtype,
        ranks,
        two_stage_faster_from: from,
        first_two_stage_faster: first,
        dispatcher_one_stage_max: dispatcher,
        ratios: points.iter().map(|&(b, one, two)| (b, two / one)).collect(),
    };
    table.note("");
    if points.is_empty() {
        return out;
    }
    let ratios: Vec<String> = out
        .ratios
        .iter()
        .map(|&(b, r)| format!("{} {r:.2}", short_bytes(b)))
        .collect();
    table.note(&format!(
        "{dtype}: 2stage/1stage time per size: {}",
        ratios.join(", ")
    ));
    let measured = match (from, first) {
        (Some(f), Some(g)) if f == g => format!("two-stage faster from {} up", format_bytes(f)),
        (Some(f), Some(g)) => format!(
            "two-stage faster from {} up (first faster at {}, not at every size after)",
            format_bytes(f),
            format_bytes(g)
        ),
        (None, Some(g)) => format!(
            "one-stage faster at the largest size; two-stage faster at some sizes from {}",
            format_bytes(g)
        ),
        _ => "one-stage faster at every size".to_string(),
    };
    let threshold = match dispatcher {
        Some(usize::MAX) => "one-stage at every size".to_string(),
        Some(t) => format!("one-stage up to {}, two-stage above", format_bytes(t)),
        None => "no threshold for this world size".to_string(),
    };
    table.note(&format!(
        "{dtype} crossover, {ranks} ranks: measured {measured}; dispatcher \
         (ONE_STAGE_MAX_BYTES[{ranks}]): {threshold}"
    ));
    let auto_wrong: Vec<String> = points
        .iter()
        .filter(|&&(b, one, two)| {
            let auto = rows
                .iter()
                .find(|r| r.path == "auto" && r.bytes == b)
                .and_then(|r| r.algorithm);
            match auto {
                Some("1stage") => two * AUTO_MARGIN < one,
                Some("2stage") => one * AUTO_MARGIN < two,
                _ => false,
            }
        })
        .map(|&(b, _, _)| short_bytes(b))
        .collect();
    if rows.iter().any(|r| r.path == "auto") {
        if auto_wrong.is_empty() {
            table.note(&format!(
                "{dtype}: auto ran the faster algorithm (or one within {:.0}%) at every size",
                (AUTO_MARGIN - 1.0) * 100.0
            ));
        } else {
            table.note(&format!(
                "{dtype}: auto ran an algorithm more than {:.0}% slower than the other at {}",
                (AUTO_MARGIN - 1.0) * 100.0,
                auto_wrong.join(", ")
            ));
        }
    }
    out
}

/// `1024` -> `1K`, `8 << 20` -> `8M`: compact sizes for summary lines.
fn short_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 20 && b.is_multiple_of(1 << 20) => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b.is_multiple_of(1 << 10) => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// Geometric mean of `MPI median / path median` over the f32 sizes in `range`.
fn geomean_speedup(rows: &[AllReduceRow], path: &str, range: (usize, usize)) -> Option<f64> {
    let speedups: Vec<f64> = rows
        .iter()
        .filter(|r| r.dtype == "f32" && r.path == path)
        .filter(|r| r.bytes >= range.0 && r.bytes <= range.1)
        .filter_map(|r| r.vs_mpi.filter(|&x| x > 0.0).map(|x| 1.0 / x))
        .collect();
    if speedups.is_empty() {
        return None;
    }
    let log_mean = speedups.iter().map(|s| s.ln()).sum::<f64>() / speedups.len() as f64;
    Some(log_mean.exp())
}

/// Issue 5's targets, judged on the `auto` rows (the eager all-reduce as callers run it,
/// the dispatcher choosing) and, separately, on the `replay` rows (a captured plan).
fn targets(rows: &[AllReduceRow], binding: bool) -> Vec<Verdict> {
    let mut out = Vec::new();
    let span = format!(
        "{}..{}",
        format_bytes(GEOMEAN_SIZES.0),
        format_bytes(GEOMEAN_SIZES.1)
    );
    let find = |path: &str, bytes: usize| {
        rows.iter()
            .find(|r| r.dtype == "f32" && r.path == path && r.bytes == bytes)
    };
    for (path, what) in [
        ("auto", "eager all_reduce"),
        ("replay", "captured plan replay"),
    ] {
        if let Some(g) = geomean_speedup(rows, path, GEOMEAN_SIZES) {
            let others: Vec<String> = ["1stage", "2stage"]
                .iter()
                .filter(|_| path == "auto")
                .filter_map(|p| {
                    geomean_speedup(rows, p, GEOMEAN_SIZES).map(|g| format!("{p} {g:.3}x"))
                })
                .collect();
            let mut detail = format!("geomean speedup over MPI_Allreduce {g:.3}x");
            if !others.is_empty() {
                detail.push_str(&format!(" (forced: {})", others.join(", ")));
            }
            out.push(Verdict {
                target: format!(
                    "{path} ({what}), f32: at least {SPEEDUP_TARGET}x faster than MPI_Allreduce, \
                     geometric mean over {span} (2 ranks)"
                ),
                met: g >= SPEEDUP_TARGET,
                detail,
                binding,
            });
        }
        let small = (
            find(path, SMALL_SIZE),
            find(PathKind::Mpi.name(), SMALL_SIZE),
        );
        if let (Some(custom), Some(mpi)) = small {
            if let Some(ratio) = custom.vs_mpi {
                out.push(Verdict {
                    target: format!(
                        "{path} ({what}), f32: within {SMALL_RATIO_TARGET}x of MPI_Allreduce \
                         at {} (2 ranks)",
                        format_bytes(SMALL_SIZE)
                    ),
                    met: ratio <= SMALL_RATIO_TARGET,
                    detail: format!(
                        "{:.2} us vs MPI_Allreduce {:.2} us: {ratio:.2}x",
                        custom.stats.median_us, mpi.stats.median_us
                    ),
                    binding,
                });
            }
        }
    }
    out
}

fn preamble(t: &Table, args: &AllReduceArgs, info: &RunInfo, ranks: usize) {
    info.preamble_header(t, "allreduce", ranks);
    t.note(&format!(
        "tpcomm-allreduce host backend (shared memory); {}",
        args.sweep().describe()
    ));
    t.note(
        "time: median over iterations of the slowest rank; before each iteration a barrier, \
         then an untimed 16-byte custom all-reduce (spinning flags) to line the ranks up",
    );
    t.note(
        "1stage / 2stage: eager all_reduce (slice in, slice out), algorithm forced by \
         Config.algorithm; auto: the dispatcher's choice (in parentheses)",
    );
    if args.paths.contains(&PathArg::Replay) {
        t.note(
            "replay: a captured plan replayed (input and output in registered peer memory, \
             no staging copy), the dispatcher's choice",
        );
    }
    if info.transport == "mpi" {
        t.note(
            "MPI_Allreduce: rsmpi all_reduce_into(SystemOperation::sum) on MPI_COMM_WORLD, the \
             same f32 data; vs MPI = custom median / MPI median (below 1 = faster)",
        );
    }
    t.note("every path verified once per size (exact integer data) before timing");
    if std::env::var_os("RUST_LOG").is_some() {
        t.note("RUST_LOG is set: tracing spans enabled by it add to tpcomm's times");
    }
}

/// Runs the subcommand.
pub(crate) fn run(args: &AllReduceArgs) -> Result<(), BenchError> {
    args.validate()?;
    launch::launch(args.transport, args.ranks, &AllReduceJob { args }).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tpcomm::transport::LocalGroup;

    use crate::{Cli, Command};

    fn quick(paths: Vec<PathArg>, dtypes: Vec<DTypeArg>) -> AllReduceArgs {
        AllReduceArgs {
            ranks: None,
            transport: Transport::Local,
            dtypes,
            paths,
            min_bytes: 1 << 10,
            max_bytes: 256 << 10,
            factor: 4,
            iter: IterArgs {
                iters: Some(2),
                warmup: Some(1),
            },
            json: None,
        }
    }

    #[test]
    fn defaults_are_f32_every_path_1_kib_to_8_mib_locally() {
        let Command::AllReduce(args) = Cli::try_parse_from(["tpcomm-bench", "allreduce"])
            .unwrap()
            .command
        else {
            panic!("not the allreduce subcommand")
        };
        assert_eq!(args.dtypes, vec![DTypeArg::F32]);
        assert_eq!(
            args.paths,
            vec![
                PathArg::OneStage,
                PathArg::TwoStage,
                PathArg::Auto,
                PathArg::Replay
            ]
        );
        assert_eq!((args.min_bytes, args.max_bytes), (1 << 10, 8 << 20));
        assert_eq!(args.sweep().sizes().len(), 14);
        assert_eq!(args.transport, Transport::Local);
        assert!(args.validate().is_ok());
    }

    #[test]
    fn options_parse_and_bad_ones_are_refused() {
        let Command::AllReduce(args) = Cli::try_parse_from([
            "tpcomm-bench",
            "allreduce",
            "--dtypes",
            "f32,f16,bf16",
            "--paths",
            "auto",
            "--ranks",
            "4",
        ])
        .unwrap()
        .command
        else {
            panic!("not the allreduce subcommand")
        };
        assert_eq!(args.dtypes.len(), 3);
        assert_eq!(args.ranks, Some(4));
        assert!(Cli::try_parse_from(["tpcomm-bench", "allreduce", "--ranks", "9"]).is_err());
        assert!(Cli::try_parse_from(["tpcomm-bench", "allreduce", "--dtypes", "f64"]).is_err());
        let odd = AllReduceArgs {
            min_bytes: 1000,
            ..quick(vec![PathArg::Auto], vec![DTypeArg::F32])
        };
        assert!(odd.validate().is_err());
    }

    #[test]
    fn every_path_and_dtype_verifies_and_times_on_three_local_ranks() {
        let args = quick(
            vec![
                PathArg::OneStage,
                PathArg::TwoStage,
                PathArg::Auto,
                PathArg::Replay,
            ],
            vec![DTypeArg::F32, DTypeArg::Bf16],
        );
        let job = AllReduceJob { args: &args };
        let results = LocalGroup::new(3).run(|comm| {
            let info = RunInfo {
                transport: "local",
                description: "local",
                mpi_library: None,
                machine: crate::report::Machine::current(),
            };
            job.run(&comm, &info)
        });
        launch::first_rank_output(results).unwrap();
    }

    #[test]
    fn crossover_is_where_two_stage_stays_faster() {
        let p = |b, one, two| (b, one, two);
        assert_eq!(
            crossover(&[
                p(1, 1.0, 2.0),
                p(2, 2.0, 1.0),
                p(4, 1.0, 2.0),
                p(8, 3.0, 2.0)
            ]),
            (Some(8), Some(2))
        );
        assert_eq!(
            crossover(&[p(1, 1.0, 2.0), p(2, 2.0, 1.0), p(4, 3.0, 2.0)]),
            (Some(2), Some(2))
        );
        assert_eq!(crossover(&[p(1, 1.0, 2.0)]), (None, None));
    }

    #[test]
    fn integer_inputs_sum_exactly_in_every_dtype() {
        let want = expected(8, 64, 3);
        let mut sum = vec![0f32; 64];
        for r in 0..8 {
            for (s, v) in sum.iter_mut().zip(input::<bf16>(r, 64, 3)) {
                *s += v.to_f32();
            }
        }
        let got: Vec<bf16> = sum.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(check(&got, &want), None);
        let mut wrong = got.clone();
        wrong[5] = bf16::from_f32(100.0);
        assert!(check(&wrong, &want).unwrap().starts_with("element 5"));
    }

    #[test]
    fn targets_use_auto_against_mpi() {
        let row = |path: &'static str, bytes, median_us, vs_mpi| AllReduceRow {
            bytes,
            count: bytes / 4,
            dtype: "f32",
            path,
            algorithm: (path != "MPI_Allreduce").then_some("1stage"),
            iters: 1,
            warmup: 0,
            stats: Stats {
                median_us,
                min_us: median_us,
                max_us: median_us,
            },
            algbw_gbps: 0.0,
            busbw_gbps: 0.0,
            vs_mpi,
            samples_ns: Vec::new(),
        };
        let rows = [
            row("auto", 1 << 10, 1.1, Some(1.1)),
            row("MPI_Allreduce", 1 << 10, 1.0, None),
            row("auto", 8 << 10, 1.0, Some(0.5)),
            row("auto", 16 << 10, 1.0, Some(0.8)),
        ];
        let v = targets(&rows, true);
        assert_eq!(v.len(), 2);
        // sqrt(2 * 1.25) = 1.58
        assert!(v[0].met, "{:?}", v[0]);
        assert!(v[1].met);
        let rows = [row("auto", 8 << 10, 1.0, Some(0.8))];
        assert!(!targets(&rows, true)[0].met);
    }
}
