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
//! - `memcpy`: one plain copy of the message (its size, on every rank at once), timed like
//!   the paths: the memory-bandwidth floor no all-reduce of that size can beat; `vs copy`
//!   is every row's time over it, and the summary quotes it at the largest size (at least
//!   8 MiB, so that it is memory and not caches);
//! - `floor copy+sum`, `floor sum` (f32): the least data movement of an all-reduce on each
//!   rank, with no synchronisation at all: the parts of the input that peers read (all but
//!   one n-th) copied into a page-aligned staging buffer, then the input and one buffer per
//!   peer (standing for the peers' staging buffers) summed into the output — what any eager
//!   all-reduce of unregistered buffers between processes must do at least — and the sum
//!   alone, a replay's share (its
//!   inputs are registered: no copy). No algorithm can beat them on this machine, so they
//!   bound the speedups the targets ask for;
//! - `floor 1stage`, `floor 2stage` (f32, with the C loop): the same staged all-reduce
//!   across cores, doing the least it must and nothing else, in C (`src/peers/staged_floor.c`):
//!   copy in, flag barriers, sums (below 1 MiB with double buffers, so that no barrier
//!   closes a call).
//!   Unlike the floors above they move the data between cores and wait for peers, so they
//!   bound what a staged eager all-reduce can gain over `MPI_Allreduce` here;
//! - `MPI_Allreduce` (the peer; `--transport mpi`, f32 only): the plain MPI call
//!   ([`MpiWorld`]) on the same input;
//! - `C loop` (with the peer, where `mpicc` builds it): the same call from a C benchmark
//!   loop ([`CLoop`]: an `MPI_Barrier`, then the call timed in C) on the same buffers, the
//!   check in the same run that the peer costs what MPI costs a C program.
//!
//! Per size: every path is verified once on fresh data (exact small integers, so every
//! algorithm and element type must match the reference bit for bit), then the harness times
//! them interleaved. Each iteration is a barrier, an untimed 16-byte custom all-reduce that
//! lines the ranks up (its flag barrier spins; the local group's barrier wakes sleeping
//! threads, tens of microseconds apart on a busy machine), then one timed all-reduce.
//! `busbw = algbw * 2(n-1)/n` (nccl-tests' all-reduce factor).
//!
//! After each table: where eager two-stage becomes faster than one-stage (next to the
//! dispatcher's thresholds, `dispatch::STAGED_ONE_STAGE_MAX_BYTES` for eager calls and
//! `dispatch::ONE_STAGE_MAX_BYTES` for replays); under `mpirun`, the targets
//! against `MPI_Allreduce` (2 ranks, f32).

use clap::{Args, ValueEnum};
use serde::Serialize;
use tpcomm::allreduce::dispatch::{ONE_STAGE_MAX_BYTES, STAGED_ONE_STAGE_MAX_BYTES};
use tpcomm::allreduce::{Algorithm, CapturedPlan, Config, DType, Element, HostBackend};
use tpcomm::ipc::{HostBuffer, HostMemory, PeerMemory};
use tpcomm::Communicator;

use crate::data::elements::{check, expected, input, with_element};
use crate::engine::error::BenchError;
use crate::engine::launch::{Bench, RunArgs};
use crate::engine::lineup::{new_all_reduce, new_sync, time_synced, HostAllReduce};
use crate::engine::options::DTypeArg;
use crate::engine::row::{Bus, Row};
use crate::engine::session::Session;
use crate::engine::summary::{geomean, per_size};
use crate::engine::sweep::{format_bytes, short_bytes, SweepArgs};
use crate::engine::table::{col, Column};
use crate::engine::targets::{floor_bound, within, RatioLine, Target};
use crate::engine::timing::Spec;
use crate::peers::c_loop::{CLoop, StagedFloor};
use crate::peers::mpi_world::MpiWorld;

/// The peer's variant name.
const MPI: &str = "MPI_Allreduce";
/// The C loop's variant name.
const C_LOOP: &str = "C loop";
/// The peer (MPI's C API from Rust, timed as the C loop times it) is the C loop's within
/// this fraction.
const PEER_TOLERANCE: f64 = 0.05;
/// The memory-bandwidth floor's variant name.
const MEMCPY: &str = "memcpy";
/// The eager floor's variant name: copy in, then sum.
const FLOOR_EAGER: &str = "floor copy+sum";
/// The replay floor's variant name: the sum alone.
const FLOOR_SUM: &str = "floor sum";
/// The staged floors' variant names (one-stage, two-stage).
const FLOOR_STAGED: [&str; 2] = ["floor 1stage", "floor 2stage"];
/// The memory-bandwidth floor is quoted from sizes of at least this many bytes (caches
/// hold less).
const FLOOR_MIN_BYTES: usize = 8 << 20;
/// The targets (2 MPI ranks, f32): at least this much faster than `MPI_Allreduce` as a
/// geometric mean, eager and replayed...
const SPEEDUP_TARGETS: [(&str, &str, f64); 2] = [
    ("auto", "eager all_reduce", 2.0),
    ("replay", "captured plan replay", 3.0),
];
/// ...over these sizes...
const GEOMEAN_SIZES: (usize, usize) = (8 << 10, 8 << 20);
/// ...and at this size...
const SMALL_SIZE: usize = 1 << 10;
/// ...at most this factor slower...
const SMALL_RATIO_TARGET: f64 = 1.2;
/// ...the eager path never slower than `MPI_Allreduce` (at every size)...
const EAGER_EVERY_SIZE: f64 = 1.0;
/// ...and at [`FLOOR_MIN_BYTES`] at most this factor of the memory-bandwidth floor.
const MEMCPY_RATIO_TARGET: f64 = 2.0;
/// The summary calls the dispatcher's choice wrong at a size only when it is slower than
/// the other algorithm by more than this factor (medians closer than that are noise here).
const AUTO_MARGIN: f64 = 1.05;

/// Options of `tpcomm-bench allreduce`.
#[derive(Debug, Clone, Args, Serialize)]
#[command(mut_arg("min_bytes", |a| a.default_value("1KiB")))]
#[command(mut_arg("max_bytes", |a| a.default_value("8MiB")))]
pub(crate) struct AllReduceArgs {
    /// Ranks at most 8; with `--transport mpi`, `MPI_Allreduce` of the same f32 data is
    /// timed too.
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

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
    pub(crate) paths: Vec<Variant>,

