//! The benchmark engine every subcommand uses: rows, the interleaved timing loop,
//! verification agreed across ranks, and targets.
//!
//! A subcommand declares each case as a [`Spec`] (the table, a size or a payload, the
//! variants it times, the peer they are compared with, sums and facts), its columns and its
//! targets; [`time_variants`] runs one case: warm-up iterations, an iteration count chosen
//! from them, then timed iterations with the variants interleaved (each timed run right after
//! an untimed one of the same variant), each iteration's time being its slowest rank's;
//! [`Spec::rows`] turns the samples into rows. [`Row`] is the one row type of every table and
//! of the JSON report.
//!
//! Conventions (nccl-tests, `doc/PERFORMANCE.md`): `time` is the median over iterations of
//! the slowest rank's time; `algbw = bytes / time`; `busbw = algbw * factor` ([`Bus`]).
//! GB/s are 10^9 bytes per second.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tpcomm::Communicator;

use crate::error::BenchError;
use crate::placement::{Placement, Probe};
use crate::sweep::IterArgs;
use crate::table::Progress;

/// Median, minimum and maximum of per-iteration times, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Stats {
    /// Median (mean of the two middle samples for an even count).
    pub(crate) median_us: f64,
    /// Fastest iteration.
    pub(crate) min_us: f64,
    /// Slowest iteration.
    pub(crate) max_us: f64,
}

impl Stats {
    /// Statistics of `samples_ns` (nanoseconds); `None` when there are no samples.
    pub(crate) fn of(samples_ns: &[u64]) -> Option<Self> {
        let mut sorted = samples_ns.to_vec();
        sorted.sort_unstable();
        let (&min, &max) = (sorted.first()?, sorted.last()?);
        let mid = sorted.len() / 2;
        let median_ns = if sorted.len() % 2 == 1 {
            sorted[mid] as f64
        } else {
            (sorted[mid - 1] as f64 + sorted[mid] as f64) / 2.0
        };
        Some(Self {
            median_us: median_ns / 1e3,
            min_us: min as f64 / 1e3,
            max_us: max as f64 / 1e3,
        })
    }
}

/// How bus bandwidth relates to algorithm bandwidth for an operation (nccl-tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bus {
    /// `busbw = algbw * (n-1)/n`: all-gather, gather, all-to-all.
    AllButOwnShare,
    /// `busbw = algbw`: broadcast.
    Same,
    /// `busbw = algbw * 2(n-1)/n`: all-reduce.
    AllReduce,
}

impl Bus {
    pub(crate) fn factor(self, ranks: usize) -> f64 {
        let n = ranks.max(1) as f64;
        match self {
            Bus::AllButOwnShare => (n - 1.0) / n,
            Bus::Same => 1.0,
            Bus::AllReduce => 2.0 * (n - 1.0) / n,
        }
    }
}

/// One row of every table and of the JSON report: one variant on one case.
///
/// The fields are the JSON schema (`bench/results/README.md`); `(table, case,
/// variant)` names a row across runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Row {
    /// The table the row belongs to (`all_gather`, `f32`, `peer mappings`, ...).
    pub(crate) table: String,
    /// The case within the table: a size in bytes, a payload (`blob:64`), a count (`N=100`).
    pub(crate) case: String,
    /// What was timed (`tpcomm`, `rsmpi`, `floor`, `1stage`, `close_all`, ...).
    pub(crate) variant: String,
    /// Bytes the case moves, in the table's convention (the charts' x axis).
    pub(crate) bytes: usize,
    /// Timed iterations.
    pub(crate) iters: usize,
    /// Untimed iterations before them.
    pub(crate) warmup: usize,
    #[serde(flatten)]
    pub(crate) stats: Stats,
    /// `bytes / median`, GB/s (tables with a bandwidth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) algbw_gbps: Option<f64>,
    /// `algbw` times the operation's bus factor, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) busbw_gbps: Option<f64>,
    /// The variant of the same case this row is compared with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) peer: Option<String>,
    /// `median / the peer's median` (below 1: faster than the peer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) vs_peer: Option<f64>,
    /// Facts particular to the subcommand (element type, algorithm, mappings, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) info: BTreeMap<String, Value>,
    /// Every iteration's time (slowest rank), nanoseconds, in the order they ran.
    #[serde(default)]
    pub(crate) samples_ns: Vec<u64>,
}

