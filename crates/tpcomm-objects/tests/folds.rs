//! mpi4py's fold collectives over serde values: `reduce` to a root, inclusive `scan` and
//! exclusive `exscan`, folded in rank order, with failures agreed by every rank.

use tpcomm_objects::{
    exscan_with, exscan_with_options, reduce_with, reduce_with_options, scan_with,
    scan_with_options, ObjectError, Options,
};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::FailOn;

/// Concatenation: not commutative, so a result shows the order of the fold.
fn concat(a: String, b: String) -> String {
    a + "," + &b
}

fn names(ranks: std::ops::Range<usize>) -> String {
    ranks.map(|r| format!("r{r}")).collect::<Vec<_>>().join(",")
}

#[test]
fn reduce_folds_in_rank_order_on_the_root_only() {
    for size in 1..6 {
        for root in 0..size {
            let results = LocalGroup::new(size)
                .run(|comm| reduce_with(&comm, root, &format!("r{}", comm.rank()), concat));
            for (rank, r) in results.into_iter().enumerate() {
                let got = r.unwrap().unwrap();
                let want = (rank == root).then(|| names(0..size));
                assert_eq!(got, want, "size {size}, root {root}, rank {rank}");
            }
        }
    }
}

#[test]
fn scan_gives_each_rank_the_fold_of_ranks_up_to_itself() {
    for size in 1..6 {
        let results = LocalGroup::new(size)
            .run(|comm| scan_with(&comm, &format!("r{}", comm.rank()), concat));
        for (rank, r) in results.into_iter().enumerate() {
            assert_eq!(r.unwrap().unwrap(), names(0..rank + 1), "size {size}");
        }
    }
}

#[test]
fn exscan_gives_rank_zero_none_and_the_others_the_fold_before_them() {
    for size in 1..6 {
        let results = LocalGroup::new(size)
            .run(|comm| exscan_with(&comm, &format!("r{}", comm.rank()), concat));
        for (rank, r) in results.into_iter().enumerate() {
            let want = (rank > 0).then(|| names(0..rank));
            assert_eq!(r.unwrap().unwrap(), want, "size {size}");
        }
    }
}

