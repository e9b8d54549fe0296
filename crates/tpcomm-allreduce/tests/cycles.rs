//! 1,000 suspend/resume cycles leave open descriptors and mappings unchanged (alone in its
//! binary so that no other test opens files meanwhile).

use std::time::Duration;

use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend};
use tpcomm_ipc::HostMemory;
use tpcomm_transport::{Communicator, LocalGroup};

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
