//! The targets of `allreduce` against `MPI_Allreduce` and the memory-bandwidth floor, each
//! verdict quoting what the data-movement and staged floors allow.

use super::{
    BEST_OF_TWO, C_LOOP, EAGER_EVERY_SIZE, FLOOR_EAGER, FLOOR_MIN_BYTES, FLOOR_STAGED, FLOOR_SUM,
    GEOMEAN_SIZES, MEMCPY_RATIO_TARGET, MPI, PEER_TOLERANCE, SMALL_RATIO_TARGET, SMALL_SIZE,
    SPEEDUP_TARGETS,
};
use crate::engine::row::Row;
use crate::engine::summary::geomean;
use crate::engine::sweep::format_bytes;
use crate::engine::targets::{floor_bound, within, RatioLine, Target};

/// The geometric mean over [`GEOMEAN_SIZES`] of how much faster than `MPI_Allreduce` the
/// f32 rows of `variant` are.
pub(super) fn speedup(rows: &[Row], variant: &str) -> Option<f64> {
    let s: Vec<f64> = rows
        .iter()
        .filter(|r| r.table == "f32" && r.is(variant))
        .filter(|r| (GEOMEAN_SIZES.0..=GEOMEAN_SIZES.1).contains(&r.bytes))
        .filter_map(|r| r.vs_peer.filter(|&x| x > 0.0).map(|x| 1.0 / x))
        .collect();
    geomean(&s)
}

/// The geometric mean over [`GEOMEAN_SIZES`] of the speedup over `MPI_Allreduce` of the
/// fastest of `variants` at each size (f32; sizes where none of them ran are left out).
pub(super) fn best_speedup(rows: &[Row], variants: &[&str]) -> Option<f64> {
    let mut best = std::collections::BTreeMap::<usize, f64>::new();
    for r in rows.iter().filter(|r| r.table == "f32") {
        let sized = (GEOMEAN_SIZES.0..=GEOMEAN_SIZES.1).contains(&r.bytes);
        let x = r.vs_peer.filter(|&x| x > 0.0);
        if let (true, true, Some(x)) = (sized, variants.iter().any(|v| r.is(v)), x) {
            let e = best.entry(r.bytes).or_insert(0.0);
            *e = e.max(1.0 / x);
        }
    }
    geomean(&best.into_values().collect::<Vec<_>>())
}

/// Where `auto` is slower than `MPI_Allreduce`, what the staged floors (the faster of
/// `floor 1stage` and `floor 2stage` at that size, in C) say: "; at 64 KiB the staged floor
/// bounds it at 1.02x: out of reach (bit-stable algorithms cannot beat MPI_Allreduce
/// there)", or nothing when auto is never slower or no floor ran.
pub(super) fn slower_sizes_bound(rows: &[Row]) -> String {
    let at = |variant: &str, bytes: usize| {
        rows.iter()
            .find(|r| r.table == "f32" && r.is(variant) && r.bytes == bytes)
            .and_then(|r| r.vs_peer)
    };
    let clauses: Vec<String> = rows
        .iter()
        .filter(|r| r.table == "f32" && r.is("auto"))
        .filter(|r| r.vs_peer.is_some_and(|x| x > EAGER_EVERY_SIZE))
        .filter_map(|r| {
            let floor = FLOOR_STAGED
                .iter()
                .filter_map(|f| at(f, r.bytes))
                .reduce(f64::min)?;
            let reach = if floor > EAGER_EVERY_SIZE {
                ": out of reach (no bit-stable staged all-reduce beats MPI_Allreduce there)"
            } else {
                ""
            };
            Some(format!(
                "at {} the staged floor bounds it at {floor:.3}x{reach}",
                format_bytes(r.bytes)
            ))
        })
        .collect();
    if clauses.is_empty() {
        String::new()
    } else {
        format!("; {}", clauses.join("; "))
    }
}

/// What a floor row allows a target: "; the floor bounds it at X" (out of reach when below
/// `target`, with `better` telling which side of it is good).
fn bound(floor: &str, value: Option<f64>, target: f64, better: fn(f64, f64) -> bool) -> String {
    value.map_or_else(String::new, |v| {
        floor_bound(
            &format!("`{floor}`"),
            &format!("it at {v:.3}x"),
            better(v, target),
            "",
        )
    })
}