    /// Sizes (here 1 KiB to 8 MiB by default, multiples of 16: the custom all-reduce moves
    /// 16-byte packs; the largest sizes the staging buffers).
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) sweep: SweepArgs,

    /// Write each rank's input again (the same values, untimed) before every timed
    /// iteration of every row, as a model's step leaves it: then what peers read is what
    /// another core has just written, for `MPI_Allreduce` and the C loop as for tpcomm.
    /// By default inputs stay as the previous call left them (a loop of the call on one
    /// buffer, what the targets are stated for).
    #[arg(long)]
    pub(crate) rewrite: bool,
}

/// What one row of a table times: a custom all-reduce path (`--paths`), or one of the two
/// rows the bench adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Variant {
    /// Eager, forced one-stage.
    #[value(name = "1stage")]
    OneStage,
    /// Eager, forced two-stage.
    #[value(name = "2stage")]
    TwoStage,
    /// Eager, the dispatcher's choice.
    Auto,
    /// A captured plan (registered graph buffers) replayed; the dispatcher's choice.
    Replay,
    /// One plain copy of the message on every rank at once: the memory-bandwidth floor.
    #[value(skip)]
    Memcpy,
    /// The eager floor: copy in, sum (f32).
    #[value(skip)]
    FloorEager,
    /// The replay floor: the sum (f32).
    #[value(skip)]
    FloorSum,
    /// The staged floor, one-stage, in C (f32 in MPI mode, with the C loop).
    #[value(skip)]
    FloorStaged1,
    /// The staged floor, two-stage, in C (f32 in MPI mode, with the C loop).
    #[value(skip)]
    FloorStaged2,
    /// `MPI_Allreduce`, the peer (f32 in MPI mode).
    #[value(skip)]
    Mpi,
    /// `MPI_Allreduce` from the C loop (with the peer, where `mpicc` builds it).
    #[value(skip)]
    CLoop,
}

/// What a variant runs from the C library (`peer_loop.c`, `staged_floor.c`).
#[derive(Debug, Clone, Copy)]
enum InC {
    /// The C loop's `MPI_Allreduce`.
    Loop,
    /// A staged floor.
    Floor(StagedFloor),
}

impl Variant {
    /// What this variant runs from the C library, if it runs there.
    fn in_c(self) -> Option<InC> {
        match self {
            Variant::CLoop => Some(InC::Loop),
            Variant::FloorStaged1 => Some(InC::Floor(StagedFloor::OneStage)),
            Variant::FloorStaged2 => Some(InC::Floor(StagedFloor::TwoStage)),
            _ => None,
        }
    }

    /// Whether the variant times its own call after an `MPI_Barrier`, as a C loop of an MPI
    /// call does ([`Runner::run_timed_by_itself`]): `MPI_Allreduce` and what runs in C.
    /// (Timed straight after the bench's spinning all-reduce instead, `MPI_Allreduce` took
    /// 6-13% longer than the C loop's at 1-4 KiB.)
    fn times_itself(self) -> bool {
        self == Variant::Mpi || self.in_c().is_some()
    }

    fn name(self) -> &'static str {
        match self {
            Variant::OneStage => "1stage",
            Variant::TwoStage => "2stage",
            Variant::Auto => "auto",
            Variant::Replay => "replay",
            Variant::Memcpy => MEMCPY,
            Variant::FloorEager => FLOOR_EAGER,
            Variant::FloorSum => FLOOR_SUM,
            Variant::FloorStaged1 => FLOOR_STAGED[0],
            Variant::FloorStaged2 => FLOOR_STAGED[1],
            Variant::Mpi => MPI,
            Variant::CLoop => C_LOOP,
        }
    }
}

/// The floors' buffers on one rank: one page-aligned window per rank (this rank's staging
/// buffer first, then one per peer), carved from one vector.
struct Floor {
    buf: Vec<f32>,
    /// Elements before the first window (its page alignment).
    start: usize,
    /// Elements from one window to the next (a whole number of pages).
    stride: usize,
    count: usize,
    ranks: usize,
}

impl Floor {
    const PAGE: usize = 4096;

    fn new(count: usize, ranks: usize) -> Self {
        let page = Self::PAGE / 4;
        let stride = count.next_multiple_of(page);
        let buf = vec![0f32; stride * ranks + page];
        let misaligned = (buf.as_ptr() as usize % Self::PAGE) / 4;
        let start = (page - misaligned) % page;
        Self {
            buf,
            start,
            stride,
            count,
            ranks,
        }
    }

    /// The staging window and the peers' windows.
    fn windows(&mut self) -> (&mut [f32], Vec<&[f32]>) {
        let (count, stride) = (self.count, self.stride);
        let all = &mut self.buf[self.start..self.start + stride * self.ranks];
        let (own, peers) = all.split_at_mut(stride);
        let peers = peers.chunks(stride).map(|w| &w[..count]).collect();
        (&mut own[..count], peers)
    }

    /// This rank's input in its staging window and the peers' inputs in theirs, as the
    /// all-reduce's staging buffers would hold them.
    fn fill(&mut self, rank: usize, salt: u64) {
        let (count, stride, start) = (self.count, self.stride, self.start);
        for r in 0..self.ranks {
            let window = (r + self.ranks - rank) % self.ranks;
            let at = start + window * stride;
            self.buf[at..at + count].copy_from_slice(&input::<f32>(r, count, salt));
        }
    }

    /// `copy`: the parts of the input that peers read (all but the first n-th) into the
    /// staging window first, and the first n-th read from `input` itself, as an eager
    /// two-stage call does; then the sum of every window into `out`.
    fn run(&mut self, copy: bool, input: &[f32], out: &mut [f32]) {
        let private = if copy { self.count / self.ranks } else { 0 };
        let (own, peers) = self.windows();
        if copy {
            own[private..].copy_from_slice(&input[private..]);
        }
        let (head, tail) = out.split_at_mut(private);
        let peer_head = peers.iter().map(|p| &p[..private]);
        Self::sum(head, &input[..private], peer_head);
        Self::sum(tail, &own[private..], peers.iter().map(|p| &p[private..]));
    }

    /// `out = own + every peer`.
    fn sum<'a>(out: &mut [f32], own: &[f32], mut peers: impl Iterator<Item = &'a [f32]>) {
        match peers.next() {
            Some(first) => out
                .iter_mut()
                .zip(own.iter().zip(first))
                .for_each(|(o, (a, b))| *o = a + b),
            None => out.copy_from_slice(own),
        }
        for peer in peers {
            out.iter_mut().zip(peer).for_each(|(o, b)| *o += b);
        }
    }
}

