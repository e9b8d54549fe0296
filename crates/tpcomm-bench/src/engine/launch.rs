//! Starting the ranks of a subcommand: threads of a local group, or this process as one MPI
//! rank under `mpirun`, each running a [`Session`].
//!
//! A subcommand is a [`Bench`]: its options, preamble, targets and per-rank measurement,
//! generic over the communicator so that each backend is called directly (no dynamic
//! dispatch in timed code); [`run`] does the rest.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::Serialize;
use tpcomm::transport::LocalGroup;
use tpcomm::{Communicator, TransportError};

use crate::engine::error::BenchError;
use crate::engine::report::Machine;
use crate::engine::session::Session;
use crate::engine::sweep::IterArgs;
use crate::engine::targets::Target;

/// Ranks of the local group when `--ranks` is not given.
pub(crate) const DEFAULT_LOCAL_RANKS: u32 = 2;

/// Which transport carries the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Transport {
    /// Threads of this process (`LocalGroup`).
    Local,
    /// MPI ranks (run under `mpirun`; needs the `mpi` feature).
    Mpi,
}

/// The options every subcommand that starts ranks takes.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct RunArgs {
    /// Ranks (threads) of the local group [default: 2]. Not with `--transport mpi`, where
    /// `mpirun -np` decides.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) ranks: Option<u32>,

    /// Transport carrying the collectives (and the handle exchanges and barriers of the
    /// peer-memory subcommands).
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub(crate) transport: Transport,

    /// Also write every figure (and every iteration's time) to this JSON file (schema in
    /// docs/benchmarks.md).
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,

    /// With `--transport mpi`: bound every collective of the communicator by this many
    /// milliseconds (`MpiCommunicator::with_timeout`), so that the run measures the timed
    /// path (nonblocking calls on owned copies, polled) instead of the blocking calls.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_name = "MS")]
    pub(crate) mpi_timeout_ms: Option<u32>,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) iter: IterArgs,
}

impl RunArgs {
    /// Refuses more local ranks than `max` (the custom all-reduce serves up to 8).
    pub(crate) fn at_most(&self, max: u32) -> Result<(), BenchError> {
        match self.ranks {
            Some(n) if n > max => Err(BenchError::Usage(format!(
                "--ranks {n}: this subcommand runs at most {max} ranks"
            ))),
            _ => Ok(()),
        }
    }
}

/// Where the ranks of this run live, for the preamble and the JSON report.
#[derive(Debug, Clone)]
pub(crate) struct RunInfo {
    /// `"local"` or `"mpi"`.
    pub(crate) transport: &'static str,
    /// One line for the preamble.
    pub(crate) description: &'static str,
    /// The MPI library's version line, in MPI mode.
    pub(crate) mpi_library: Option<String>,
    pub(crate) machine: Machine,
}

impl RunInfo {
    /// Ranks as threads of this process.
    pub(crate) fn local(description: &'static str) -> Self {
        Self {
            transport: "local",
            description,
            mpi_library: None,
            machine: Machine::current(),
        }
    }
}

/// A subcommand that measures: its options, preamble, targets and per-rank measurement;
/// [`run`] does the rest (ranks, session, verdicts, JSON).
pub(crate) trait Bench: Serialize + Sync {
    /// The subcommand's name.
    const NAME: &'static str;
    /// The configuration the targets are stated for, in words.
    const STATED_FOR: &'static str = "2 ranks";

    /// The options every measuring subcommand takes.
    fn run_args(&self) -> &RunArgs;

    /// Checks what clap cannot check option by option.
    fn validate(&self) -> Result<(), BenchError> {
        Ok(())
    }

    /// Lines printed below the common preamble: what is timed and how.
    fn preamble(&self, mpi: bool) -> Vec<String>;

    /// False when an option times something other than what the targets are stated for
    /// (their verdicts are then indicative only, as on another rank count).
    fn judged(&self) -> bool {
        true
    }

    /// The targets the rows are judged against.
    fn targets(&self) -> Vec<Target> {
        Vec::new()
    }

    /// Whether the targets are stated for 2 MPI ranks (otherwise for 2 ranks of either
    /// transport).
    const MPI_TARGETS: bool = false;

    /// Verifies, times and prints every case on this rank (collective).
    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError>;
}

/// Runs `bench` on every rank: the session, its measurement, the verdicts and the report.
pub(crate) fn run<B: Bench>(bench: &B) -> Result<(), BenchError> {
    bench.run_args().iter.validate()?;
    bench.validate()?;
    launch(bench.run_args(), bench).map(drop)
}

/// One rank of [`run`].
fn run_rank<B: Bench, C: Communicator>(
    bench: &B,
    comm: &C,
    info: &RunInfo,
) -> Result<Option<()>, BenchError> {
    let json = bench.run_args().json.as_deref();
    let mpi = info.transport == "mpi";
    let (rank, ranks) = (comm.rank(), comm.size());
    let mut lines = vec![bench.run_args().iter.describe()];
    lines.extend(bench.preamble(mpi));
    let mut s = Session::start(info, B::NAME, rank, ranks, json, &lines)?;
    s.iter = bench.run_args().iter.clone();
    bench.measure(comm, &mut s)?;
    // The targets are stated for the blocking calls: a run of the timed path is indicative.
    let binding = ranks == 2
        && (info.transport == "mpi" || !B::MPI_TARGETS)
        && bench.run_args().mpi_timeout_ms.is_none()
        && bench.judged();
    let binding = (binding, B::STATED_FOR);
    s.finish(B::NAME, json, bench, &bench.targets(), binding)?;
    Ok((rank == 0).then_some(()))
}