impl Row {
    /// A row of `samples_ns`; `None` without samples.
    pub(crate) fn new(
        table: &str,
        case: &str,
        variant: &str,
        bytes: usize,
        warmup: usize,
        samples_ns: Vec<u64>,
    ) -> Option<Self> {
        Some(Self {
            table: table.into(),
            case: case.into(),
            variant: variant.into(),
            bytes,
            iters: samples_ns.len(),
            warmup,
            stats: Stats::of(&samples_ns)?,
            algbw_gbps: None,
            busbw_gbps: None,
            peer: None,
            vs_peer: None,
            info: BTreeMap::new(),
            samples_ns,
        })
    }

    /// Adds the bandwidth columns.
    pub(crate) fn bus(mut self, bus: Bus, ranks: usize) -> Self {
        let algbw = if self.stats.median_us > 0.0 {
            self.bytes as f64 / self.stats.median_us / 1e3
        } else {
            0.0
        };
        self.algbw_gbps = Some(algbw);
        self.busbw_gbps = Some(algbw * bus.factor(ranks));
        self
    }

    /// Adds a subcommand-specific fact.
    pub(crate) fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.info.insert(key.into(), value.into());
        self
    }

    /// An `info` fact as text (`-` when absent).
    pub(crate) fn text(&self, key: &str) -> String {
        match self.info.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => "-".into(),
            Some(v) => v.to_string(),
        }
    }

    /// An `info` fact as a number.
    pub(crate) fn number(&self, key: &str) -> Option<f64> {
        self.info.get(key).and_then(Value::as_f64)
    }

    /// Whether this row is `(table, case)`'s row of `variant`.
    pub(crate) fn is(&self, variant: &str) -> bool {
        self.variant == variant
    }
}

/// Compares each row with the row of `peer_of(variant)` of its table and case: sets `peer`
/// and `vs_peer`.
pub(crate) fn link_peers(rows: &mut [Row], peer_of: impl Fn(&Row) -> Option<String>) {
    for i in 0..rows.len() {
        let Some(peer) = peer_of(&rows[i]) else {
            continue;
        };
        let peer_median = rows
            .iter()
            .find(|p| p.table == rows[i].table && p.case == rows[i].case && p.variant == peer)
            .map(|p| p.stats.median_us);
        if let Some(m) = peer_median {
            let r = &mut rows[i];
            r.vs_peer = (m > 0.0).then(|| r.stats.median_us / m);
            r.peer = Some(peer);
        }
    }
}

/// Nanoseconds since `start`, saturating.
pub(crate) fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// One timed iteration on this rank: a barrier, then `work`, which receives the start
/// instant and returns its own [`elapsed_ns`] (so that it can stop the clock once its result
/// is ready and drop the result untimed).
pub(crate) fn time_once<C: Communicator>(
    comm: &C,
    work: impl FnOnce(Instant) -> Result<u64, BenchError>,
) -> Result<u64, BenchError> {
    comm.barrier()?;
    work(Instant::now())
}

/// For each position `i`, the largest `local[i]` over all ranks (collective; every rank
/// passes as many values).
pub(crate) fn slowest<C: Communicator>(comm: &C, local: &[u64]) -> Result<Vec<u64>, BenchError> {
    let send: Vec<u8> = local.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut all = vec![0u8; send.len() * comm.size()];
    comm.all_gather(&send, &mut all)?;
    let mut max = vec![0u64; local.len()];
    for rank_block in all.chunks_exact(send.len().max(1)) {
        for (m, word) in max.iter_mut().zip(rank_block.chunks_exact(8)) {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(word);
            *m = (*m).max(u64::from_le_bytes(bytes));
        }
    }
    Ok(max)
}

