//! Verification agreed across ranks: a case's data is checked on every rank, and every rank
//! fails when any rank saw wrong data, so that nobody is left waiting in a collective.

use tpcomm::Communicator;

use crate::engine::error::BenchError;

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

#[cfg(test)]
mod tests {
    use super::*;
    use tpcomm::transport::LocalGroup;

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
}