/// Runs `bench` on `ranks` local threads (default [`DEFAULT_LOCAL_RANKS`]) or, with
/// [`Transport::Mpi`], as this MPI rank. In MPI mode a failing rank prints its error and
/// aborts the job, so that no rank stays blocked in a collective its peers left.
fn launch<B: Bench>(args: &RunArgs, bench: &B) -> Result<Option<()>, BenchError> {
    let ranks = args.ranks;
    match args.transport {
        Transport::Local if args.mpi_timeout_ms.is_some() => Err(BenchError::Usage(
            "--mpi-timeout-ms bounds the MPI communicator's collectives: it needs --transport mpi"
                .into(),
        )),
        Transport::Local => {
            warn_if_under_mpirun();
            let info = RunInfo::local("local (threads of this process)");
            let ranks = ranks.unwrap_or(DEFAULT_LOCAL_RANKS) as usize;
            let results = LocalGroup::new(ranks).run(|comm| run_rank(bench, &comm, &info));
            first_rank_output(results)
        }
        Transport::Mpi => {
            if ranks.is_some() {
                return Err(BenchError::Usage(
                    "--ranks is for --transport local; with --transport mpi the ranks are \
                     mpirun's (mpirun -np N)"
                        .into(),
                ));
            }
            launch_mpi(bench)
        }
    }
}

#[cfg(feature = "mpi")]
fn launch_mpi<B: Bench>(bench: &B) -> Result<Option<()>, BenchError> {
    use mpi::topology::Communicator as _;
    use tpcomm::transport::MpiCommunicator;

    let universe = mpi::initialize()
        .ok_or_else(|| BenchError::Usage("MPI was already initialized in this process".into()))?;
    let world = universe.world();
    let rank = usize::try_from(world.rank()).unwrap_or(0);
    let timeout = bench
        .run_args()
        .mpi_timeout_ms
        .map(|ms| std::time::Duration::from_millis(ms.into()));
    let info = RunInfo {
        transport: "mpi",
        description: match timeout {
            None => "mpi (tpcomm MpiCommunicator on a duplicate of MPI_COMM_WORLD)",
            Some(_) => {
                "mpi (tpcomm MpiCommunicator on a duplicate of MPI_COMM_WORLD, every collective \
                 bounded by --mpi-timeout-ms: the timed path)"
            }
        },
        mpi_library: mpi_library_version(),
        machine: Machine::current(),
    };
    let result = MpiCommunicator::world(&universe)
        .and_then(|comm| match timeout {
            Some(timeout) => comm.with_timeout(timeout),
            None => Ok(comm),
        })
        .map_err(BenchError::from)
        .and_then(|comm| run_rank(bench, &comm, &info));
    match result {
        Ok(out) => Ok(out),
        Err(e) => {
            eprintln!(
                "tpcomm-bench: rank {rank}: error: {}",
                crate::engine::error::chain(&e)
            );
            world.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi<B: Bench>(_: &B) -> Result<Option<()>, BenchError> {
    Err(BenchError::Usage(
        "this tpcomm-bench was built without MPI: rebuild with \
         `cargo build --release -p tpcomm-bench --features mpi`"
            .into(),
    ))
}

/// The first line of the MPI library's version string (it comes with a trailing NUL and,
/// for some libraries, several lines).
#[cfg(feature = "mpi")]
pub(crate) fn mpi_library_version() -> Option<String> {
    mpi::environment::library_version().ok().map(|v| {
        let v = v.replace('\0', "");
        v.lines().next().unwrap_or_default().trim().to_string()
    })
}

/// Warns when the process looks started by `mpirun` but runs a local group: every process
/// would run its own group and print its own tables.
pub(crate) fn warn_if_under_mpirun() {
    if let Some(var) = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .into_iter()
        .find(|v| std::env::var_os(v).is_some())
    {
        eprintln!(
            "tpcomm-bench: warning: {var} is set (running under mpirun?) but --transport is \
             local: every process runs its own local group; pass --transport mpi"
        );
    }
}

/// Rank 0's output, or the most telling error of any rank: one that is not just "the group
/// was aborted by someone else".
pub(crate) fn first_rank_output<T>(
    results: Vec<Result<Result<T, BenchError>, TransportError>>,
) -> Result<T, BenchError> {
    let mut output = None;
    let mut errors = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        match result.map_err(BenchError::from).and_then(|r| r) {
            Ok(r) if rank == 0 => output = Some(r),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }
    let secondary =
        |e: &BenchError| matches!(e, BenchError::Transport(TransportError::Aborted { .. }));
    if let Some(i) = errors.iter().position(|e| !secondary(e)) {
        return Err(errors.swap_remove(i));
    }
    if let Some(e) = errors.into_iter().next() {
        return Err(e);
    }
    output.ok_or_else(|| BenchError::Usage("rank 0 returned no output".into()))
}