impl Serialize for Variant {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

fn columns(with_mpi: bool) -> Vec<Column> {
    let mut c = vec![
        col::size(10),
        Column::new("count", "(elements)", 10, |r, _| r.text("count")),
        Column::new("type", "", 5, |r, _| r.text("type")),
        Column::new("algorithm", "", 15, |r, _| match r.text("algorithm") {
            a if a != r.variant && a != "-" => format!("{} ({a})", r.variant),
            _ => r.variant.clone(),
        }),
        col::iters(),
        col::time::<2>("time", 10),
        col::min::<2>(10),
        col::algbw(7),
        col::busbw(7),
    ];
    c.push(Column::new("vs copy", "t/memcpy", 9, |r, _| {
        col::ratio(r.number("vs_memcpy"))
    }));
    if with_mpi {
        c.push(col::vs_peer("vs MPI", "cust/MPI", 8));
    }
    c
}

/// Stores every element of `values` again, unchanged (`black_box` keeps the stores).
fn rewrite_in_place<T: Copy>(values: &mut [T]) {
    for v in values {
        *v = std::hint::black_box(*v);
    }
}

/// One captured plan per (element type, size), replayed by the `replay` rows, and the
/// peer-memory buffers they read and write.
struct Replay<'b> {
    memory: HostMemory,
    input: &'b HostBuffer,
    output: &'b HostBuffer,
    /// Per element type of `--dtypes`, per size: the plan and the algorithm it recorded.
    plans: Vec<(CapturedPlan<'b, HostBackend>, Algorithm)>,
}

/// What a rank runs the variants with.
struct Runner<'r, 'b> {
    /// The instances of one-stage, two-stage and auto (also replay's).
    instances: [Option<HostAllReduce>; 3],
    replay: Option<Replay<'b>>,
    mpi: Option<&'r MpiWorld>,
    c_loop: Option<&'r CLoop>,
}

/// The buffers of one size and element type on one rank (`MPI_Allreduce`, f32 only, uses
/// the same).
struct Case<T> {
    input: Vec<T>,
    output: Vec<T>,
    /// The memcpy variant's destination.
    copy: Vec<T>,
    /// The floors' buffers (f32 tables only).
    floor: Option<Floor>,
    /// The index of the replayed plan in [`Replay::plans`].
    plan: usize,
}

impl<T: Element> Case<T> {
    /// `what` from the C library, of the input into the output (f32 tables only), timed in
    /// C with `timed` (see [`CLoop::all_reduce_sum`], [`CLoop::staged_floor`]).
    fn in_c(&mut self, what: InC, c_loop: &CLoop, timed: bool) -> Result<u64, BenchError> {
        let input = bytemuck::cast_slice(&self.input);
        let output = bytemuck::cast_slice_mut(&mut self.output);
        match what {
            InC::Loop => c_loop.all_reduce_sum(input, output, timed),
            InC::Floor(floor) => c_loop.staged_floor(floor, input, output, timed),
        }
    }
}

impl Runner<'_, '_> {
    /// Runs `variant` once; returns the algorithm it used.
    fn run<T: Element>(
        &mut self,
        variant: Variant,
        case: &mut Case<T>,
    ) -> Result<Option<Algorithm>, BenchError> {
        let missing = || BenchError::Usage(format!("nothing runs {}", variant.name()));
        if let Some(what) = variant.in_c() {
            case.in_c(what, self.c_loop.ok_or_else(missing)?, false)?;
            return Ok(None);
        }
        let slot = match variant {
            Variant::OneStage => 0,
            Variant::TwoStage => 1,
            _ => 2,
        };
        match variant {
            Variant::Replay => {
                let (plan, algorithm) = &self.replay.as_ref().ok_or_else(missing)?.plans[case.plan];
                plan.replay(self.instances[2].as_mut().ok_or_else(missing)?)?;
                Ok(Some(*algorithm))
            }
            Variant::Memcpy => {
                case.copy.copy_from_slice(&case.input);
                Ok(None)
            }
            Variant::FloorEager | Variant::FloorSum => {
                let floor = case.floor.as_mut().ok_or_else(missing)?;
                floor.run(
                    variant == Variant::FloorEager,
                    bytemuck::cast_slice(&case.input),
                    bytemuck::cast_slice_mut(&mut case.output),
                );
                Ok(None)
            }
            Variant::Mpi => {
                let (input, output) = (&case.input, &mut case.output);
                let mpi = self.mpi.ok_or_else(missing)?;
                mpi.all_reduce_sum(
                    bytemuck::cast_slice(input),
                    bytemuck::cast_slice_mut(output),
                    false,
                )?;
                Ok(None)
            }
            _ => {
                let ar = self.instances[slot].as_mut().ok_or_else(missing)?;
                Ok(Some(ar.all_reduce(&case.input, &mut case.output)?))
            }
        }
    }

    /// Runs `variant` (one that [`Variant::times_itself`]) as a C benchmark loop runs its
    /// call: an `MPI_Barrier`, then the call between two clock reads; its nanoseconds.
    fn run_timed_by_itself<T: Element>(
        &self,
        variant: Variant,
        case: &mut Case<T>,
    ) -> Result<u64, BenchError> {
        let missing = || BenchError::Usage(format!("nothing runs {}", variant.name()));
        match variant.in_c() {
            Some(what) => case.in_c(what, self.c_loop.ok_or_else(missing)?, true),
            None => self.mpi.ok_or_else(missing)?.all_reduce_sum(
                bytemuck::cast_slice(&case.input),
                bytemuck::cast_slice_mut(&mut case.output),
                true,
            ),
        }
    }

    /// `--rewrite`: writes this rank's input for `variant` again, with the values it holds,
    /// so that its lines are freshly written by this core.
    fn rewrite<T: Element>(&self, variant: Variant, case: &mut Case<T>) -> Result<(), BenchError> {
        match (variant, &self.replay) {
            (Variant::Replay, Some(r)) => {
                let mut raw = vec![0u8; std::mem::size_of_val(case.input.as_slice())];
                r.memory.read(r.input, 0, &mut raw)?;
                r.memory.write(r.input, 0, &raw)?;
            }
            _ => rewrite_in_place(&mut case.input),
        }
        Ok(())
    }

