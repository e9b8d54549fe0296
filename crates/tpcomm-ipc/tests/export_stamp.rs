//! A reopen skips exporting the regions again while nothing of the process was allocated or
//! freed (the host backend's export stamp), and still notices a registered buffer freed.
//!
//! One test in its own binary: the stamp counts the allocations of the whole process, which
//! the tests of another binary would change at any time.

use std::sync::Barrier;

use tpcomm_ipc::{HostMemory, IpcError, PeerMappings, PeerMemory};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::{done, read_peer, region};

#[test]
fn a_reopen_skips_the_export_until_something_is_allocated_or_freed() {
    let barrier = Barrier::new(2);
    let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let (rank, other) = (comm.rank(), 1 - comm.rank());
        let memory = HostMemory::new();
        let a = memory.allocate(4096)?;
        let b = memory.allocate(4096)?;
        memory.write(&a, 0, &[rank as u8 + 1; 8])?;
        memory.write(&b, 0, &[rank as u8 + 11; 8])?;
        let mut peers = PeerMappings::new(memory.clone(), &comm)?;
        let id = peers.exchange(&comm, &[region(&a), region(&b)])?;
        let cycle = |peers: &mut PeerMappings<HostMemory>| -> tpcomm_ipc::Result<()> {
            peers.close_all()?;
            peers.reopen_all(&comm)
        };
        let read = |peers: &PeerMappings<HostMemory>, index| -> tpcomm_ipc::Result<[u8; 8]> {
            read_peer(peers, id, other, index)
        };
        // The peer may still have been allocating when this rank exported: the first reopen
        // may export again; after it every rank's handles are stamped.
        cycle(&mut peers)?;
        let skipped = peers.counters().exports_skipped;
        for _ in 0..3 {
            cycle(&mut peers)?;
        }
        let c = peers.counters();
        assert_eq!(
            c.exports_skipped,
            skipped + 3,
            "nothing allocated: no export"
        );
        assert_eq!(c.reopens_in_place, 4);
        assert_eq!(read(&peers, 0)?, [other as u8 + 1; 8]);
        assert_eq!(read(&peers, 1)?, [other as u8 + 11; 8]);

        // An allocation anywhere in the process: exported again, found unchanged.
        let extra = (rank == 0).then(|| memory.allocate(4096)).transpose()?;
        barrier.wait();
        cycle(&mut peers)?;
        let c = peers.counters();
        assert_eq!(
            c.exports_skipped,
            skipped + 3,
            "exported after an allocation"
        );
        assert_eq!(c.reopens_in_place, 5);
        cycle(&mut peers)?;
        assert_eq!(
            peers.counters().exports_skipped,
            skipped + 4,
            "stamped again"
        );
        assert_eq!(read(&peers, 1)?, [other as u8 + 11; 8]);

        // A registered buffer freed on rank 0: its export fails, every rank's reopen with it.
        drop(extra);
        let b = if rank == 0 {
            drop(b);
            None
        } else {
            Some(b)
        };
        barrier.wait();
        match cycle(&mut peers) {
            Err(IpcError::PeerOpenFailed { ranks, local }) => {
                assert_eq!(ranks, vec![0]);
                assert_eq!(local.is_some(), rank == 0, "only rank 0 failed itself");
            }
            other => panic!("expected PeerOpenFailed, got {other:?}"),
        }
        assert!(peers.is_closed());
        drop(b);
        Ok(())
    });
    done(results);
}
