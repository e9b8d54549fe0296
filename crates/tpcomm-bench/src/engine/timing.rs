//! The interleaved timing loop.
//!
//! A subcommand declares each case as a [`Spec`] (the table, a size or a payload, the
//! variants it times, the peer they are compared with, sums and facts); [`time_variants`]
//! runs one case: warm-up iterations, an iteration count chosen from them, then timed
//! iterations with the variants interleaved (each timed run right after an untimed one of
//! the same variant), each iteration's time being its slowest rank's; [`Spec::rows`] turns
//! the samples into rows.

use std::time::{Duration, Instant};

use serde_json::Value;
use tpcomm::Communicator;

use crate::engine::error::BenchError;
use crate::engine::placement::{Placement, Probe};
use crate::engine::row::{link_peers, Bus, Row};
use crate::engine::sweep::IterArgs;
use crate::engine::table::Progress;

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
/// [`Session::measure`](crate::engine::session::Session::measure).
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

#[cfg(test)]
mod tests {
    use super::*;
    use tpcomm::transport::LocalGroup;

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
}
