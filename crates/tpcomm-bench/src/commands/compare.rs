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
    use crate::engine::report::{sample, scratch};

    #[test]
    fn compare_flags_rows_slower_than_the_threshold() {
        let dir = scratch("compare");
        let (old, new) = (dir.join("old.json"), dir.join("new.json"));
        report::write(&old, &sample(1000)).unwrap();
        report::write(&new, &sample(1200)).unwrap();
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
}
