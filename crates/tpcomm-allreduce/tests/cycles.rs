//! 1,000 suspend/resume cycles, and refused creations, leave open descriptors and mappings
//! unchanged (in their own binary, one test at a time, so that nothing else opens files
//! meanwhile).

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::new_ar;
use tpcomm_allreduce::{AllReduceError, Config};
use tpcomm_transport::{Communicator, LocalGroup};

/// Counts are process-wide: the tests of this binary take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn counts() -> (usize, usize) {
    let fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0);
    (fds, maps)
}

/// Rank 0's (open fds, mappings), `None` on the other ranks.
type Counts = Option<(usize, usize)>;

/// Rank 0's [`counts`], taken between two barriers: no rank allocates meanwhile.
fn counts_in_step<C: Communicator>(comm: &C) -> tpcomm_allreduce::Result<Counts> {
    comm.barrier()?;
    let counts = (comm.rank() == 0).then(counts);
    comm.barrier()?;
    Ok(counts)
}

/// Every rank's (before, after) counts are equal.
fn assert_unchanged(
    results: Vec<tpcomm_transport::Result<tpcomm_allreduce::Result<(Counts, Counts)>>>,
    after_what: &str,
) {
    for r in results {
        let (before, after) = r.unwrap().unwrap();
        assert_eq!(
            before, after,
            "(open fds, mappings) before vs after {after_what}"
        );
    }
}

#[test]
fn a_thousand_suspend_resume_cycles_leak_nothing_and_keep_results_right() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let results = LocalGroup::new(2).timeout(Duration::from_secs(60)).run(
        |comm| -> tpcomm_allreduce::Result<_> {
            let mut ar = new_ar(&comm, Config::default())?;
            let mut out = [0f32; 64];
            ar.all_reduce(&[1f32; 64], &mut out)?;
            let before = counts_in_step(&comm)?;
            for cycle in 0..1000 {
                ar.prepare_for_suspend(&comm)?;
                ar.reinit_after_resume(&comm)?;
                if cycle % 100 == 0 {
                    ar.all_reduce(&[cycle as f32; 64], &mut out)?;
                    assert_eq!(out, [2.0 * cycle as f32; 64]);
                }
            }
            let after = counts_in_step(&comm)?;
            Ok((before, after))
        },
    );
    assert_unchanged(results, "1000 cycles");
}

/// A creation refused for mismatched settings frees everything both ranks allocated: their
/// Signal, staging and temp buffers and tables (allocated before the agreement) and the
/// registry, on every rank.
#[test]
fn a_hundred_creations_refused_for_mismatched_settings_leak_nothing() {
    const WARM_UP: usize = 10;
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let results = LocalGroup::new(2).timeout(Duration::from_secs(60)).run(
        |comm| -> tpcomm_allreduce::Result<_> {
            let config = Config {
                max_bytes: if comm.rank() == 0 { 1 << 20 } else { 1 << 16 },
                ..Config::default()
            };
            let attempt = || new_ar(&comm, config.clone());
            // A few first: lazily created process state (allocator arenas, ...) is not a leak.
            for _ in 0..WARM_UP {
                assert!(matches!(
                    attempt(),
                    Err(AllReduceError::ConfigMismatch { .. })
                ));
            }
            let before = counts_in_step(&comm)?;
            for _ in 0..100 {
                match attempt() {
                    Err(AllReduceError::ConfigMismatch { field, .. }) => {
                        assert_eq!(field, "max_bytes")
                    }
                    other => panic!("{other:?}"),
                }
            }
            let after = counts_in_step(&comm)?;
            Ok((before, after))
        },
    );
    assert_unchanged(results, "100 refused creations");
}