    /// Runs `variant` on fresh data; the algorithm it used and what is wrong, if anything.
    fn verify<T: Element>(
        &mut self,
        (rank, ranks): (usize, usize),
        variant: Variant,
        case: &mut Case<T>,
        salt: u64,
    ) -> Result<(Option<Algorithm>, Option<String>), BenchError> {
        let count = case.input.len();
        case.input = input(rank, count, salt);
        case.output.fill(T::from_f32(f32::NAN));
        case.copy.fill(T::from_f32(f32::NAN));
        if let (Variant::FloorEager | Variant::FloorSum, Some(floor)) = (variant, &mut case.floor) {
            floor.fill(rank, salt);
        }
        let replayed = variant == Variant::Replay;
        if let (true, Some(r)) = (replayed, &self.replay) {
            r.memory
                .write(r.input, 0, bytemuck::cast_slice(&case.input))?;
            r.memory
                .write(r.output, 0, bytemuck::cast_slice(&case.output))?;
        }
        let algorithm = self.run(variant, case)?;
        if let (true, Some(r)) = (replayed, &self.replay) {
            r.memory
                .read(r.output, 0, bytemuck::cast_slice_mut(&mut case.output))?;
        }
        let problem = match variant {
            Variant::Memcpy => (bytemuck::cast_slice::<T, u8>(&case.copy)
                != bytemuck::cast_slice::<T, u8>(&case.input))
            .then(|| "the copy differs from its source".to_string()),
            _ => check(&case.output, &expected(ranks, count, salt)),
        };
        Ok((algorithm, problem))
    }

    /// Verifies and times every variant at every size for `T`, the element type of table
    /// `dtype_index`, each iteration lined up by `sync`; rank 0 prints.
    fn bench<T: Element, C: Communicator>(
        &mut self,
        s: &mut Session<'_>,
        comm: &C,
        args: &AllReduceArgs,
        dtype_index: usize,
        sync: &mut HostAllReduce,
    ) -> Result<(), BenchError> {
        let (rank, ranks) = (comm.rank(), comm.size());
        let name = T::DTYPE.name();
        let with_mpi = self.mpi.is_some() && T::DTYPE == DType::F32;
        let columns = columns(with_mpi);
        s.header(
            &format!(
                "all_reduce sum, {name}, {ranks} ranks: size = bytes per rank; busbw = algbw * \
                 2(n-1)/n"
            ),
            &columns,
        );
        let mut variants = args.paths.clone();
        variants.push(Variant::Memcpy);
        let floors = T::DTYPE == DType::F32;
        if floors {
            variants.extend([Variant::FloorEager, Variant::FloorSum]);
        }
        if with_mpi {
            variants.push(Variant::Mpi);
            if self.c_loop.is_some() {
                variants.extend([Variant::FloorStaged1, Variant::FloorStaged2, Variant::CLoop]);
            }
        }
        let names: Vec<&str> = variants.iter().map(|v| v.name()).collect();
        let sizes = args.sweep.sizes();
        for (size_index, &bytes) in sizes.iter().enumerate() {
            let count = bytes / T::DTYPE.size();
            let zeros = || vec![T::from_f32(0.0); count];
            let mut case = Case {
                input: zeros(),
                output: zeros(),
                copy: zeros(),
                floor: floors.then(|| Floor::new(count, ranks)),
                plan: dtype_index * sizes.len() + size_index,
            };
            let spec = Spec {
                peer: with_mpi.then_some(MPI),
                bus: Some(Bus::AllReduce),
                ..Spec::new(name, bytes.to_string(), bytes, &names)
                    .with("count", count)
                    .with("type", name)
            };
            let salt = ((dtype_index as u64) << 40) ^ ((size_index as u64) << 20) ^ 0x5eed;
            let mut algorithms = Vec::with_capacity(variants.len());
            s.verify(comm, &spec, &mut case, |case, k| {
                let salt = salt ^ ((k as u64) << 56);
                let (algorithm, problem) = self.verify((rank, ranks), variants[k], case, salt)?;
                algorithms.push(algorithm);
                Ok(problem)
            })?;
            let rows = s.measure(comm, &spec, &mut case, |case, k| {
                if args.rewrite {
                    self.rewrite(variants[k], case)?;
                }
                let variant = variants[k];
                if !variant.times_itself() {
                    return time_synced(comm, sync, || self.run(variant, case).map(drop));
                }
                let mut ns = 0;
                time_synced(comm, sync, || {
                    ns = self.run_timed_by_itself(variant, case)?;
                    Ok(())
                })?;
                Ok(ns)
            })?;
            let copy = rows
                .iter()
                .find(|r| r.is(MEMCPY))
                .map(|r| r.stats.median_us);
            let rows = rows
                .into_iter()
                .zip(&algorithms)
                .map(|(row, a)| {
                    let vs_copy = copy.filter(|&c| c > 0.0 && !row.is(MEMCPY));
                    let vs_copy = vs_copy.map(|c| row.stats.median_us / c);
                    row.with("algorithm", a.map(Algorithm::name))
                        .with("vs_memcpy", vs_copy)
                })
                .collect();
            s.rows(&columns, rows, |_| true);
        }
        match (with_mpi, self.c_loop) {
            // Every rank ran the staged floors of this table: their window goes together.
            (true, Some(c_loop)) => c_loop.release_staged_floors(),
            _ => Ok(()),
        }
    }
}

impl Bench for AllReduceArgs {
    const NAME: &'static str = "allreduce";
    const STATED_FOR: &'static str = "2 MPI ranks (mpirun -np 2 ... --transport mpi), inputs \
        unchanged between calls (no --rewrite): they compare with a loop of MPI_Allreduce";

    fn run_args(&self) -> &RunArgs {
        &self.run
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.sweep.validate()?;
        self.run.at_most(8)?;
        if !self.sweep.min_bytes.is_multiple_of(16) {
            return Err(BenchError::Usage(format!(
                "--min-bytes ({}) must be a multiple of 16 bytes: the custom all-reduce moves \
                 16-byte packs",
                self.sweep.min_bytes
            )));
        }
        if self.dtypes.is_empty() || self.paths.is_empty() {
            return Err(BenchError::Usage(
                "--dtypes and --paths need at least one value".into(),
            ));
        }
        Ok(())
    }

