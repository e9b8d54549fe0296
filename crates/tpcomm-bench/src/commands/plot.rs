//! `tpcomm-bench plot RESULTS.json... -o DIR`: SVG charts of reports.
//!
//! Per report and table, one chart of time against size and, where the rows have a
//! bandwidth, one of bus bandwidth against size; both axes logarithmic, one line per variant
//! (the peer included). Where a target is a ratio to a peer at every case, the time chart
//! also draws it as a dashed line: the peer's time times the ratio, the most a variant may
//! take. Tables without sizes (peer mappings, suspend/resume) are drawn against their case,
//! a count. Text is left to the SVG viewer's fonts.

use std::path::{Path, PathBuf};

use clap::Args;
use plotters::prelude::*;

use crate::engine::error::BenchError;
use crate::engine::report::{self, Report};
use crate::engine::row::Row;

/// Options of `tpcomm-bench plot`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PlotArgs {
    /// JSON reports written with `--json`.
    #[arg(required = true, value_name = "RESULTS.json")]
    pub(crate) reports: Vec<PathBuf>,
    /// Directory the SVG files go to (created if missing).
    #[arg(short, long, value_name = "DIR")]
    pub(crate) out: PathBuf,
}

/// Runs the subcommand.
pub(crate) fn run(args: &PlotArgs) -> Result<(), BenchError> {
    std::fs::create_dir_all(&args.out).map_err(|source| BenchError::Write {
        path: args.out.clone(),
        source,
    })?;
    for path in &args.reports {
        for file in plot_report(&report::read(path)?, &args.out)? {
            println!("{}", file.display());
        }
    }
    Ok(())
}

/// What a chart's y axis shows: the file name's suffix, the title's word, the axis's name,
/// a row's figure, and whether the ratio targets are drawn.
struct Measure {
    file: &'static str,
    title: &'static str,
    axis: &'static str,
    of: fn(&Row) -> Option<f64>,
    targets: bool,
}

/// The charts of every table: time, and bus bandwidth where the rows have one.
const MEASURES: [Measure; 2] = [
    Measure {
        file: "time",
        title: "time",
        axis: "median time (us)",
        of: |r| Some(r.stats.median_us),
        targets: true,
    },
    Measure {
        file: "busbw",
        title: "bus bandwidth",
        axis: "bus bandwidth (GB/s)",
        of: |r| r.busbw_gbps,
        targets: false,
    },
];

/// The x of a row: its case where that is a number (a size, a count of buffers), otherwise
/// its bytes (a payload's).
fn x_of(r: &Row) -> Option<f64> {
    let x = r.case.parse::<f64>().unwrap_or(r.bytes as f64);
    (x > 0.0).then_some(x)
}

/// The x axis's name: sizes where the cases are the bytes, counts where they are other
/// numbers, bytes per rank where they are payloads.
fn x_desc(rows: &[&Row]) -> &'static str {
    let case = |r: &&Row| r.case.parse::<f64>().ok();
    if rows.iter().all(|r| case(r) == Some(r.bytes as f64)) {
        "size (B)"
    } else if rows.iter().all(|r| case(r).is_some()) {
        "count"
    } else {
        "bytes per rank"
    }
}

/// The dashed lines of the report's ratio targets whose peer has a series here: the peer's
/// points times the ratio, labelled for the legend.
fn target_lines(
    report: &Report,
    series: &[(String, Vec<(f64, f64)>)],
) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for line in report.targets.iter().filter_map(|v| v.line.as_ref()) {
        let Some((_, peer)) = series.iter().find(|(v, _)| *v == line.peer) else {
            continue;
        };
        let label = format!("target: {:.2}x {}", line.ratio, line.peer);
        if lines.iter().all(|(l, _)| *l != label) {
            let points = peer.iter().map(|&(x, y)| (x, y * line.ratio)).collect();
            lines.push((label, points));
        }
    }
    lines
}

/// `x` in the largest unit of `base` it reaches, without needless decimals: `64K`, `1.5M`,
/// `0.25`.
fn short(x: f64, base: f64, units: &[&str]) -> String {
    let mut v = x;
    let mut unit = 0;
    while v >= base && unit + 1 < units.len() {
        v /= base;
        unit += 1;
    }
    let text = format!("{v:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{}", units[unit])
}

/// `peer mappings` -> `peer-mappings`: a file-name-safe form.
fn slug(text: &str) -> String {
    let s: String = text
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    s.split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// Draws every chart of `report` into `dir`; returns the files written.
pub(crate) fn plot_report(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    let mut tables: Vec<&str> = Vec::new();
    for r in &report.rows {
        if !tables.contains(&r.table.as_str()) {
            tables.push(&r.table);
        }
    }
    let mut written = Vec::new();
    for table in tables {
        let rows: Vec<&Row> = report.rows.iter().filter(|r| r.table == table).collect();
        for measure in &MEASURES {
            let name = format!(
                "{}-{}{}-{}-{}.svg",
                report.subcommand,
                report.transport,
                report.ranks,
                slug(table),
                measure.file
            );
            let path = dir.join(name);
            if chart(report, table, &rows, measure, &path)? {
                written.push(path);
            }
        }
    }
    Ok(written)
}

/// One chart; `false` (nothing written) when the rows hold fewer than two points of it.
fn chart(
    report: &Report,
    table: &str,
    rows: &[&Row],
    measure: &Measure,
    path: &Path,
) -> Result<bool, BenchError> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let (Some(x), Some(y)) = (x_of(r), (measure.of)(r).filter(|&y| y > 0.0)) else {
            continue;
        };
        match series.iter_mut().find(|(v, _)| *v == r.variant) {
            Some((_, points)) => points.push((x, y)),
            None => series.push((r.variant.clone(), vec![(x, y)])),
        }
    }
    let targets = match measure.targets {
        true => target_lines(report, &series),
        false => Vec::new(),
    };
    let points = || {
        series
            .iter()
            .chain(&targets)
            .flat_map(|(_, p)| p.iter().copied())
    };
    if points().count() < 2 {
        return Ok(false);
    }
    let range = |f: fn(&(f64, f64)) -> f64| {
        let (lo, hi) = points()
            .map(|p| f(&p))
            .fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        (lo / 1.5)..(hi * 1.5)
    };
    let err = |e: &dyn std::fmt::Display| BenchError::Plot {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "{} {table}: {} ({}, {} ranks)",
        report.subcommand, measure.title, report.transport, report.ranks
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(range(|p| p.0).log_scale(), range(|p| p.1).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc(rows))
        .y_desc(measure.axis)
        .x_label_formatter(&|x| short(*x, 1000.0, &["", "k", "M", "G"]))
        .y_label_formatter(&|y| short(*y, 1000.0, &["", "k", "M", "G"]))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (variant, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(variant.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    for (label, points) in &targets {
        let style = BLACK.mix(0.6).stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(points.iter().copied(), 6, 4, style))
            .map_err(|e| err(&e))?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::report::{sample, scratch};

    #[test]
    fn plot_writes_a_time_and_a_bandwidth_chart_per_table() {
        let dir = scratch("plot");
        let files = plot_report(&sample(1100), &dir).unwrap();
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