/// Median of `values` (upper middle for an even count); 0 when empty.
pub(crate) fn median(values: &[u64]) -> u64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted.get(sorted.len() / 2).copied().unwrap_or(0)
}

/// In which order the variants of a case run within one iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Iteration `i` starts at variant `i` and steps through the list by a stride coprime
    /// to its length, the next such stride at each iteration: no variant always runs first,
    /// and none always runs after the same one (with every stride 1, variant `k` would
    /// follow `k - 1` in every iteration but one in `n`, and carry that variant's effect on
    /// the caches: timed after the allreduce table's sum floor, `MPI_Allreduce` of 2 MiB
    /// took 4-8% longer than the identical call timed after a staged floor).
    Rotate,
    /// Always in declaration order (a variant that needs the previous one's effect, such as
    /// `reopen_all` after `close_all`).
    Fixed,
}

impl Order {
    /// The variants of iteration `i` of `n`, in running order.
    pub(crate) fn of(self, n: usize, i: usize) -> Vec<usize> {
        match self {
            Order::Rotate => {
                let strides: Vec<usize> = (1..n).filter(|&s| gcd(s, n) == 1).collect();
                let stride = strides.get(i % strides.len().max(1)).copied().unwrap_or(1);
                (0..n).map(|p| (i + p * stride) % n).collect()
            }
            Order::Fixed => (0..n).collect(),
        }
    }
}

/// The greatest common divisor of `a` and `b`.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// One case of a table, declared by a subcommand and measured by
/// [`Session::measure`](crate::launch::Session::measure).
#[derive(Debug, Clone)]
pub(crate) struct Spec<'a> {
    /// The table the rows go to.
    pub(crate) table: &'a str,
    /// The case within the table (a size, a payload, a count).
    pub(crate) case: String,
    /// Bytes the case moves (0 where it is not a size).
    pub(crate) bytes: usize,
    /// What is timed, one name per variant, in declaration order.
    pub(crate) variants: &'a [&'a str],
    pub(crate) order: Order,
    /// The variant every other one is compared with.
    pub(crate) peer: Option<&'a str>,
    /// How bus bandwidth follows from algorithm bandwidth, for tables with bandwidths.
    pub(crate) bus: Option<Bus>,
    /// Rows that are the per-iteration sum of two variants: `(name, a, b)`.
    pub(crate) sums: &'a [(&'a str, usize, usize)],
    /// Facts every row of the case carries (`info`).
    pub(crate) info: Vec<(String, Value)>,
}

impl<'a> Spec<'a> {
    /// A case of `variants` in rotated order, without peer, bandwidth, sums or facts.
    pub(crate) fn new(table: &'a str, case: String, bytes: usize, variants: &'a [&'a str]) -> Self {
        Self {
            table,
            case,
            bytes,
            variants,
            order: Order::Rotate,
            peer: None,
            bus: None,
            sums: &[],
            info: Vec::new(),
        }
    }

    /// Adds a fact every row carries.
    pub(crate) fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.info.push((key.into(), value.into()));
        self
    }

    /// The rows of the case from every variant's samples (`samples[v]`, slowest rank per
    /// iteration, nanoseconds) over `ranks` ranks: one per variant and per declared sum, with
    /// the bandwidths, the case's facts and the comparison with its peer. A variant without
    /// samples has no row.
    pub(crate) fn rows(&self, ranks: usize, warmup: usize, mut samples: Vec<Vec<u64>>) -> Vec<Row> {
        let mut names: Vec<&str> = self.variants.to_vec();
        for &(name, a, b) in self.sums {
            let sum = samples[a].iter().zip(&samples[b]).map(|(x, y)| x + y);
            samples.push(sum.collect());
            names.push(name);
        }
        let mut rows: Vec<Row> = names
            .into_iter()
            .zip(samples)
            .filter_map(|(variant, samples)| {
                let mut row =
                    Row::new(self.table, &self.case, variant, self.bytes, warmup, samples)?;
                if let Some(bus) = self.bus {
                    row = row.bus(bus, ranks);
                }
                row.info.extend(self.info.iter().cloned());
                Some(row)
            })
            .collect();
        if let Some(peer) = self.peer {
            link_peers(&mut rows, |r| (!r.is(peer)).then(|| peer.to_string()));
        }
        rows
    }
}