    fn preamble(&self, mpi: bool) -> Vec<String> {
        let mut lines = vec![
            format!(
                "tpcomm-allreduce host backend (shared memory); {}",
                self.sweep.describe()
            ),
            "time: median over iterations of the slowest rank; before each iteration a barrier, \
             then an untimed 16-byte custom all-reduce (spinning flags) to line the ranks up"
                .into(),
            "1stage / 2stage: eager all_reduce (slice in, slice out), algorithm forced by \
             Config.algorithm; auto: the dispatcher's choice (in parentheses)"
                .into(),
        ];
        if self.paths.contains(&Variant::Replay) {
            lines.push(
                "replay: a captured plan replayed (input and output in registered peer memory, \
                 no staging copy), the dispatcher's choice"
                    .into(),
            );
        }
        lines.push(
            "memcpy: one plain copy of the message (its size, per rank, every rank at once), \
             timed like the paths: the memory-bandwidth floor; vs copy = median / memcpy median"
                .into(),
        );
        if self.dtypes.contains(&DTypeArg::F32) {
            lines.push(
                "floor copy+sum / floor sum (f32): every rank copies the parts of its input \
                 that peers read ((n-1)/n of it) into a page-aligned buffer and sums its input \
                 with one buffer per peer into the output, or only sums: the least data movement of an eager all-reduce of unregistered \
                 buffers and of a replay, with no synchronisation (no algorithm beats them here)"
                    .into(),
            );
        }
        if mpi {
            lines.push(
                "MPI_Allreduce: the plain MPI call (MPI's C API, sum, on MPI_COMM_WORLD), \
                 the same f32 data, timed as the C loop times it (MPI_Barrier, then the call); \
                 vs MPI = custom median / MPI median (below 1 = faster)"
                    .into(),
            );
            lines.push(
                "C loop: the same MPI_Allreduce from a C benchmark loop (src/peers/peer_loop.c built \
                 with mpicc -O2: MPI_Barrier, then the call timed with CLOCK_MONOTONIC) on the \
                 same buffers, where mpicc builds it: what the call costs a C program now"
                    .into(),
            );
            lines.push(
                "floor 1stage / floor 2stage (f32, with the C loop): a staged all-reduce doing \
                 only what it must, in C (src/peers/staged_floor.c, timed like the C loop): copy in, \
                 flag barriers, sums between cores (below 1 MiB double buffers: no barrier closes \
                 a call); the eager targets quote the faster of the two at each size as their \
                 bound"
                    .into(),
            );
        }
        if self.rewrite {
            lines.push(
                "--rewrite: before every timed iteration each rank writes its input again \
                 (untimed; the registered input for replay), so peers read lines another core \
                 has just written; the floors' peer buffers stay local"
                    .into(),
            );
        }
        lines.push("every path verified once per size (exact integer data) before timing".into());
        lines
    }

    fn targets(&self) -> Vec<Target> {
        targets()
    }

