//! Timing shared by every subcommand: one iteration is a barrier followed by the timed
//! work on every rank; after the loop the per-rank times are all-gathered and each
//! iteration counts as its slowest rank's time.
//!
//! Collective bookkeeping (the gathers of times and of verification verdicts) goes through
//! the fixed-size all-gather of the communicator under test, outside every timed region.

use std::time::Instant;

use tpcomm::Communicator;

use crate::error::BenchError;

/// Nanoseconds since `start`, saturating.
pub(crate) fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// One timed iteration on this rank: a barrier, then `work`, which receives the start
/// instant and returns its own [`elapsed_ns`]. Letting the work stop the clock itself
/// means it can stop it once its result is ready and drop the result afterwards, untimed.
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

/// Collective: the ranks that passed `true`, in rank order, the same list on every rank.
/// Verification uses it so that all ranks fail together when any rank saw wrong data.
pub(crate) fn ranks_flagging<C: Communicator>(
    comm: &C,
    flag: bool,
) -> Result<Vec<usize>, BenchError> {
    let mut all = vec![0u8; comm.size()];
    comm.all_gather(&[u8::from(flag)], &mut all)?;
    Ok(all
        .iter()
        .enumerate()
        .filter(|&(_, &f)| f != 0)
        .map(|(r, _)| r)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpcomm::transport::LocalGroup;

    #[test]
    fn slowest_takes_the_largest_time_of_each_iteration() {
        let results = LocalGroup::new(3).run(|comm| {
            let r = comm.rank() as u64;
            slowest(&comm, &[r, 10 - r, 5])
        });
        for r in results {
            assert_eq!(r.unwrap().unwrap(), vec![2, 10, 5]);
        }
    }

    #[test]
    fn flags_are_agreed_on_every_rank() {
        let results = LocalGroup::new(4).run(|comm| ranks_flagging(&comm, comm.rank() % 2 == 1));
        for r in results {
            assert_eq!(r.unwrap().unwrap(), vec![1, 3]);
        }
    }

    #[test]
    fn median_is_the_upper_middle() {
        assert_eq!(median(&[3, 1, 2]), 2);
        assert_eq!(median(&[4, 1, 2, 3]), 3);
        assert_eq!(median(&[]), 0);
    }
}