/// The targets against `MPI_Allreduce`, judged on the `auto` rows (the eager all-reduce as
/// callers run it) and, separately, on the `replay` rows (a captured plan); and the eager
/// path against the memory-bandwidth floor. Each verdict quotes what the data-movement
/// floors (`floor copy+sum` for the eager path, `floor sum` for a replay) allow.
pub(super) fn targets() -> Vec<Target> {
    let span = format!(
        "{}..{}",
        format_bytes(GEOMEAN_SIZES.0),
        format_bytes(GEOMEAN_SIZES.1)
    );
    let more = |v: f64, t: f64| v >= t;
    let mut out = Vec::new();
    for (path, what, target) in SPEEDUP_TARGETS {
        let floor = if path == "auto" {
            FLOOR_EAGER
        } else {
            FLOOR_SUM
        };
        out.push(Target {
            what: format!(
                "{path} ({what}), f32: at least {target}x faster than MPI_Allreduce, \
                 geometric mean over {span} (2 ranks)"
            ),
            why: "a custom all-reduce inside a node is only worth its peer memory and its \
                  lifecycle if it clearly beats the MPI library on the sizes of inference",
            line: RatioLine::new(MPI, 1.0 / target),
            judge: Box::new(move |rows: &[Row]| {
                let g = speedup(rows, path)?;
                let mut detail = format!("geomean speedup over MPI_Allreduce {g:.3}x");
                let forced: Vec<String> = ["1stage", "2stage"]
                    .iter()
                    .filter(|_| path == "auto")
                    .filter_map(|p| speedup(rows, p).map(|g| format!("{p} {g:.3}x")))
                    .collect();
                if !forced.is_empty() {
                    detail.push_str(&format!(" (forced: {})", forced.join(", ")));
                }
                detail.push_str(&bound(floor, speedup(rows, floor), target, more));
                if path == "auto" {
                    let staged = best_speedup(rows, &FLOOR_STAGED);
                    let name = "floor 1stage|2stage";
                    detail.push_str(&bound(name, staged, target, more));
                }
                Some((g >= target, detail))
            }),
        });
        out.push(Target {
            what: format!(
                "{path} ({what}), f32: within {SMALL_RATIO_TARGET}x of MPI_Allreduce at {} \
                 (2 ranks)",
                format_bytes(SMALL_SIZE)
            ),
            why: "small all-reduces are latency-bound; the custom path must not lose there what \
                  it gains on larger sizes",
            line: None,
            judge: within(
                move |r| r.table == "f32" && r.is(path) && r.bytes == SMALL_SIZE,
                |x| x,
                SMALL_RATIO_TARGET,
            ),
        });
    }
    out.push(Target {
        what: format!(
            "the peer, f32: MPI_Allreduce timed in the run within {:.0}% of the C loop's, at \
             every size (2 ranks)",
            PEER_TOLERANCE * 100.0
        ),
        why: "the targets above compare with the peer: it must cost what the call costs a C \
              program calling it in a loop at the same moment, no more",
        line: None,
        judge: within(
            |r| r.table == "f32" && r.is(C_LOOP),
            |x| (1.0 / x - 1.0).abs(),
            PEER_TOLERANCE,
        ),
    });
    out.push(Target {
        what: "auto (eager all_reduce, bit-stable), f32: never slower than MPI_Allreduce, at \
               every size (2 ranks)"
            .into(),
        why: "a caller should not have to choose the library per message size, nor give up \
              results that do not depend on the batch to get the faster one",
        line: RatioLine::new(MPI, EAGER_EVERY_SIZE),
        judge: Box::new(|rows: &[Row]| {
            let every = within(
                |r| r.table == "f32" && r.is("auto"),
                |x| x,
                EAGER_EVERY_SIZE,
            );
            let (met, detail) = every(rows)?;
            Some((met, format!("{detail}{}", slower_sizes_bound(rows))))
        }),
    });
    out.push(Target {
        what: format!(
            "auto (eager all_reduce), f32: within {:.0}% of the faster of 1stage and 2stage, at \
             every size (2 ranks)",
            (BEST_OF_TWO - 1.0) * 100.0
        ),
        why: "the dispatch table is worth having only if it picks the faster algorithm on the \
              machine it was tuned on",
        line: None,
        judge: Box::new(|rows: &[Row]| {
            let f32_rows = || rows.iter().filter(|r| r.table == "f32");
            let median = |variant: &str, bytes: usize| {
                f32_rows()
                    .find(|r| r.is(variant) && r.bytes == bytes)
                    .map(|r| r.stats.median_us)
            };
            let ratios: Vec<(usize, f64)> = f32_rows()
                .filter(|r| r.is("auto"))
                .filter_map(|r| {
                    let best = median("1stage", r.bytes)?.min(median("2stage", r.bytes)?);
                    (best > 0.0).then(|| (r.bytes, r.stats.median_us / best))
                })
                .collect();
            let &(far_at, farthest) = ratios.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
            let outside: Vec<String> = ratios
                .iter()
                .filter(|(_, x)| *x > BEST_OF_TWO)
                .map(|&(b, x)| format!("{} {x:.3}x", format_bytes(b)))
                .collect();
            let within = ratios.len() - outside.len();
            let mut detail = format!(
                "auto / faster forced algorithm: {within} of {} sizes within",
                ratios.len()
            );
            if outside.is_empty() {
                detail.push_str(&format!(
                    ", farthest {} {farthest:.3}x",
                    format_bytes(far_at)
                ));
            } else {
                detail.push_str(&format!("; outside: {}", outside.join(", ")));
            }
            Some((outside.is_empty(), detail))
        }),
    });
    out.push(Target {
        what: format!(
            "auto (eager all_reduce), f32: at most {MEMCPY_RATIO_TARGET}x the time of one memcpy \
             of the message at {} (2 ranks)",
            format_bytes(FLOOR_MIN_BYTES)
        ),
        why: "large all-reduces are bound by memory bandwidth: the eager path should cost about \
              as much memory traffic as the copies it cannot avoid",
        line: None,
        judge: Box::new(|rows: &[Row]| {
            let at = |variant: &str| {
                rows.iter()
                    .filter(|r| r.table == "f32" && r.is(variant))
                    .filter(|r| r.bytes >= FLOOR_MIN_BYTES)
                    .max_by_key(|r| r.bytes)
                    .and_then(|r| r.number("vs_memcpy"))
            };
            let x = at("auto")?;
            let less = |v: f64, t: f64| v <= t;
            let staged = FLOOR_STAGED.iter().filter_map(|f| at(f)).reduce(f64::min);
            let detail = format!(
                "auto / memcpy {x:.3}x{}{}",
                bound(FLOOR_EAGER, at(FLOOR_EAGER), MEMCPY_RATIO_TARGET, less),
                bound("floor 1stage|2stage", staged, MEMCPY_RATIO_TARGET, less)
            );
            Some((x <= MEMCPY_RATIO_TARGET, detail))
        }),
    });
    out
}
