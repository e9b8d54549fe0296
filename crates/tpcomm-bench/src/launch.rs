//! Starting the ranks of a subcommand (threads of a local group, or this process as one MPI
//! rank under `mpirun`) and the [`Session`] each rank runs in: rank 0's printer, the rows,
//! the summary lines, progress, and the JSON report at the end.
//!
//! A subcommand's per-rank work is a [`PerRank`] job, generic over the communicator so
//! that each backend is called directly (no dynamic dispatch in timed code).

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde::Serialize;
use tpcomm::transport::LocalGroup;
use tpcomm::{Communicator, TransportError};

use crate::error::BenchError;
use crate::harness::{Row, Target, Verdict};
use crate::report::{self, Machine, Report};
use crate::table::{self, Column, Progress};

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

/// One rank's view of a run: rank 0 prints and keeps the rows; every rank has the
/// communicator's rank and size at hand.
#[derive(Debug)]
pub(crate) struct Session<'a> {
    pub(crate) info: &'a RunInfo,
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) progress: Progress,
    rows: Vec<Row>,
    summary: Vec<String>,
}

impl<'a> Session<'a> {
    /// Starts the session of `subcommand` on this rank; rank 0 checks that `json` can be
    /// written (failing now, not after the run) and prints the preamble: the command line,
    /// transport, ranks, MPI library, machine, then `lines`.
    pub(crate) fn start(
        info: &'a RunInfo,
        subcommand: &str,
        rank: usize,
        ranks: usize,
        json: Option<&Path>,
        lines: &[String],
    ) -> Result<Self, BenchError> {
        let s = Self {
            info,
            rank,
            ranks,
            progress: Progress::new(rank),
            rows: Vec::new(),
            summary: Vec::new(),
        };
        if rank == 0 {
            if let Some(path) = json {
                report::check_writable(path)?;
            }
            let plural = if ranks == 1 { "" } else { "s" };
            let argv = std::env::args().collect::<Vec<_>>().join(" ");
            s.note(&format!("tpcomm-bench {subcommand}: {argv}"));
            s.note(&format!(
                "transport {}, {ranks} rank{plural}",
                info.description
            ));
            if let Some(lib) = &info.mpi_library {
                s.note(&format!("MPI library: {lib}"));
            }
            s.note(&format!("machine: {}", info.machine.describe()));
            lines.iter().for_each(|l| s.note(l));
            if std::env::var_os("RUST_LOG").is_some() {
                s.note("RUST_LOG is set: tracing spans enabled by it add to tpcomm's times");
            }
        }
        Ok(s)
    }

    /// Whether this rank prints (rank 0).
    pub(crate) fn prints(&self) -> bool {
        self.rank == 0
    }

    /// Prints a comment line (rank 0).
    pub(crate) fn note(&self, text: &str) {
        if self.prints() {
            let line = if text.is_empty() {
                "#".into()
            } else {
                format!("# {text}")
            };
            self.progress.finish();
            table::print(&[line]);
        }
    }

    /// Prints a table's header (rank 0).
    pub(crate) fn header(&self, title: &str, columns: &[Column]) {
        if self.prints() {
            self.progress.finish();
            table::print(&table::header(title, columns));
        }
    }

    /// Prints `rows` of a table whose peers are among `all` (rank 0), and keeps every row of
    /// `all` for the report.
    pub(crate) fn rows(
        &mut self,
        columns: &[Column],
        all: Vec<Row>,
        printed: impl Fn(&Row) -> bool,
    ) {
        if !self.prints() {
            return;
        }
        let peer = |r: &Row| {
            let p = r.peer.as_deref()?;
            all.iter()
                .find(|x| x.table == r.table && x.case == r.case && x.variant == p)
        };
        let lines: Vec<String> = all
            .iter()
            .filter(|r| printed(r))
            .map(|r| table::row_line(columns, r, peer(r)))
            .collect();
        self.progress.finish();
        table::print(&lines);
        self.rows.extend(all);
    }

    /// Every row kept so far (rank 0; empty elsewhere).
    pub(crate) fn kept(&self) -> &[Row] {
        &self.rows
    }

    /// Prints a summary line and keeps it for the report (rank 0).
    pub(crate) fn summary(&mut self, text: String) {
        self.note(&text);
        if self.prints() {
            self.summary.push(text);
        }
    }

    /// Keeps rows for the report without printing them (rank 0).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn keep(&mut self, rows: Vec<Row>) {
        if self.prints() {
            self.rows.extend(rows);
        }
    }

    /// Replaces the rows kept for the report (rank 0).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn keep_only(&mut self, rows: Vec<Row>) {
        self.rows.clear();
        self.keep(rows);
    }

    /// Ends the run on rank 0: judges `targets` on the rows (binding when this run is the
    /// configuration they are stated for), prints the verdicts and writes the JSON report.
    pub(crate) fn finish<S: Serialize>(
        self,
        subcommand: &str,
        json: Option<&Path>,
        settings: &S,
        targets: &[Target],
        binding: bool,
    ) -> Result<(), BenchError> {
        if !self.prints() {
            return Ok(());
        }
        self.progress.finish();
        let verdicts = Verdict::judge_all(targets, &self.rows, binding);
        if !verdicts.is_empty() {
            self.note("");
        }
        for v in &verdicts {
            v.lines().iter().for_each(|l| self.note(l));
        }
        self.write_json(subcommand, json, settings, &verdicts)
    }

    /// Writes the JSON report of the rows kept so far to `json`, if given (rank 0).
    pub(crate) fn write_json<S: Serialize>(
        &self,
        subcommand: &str,
        json: Option<&Path>,
        settings: &S,
        verdicts: &[Verdict],
    ) -> Result<(), BenchError> {
        let (Some(path), true) = (json, self.prints()) else {
            return Ok(());
        };
        let report = Report {
            schema_version: report::SCHEMA_VERSION,
            tool: "tpcomm-bench".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            subcommand: subcommand.into(),
            command_line: std::env::args().collect(),
            unix_time: report::unix_time(),
            machine: self.info.machine.clone(),
            transport: self.info.transport.into(),
            ranks: self.ranks,
            mpi_library: self.info.mpi_library.clone(),
            settings: serde_json::to_value(settings)?,
            rows: self.rows.clone(),
            summary: self.summary.clone(),
            targets: verdicts.to_vec(),
        };
        report::write(path, &report)?;
        self.note(&format!("JSON written to {}", path.display()));
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
pub(crate) fn launch<J: PerRank>(args: &RunArgs, job: &J) -> Result<Option<J::Output>, BenchError> {
    let ranks = args.ranks;
    match args.transport {
        Transport::Local => {
            warn_if_under_mpirun();
            let info = RunInfo::local("local (threads of this process)");
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
