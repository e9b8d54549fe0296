//! Starting the ranks of a subcommand: threads of a local group, or this process as one
//! MPI rank under `mpirun`.
//!
//! A subcommand's per-rank work is a [`PerRank`] job, generic over the communicator so
//! that each backend is called directly (no dynamic dispatch in timed code). Rank 0
//! prints and returns its output; the other ranks return nothing.

use tpcomm::transport::LocalGroup;
use tpcomm::{Communicator, TransportError};

use crate::error::BenchError;
use std::path::Path;

use serde::Serialize;

use crate::report::{self, Machine, Report, Table, Verdict};
use crate::transport::Transport;

/// Ranks of the local group when `--ranks` is not given.
pub(crate) const DEFAULT_LOCAL_RANKS: u32 = 2;

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
    /// The preamble lines every subcommand starts with: the command line, the transport and
    /// rank count, the MPI library (MPI mode) and the machine.
    pub(crate) fn preamble_header(&self, t: &Table, subcommand: &str, ranks: usize) {
        t.note(&format!(
            "tpcomm-bench {subcommand}: {}",
            std::env::args().collect::<Vec<_>>().join(" ")
        ));
        let plural = if ranks == 1 { "" } else { "s" };
        t.note(&format!(
            "transport {}, {ranks} rank{plural}",
            self.description
        ));
        if let Some(lib) = &self.mpi_library {
            t.note(&format!("MPI library: {lib}"));
        }
        t.note(&format!("machine: {}", self.machine.describe()));
    }

    /// Writes the JSON report of `subcommand` to `path` and notes where it went.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_report<S: Serialize, R: Serialize>(
        &self,
        t: &Table,
        path: &Path,
        subcommand: &'static str,
        ranks: usize,
        settings: &S,
        rows: &[R],
        targets: &[Verdict],
    ) -> Result<(), BenchError> {
        let report = Report {
            tool: "tpcomm-bench",
            version: env!("CARGO_PKG_VERSION"),
            subcommand,
            command_line: std::env::args().collect(),
            unix_time: report::unix_time(),
            machine: self.machine.clone(),
            transport: self.transport,
            ranks,
            mpi_library: self.mpi_library.clone(),
            settings,
            rows,
            targets,
        };
        report::write_json(path, &report)?;
        t.note(&format!("JSON written to {}", path.display()));
        Ok(())
    }
}

/// The work of one rank of a subcommand.
pub(crate) trait PerRank: Sync {
    /// What rank 0 returns.
    type Output: Send;

    /// Runs on every rank; rank 0's `Ok(Some(_))` is the run's output, the other ranks
    /// return `Ok(None)`.
    fn run<C: Communicator>(
        &self,
        comm: &C,
        info: &RunInfo,
    ) -> Result<Option<Self::Output>, BenchError>;
}

/// Runs `job` on `ranks` local threads (default [`DEFAULT_LOCAL_RANKS`]) or, with
/// [`Transport::Mpi`], as this MPI rank. Returns rank 0's output (`None` on other MPI
/// ranks). In MPI mode a failing rank prints its error and aborts the job, so that no rank
/// stays blocked in a collective its peers left.
pub(crate) fn launch<J: PerRank>(
    transport: Transport,
    ranks: Option<u32>,
    job: &J,
) -> Result<Option<J::Output>, BenchError> {
    match transport {
        Transport::Local => {
            warn_if_under_mpirun();
            let info = RunInfo {
                transport: "local",
                description: "local (threads of this process)",
                mpi_library: None,
                machine: Machine::current(),
            };
            let ranks = ranks.unwrap_or(DEFAULT_LOCAL_RANKS) as usize;
            let results = LocalGroup::new(ranks).run(|comm| job.run(&comm, &info));
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
            launch_mpi(job)
        }
    }
}

#[cfg(feature = "mpi")]
fn launch_mpi<J: PerRank>(job: &J) -> Result<Option<J::Output>, BenchError> {
    use mpi::topology::Communicator as _;
    use tpcomm::transport::MpiCommunicator;

    let universe = mpi::initialize()
        .ok_or_else(|| BenchError::Usage("MPI was already initialized in this process".into()))?;
    let world = universe.world();
    let rank = usize::try_from(world.rank()).unwrap_or(0);
    let info = RunInfo {
        transport: "mpi",
        description: "mpi (tpcomm MpiCommunicator on a duplicate of MPI_COMM_WORLD)",
        mpi_library: mpi_library_version(),
        machine: Machine::current(),
    };
    let result = MpiCommunicator::world(&universe)
        .map_err(BenchError::from)
        .and_then(|comm| job.run(&comm, &info));
    match result {
        Ok(out) => Ok(out),
        Err(e) => {
            eprintln!(
                "tpcomm-bench: rank {rank}: error: {}",
                crate::error::chain(&e)
            );
            world.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi<J: PerRank>(_: &J) -> Result<Option<J::Output>, BenchError> {
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
