//! 10,000 close/reopen cycles leave the number of open descriptors and of mappings
//! unchanged (alone in its binary, so no other test opens files meanwhile).

use std::time::Duration;

use tpcomm_ipc::{HostMemory, MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::open_fds;

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0)
}

#[test]
fn ten_thousand_close_reopen_cycles_leak_no_descriptor_and_no_mapping() {
    const CYCLES: usize = 10_000;
    let results =
        LocalGroup::new(2)
            .timeout(Duration::from_secs(60))
            .run(|comm| -> tpcomm_ipc::Result<_> {
                let mem = HostMemory::new();
                let bufs = [mem.allocate(4096)?, mem.allocate(1 << 16)?];
                let regions: Vec<Region> = bufs
                    .iter()
                    .map(|b| Region {
                        addr: b.addr(),
                        len: b.len(),
                    })
                    .collect();
                let mut peers = PeerMappings::new(mem, &comm)?;
                let id = peers.exchange(&comm, &regions)?;
                // Counts are process-wide: rank 0 takes them while rank 1 waits at the barrier.
                comm.barrier()?;
                let before = (comm.rank() == 0).then(|| (open_fds(), mappings()));
                comm.barrier()?;
                let other = 1 - comm.rank();
                for cycle in 0..CYCLES {
                    assert_eq!(peers.close_all()?, 2);
                    peers.reopen_all(&comm)?;
                    if cycle % 1000 == 0 {
                        let mut b = [0u8; 1];
                        peers.backend().read(peers.peer(id, other, 1)?, 0, &mut b)?;
                    }
                }
                comm.barrier()?;
                let after = (comm.rank() == 0).then(|| (open_fds(), mappings()));
                comm.barrier()?;
                Ok((before, after, peers.counters()))
            });
    for r in results {
        let (before, after, counters) = r.unwrap().unwrap();
        assert_eq!(
            before, after,
            "(open fds, mappings) before vs after {CYCLES} cycles"
        );
        assert_eq!(counters.opens, 2 * (CYCLES as u64 + 1));
        assert_eq!(counters.closes, 2 * CYCLES as u64);
    }
}
