//! 1,000 suspend/resume cycles, and refused creations, leave open descriptors and mappings
//! unchanged (in their own binary, one test at a time, so that nothing else opens files
//! meanwhile).

use std::sync::Mutex;
use std::time::Duration;

use tpcomm_allreduce::{AllReduceError, Config, CustomAllReduce, HostBackend};
use tpcomm_ipc::HostMemory;
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

#[test]
fn a_thousand_suspend_resume_cycles_leak_nothing_and_keep_results_right() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let results = LocalGroup::new(2).timeout(Duration::from_secs(60)).run(
        |comm| -> tpcomm_allreduce::Result<_> {
            let mut ar = CustomAllReduce::new(
                HostBackend::new(),
                HostMemory::new(),
                &comm,
                Config::default(),
            )?;
            let mut out = [0f32; 64];
            ar.all_reduce(&[1f32; 64], &mut out)?;
            comm.barrier()?;
            let before = (comm.rank() == 0).then(counts);
            comm.barrier()?;
            for cycle in 0..1000 {
                ar.prepare_for_suspend(&comm)?;
                ar.reinit_after_resume(&comm)?;
                if cycle % 100 == 0 {
                    ar.all_reduce(&[cycle as f32; 64], &mut out)?;
                    assert_eq!(out, [2.0 * cycle as f32; 64]);
                }
            }
            comm.barrier()?;
            let after = (comm.rank() == 0).then(counts);
            comm.barrier()?;
            Ok((before, after))
        },
    );
    for r in results {
        let (before, after) = r.unwrap().unwrap();
        assert_eq!(
            before, after,
            "(open fds, mappings) before vs after 1000 cycles"
        );
    }
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
            let attempt = || {
                CustomAllReduce::new(HostBackend::new(), HostMemory::new(), &comm, config.clone())
            };
            // A few first: lazily created process state (allocator arenas, ...) is not a leak.
            for _ in 0..WARM_UP {
                assert!(matches!(
                    attempt(),
                    Err(AllReduceError::ConfigMismatch { .. })
                ));
            }
            comm.barrier()?;
            let before = (comm.rank() == 0).then(counts);
            comm.barrier()?;
            for _ in 0..100 {
                match attempt() {
                    Err(AllReduceError::ConfigMismatch { field, .. }) => {
                        assert_eq!(field, "max_bytes")
                    }
                    other => panic!("{other:?}"),
                }
            }
            comm.barrier()?;
            let after = (comm.rank() == 0).then(counts);
            comm.barrier()?;
            Ok((before, after))
        },
    );
    for r in results {
        let (before, after) = r.unwrap().unwrap();
        assert_eq!(
            before, after,
            "(open fds, mappings) before vs after 100 refused creations"
        );
    }
}
