//! Starting the ranks of a subcommand (threads of a local group, or this process as one MPI
//! rank under `mpirun`) and the [`Session`] each rank runs in: verification and timing of
//! the declared cases, rank 0's printer, the rows, the summary lines, progress, the
//! verdicts and the JSON report at the end.
//!
//! A subcommand is a [`Bench`]: its options, preamble, targets and per-rank measurement,
//! generic over the communicator so that each backend is called directly (no dynamic
//! dispatch in timed code); [`run`] does the rest.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde::Serialize;
use tpcomm::transport::LocalGroup;
use tpcomm::{Communicator, TransportError};

use crate::error::BenchError;
use crate::harness::{time_variants, Row, Spec, Target, Verdict};
use crate::mpi_peer::MpiWorld;
use crate::placement::{self, Placement, StealClock};
use crate::report::{self, Machine, Report};
use crate::sweep::IterArgs;
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

/// One rank's view of a run: rank 0 prints and keeps the rows; every rank has the
/// communicator's rank and size at hand.
#[derive(Debug)]
pub(crate) struct Session<'a> {
    pub(crate) info: &'a RunInfo,
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) progress: Progress,
    /// The iteration policy of [`Session::measure`].
    pub(crate) iter: IterArgs,
    /// The plain MPI calls on `MPI_COMM_WORLD`, when the ranks are MPI ranks.
    pub(crate) mpi: Option<MpiWorld>,
    rows: Vec<Row>,
    summary: Vec<String>,
    /// Where the ranks ran over each measured case (`table case`).
    placements: RefCell<Vec<(String, Placement)>>,
    /// The CPU time stolen from the machine since the session started.
    stolen: StealClock,
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
            iter: IterArgs::default(),
            mpi: MpiWorld::for_run(info),
            rows: Vec::new(),
            summary: Vec::new(),
            placements: RefCell::default(),
            stolen: StealClock::start(),
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

    /// Verifies every variant of `spec` once (`check(state, v)` runs variant `v` on fresh
    /// data and says what is wrong, if anything), failing on every rank when any rank saw
    /// wrong data (collective).
    pub(crate) fn verify<C: Communicator, S>(
        &self,
        comm: &C,
        spec: &Spec<'_>,
        state: &mut S,
        mut check: impl FnMut(&mut S, usize) -> Result<Option<String>, BenchError>,
    ) -> Result<(), BenchError> {
        self.progress.case(format!("{} {}", spec.table, spec.case));
        for (v, variant) in spec.variants.iter().enumerate() {
            let problem = check(state, v)?;
            crate::harness::agree(comm, problem, || {
                format!("{variant} {} of {}", spec.table, spec.case)
            })?;
        }
        Ok(())
    }

    /// Times the variants of `spec` interleaved (collective; `once(state, v)` runs variant
    /// `v` as one timed iteration) and returns its rows: one per variant and per declared
    /// sum, with the bandwidths, the case's facts, where the ranks ran ([`Placement`]) and
    /// the comparison with its peer.
    pub(crate) fn measure<C: Communicator, S>(
        &self,
        comm: &C,
        spec: &Spec<'_>,
        state: &mut S,
        once: impl FnMut(&mut S, usize) -> Result<u64, BenchError>,
    ) -> Result<Vec<Row>, BenchError> {
        self.progress.case(format!("{} {}", spec.table, spec.case));
        let (warmup, samples, placement) =
            time_variants(comm, &self.iter, spec, &self.progress, state, once)?;
        let mut rows = spec.rows(comm.size(), warmup, samples);
        rows.iter_mut().for_each(|r| placement.annotate(r));
        self.placements
            .borrow_mut()
            .push((format!("{} {}", spec.table, spec.case), placement));
        Ok(rows)
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
        self.progress.finish();
        table::print_rows(columns, all.iter().filter(|r| printed(r)), &all);
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

    /// Ends the run on rank 0: prints where the ranks ran ([`placement::summary`]), judges
    /// `targets` on the rows (binding when this run is the configuration they are stated
    /// for, `stated_for`), prints the verdicts and writes the JSON report.
    pub(crate) fn finish<S: Serialize>(
        mut self,
        subcommand: &str,
        json: Option<&Path>,
        settings: &S,
        targets: &[Target],
        (binding, stated_for): (bool, &str),
    ) -> Result<(), BenchError> {
        if !self.prints() {
            return Ok(());
        }
        self.progress.finish();
        let placed = placement::summary(&self.placements.take(), self.stolen.share());
        if !placed.is_empty() {
            self.note("");
        }
        placed.into_iter().for_each(|line| self.summary(line));
        let verdicts = Verdict::judge_all(targets, &self.rows, binding);
        for line in verdict_lines(targets.len(), &verdicts, (binding, stated_for)) {
            self.note(&line);
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

/// The closing lines of a run with `targets` targets, judged into `verdicts`: a blank line,
/// a note when none could be judged or the run is not the configuration they are stated
/// for, and the verdicts with their reasons.
fn verdict_lines(
    targets: usize,
    verdicts: &[Verdict],
    (binding, stated_for): (bool, &str),
) -> Vec<String> {
    let mut lines = Vec::new();
    if targets == 0 {
        return lines;
    }
    lines.push(String::new());
    if verdicts.is_empty() {
        lines.push(format!(
            "no target can be judged on this run: they are stated for {stated_for}"
        ));
    } else if !binding {
        lines.push(format!(
            "the targets are stated for {stated_for}: the verdicts below are indicative only"
        ));
    }
    lines.extend(verdicts.iter().flat_map(Verdict::lines));
    lines
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
    let binding = ranks == 2 && (info.transport == "mpi" || !B::MPI_TARGETS) && bench.judged();
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
    let info = RunInfo {
        transport: "mpi",
        description: "mpi (tpcomm MpiCommunicator on a duplicate of MPI_COMM_WORLD)",
        mpi_library: mpi_library_version(),
        machine: Machine::current(),
    };
    let result = MpiCommunicator::world(&universe)
        .map_err(BenchError::from)
        .and_then(|comm| run_rank(bench, &comm, &info));
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

/// Runs `f` on `ranks` local threads in a session that prints nothing (2 timed iterations
/// after 1 warm-up); rank 0's result.
#[cfg(test)]
pub(crate) fn test_rank_rows<T: Send>(
    ranks: usize,
    f: impl Fn(&Session<'_>, &tpcomm::transport::LocalCommunicator) -> Result<T, BenchError> + Sync,
) -> T {
    let info = RunInfo::local("test");
    let results = LocalGroup::new(ranks).run(|comm| {
        let mut s = Session::start(&info, "test", 1, ranks, None, &[])?;
        s.iter = IterArgs {
            iters: Some(2),
            warmup: Some(1),
            cold: false,
        };
        f(&s, &comm)
    });
    first_rank_output(results).unwrap()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::{Bus, Order};

    #[test]
    fn a_case_gives_a_row_per_variant_and_sum_with_its_facts_bandwidth_and_peer() {
        let rows = test_rank_rows(2, |s, comm| {
            let spec = Spec {
                order: Order::Fixed,
                peer: Some("peer"),
                bus: Some(Bus::Same),
                sums: &[("a+b", 0, 1)],
                ..Spec::new("t", "1000".into(), 1000, &["a", "b", "peer"]).with("type", "x")
            };
            // Variant v takes (v + 1) us on rank 1, less on rank 0.
            let ns = |v: usize| ((v + 1) * 1000 / (2 - comm.rank())) as u64;
            s.measure(comm, &spec, &mut (), |_, v| Ok(ns(v)))
        });
        let names: Vec<&str> = rows.iter().map(|r| r.variant.as_str()).collect();
        assert_eq!(names, ["a", "b", "peer", "a+b"]);
        let medians: Vec<f64> = rows.iter().map(|r| r.stats.median_us).collect();
        assert_eq!(medians, [1.0, 2.0, 3.0, 3.0], "the slowest rank's times");
        assert_eq!(rows[0].vs_peer, Some(1.0 / 3.0));
        assert_eq!(rows[3].peer.as_deref(), Some("peer"));
        assert_eq!(
            rows[2].vs_peer, None,
            "the peer is not compared with itself"
        );
        assert!(rows.iter().all(|r| r.text("type") == "x" && r.iters == 2));
        assert_eq!(rows[0].busbw_gbps, Some(1.0), "1000 B in 1 us");
    }

    #[test]
    fn verification_fails_every_rank_naming_the_variant_and_the_case() {
        let info = RunInfo::local("test");
        let results = LocalGroup::new(2).run(|comm| {
            let s = Session::start(&info, "test", 1, 2, None, &[])?;
            let spec = Spec::new("t", "64".into(), 64, &["good", "bad"]);
            s.verify(&comm, &spec, &mut (), |_, v| {
                Ok((v == 1 && comm.rank() == 1).then(|| "byte 3".to_string()))
            })
        });
        for r in results {
            let e = r.unwrap().unwrap_err().to_string();
            assert!(
                e.starts_with("bad t of 64 delivered wrong data on rank 1"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_verdicts_say_when_the_run_is_not_the_configuration_of_the_targets() {
        let target = Target {
            what: "fast".into(),
            why: "because",
            judge: Box::new(|rows: &[Row]| {
                Some((rows.first()?.stats.median_us < 2.0, "1 us".into()))
            }),
            line: None,
        };
        let rows = [Row::of_us("t", "c", "v", 1.0)];
        let lines = |rows: &[Row], binding| {
            let verdicts = Verdict::judge_all(std::slice::from_ref(&target), rows, binding);
            verdict_lines(1, &verdicts, (binding, "2 ranks"))
        };
        assert_eq!(
            lines(&rows, false)[1..],
            [
                "the targets are stated for 2 ranks: the verdicts below are indicative only",
                "target fast: MET [indicative only] (1 us)",
                "  why: because"
            ]
        );
        assert_eq!(lines(&rows, true)[1], "target fast: MET (1 us)");
        assert_eq!(
            lines(&[], true)[1],
            "no target can be judged on this run: they are stated for 2 ranks"
        );
        assert!(verdict_lines(0, &[], (false, "2 ranks")).is_empty());
    }
}
