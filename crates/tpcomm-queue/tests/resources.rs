//! Resources: queues closed or dropped leave no descriptor or mapping behind (alone in its
//! test binary, so that no other test opens descriptors while it counts).

use std::time::Duration;

use tpcomm_queue::{BroadcastQueue, QueueConfig, QueueError};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

mod common;
use common::tiny_ring;

fn config() -> QueueConfig {
    tiny_ring(Duration::from_secs(20))
}

/// Open descriptors and mappings of this process.
fn resources() -> (usize, usize) {
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let maps = std::fs::read_to_string("/proc/self/maps").map_or(0, |m| m.lines().count());
    (fds, maps)
}

#[test]
fn queues_closed_or_dropped_leave_no_descriptor_or_mapping_behind() {
    let group = LocalGroup::new(3);
    let run = |rounds: usize| {
        for round in 0..rounds {
            let results = group.run(|comm: LocalCommunicator| {
                let mut q = BroadcastQueue::create(&comm, config())?;
                if q.is_writer() {
                    q.send(&vec![round as u8; 300])?;
                } else {
                    q.recv::<Vec<u8>>()?;
                }
                if round % 2 == 0 {
                    q.close_with(&comm)
                } else {
                    comm.barrier().map_err(|source| QueueError::Transport {
                        rank: comm.rank(),
                        message: 1,
                        culprit: source.culprit(),
                        source: Box::new(source),
                    })?;
                    drop(q);
                    Ok(())
                }
            });
            results.into_iter().for_each(|r| r.unwrap().unwrap());
        }
    };
    run(5);
    let before = resources();
    run(100);
    let after = resources();
    assert_eq!(
        before, after,
        "(descriptors, mappings) before and after 100 queues"
    );
}
