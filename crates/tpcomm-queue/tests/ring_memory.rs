//! What a ring costs in memory: a large ring commits, at creation, only the pages its speed
//! needs (alone in its test binary, so that no other test moves the resident size it reads).

use serde_bytes::ByteBuf;
use tpcomm_queue::{BroadcastQueue, QueueConfig};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

/// This process's resident memory, in bytes.
fn resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("/proc/self/status has VmRSS");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("VmRSS in kB");
    kib << 10
}

#[test]
fn a_one_gib_ring_commits_only_the_pages_its_speed_needs_at_creation() {
    let group = LocalGroup::new(2);
    let before = resident();
    let results = group.run(|comm: LocalCommunicator| {
        // 4 chunks of 256 MiB: a ring of 1 GiB, mapped by the writer and by the reader (two
        // threads of this process).
        let config = QueueConfig {
            depth: 4,
            chunk_bytes: 256 << 20,
            ..QueueConfig::default()
        };
        let mut q = BroadcastQueue::create(&comm, config).unwrap();
        comm.barrier().unwrap();
        let created = resident();
        comm.barrier().unwrap();
        if q.is_writer() {
            q.send(&ByteBuf::from(vec![9u8; 1000])).unwrap();
        } else {
            assert_eq!(q.recv::<ByteBuf>().unwrap().len(), 1000);
        }
        q.close_with(&comm).unwrap();
        created
    });
    let created = results.into_iter().next().unwrap().unwrap();
    let added = created.saturating_sub(before);
    eprintln!(
        "a 1 GiB ring, writer and reader in one process: {} MiB resident added at creation",
        added >> 20
    );
    assert!(
        added < 128 << 20,
        "creating a 1 GiB ring added {} MiB of resident memory",
        added >> 20
    );
}