#[test]
fn zero_byte_values_are_scanned() {
    // postcard encodes `()` in 0 bytes: a valid length, not "no value".
    let results = LocalGroup::new(3).run(|comm| {
        scan_with(&comm, &(), |(), ()| ())?;
        let exclusive = exscan_with(&comm, &(), |(), ()| ())?;
        Ok::<_, ObjectError>(exclusive.is_some())
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert_eq!(r.unwrap().unwrap(), rank > 0);
    }
}

#[test]
fn large_values_take_the_round_path_and_fold_correctly() {
    // max_count 100 bytes: each 1000-byte value moves in rounds.
    let results = LocalGroup::new(4).max_count(100).run(|comm| {
        let mine = vec![comm.rank() as u8; 1000];
        let sum = |a: Vec<u8>, b: Vec<u8>| a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let scanned = scan_with(&comm, &mine, sum)?;
        let reduced = reduce_with(&comm, 3, &mine, sum)?;
        let exscanned = exscan_with(&comm, &mine, sum)?;
        Ok::<_, ObjectError>((scanned[999], reduced.map(|v| v[0]), exscanned.map(|v| v[0])))
    });
    let prefix = |r: usize| (0..=r).sum::<usize>() as u8;
    for (rank, r) in results.into_iter().enumerate() {
        let (scanned, reduced, exscanned) = r.unwrap().unwrap();
        assert_eq!(scanned, prefix(rank));
        assert_eq!(reduced, (rank == 3).then_some(6));
        assert_eq!(exscanned, (rank > 0).then(|| prefix(rank - 1)));
    }
}

fn item(comm: &impl Communicator, failing: usize) -> FailOn {
    FailOn {
        fail: comm.rank() == failing,
        text: format!("r{}", comm.rank()),
    }
}

fn fold_items(a: FailOn, b: FailOn) -> FailOn {
    FailOn {
        fail: false,
        text: a.text + &b.text,
    }
}

/// Asserts that every rank returned `PeerSerialization` naming exactly `failing`.
fn assert_agreed_failure<T: std::fmt::Debug>(
    results: Vec<tpcomm_transport::Result<Result<T, ObjectError>>>,
    failing: usize,
) {
    for (rank, r) in results.into_iter().enumerate() {
        match r.unwrap() {
            Err(ObjectError::PeerSerialization { ranks, source }) => {
                assert_eq!(ranks, vec![failing], "rank {rank}");
                assert_eq!(source.is_some(), rank == failing, "rank {rank}");
            }
            other => panic!("rank {rank}: expected an agreed failure, got {other:?}"),
        }
    }
}

#[test]
fn one_rank_failing_to_serialize_fails_reduce_on_every_rank() {
    for failing in 0..3 {
        let results =
            LocalGroup::new(3).run(|comm| reduce_with(&comm, 1, &item(&comm, failing), fold_items));
        assert_agreed_failure(results, failing);
    }
}

#[test]
fn one_rank_failing_to_serialize_fails_scan_on_every_rank() {
    for failing in 0..3 {
        let results =
            LocalGroup::new(3).run(|comm| scan_with(&comm, &item(&comm, failing), fold_items));
        assert_agreed_failure(results, failing);
    }
}

#[test]
fn one_rank_failing_to_serialize_fails_exscan_on_every_rank_even_the_last() {
    // The last rank's value goes nowhere in an exclusive scan; its failure is still agreed.
    for failing in 0..3 {
        let results =
            LocalGroup::new(3).run(|comm| exscan_with(&comm, &item(&comm, failing), fold_items));
        assert_agreed_failure(results, failing);
    }
}

#[test]
fn the_group_stays_usable_after_an_agreed_failure() {
    let results = LocalGroup::new(2).run(|comm| {
        assert!(scan_with(&comm, &item(&comm, 0), fold_items).is_err());
        scan_with(&comm, &(comm.rank() as u32), |a, b| a + b)
    });
    let got: Vec<u32> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(got, [0, 1]);
}

#[test]
fn a_total_over_the_cap_fails_every_fold_on_every_rank() {
    let opts = Options {
        max_total_bytes: 1500,
        ..Options::default()
    };
    let results = LocalGroup::new(3).run(|comm| {
        let big = vec![0u8; 1000];
        let keep = |a: Vec<u8>, _b: Vec<u8>| a;
        let scan = scan_with_options(&comm, &big, &opts, keep).map(drop);
        let exscan = exscan_with_options(&comm, &big, &opts, keep).map(drop);
        let reduce = reduce_with_options(&comm, 0, &big, &opts, keep).map(drop);
        (scan, exscan, reduce)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (scan, exscan, reduce) = r.unwrap();
        // The last rank receives three values in the scan and two in the exscan, the root
        // three in the reduce: rank 1's value crosses the cap each time, on every rank.
        assert!(
            matches!(scan, Err(ObjectError::TooLarge { rank: 1, .. })),
            "rank {rank}: {scan:?}"
        );
        assert!(
            matches!(exscan, Err(ObjectError::TooLarge { rank: 1, .. })),
            "rank {rank}: {exscan:?}"
        );
        assert!(
            matches!(reduce, Err(ObjectError::TooLarge { rank: 1, .. })),
            "rank {rank}: {reduce:?}"
        );
    }
}

#[test]
fn an_out_of_range_root_is_an_invalid_argument() {
    let results = LocalGroup::new(2).run(|comm| reduce_with(&comm, 2, &1u8, |a, b| a + b));
    for r in results {
        assert!(matches!(r.unwrap(), Err(ObjectError::InvalidArgument(_))));
    }
}