/// Times the variants of `spec`, interleaved in its order (collective): `warmup_for(bytes)`
/// warm-up rounds, an iteration count chosen from them (the same on every rank, from
/// gathered figures), then the timed rounds. `once(state, v)` runs variant `v` once, as one
/// timed iteration ([`time_once`]), and returns its time on this rank. Returns the warm-up
/// count, per variant every iteration's slowest-rank time, and where the ranks ran over the
/// timed rounds (read between rounds, untimed).
///
/// In rotated order (unless `--cold`), each variant runs twice in a row within a round and
/// only the second run counts: it finds its buffers and caches as its own previous call left
/// them, as in a loop of the call. Interleaving single runs would time every variant just
/// after the others evicted its data: `MPI_Allreduce` of 2-4 MiB then took 1.3-1.7x as long
/// as the same call in a C loop.
pub(crate) fn time_variants<C: Communicator, S>(
    comm: &C,
    iter: &IterArgs,
    spec: &Spec<'_>,
    progress: &Progress,
    state: &mut S,
    mut once: impl FnMut(&mut S, usize) -> Result<u64, BenchError>,
) -> Result<(usize, Vec<Vec<u64>>, Placement), BenchError> {
    let (n, warmup) = (spec.variants.len(), iter.warmup_for(spec.bytes));
    let twice = spec.order == Order::Rotate && !iter.cold;
    let mut round = |i: usize, out: &mut Vec<Vec<u64>>| -> Result<(), BenchError> {
        for v in spec.order.of(n, i) {
            if twice {
                once(state, v)?;
            }
            out[v].push(once(state, v)?);
        }
        Ok(())
    };
    let mut warm = vec![Vec::with_capacity(warmup); n];
    for i in 0..warmup {
        round(i, &mut warm)?;
        progress.tick(0, 0);
    }
    let iters = iteration_count(comm, iter, &warm)?;
    let mut times = vec![Vec::with_capacity(iters); n];
    let mut probe = Probe::start(iters);
    for i in 0..iters {
        round(i, &mut times)?;
        probe.round();
        progress.tick(i + 1, iters);
    }
    let samples: Vec<Vec<u64>> = times
        .iter()
        .map(|t| slowest(comm, t))
        .collect::<Result<_, _>>()?;
    let calls = if twice { 2 } else { 1 };
    let round_ns = samples.iter().map(|t| calls * median(t)).sum();
    Ok((warmup, samples, probe.finish(comm, round_ns)?))
}

/// Collective: the timed iterations the policy picks after the warm-up times `warm` (one list
/// per variant, this rank's): from the slowest variant's median of the slowest rank's times,
/// the same count on every rank.
pub(crate) fn iteration_count<C: Communicator>(
    comm: &C,
    iter: &IterArgs,
    warm: &[Vec<u64>],
) -> Result<usize, BenchError> {
    let mut estimate = 0;
    for w in warm {
        estimate = estimate.max(median(&slowest(comm, w)?));
    }
    Ok(iter.iters_for(Duration::from_nanos(estimate)))
}

/// Collective: the ranks whose `problem` is set, the same list on every rank; fails on every
/// rank when any rank saw wrong data, so that nobody is left waiting in a collective.
pub(crate) fn agree<C: Communicator>(
    comm: &C,
    problem: Option<String>,
    what: impl FnOnce() -> String,
) -> Result<(), BenchError> {
    let mut all = vec![0u8; comm.size()];
    comm.all_gather(&[u8::from(problem.is_some())], &mut all)?;
    let bad_ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r] != 0).collect();
    let Some(&first) = bad_ranks.first() else {
        return Ok(());
    };
    let rank = if problem.is_some() {
        comm.rank()
    } else {
        first
    };
    Err(BenchError::WrongData {
        what: what(),
        rank,
        detail: problem.unwrap_or_else(|| format!("see rank {first}")),
        bad_ranks,
    })
}