    fn judged(&self) -> bool {
        !self.rewrite
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        let mpi = MpiWorld::for_run(s.info);
        let sizes = self.sweep.sizes();
        let max_bytes = sizes.last().copied().unwrap_or(self.sweep.max_bytes);
        let wants = |p: &[Variant]| p.iter().any(|x| self.paths.contains(x));
        let build = |wanted: bool, algorithm| -> Result<Option<HostAllReduce>, BenchError> {
            let config = Config {
                max_bytes,
                algorithm,
                ..Config::default()
            };
            wanted.then(|| new_all_reduce(comm, config)).transpose()
        };
        let mut instances = [
            build(wants(&[Variant::OneStage]), Some(Algorithm::OneStage))?,
            build(wants(&[Variant::TwoStage]), Some(Algorithm::TwoStage))?,
            build(wants(&[Variant::Auto, Variant::Replay]), None)?,
        ];
        // Replay: one plan per (element type, size), captured up front on the auto
        // instance, registered in one collective call.
        let memory = match &instances[2] {
            Some(ar) if wants(&[Variant::Replay]) => Some(ar.memory()?.clone()),
            _ => None,
        };
        let buffers = match &memory {
            Some(m) => Some((m.allocate(max_bytes)?, m.allocate(max_bytes)?)),
            None => None,
        };
        let replay = match (memory, &buffers, &mut instances[2]) {
            (Some(memory), Some((input, output)), Some(ar)) => {
                let mut plans = Vec::with_capacity(self.dtypes.len() * sizes.len());
                for dtype in self.dtypes.iter().map(|d| d.dtype()) {
                    for &bytes in &sizes {
                        let mut algorithm = None;
                        let plan = ar.capture(|cap| {
                            let count = bytes / dtype.size();
                            algorithm = Some(cap.all_reduce(input, output, dtype, count)?);
                            Ok(())
                        })?;
                        let recorded = || BenchError::Usage("the capture recorded nothing".into());
                        plans.push((plan, algorithm.ok_or_else(recorded)?));
                    }
                }
                ar.register_graph_buffers(comm)?;
                Some(Replay {
                    memory,
                    input,
                    output,
                    plans,
                })
            }
            _ => None,
        };
        let c_loop = match mpi {
            Some(_) => load_c_loop(comm, s)?,
            None => None,
        };
        let mut runner = Runner {
            instances,
            replay,
            mpi: mpi.as_ref(),
            c_loop: c_loop.as_ref(),
        };
        let mut sync = new_sync(comm)?;
        s.progress.plan(self.dtypes.len() * sizes.len());
        for (di, &d) in self.dtypes.iter().enumerate() {
            with_element!(d.dtype(), T => runner.bench::<T, C>(s, comm, self, di, &mut sync))?;
            summarize(s, d.dtype().name(), comm.size());
        }
        Ok(())
    }
}

/// Collective: the C loop, when every rank built and loaded it (otherwise a note says why
/// the row is left out).
fn load_c_loop<C: Communicator>(comm: &C, s: &Session<'_>) -> Result<Option<CLoop>, BenchError> {
    let loaded = CLoop::load();
    let mut all = vec![0u8; comm.size()];
    comm.all_gather(&[u8::from(loaded.is_ok())], &mut all)?;
    match (loaded, all.iter().position(|&ok| ok == 0)) {
        (Ok(c_loop), None) => Ok(Some(c_loop)),
        (Err(e), _) => {
            s.note(&format!("C loop row left out: {e}"));
            Ok(None)
        }
        (Ok(_), Some(rank)) => {
            s.note(&format!(
                "C loop row left out: rank {rank} could not build it"
            ));
            Ok(None)
        }
    }
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

/// The closing lines of one element type's table: the crossover of the two algorithms
/// against the dispatcher's threshold, and whether `auto` ran the faster one.
fn summarize(s: &mut Session<'_>, dtype: &str, ranks: usize) {
    let rows: Vec<Row> = s
        .kept()
        .iter()
        .filter(|r| r.table == dtype)
        .cloned()
        .collect();
    let median_of = |path: &str, bytes: usize| {
        rows.iter()
            .find(|r| r.is(path) && r.bytes == bytes)
            .map(|r| r.stats.median_us)
    };
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.bytes).collect();
    sizes.dedup();
    let points: Vec<(usize, f64, f64)> = sizes
        .iter()
        .filter_map(|&b| Some((b, median_of("1stage", b)?, median_of("2stage", b)?)))
        .collect();
    s.note("");
    if let Some(line) = floor_line(dtype, &rows) {
        s.summary(line);
    }
    if points.is_empty() {
        return;
    }
    let two = rows.iter().filter(|r| r.is("2stage"));
    let (ratios, _) = per_size(
        two,
        |r| Some(r.stats.median_us / median_of("1stage", r.bytes)?),
        2,
    );
    s.summary(format!("{dtype}: 2stage/1stage time per size: {ratios}"));
    let measured = match crossover(&points) {
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
    let threshold = |table: &[usize]| match table.get(ranks).copied() {
        Some(usize::MAX) => "one-stage at every size".to_string(),
        Some(t) => format!("one-stage up to {}, two-stage above", format_bytes(t)),
        None => "no threshold for this world size".to_string(),
    };
    s.summary(format!(
        "{dtype} crossover, {ranks} ranks: measured {measured}; dispatcher for eager calls \
         (STAGED_ONE_STAGE_MAX_BYTES[{ranks}]): {}; for registered inputs and replays \
         (ONE_STAGE_MAX_BYTES[{ranks}]): {}",
        threshold(&STAGED_ONE_STAGE_MAX_BYTES),
        threshold(&ONE_STAGE_MAX_BYTES)
    ));
    let auto_wrong: Vec<String> = points
        .iter()
        .filter(|&&(b, one, two)| {
            match rows
                .iter()
                .find(|r| r.is("auto") && r.bytes == b)
                .map(|r| r.text("algorithm"))
                .as_deref()
            {
                Some("1stage") => two * AUTO_MARGIN < one,
                Some("2stage") => one * AUTO_MARGIN < two,
                _ => false,
            }
        })
        .map(|&(b, _, _)| short_bytes(b))
        .collect();
    if rows.iter().any(|r| r.is("auto")) {
        let margin = (AUTO_MARGIN - 1.0) * 100.0;
        s.summary(if auto_wrong.is_empty() {
            format!(
                "{dtype}: auto ran the faster algorithm (or one within {margin:.0}%) at every size"
            )
        } else {
            format!(
                "{dtype}: auto ran an algorithm more than {margin:.0}% slower than the other at {}",
                auto_wrong.join(", ")
            )
        });
    }
}

/// The memory-bandwidth floor of one table: memcpy at its largest size, which must be at
/// least [`FLOOR_MIN_BYTES`] (smaller copies stay in caches), and every path's time over it
/// there.
fn floor_line(dtype: &str, rows: &[Row]) -> Option<String> {
    let copy = rows
        .iter()
        .filter(|r| r.is(MEMCPY))
        .max_by_key(|r| r.bytes)?;
    let size = format_bytes(copy.bytes);
    if copy.bytes < FLOOR_MIN_BYTES {
        return Some(format!(
            "{dtype}: memory-bandwidth floor not quoted: the largest size ({size}) is below {} \
             and stays in caches; give --max-bytes 8MiB or more",
            format_bytes(FLOOR_MIN_BYTES)
        ));
    }
    let paths: Vec<String> = rows
        .iter()
        .filter(|r| r.bytes == copy.bytes && !r.is(MEMCPY))
        .filter_map(|r| Some(format!("{} {:.2}x", r.variant, r.number("vs_memcpy")?)))
        .collect();
    Some(format!(
        "{dtype}: memory-bandwidth floor: memcpy of {size} per rank, every rank at once, {:.1} us \
         ({:.2} GB/s per rank); time / memcpy at {size}: {}",
        copy.stats.median_us,
        copy.algbw_gbps.unwrap_or(0.0),
        paths.join(", ")
    ))
}

/// The geometric mean over [`GEOMEAN_SIZES`] of how much faster than `MPI_Allreduce` the
/// f32 rows of `variant` are.
fn speedup(rows: &[Row], variant: &str) -> Option<f64> {
    let s: Vec<f64> = rows
        .iter()
        .filter(|r| r.table == "f32" && r.is(variant))
        .filter(|r| (GEOMEAN_SIZES.0..=GEOMEAN_SIZES.1).contains(&r.bytes))
        .filter_map(|r| r.vs_peer.filter(|&x| x > 0.0).map(|x| 1.0 / x))
        .collect();
    geomean(&s)
}

/// The geometric mean over [`GEOMEAN_SIZES`] of the speedup over `MPI_Allreduce` of the
/// fastest of `variants` at each size (f32; sizes where none of them ran are left out).
fn best_speedup(rows: &[Row], variants: &[&str]) -> Option<f64> {
    let mut best = std::collections::BTreeMap::<usize, f64>::new();
    for r in rows.iter().filter(|r| r.table == "f32") {
        let sized = (GEOMEAN_SIZES.0..=GEOMEAN_SIZES.1).contains(&r.bytes);
        let x = r.vs_peer.filter(|&x| x > 0.0);
        if let (true, true, Some(x)) = (sized, variants.iter().any(|v| r.is(v)), x) {
            let e = best.entry(r.bytes).or_insert(0.0);
            *e = e.max(1.0 / x);
        }
    }
    geomean(&best.into_values().collect::<Vec<_>>())
}

/// What a floor row allows a target: "; the floor bounds it at X" (out of reach when below
/// `target`, with `better` telling which side of it is good).
fn bound(floor: &str, value: Option<f64>, target: f64, better: fn(f64, f64) -> bool) -> String {
    value.map_or_else(String::new, |v| {
        floor_bound(
            &format!("`{floor}`"),
            &format!("it at {v:.3}x"),
            better(v, target),
            "",
        )
    })
}

/// The targets against `MPI_Allreduce`, judged on the `auto` rows (the eager all-reduce as
/// callers run it) and, separately, on the `replay` rows (a captured plan); and the eager
/// path against the memory-bandwidth floor. Each verdict quotes what the data-movement
/// floors (`floor copy+sum` for the eager path, `floor sum` for a replay) allow.
fn targets() -> Vec<Target> {
    let span = format!(
        "{}..{}",
        format_bytes(GEOMEAN_SIZES.0),
        format_bytes(GEOMEAN_SIZES.1)
    );
    let more = |v: f64, t: f64| v >= t;
    let mut out = Vec::new();
    for (path, what, target) in SPEEDUP_TARGETS {
        let floor = if path == "auto" {
            FLOOR_EAGER
        } else {
            FLOOR_SUM
        };
        out.push(Target {
            what: format!(
                "{path} ({what}), f32: at least {target}x faster than MPI_Allreduce, \
                 geometric mean over {span} (2 ranks)"
            ),
            why: "a custom all-reduce inside a node is only worth its peer memory and its \
                  lifecycle if it clearly beats the MPI library on the sizes of inference",
            line: RatioLine::new(MPI, 1.0 / target),
            judge: Box::new(move |rows: &[Row]| {
                let g = speedup(rows, path)?;
                let mut detail = format!("geomean speedup over MPI_Allreduce {g:.3}x");
                let forced: Vec<String> = ["1stage", "2stage"]
                    .iter()
                    .filter(|_| path == "auto")
                    .filter_map(|p| speedup(rows, p).map(|g| format!("{p} {g:.3}x")))
                    .collect();
                if !forced.is_empty() {
                    detail.push_str(&format!(" (forced: {})", forced.join(", ")));
                }
                detail.push_str(&bound(floor, speedup(rows, floor), target, more));
                if path == "auto" {
                    let staged = best_speedup(rows, &FLOOR_STAGED);
                    let name = "floor 1stage|2stage";
                    detail.push_str(&bound(name, staged, target, more));
                }
                Some((g >= target, detail))
            }),
        });
        out.push(Target {
            what: format!(
                "{path} ({what}), f32: within {SMALL_RATIO_TARGET}x of MPI_Allreduce at {} \
                 (2 ranks)",
                format_bytes(SMALL_SIZE)
            ),
            why: "small all-reduces are latency-bound; the custom path must not lose there what \
                  it gains on larger sizes",
            line: None,
            judge: within(
                move |r| r.table == "f32" && r.is(path) && r.bytes == SMALL_SIZE,
                |x| x,
                SMALL_RATIO_TARGET,
            ),
        });
    }
    out.push(Target {
        what: format!(
            "the peer, f32: MPI_Allreduce timed in the run within {:.0}% of the C loop's, at \
             every size (2 ranks)",
            PEER_TOLERANCE * 100.0
        ),
        why: "the targets above compare with the peer: it must cost what the call costs a C \
              program calling it in a loop at the same moment, no more",
        line: None,
        judge: within(
            |r| r.table == "f32" && r.is(C_LOOP),
            |x| (1.0 / x - 1.0).abs(),
            PEER_TOLERANCE,
        ),
    });
    out.push(Target {
        what: "auto (eager all_reduce), f32: never slower than MPI_Allreduce, at every size \
               (2 ranks)"
            .into(),
        why: "a caller should not have to choose the library per message size",
        line: RatioLine::new(MPI, EAGER_EVERY_SIZE),
        judge: within(
            |r| r.table == "f32" && r.is("auto"),
            |x| x,
            EAGER_EVERY_SIZE,
        ),
    });
    out.push(Target {
        what: format!(
            "auto (eager all_reduce), f32: at most {MEMCPY_RATIO_TARGET}x the time of one memcpy \
             of the message at {} (2 ranks)",
            format_bytes(FLOOR_MIN_BYTES)
        ),
        why: "large all-reduces are bound by memory bandwidth: the eager path should cost about \
              as much memory traffic as the copies it cannot avoid",
        line: None,
        judge: Box::new(|rows: &[Row]| {
            let at = |variant: &str| {
                rows.iter()
                    .filter(|r| r.table == "f32" && r.is(variant))
                    .filter(|r| r.bytes >= FLOOR_MIN_BYTES)
                    .max_by_key(|r| r.bytes)
                    .and_then(|r| r.number("vs_memcpy"))
            };
            let x = at("auto")?;
            let less = |v: f64, t: f64| v <= t;
            let staged = FLOOR_STAGED.iter().filter_map(|f| at(f)).reduce(f64::min);
            let detail = format!(
                "auto / memcpy {x:.3}x{}{}",
                bound(FLOOR_EAGER, at(FLOOR_EAGER), MEMCPY_RATIO_TARGET, less),
                bound("floor 1stage|2stage", staged, MEMCPY_RATIO_TARGET, less)
            );
            Some((x <= MEMCPY_RATIO_TARGET, detail))
        }),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::elements::input_value;
    use crate::engine::targets::judge;

    #[test]
    fn defaults_are_f32_every_path_1_kib_to_8_mib_locally() {
        let args = parse!(AllReduce, ["allreduce"]);
        assert_eq!(args.dtypes, vec![DTypeArg::F32]);
        assert_eq!(args.paths.len(), 4);
        assert_eq!(args.sweep.sizes().len(), 14);
        assert!(args.validate().is_ok());
        let nine = parse!(AllReduce, ["allreduce", "--ranks", "9"]);
        assert!(nine.validate().is_err());
    }

    #[test]
    fn rewrite_keeps_the_values_and_makes_the_verdicts_indicative() {
        let mut values = input::<f32>(1, 1000, 7);
        let before = values.clone();
        rewrite_in_place(&mut values);
        assert_eq!(values, before);
        assert!(parse!(AllReduce, ["allreduce"]).judged());
        assert!(!parse!(AllReduce, ["allreduce", "--rewrite"]).judged());
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
        assert_eq!(crossover(&[p(1, 1.0, 2.0)]), (None, None));
    }

    #[test]
    fn the_floor_line_quotes_memcpy_at_8_mib_or_says_why_not() {
        let row = |path, bytes: usize, us| {
            Row::of_us("f32", &bytes.to_string(), path, us).bus(Bus::AllReduce, 2)
        };
        let big = 8 << 20;
        let rows = [
            row(MEMCPY, 1 << 20, 50.0),
            row(MEMCPY, big, 1000.0),
            row("auto", big, 2500.0).with("vs_memcpy", 2.5),
        ];
        let line = floor_line("f32", &rows).unwrap();
        assert!(line.contains("memcpy of 8 MiB"), "{line}");
        assert!(
            line.contains("8.39 GB/s") && line.ends_with("auto 2.50x"),
            "{line}"
        );
        let small = floor_line("f32", &rows[..1]).unwrap();
        assert!(small.contains("not quoted"), "{small}");
        assert_eq!(floor_line("f32", &rows[2..]), None);
    }

    #[test]
    fn targets_use_auto_against_mpi_and_quote_the_floors() {
        let row = |path, bytes: usize, vs| Row::of_us("f32", &bytes.to_string(), path, 1.0).vs(vs);
        let rows = [
            row("auto", 1 << 10, 1.1),
            row("auto", 8 << 10, 0.4),
            row("auto", 16 << 10, 0.5),
            row(FLOOR_EAGER, 8 << 10, 0.25),
            row(FLOOR_EAGER, 16 << 10, 0.3),
        ];
        let v = judge(&targets(), &rows);
        let find = |start: &str| v.iter().find(|v| v.target.starts_with(start)).unwrap();
        // sqrt(2.5 * 2) = 2.24 >= 2; the floor allows sqrt(4 * 3.33) = 3.65.
        let geomean = find("auto (eager all_reduce), f32: at least 2x");
        assert!(geomean.met, "{v:?}");
        assert!(
            geomean.detail.contains("bounds it at 3.651x")
                && !geomean.detail.contains("out of reach")
        );
        assert!(find("auto (eager all_reduce), f32: within 1.2x").met);
        assert!(!find("auto (eager all_reduce), f32: never slower").met);
        assert_eq!(v.len(), 3, "no replay rows, no memcpy ratios: {v:?}");
        let slower = [row("auto", 8 << 10, 0.9), row(FLOOR_EAGER, 8 << 10, 0.6)];
        let missed = judge(&targets(), &slower);
        assert!(
            !missed[0].met && missed[0].detail.contains("out of reach"),
            "{missed:?}"
        );
    }

    #[test]
    fn the_staged_floors_bound_the_eager_target_with_the_faster_of_the_two_at_each_size() {
        let row = |path, bytes: usize, vs| Row::of_us("f32", &bytes.to_string(), path, 1.0).vs(vs);
        let [one, two] = FLOOR_STAGED;
        let rows = [
            row("auto", 8 << 10, 0.5),
            row("auto", 16 << 10, 0.8),
            // 8 KiB: one-stage is the faster floor (1/0.4 = 2.5x), 16 KiB two-stage (1/0.5).
            row(one, 8 << 10, 0.4),
            row(two, 8 << 10, 0.8),
            row(one, 16 << 10, 0.9),
            row(two, 16 << 10, 0.5),
            // Outside the geomean's sizes: ignored.
            row(one, 1 << 10, 0.01),
        ];
        assert!((best_speedup(&rows, &FLOOR_STAGED).unwrap() - 5f64.sqrt()).abs() < 1e-9);
        let v = judge(&targets(), &rows);
        let eager = v
            .iter()
            .find(|v| {
                v.target
                    .starts_with("auto (eager all_reduce), f32: at least 2x")
            })
            .unwrap();
        // sqrt(2 * 1.25) = 1.58 < 2; the staged floors allow sqrt(2.5 * 2) = 2.24.
        assert!(!eager.met);
        assert!(
            eager
                .detail
                .contains("`floor 1stage|2stage` bounds it at 2.236x")
                && !eager.detail.contains("out of reach"),
            "{eager:?}"
        );
        // Both floors at 0.6x of MPI's time: 1.67x, below the target.
        let slow = [
            row("auto", 8 << 10, 0.9),
            row(one, 8 << 10, 0.6),
            row(two, 8 << 10, 0.7),
        ];
        let v = judge(&targets(), &slow);
        assert!(
            v[0].detail.contains("bounds it at 1.667x: out of reach"),
            "{v:?}"
        );
        assert_eq!(
            best_speedup(&[row("auto", 8 << 10, 0.5)], &FLOOR_STAGED),
            None
        );
    }

    #[test]
    fn the_peer_is_judged_against_the_c_loop_within_five_percent_either_way() {
        let row = |bytes: usize, vs| Row::of_us("f32", &bytes.to_string(), C_LOOP, 1.0).vs(vs);
        let peer = |rows: &[Row]| {
            let v = judge(&targets(), rows);
            v.into_iter()
                .find(|v| v.target.starts_with("the peer"))
                .unwrap()
        };
        // C loop / MPI_Allreduce: the peer 1/0.96 = 4.2% slower, 1/1.04 = 3.8% faster.
        assert!(peer(&[row(1 << 10, 0.96), row(8 << 20, 1.04)]).met);
        // The peer 1/0.94 = 6.4% slower than the C loop at 4 KiB: a handicapped peer.
        let v = peer(&[row(1 << 10, 0.99), row(4 << 10, 0.94)]);
        assert!(!v.met);
        assert!(v.detail.contains("f32 4096 C loop 0.940x"), "{v:?}");
        // Without C loop rows (no mpicc) the target is not judged.
        let v = judge(
            &targets(),
            &[Row::of_us("f32", "1024", "auto", 1.0).vs(0.5)],
        );
        assert!(v.iter().all(|v| !v.target.starts_with("the peer")), "{v:?}");
    }

    #[test]
    fn the_memcpy_target_is_judged_at_8_mib_with_the_eager_floor() {
        let row = |path, ratio| {
            Row::of_us("f32", &(8usize << 20).to_string(), path, 1.0).with("vs_memcpy", ratio)
        };
        let v = judge(&targets(), &[row("auto", 2.5), row(FLOOR_EAGER, 2.2)]);
        assert_eq!(v.len(), 1);
        assert!(!v[0].met);
        assert!(
            v[0].detail.contains("auto / memcpy 2.500x") && v[0].detail.contains("out of reach")
        );
        assert!(judge(&targets(), &[row("auto", 1.9)])[0].met);
        // The staged floors: the faster of the two at 8 MiB.
        let [one, two] = FLOOR_STAGED;
        let v = judge(
            &targets(),
            &[row("auto", 2.5), row(one, 2.4), row(two, 2.1)],
        );
        assert!(
            v[0].detail
                .contains("`floor 1stage|2stage` bounds it at 2.100x: out of reach"),
            "{v:?}"
        );
    }

    #[test]
    fn the_floor_sums_page_aligned_windows() {
        let (ranks, count, salt) = (3, 1000, 7);
        for rank in 0..ranks {
            let mut floor = Floor::new(count, ranks);
            floor.fill(rank, salt);
            {
                let (own, peers) = floor.windows();
                assert!((own.as_ptr() as usize).is_multiple_of(Floor::PAGE));
                assert!(peers
                    .iter()
                    .all(|p| (p.as_ptr() as usize).is_multiple_of(Floor::PAGE)));
            }
            let mut out = vec![f32::NAN; count];
            floor.run(false, &[], &mut out);
            assert_eq!(check(&out, &expected(ranks, count, salt)), None);
            let mine = input::<f32>(rank, count, salt);
            floor.fill(rank, salt ^ 1);
            floor.run(true, &mine, &mut out);
            // This rank's input copied in; the peers' windows hold salt ^ 1 inputs.
            let want: Vec<f32> = (0..count)
                .map(|i| {
                    (0..ranks)
                        .map(|r| input_value(r, i, if r == rank { salt } else { salt ^ 1 }))
                        .sum()
                })
                .collect();
            assert_eq!(check(&out, &want), None);
        }
    }
}
