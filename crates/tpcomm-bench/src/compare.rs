//! `tpcomm-bench compare OLD.json NEW.json`: the ratio of the medians of every row the two
//! reports share (rows are named by table, case and variant), with the rows slower than
//! `--threshold` flagged as regressions and the status 1 when there is any.
//!
//! Two runs on a shared machine differ by several percent without any change: compare
//! reports of the same configuration, and prefer the ratios against a peer measured in the
//! same run (the `vs peer` columns) to absolute times.

use std::path::PathBuf;

use clap::Args;

use crate::engine::error::BenchError;
use crate::engine::report::{self, Report};
use crate::engine::row::Row;
use crate::engine::summary::geomean;
use crate::engine::table::{self, Column};

/// Options of `tpcomm-bench compare`.
#[derive(Debug, Clone, Args)]
pub(crate) struct CompareArgs {
    /// The report taken as the reference.
    pub(crate) old: PathBuf,
    /// The report compared with it.
    pub(crate) new: PathBuf,
    /// A row regressed when its new median exceeds the old one by more than this many
    /// percent.
    #[arg(long, default_value_t = 10.0, value_name = "PCT")]
    pub(crate) threshold: f64,
}

/// One row both reports have.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Change {
    pub(crate) old: Row,
    pub(crate) new: Row,
    /// `new median / old median`.
    pub(crate) ratio: f64,
}

/// The rows of `new` that `old` has too, in `new`'s order, and how many rows only one has.
pub(crate) fn changes(old: &Report, new: &Report) -> (Vec<Change>, usize) {
    let key = |r: &Row| (r.table.clone(), r.case.clone(), r.variant.clone());
    let mut unmatched = 0;
    let mut out = Vec::new();
    for n in &new.rows {
        match old.rows.iter().find(|o| key(o) == key(n)) {
            Some(o) if o.stats.median_us > 0.0 => out.push(Change {
                old: o.clone(),
                new: n.clone(),
                ratio: n.stats.median_us / o.stats.median_us,
            }),
            _ => unmatched += 1,
        }
    }
    unmatched += old.rows.len().saturating_sub(out.len());
    (out, unmatched)
}

/// `REGRESSION` above `1 + threshold`, `faster` below `1 - threshold`, empty otherwise.
fn flag(ratio: f64, threshold: f64) -> &'static str {
    if ratio > 1.0 + threshold / 100.0 {
        "REGRESSION"
    } else if ratio < 1.0 - threshold / 100.0 {
        "faster"
    } else {
        ""
    }
}