/// How a [`Target`] judges the rows: met, and the figures it was decided from; `None` when
/// the rows hold nothing to judge.
pub(crate) type Judge = Box<dyn Fn(&[Row]) -> Option<(bool, String)>>;

/// The most rows outside a target that its detail names.
const MAX_LISTED: usize = 5;

/// The judge of "every row that `pick` chooses within `limit` of its peer", `distance`
/// telling how far a ratio is (`|x| x` for "at most", `|x| (x - 1.0).abs()` for "either
/// way"): met when no ratio is farther than `limit`; the detail counts the rows within and
/// names those outside, farthest first (or the farthest, when none is). `None` when no
/// chosen row has a peer.
pub(crate) fn within(
    pick: impl Fn(&Row) -> bool + 'static,
    distance: fn(f64) -> f64,
    limit: f64,
) -> Judge {
    Box::new(move |rows: &[Row]| {
        let ratios: Vec<(f64, &Row)> = rows
            .iter()
            .filter(|r| pick(r))
            .filter_map(|r| Some((r.vs_peer?, r)))
            .collect();
        let far = |(x, r): &(f64, &Row)| format!("{} {} {} {x:.3}x", r.table, r.case, r.variant);
        let mut outside: Vec<&(f64, &Row)> = ratios
            .iter()
            .filter(|(x, _)| distance(*x) > limit)
            .collect();
        outside.sort_by(|a, b| distance(b.0).total_cmp(&distance(a.0)));
        let within = ratios.len() - outside.len();
        let mut detail = format!("{within} of {} rows within", ratios.len());
        if outside.is_empty() {
            let farthest = ratios
                .iter()
                .max_by(|a, b| distance(a.0).total_cmp(&distance(b.0)))?;
            detail.push_str(&format!(", farthest {}", far(farthest)));
        } else {
            let listed: Vec<String> = outside.iter().take(MAX_LISTED).map(|r| far(r)).collect();
            detail.push_str(&format!("; outside, farthest first: {}", listed.join(", ")));
            if outside.len() > MAX_LISTED {
                detail.push_str(&format!(" and {} more", outside.len() - MAX_LISTED));
            }
        }
        Some((outside.is_empty(), detail))
    })
}

/// The clause a verdict adds for the floor measured beside a target: "; `subject` bounds
/// `at`", then ": out of reach`scope` on this machine" when the floor itself misses the
/// target (`reachable` false).
pub(crate) fn floor_bound(subject: &str, at: &str, reachable: bool, scope: &str) -> String {
    let reach = if reachable {
        String::new()
    } else {
        format!(": out of reach{scope} on this machine")
    };
    format!("; {subject} bounds {at}{reach}")
}

/// A target drawn on the time charts: `ratio` times the median of `peer`, case by case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RatioLine {
    /// The variant the target compares with.
    pub(crate) peer: String,
    /// The largest time allowed, as a multiple of the peer's.
    pub(crate) ratio: f64,
}

impl RatioLine {
    pub(crate) fn new(peer: &str, ratio: f64) -> Option<Self> {
        Some(Self {
            peer: peer.into(),
            ratio,
        })
    }
}

/// A performance target a subcommand checks its rows against, with the reason it exists.
pub(crate) struct Target {
    /// What is aimed at, for a user ("tpcomm within 1.1x of rsmpi at every size").
    pub(crate) what: String,
    /// Why this figure is the target.
    pub(crate) why: &'static str,
    /// The verdict from the rows: met, and the figures it was decided from; `None` when the
    /// rows hold nothing to judge.
    pub(crate) judge: Judge,
    /// The target as a line on the charts, where it is a ratio to a peer at every case.
    pub(crate) line: Option<RatioLine>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("what", &self.what).finish()
    }
}

