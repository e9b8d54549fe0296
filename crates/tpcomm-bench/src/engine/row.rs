//! [`Row`], the one row type of every table and of the JSON report: a variant's statistics
//! on one case ([`Stats`]), its bandwidths ([`Bus`]) and its comparison with the case's peer
//! ([`link_peers`]).
//!
//! Conventions (nccl-tests, `doc/PERFORMANCE.md`): `time` is the median over iterations of
//! the slowest rank's time; `algbw = bytes / time`; `busbw = algbw * factor` ([`Bus`]).
//! GB/s are 10^9 bytes per second.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::timing::median;

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
}