/// Runs the subcommand.
pub(crate) fn run(args: &CompareArgs) -> Result<(), BenchError> {
    if args.threshold.is_nan() || args.threshold < 0.0 {
        return Err(BenchError::Usage("--threshold must be 0 or more".into()));
    }
    let (old, new) = (report::read(&args.old)?, report::read(&args.new)?);
    let describe = |r: &Report| {
        format!(
            "{} ({} x{}, {}, unix time {})",
            r.subcommand, r.transport, r.ranks, r.machine.hostname, r.unix_time
        )
    };
    let mut lines = vec![
        format!("# old: {}: {}", args.old.display(), describe(&old)),
        format!("# new: {}: {}", args.new.display(), describe(&new)),
    ];
    if (&old.subcommand, &old.transport, old.ranks) != (&new.subcommand, &new.transport, new.ranks)
    {
        lines.push("# warning: the two reports measure different configurations".into());
    }
    let (changes, unmatched) = changes(&old, &new);
    let threshold = args.threshold;
    // The cells read the change back from the row pair: `row` is the new row, `peer` the old.
    const COLUMNS: [Column; 6] = [
        Column::new("table", "", 22, |r, _| r.table.clone()),
        Column::new("case", "", 15, |r, _| r.case.clone()),
        Column::new("variant", "", 21, |r, _| r.variant.clone()),
        Column::new("old", "(us)", 12, |_, o| {
            table::col::f3(o.map(|o| o.stats.median_us))
        }),
        Column::new("new", "(us)", 12, |r, _| {
            format!("{:.3}", r.stats.median_us)
        }),
        Column::new("new/old", "", 8, |r, o| {
            table::col::ratio(o.map(|o| r.stats.median_us / o.stats.median_us))
        }),
    ];
    lines.extend(table::header(
        &format!("median time per row; flagged beyond {threshold}%"),
        &COLUMNS,
    ));
    for c in &changes {
        let line = table::row_line(&COLUMNS, &c.new, Some(&c.old));
        lines.push(
            format!("{line}  {}", flag(c.ratio, threshold))
                .trim_end()
                .into(),
        );
    }
    let regressions = changes
        .iter()
        .filter(|c| flag(c.ratio, threshold) == "REGRESSION")
        .count();
    let ratios: Vec<f64> = changes.iter().map(|c| c.ratio).collect();
    lines.push(format!(
        "# {} rows compared ({unmatched} in only one report); geomean new/old {}; {regressions} \
         regressions beyond {threshold}%",
        changes.len(),
        table::col::ratio(geomean(&ratios))
    ));
    table::print(&lines);
    if regressions > 0 {
        return Err(BenchError::Regressions(regressions));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::report::{Machine, SCHEMA_VERSION};
    use crate::engine::row::Bus;

    /// A report of one all_gather table: tpcomm at `tpcomm_ns` per size, rsmpi at 1 us.
    pub(crate) fn report(tpcomm_ns: u64) -> Report {
        let mut rows = Vec::new();
        for bytes in [8usize, 64, 512] {
            for (variant, ns) in [("tpcomm", tpcomm_ns), ("rsmpi", 1000)] {
                let row = Row::new(
                    "all_gather",
                    &bytes.to_string(),
                    variant,
                    bytes,
                    1,
                    vec![ns; 3],
                );
                rows.push(
                    row.unwrap()
                        .bus(Bus::AllButOwnShare, 2)
                        .with("type", "uint8"),
                );
            }
        }
        crate::engine::row::link_peers(&mut rows, |r| r.is("tpcomm").then(|| "rsmpi".into()));
        Report {
            schema_version: SCHEMA_VERSION,
            tool: "tpcomm-bench".into(),
            version: "0".into(),
            subcommand: "transport".into(),
            command_line: vec!["tpcomm-bench".into(), "transport".into()],
            unix_time: 1,
            machine: Machine::current(),
            transport: "local".into(),
            ranks: 2,
            mpi_library: None,
            settings: serde_json::json!({ "iters": 3 }),
            rows,
            summary: vec!["all_gather: avg busbw 0.1 GB/s".into()],
            targets: vec![crate::engine::targets::Verdict {
                target: "tpcomm within 1.10x of rsmpi".into(),
                reason: "a wrapper should cost next to nothing".into(),
                met: tpcomm_ns <= 1100,
                detail: String::new(),
                binding: false,
                line: crate::engine::targets::RatioLine::new("rsmpi", 1.1),
            }],
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tpcomm-bench-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_report_written_reads_back_the_same_unless_its_schema_is_newer() {
        let path = scratch("roundtrip").join("r.json");
        let written = report(1100);
        report::write(&path, &written).unwrap();
        let read = report::read(&path).unwrap();
        assert_eq!(read, written);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"schema_version\": 1"), "{text}");
        // A report of a newer schema is refused.
        let mut newer = report(1000);
        newer.schema_version = SCHEMA_VERSION + 1;
        report::write(&path, &newer).unwrap();
        assert!(report::read(&path).is_err());
    }

    #[test]
    fn compare_flags_rows_slower_than_the_threshold() {
        let dir = scratch("compare");
        let (old, new) = (dir.join("old.json"), dir.join("new.json"));
        report::write(&old, &report(1000)).unwrap();
        report::write(&new, &report(1200)).unwrap();
        let (changes, unmatched) =
            changes(&report::read(&old).unwrap(), &report::read(&new).unwrap());
        assert_eq!((changes.len(), unmatched), (6, 0));
        let tpcomm: Vec<f64> = changes
            .iter()
            .filter(|c| c.new.is("tpcomm"))
            .map(|c| c.ratio)
            .collect();
        assert!(tpcomm.iter().all(|&r| (r - 1.2).abs() < 1e-9), "{tpcomm:?}");
        let args = |threshold| CompareArgs {
            old: old.clone(),
            new: new.clone(),
            threshold,
        };
        assert!(matches!(run(&args(10.0)), Err(BenchError::Regressions(3))));
        assert!(run(&args(25.0)).is_ok());
        assert_eq!(flag(0.8, 10.0), "faster");
    }

    #[test]
    fn plot_writes_a_time_and_a_bandwidth_chart_per_table() {
        let dir = scratch("plot");
        let files = crate::charts::plot_report(&report(1100), &dir).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "transport-local2-all-gather-time.svg",
                "transport-local2-all-gather-busbw.svg"
            ]
        );
        let svg: Vec<String> = files
            .iter()
            .map(|f| std::fs::read_to_string(f).unwrap())
            .collect();
        for s in &svg {
            assert!(s.starts_with("<svg") && s.contains("tpcomm") && s.contains("rsmpi"));
        }
        assert!(svg[0].contains("size (B)"));
        // The ratio target on the time chart only.
        assert!(svg[0].contains("target: 1.10x rsmpi"), "{}", svg[0]);
        assert!(!svg[1].contains("target:"));
    }
}