/// A target checked against this run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Verdict {
    pub(crate) target: String,
    pub(crate) reason: String,
    pub(crate) met: bool,
    pub(crate) detail: String,
    /// Whether this run is the configuration the target is stated for; a verdict on
    /// another configuration is indicative only.
    pub(crate) binding: bool,
    /// The target as a line on the charts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) line: Option<RatioLine>,
}

impl Verdict {
    /// The targets `rows` can judge.
    pub(crate) fn judge_all(targets: &[Target], rows: &[Row], binding: bool) -> Vec<Verdict> {
        targets
            .iter()
            .filter_map(|t| {
                let (met, detail) = (t.judge)(rows)?;
                Some(Verdict {
                    target: t.what.clone(),
                    reason: t.why.into(),
                    met,
                    detail,
                    binding,
                    line: t.line.clone(),
                })
            })
            .collect()
    }

    /// The two comment lines of the verdict.
    pub(crate) fn lines(&self) -> [String; 2] {
        let state = if self.met { "MET" } else { "MISSED" };
        let scope = if self.binding {
            ""
        } else {
            " [indicative only]"
        };
        [
            format!("target {}: {state}{scope} ({})", self.target, self.detail),
            format!("  why: {}", self.reason),
        ]
    }
}

/// `items` without repeats, in the order they first come.
pub(crate) fn distinct<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// `"1K 1.02, 4K 0.98"`: each row's size and `value` (rows without one are left out),
/// `decimals` after the point, and the geometric mean of the values.
pub(crate) fn per_size<'r>(
    rows: impl IntoIterator<Item = &'r Row>,
    value: impl Fn(&Row) -> Option<f64>,
    decimals: usize,
) -> (String, Option<f64>) {
    let (mut text, mut values) = (Vec::new(), Vec::new());
    for r in rows {
        if let Some(v) = value(r) {
            text.push(format!(
                "{} {v:.decimals$}",
                crate::sweep::short_bytes(r.bytes)
            ));
            values.push(v);
        }
    }
    (text.join(", "), geomean(&values))
}

/// Geometric mean of `values` (`None` when empty or any is not positive).
pub(crate) fn geomean(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|&v| v <= 0.0) {
        return None;
    }
    Some((values.iter().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp())
}

#[cfg(test)]
impl Row {
    /// A row of one iteration of `us` microseconds, its bytes the case where that is a
    /// number (for tests).
    pub(crate) fn of_us(table: &str, case: &str, variant: &str, us: f64) -> Row {
        let bytes = case.parse().unwrap_or(0);
        Row::new(table, case, variant, bytes, 0, vec![(us * 1e3) as u64]).expect("one sample")
    }

    /// The row compared with its peer by `vs_peer` (for tests).
    pub(crate) fn vs(self, vs_peer: f64) -> Row {
        Row {
            vs_peer: Some(vs_peer),
            ..self
        }
    }
}

/// A row of one iteration of 1 us compared with its peer by `vs_peer` (for tests).
#[cfg(test)]
pub(crate) fn row_vs(table: &str, case: &str, variant: &str, vs_peer: f64) -> Row {
    Row::of_us(table, case, variant, 1.0).vs(vs_peer)
}

