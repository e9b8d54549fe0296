//! The [`Session`] each rank runs in: verification and timing of the declared cases, rank
//! 0's printer, the rows, the summary lines, progress, the verdicts and the JSON report at
//! the end.

use std::cell::RefCell;
use std::path::Path;

use serde::Serialize;
use tpcomm::Communicator;

use crate::engine::error::BenchError;
use crate::engine::launch::RunInfo;
use crate::engine::placement::{self, Placement, StealClock};
use crate::engine::report::{self, Report};
use crate::engine::row::Row;
use crate::engine::sweep::IterArgs;
use crate::engine::table::{self, Column, Progress};
use crate::engine::targets::{verdict_lines, Target, Verdict};
use crate::engine::timing::{time_variants, Spec};
use crate::engine::verify::agree;

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
            agree(comm, problem, || {
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

    /// Prints a blank line, then `lines` as summary lines, when there are any (rank 0).
    pub(crate) fn closing(&mut self, lines: Vec<String>) {
        if !lines.is_empty() {
            self.note("");
            lines.into_iter().for_each(|l| self.summary(l));
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

/// Runs `f` on `ranks` local threads in a session that prints nothing (2 timed iterations
/// after 1 warm-up); rank 0's result.
#[cfg(test)]
pub(crate) fn test_rank_rows<T: Send>(
    ranks: usize,
    f: impl Fn(&Session<'_>, &tpcomm::transport::LocalCommunicator) -> Result<T, BenchError> + Sync,
) -> T {
    let info = RunInfo::local("test");
    let results = tpcomm::transport::LocalGroup::new(ranks).run(|comm| {
        let mut s = Session::start(&info, "test", 1, ranks, None, &[])?;
        s.iter = IterArgs {
            iters: Some(2),
            warmup: Some(1),
            cold: false,
        };
        f(&s, &comm)
    });
    crate::engine::launch::first_rank_output(results).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::row::Bus;
    use crate::engine::timing::Order;
    use tpcomm::transport::LocalGroup;

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
}
