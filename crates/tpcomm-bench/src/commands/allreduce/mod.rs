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
//!   across cores, doing the least it must and nothing else, in C
//!   (`src/peers/staged_floor.c`): copy in, flag barriers, sums (below 1 MiB with double
//!   buffers, so that no barrier closes a call).
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
//! `auto` and `replay` choose by the dispatch table of `--table` (a file `tpcomm-bench tune`
//! wrote), else by the file `TPCOMM_DISPATCH_TABLE` names, else by the built-in table; the
//! run prints which, with its digest. Every instance is bit-stable
//! (`Reproducibility::BitStable`: one-stage and two-stage only).
//!
//! After each table: where eager two-stage becomes faster than one-stage, next to the bands
//! of the table in use for eager (staged) and registered inputs; under `mpirun`, the
//! targets against `MPI_Allreduce` (2 ranks, f32) and `auto` against the faster of the
//! forced algorithms.
//!
//! [`CustomAllReduce`]: tpcomm::allreduce::CustomAllReduce

mod floor;
mod runner;
mod summary;
mod targets;
#[cfg(test)]
mod tests;

use clap::{Args, ValueEnum};
use serde::Serialize;
use tpcomm::allreduce::dispatch::DispatchTable;
use tpcomm::allreduce::{Algorithm, AllReduceError, Config};
use tpcomm::ipc::PeerMemory;
use tpcomm::Communicator;

use self::runner::{Replay, Runner};
use self::summary::summarize;
use crate::data::elements::with_element;
use crate::engine::error::BenchError;
use crate::engine::launch::{Bench, RunArgs};
use crate::engine::lineup::{new_all_reduce, new_sync, HostAllReduce};
use crate::engine::options::DTypeArg;
use crate::engine::session::Session;
use crate::engine::sweep::SweepArgs;
use crate::engine::table::{col, Column};
use crate::engine::targets::Target;
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
/// `auto` at most this factor of the faster of `1stage` and `2stage`, at every size.
const BEST_OF_TWO: f64 = 1.03;
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

    /// The dispatch table `auto` and `replay` choose by: a file `tpcomm-bench tune` wrote
    /// [default: the file `TPCOMM_DISPATCH_TABLE` names, else the built-in table].
    #[arg(long, value_name = "FILE")]
    pub(crate) table: Option<std::path::PathBuf>,
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

impl Serialize for Variant {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

fn columns(with_mpi: bool) -> Vec<Column> {
    let mut c = vec![
        col::size(10),
        Column::fact("count", "(elements)", 10, "count"),
        Column::fact("type", "", 5, "type"),
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
             Config.algorithm; auto: the dispatch table's choice (in parentheses), bit-stable"
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
                "C loop: the same MPI_Allreduce from a C benchmark loop (src/peers/peer_loop.c \
                 built with mpicc -O2: MPI_Barrier, then the call timed with CLOCK_MONOTONIC) on \
                 the same buffers, where mpicc builds it: what the call costs a C program now"
                    .into(),
            );
            lines.push(
                "floor 1stage / floor 2stage (f32, with the C loop): a staged all-reduce doing \
                 only what it must, in C (src/peers/staged_floor.c, timed like the C loop): copy \
                 in, flag barriers, sums between cores (below 1 MiB double buffers: no barrier \
                 closes a call); the eager targets quote the faster of the two at each size as \
                 their bound"
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
        targets::targets()
    }

    fn judged(&self) -> bool {
        !self.rewrite
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        let mpi = MpiWorld::for_run(s.info);
        let sizes = self.sweep.sizes();
        let max_bytes = sizes.last().copied().unwrap_or(self.sweep.max_bytes);
        let wants = |p: &[Variant]| p.iter().any(|x| self.paths.contains(x));
        let table = match &self.table {
            Some(path) => Some(DispatchTable::load(path).map_err(AllReduceError::from)?),
            None => None,
        };
        let build = |wanted: bool, algorithm| -> Result<Option<HostAllReduce>, BenchError> {
            let config = Config {
                max_bytes,
                algorithm,
                dispatch: table.clone(),
                ..Config::default()
            };
            wanted.then(|| new_all_reduce(comm, config)).transpose()
        };
        let mut instances = [
            build(wants(&[Variant::OneStage]), Some(Algorithm::OneStage))?,
            build(wants(&[Variant::TwoStage]), Some(Algorithm::TwoStage))?,
            build(wants(&[Variant::Auto, Variant::Replay]), None)?,
        ];
        let in_use = instances[2].as_ref().map(|ar| ar.dispatch_table().clone());
        if let Some(t) = &in_use {
            s.summary(format!(
                "dispatch table of auto and replay: {} (rows for {} ranks, digest {:016x}), {}",
                t.origin(),
                comm.size(),
                t.digest(),
                instances[2]
                    .as_ref()
                    .map_or("", |ar| ar.config().reproducibility.name())
            ));
        }
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
            summarize(s, d.dtype(), comm.size(), in_use.as_ref());
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