/// The verdicts of `targets` on `rows`, binding (for tests).
#[cfg(test)]
pub(crate) fn judge(targets: &[Target], rows: &[Row]) -> Vec<Verdict> {
    Verdict::judge_all(targets, rows, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpcomm::transport::LocalGroup;

    #[test]
    fn median_of_odd_and_even_counts() {
        let s = Stats::of(&[3000, 1000, 2000]).unwrap();
        assert_eq!((s.median_us, s.min_us, s.max_us), (2.0, 1.0, 3.0));
        assert_eq!(Stats::of(&[4000, 1000, 2000, 3000]).unwrap().median_us, 2.5);
        assert!(Stats::of(&[]).is_none());
        assert_eq!(median(&[4, 1, 2, 3]), 3);
    }

    #[test]
    fn bandwidths_follow_nccl_tests() {
        // 1 MB in 1 ms: 1 GB/s algorithm bandwidth.
        let row = |bus| {
            Row::new("t", "c", "v", 1_000_000, 0, vec![1_000_000])
                .unwrap()
                .bus(bus, 4)
        };
        assert!((row(Bus::AllButOwnShare).busbw_gbps.unwrap() - 0.75).abs() < 1e-12);
        assert!((row(Bus::Same).busbw_gbps.unwrap() - 1.0).abs() < 1e-12);
        assert!((row(Bus::AllReduce).busbw_gbps.unwrap() - 1.5).abs() < 1e-12);
    }

    #[test]
    fn rotation_is_a_permutation_that_starts_at_each_variant_equally_often() {
        assert_eq!(Order::Rotate.of(3, 0), vec![0, 1, 2]);
        assert_eq!(Order::Rotate.of(3, 1), vec![1, 0, 2]);
        assert_eq!(Order::Rotate.of(3, 2), vec![2, 0, 1]);
        assert_eq!(Order::Rotate.of(2, 1), vec![1, 0]);
        assert_eq!(Order::Rotate.of(1, 7), vec![0]);
        assert!(Order::Rotate.of(0, 3).is_empty());
        assert_eq!(Order::Fixed.of(3, 2), vec![0, 1, 2]);
        for n in 1..=12 {
            let rounds: Vec<Vec<usize>> = (0..n * n).map(|i| Order::Rotate.of(n, i)).collect();
            for (i, order) in rounds.iter().enumerate() {
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n {n}, round {i}");
            }
            for v in 0..n {
                let first = rounds.iter().filter(|o| o[0] == v).count();
                assert_eq!(
                    first,
                    n,
                    "n {n}: variant {v} runs first {first} times in {}",
                    n * n
                );
            }
        }
    }

    #[test]
    fn rotation_varies_what_runs_before_each_variant() {
        // The variants that run just before `v` within a round, over `2n` rounds.
        let before = |n: usize, v: usize| -> Vec<usize> {
            let mut seen: Vec<usize> = (0..2 * n)
                .filter_map(|i| {
                    let order = Order::Rotate.of(n, i);
                    let p = order.iter().position(|&x| x == v)?;
                    p.checked_sub(1).map(|q| order[q])
                })
                .collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        // 11 variants (the allreduce table with MPI): every other variant runs before each.
        for v in 0..11 {
            let others: Vec<usize> = (0..11).filter(|&u| u != v).collect();
            assert_eq!(before(11, v), others, "variant {v}");
        }
        // 4 (objects): one on each side.
        assert_eq!(before(4, 0), vec![1, 3]);
    }

    /// What `time_variants` returns: the warm-up count, every variant's times and where the
    /// ranks ran.
    type Timed = (usize, Vec<Vec<u64>>, Placement);

    /// Every rank's calls of `once` (the variants, in running order) and what
    /// `time_variants` returned: 1 warm-up round and 4 timed rounds of variants `a` and `b`,
    /// where a variant's first run of a pair takes 1000 ns more than its second.
    fn timed_rounds(cold: bool) -> Vec<(Vec<usize>, Timed)> {
        let iter = IterArgs {
            iters: Some(4),
            warmup: Some(1),
            cold,
        };
        let results = LocalGroup::new(2).run(|comm| {
            let mut log = Vec::new();
            let spec = Spec::new("t", "8".into(), 8, &["a", "b"]);
            let timed =
                time_variants(&comm, &iter, &spec, &Progress::off(), &mut log, |log, v| {
                    let first_of_pair = !cold && log.len() % 2 == 0;
                    log.push(v);
                    Ok(comm.rank() as u64 * 10 + v as u64 + 1000 * u64::from(first_of_pair))
                })?;
            Ok::<_, BenchError>((log, timed))
        });
        results.into_iter().map(|r| r.unwrap().unwrap()).collect()
    }

    /// The variants of the warm-up round and the 4 timed rounds, rotated each round.
    const ROUNDS: [[usize; 2]; 5] = [[0, 1], [0, 1], [1, 0], [0, 1], [1, 0]];

    #[test]
    fn variants_run_interleaved_with_their_peer_in_rotated_order_twice_in_a_row() {
        for (log, timed) in timed_rounds(false) {
            let twice: Vec<usize> = ROUNDS.iter().flatten().flat_map(|&v| [v, v]).collect();
            assert_eq!(log, twice);
            // 1 warm-up; the slowest rank (rank 1) of every iteration, from the second run
            // of each pair; a round runs each variant twice.
            assert_eq!((timed.0, timed.1), (1, vec![vec![10; 4], vec![11; 4]]));
            assert_eq!(timed.2.round_us, 2.0 * (10.0 + 11.0) / 1e3);
        }
    }

    #[test]
    fn cold_rounds_run_each_variant_once() {
        for (log, timed) in timed_rounds(true) {
            assert_eq!(log, ROUNDS.concat());
            assert_eq!((timed.0, timed.1), (1, vec![vec![10; 4], vec![11; 4]]));
            assert_eq!(timed.2.round_us, (10.0 + 11.0) / 1e3);
        }
    }

    #[test]
    fn peers_are_linked_within_a_case() {
        let row = |case: &str, variant: &str, ns| Row::new("t", case, variant, 8, 0, vec![ns]);
        let mut rows: Vec<Row> = [
            row("8", "tpcomm", 1100),
            row("8", "rsmpi", 1000),
            row("16", "tpcomm", 500),
        ]
        .into_iter()
        .flatten()
        .collect();
        link_peers(&mut rows, |r| r.is("tpcomm").then(|| "rsmpi".to_string()));
        assert!((rows[0].vs_peer.unwrap() - 1.1).abs() < 1e-12);
        assert_eq!(rows[0].peer.as_deref(), Some("rsmpi"));
        assert_eq!((rows[1].vs_peer, rows[2].vs_peer), (None, None));
    }

    #[test]
    fn wrong_data_on_one_rank_fails_every_rank_naming_it() {
        let results = LocalGroup::new(3).run(|comm| {
            let problem = (comm.rank() == 2).then(|| "byte 5".to_string());
            agree(&comm, problem, || "all_gather".into())
        });
        for (rank, r) in results.into_iter().enumerate() {
            match r.unwrap() {
                Err(BenchError::WrongData {
                    rank: culprit,
                    bad_ranks,
                    ..
                }) => {
                    assert_eq!((culprit, bad_ranks), (2, vec![2]), "rank {rank}");
                }
                other => panic!("rank {rank}: expected WrongData, got {other:?}"),
            }
        }
    }

    #[test]
    fn within_counts_the_rows_inside_and_names_the_farthest_and_those_outside() {
        let row = |case: &str, vs| row_vs("t", case, "v", vs);
        let judge = within(|r| r.is("v"), |x| (x - 1.0).abs(), 0.05);
        let (met, detail) = judge(&[row("8", 1.04), row("16", 0.94)]).unwrap();
        assert!(!met);
        assert_eq!(
            detail,
            "1 of 2 rows within; outside, farthest first: t 16 v 0.940x"
        );
        assert_eq!(
            judge(&[row("8", 0.96)]),
            Some((true, "1 of 1 rows within, farthest t 8 v 0.960x".into()))
        );
        assert_eq!(judge(&[]), None);
    }

    #[test]
    fn summary_helpers_take_geometric_means_and_keep_first_occurrences() {
        assert_eq!(geomean(&[2.0, 8.0]), Some(4.0));
        assert_eq!(distinct([3, 1, 3, 2, 1]), [3, 1, 2]);
        let rows = [row_vs("t", "a", "v", 2.0), row_vs("t", "b", "v", 8.0)];
        let (text, g) = per_size(&rows, |r| r.vs_peer, 1);
        assert_eq!((text.as_str(), g), ("0 2.0, 0 8.0", Some(4.0)));
    }
}
