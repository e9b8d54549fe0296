//! The closing lines of each `allreduce` table: the memory-bandwidth floor, where two-stage
//! overtakes one-stage next to the dispatcher's thresholds, and whether `auto` ran the
//! faster algorithm.

use tpcomm::allreduce::dispatch::{DispatchTable, Input};
use tpcomm::allreduce::DType;

use super::{AUTO_MARGIN, FLOOR_MIN_BYTES, MEMCPY};
use crate::engine::row::Row;
use crate::engine::session::Session;
use crate::engine::summary::per_size;
use crate::engine::sweep::{format_bytes, short_bytes};

/// `(size, one-stage median, two-stage median)` -> the crossover sizes: from which size on
/// two-stage stays faster, and the first size where it is faster.
pub(super) fn crossover(points: &[(usize, f64, f64)]) -> (Option<usize>, Option<usize>) {
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

/// The bands of `table` for `ranks` ranks, `dtype` and `input`: "1stage up to 4 KiB,
/// 2stage above".
pub(super) fn bands_text(
    table: &DispatchTable,
    ranks: usize,
    dtype: DType,
    input: Input,
) -> String {
    let key = tpcomm::allreduce::dispatch::Key {
        ranks,
        dtype,
        input,
    };
    let Some(bands) = table.bands(&key) else {
        return "no rows".into();
    };
    let parts: Vec<String> = bands
        .iter()
        .map(|b| match (b.min, b.max) {
            (_, usize::MAX) if bands.len() == 1 => format!("{} at every size", b.choice.name()),
            (_, usize::MAX) => format!("{} above", b.choice.name()),
            (0, max) => format!("{} up to {}", b.choice.name(), format_bytes(max)),
            (_, max) => format!("{} to {}", b.choice.name(), format_bytes(max)),
        })
        .collect();
    parts.join(", ")
}

/// The closing lines of one element type's table: the crossover of the two algorithms
/// against the bands of the dispatch table in use, and whether `auto` ran the faster one.
pub(super) fn summarize(
    s: &mut Session<'_>,
    dtype: DType,
    ranks: usize,
    table: Option<&DispatchTable>,
) {
    let (element, dtype) = (dtype, dtype.name());
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
    let dispatcher = match table {
        Some(t) => format!(
            "; dispatch table for eager calls: {}; for registered inputs and replays: {}",
            bands_text(t, ranks, element, Input::Staged),
            bands_text(t, ranks, element, Input::Registered)
        ),
        None => String::new(),
    };
    s.summary(format!(
        "{dtype} crossover, {ranks} ranks: measured {measured}{dispatcher}"
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
pub(super) fn floor_line(dtype: &str, rows: &[Row]) -> Option<String> {
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
