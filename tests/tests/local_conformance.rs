//! The conformance suite on the local group, 1..=8 ranks, one test per group size.

use std::time::Duration;

use tpcomm::transport::LocalGroup;
use tpcomm_conformance::run_all;

fn conformance_on(ranks: usize) {
    let results = LocalGroup::new(ranks)
        .timeout(Duration::from_secs(60))
        .run(|comm| run_all(&comm));
    let mut failures = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        let reports = result.unwrap_or_else(|e| panic!("rank {rank} did not finish: {e}"));
        assert!(!reports.is_empty());
        for report in reports.into_iter().filter(|r| !r.passed) {
            failures.push(format!(
                "{} ({} ranks): {}",
                report.name, ranks, report.detail
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "conformance failures:\n{}",
        failures.join("\n")
    );
}

#[test]
fn conformance_1_rank() {
    conformance_on(1);
}

#[test]
fn conformance_2_ranks() {
    conformance_on(2);
}

#[test]
fn conformance_3_ranks() {
    conformance_on(3);
}

#[test]
fn conformance_4_ranks() {
    conformance_on(4);
}

#[test]
fn conformance_5_ranks() {
    conformance_on(5);
}

#[test]
fn conformance_6_ranks() {
    conformance_on(6);
}

#[test]
fn conformance_7_ranks() {
    conformance_on(7);
}

#[test]
fn conformance_8_ranks() {
    conformance_on(8);
}
