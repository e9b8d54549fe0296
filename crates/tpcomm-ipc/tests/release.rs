//! `PeerMappings::release` and `region_len`: forgetting one exchange closes only the
//! mappings no other exchange uses, and a reopen exports nothing for it.

use tpcomm_ipc::{HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm_transport::{Communicator, LocalGroup};

#[test]
fn releasing_an_exchange_closes_only_its_own_mappings_and_is_not_reopened() {
    let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let memory = HostMemory::new();
        let a = memory.allocate(4096)?;
        let b = memory.allocate(8192)?;
        memory.write(&a, 0, &[comm.rank() as u8 + 1; 8])?;
        let region = |buf: &tpcomm_ipc::HostBuffer| Region {
            addr: buf.addr(),
            len: buf.len(),
        };
        let mut peers = PeerMappings::new(memory, &comm)?;
        // `a` twice: the memo opens its handle once, both exchanges name that mapping.
        let first = peers.exchange(&comm, &[region(&a)])?;
        let second = peers.exchange(&comm, &[region(&a)])?;
        let third = peers.exchange(&comm, &[region(&b)])?;
        let other = 1 - comm.rank();
        assert_eq!(peers.counters().open, 2);
        assert_eq!(peers.region_len(third, other, 0)?, 8192);
        assert_eq!(peers.region_len(third, comm.rank(), 0)?, 8192);

        assert_eq!(
            peers.release(first)?,
            0,
            "the mapping is shared with `second`"
        );
        assert!(matches!(
            peers.peer(first, other, 0),
            Err(IpcError::NoSuchMapping(_))
        ));
        assert_eq!(peers.release(third)?, 1);
        assert_eq!(peers.counters().open, 1);
        let mut got = [0u8; 8];
        peers
            .backend()
            .read(peers.peer(second, other, 0)?, 0, &mut got)?;
        assert_eq!(got, [other as u8 + 1; 8]);

        // A reopen exchanges nothing for the released exchanges, `second` as before.
        peers.close_all()?;
        peers.reopen_all(&comm)?;
        assert_eq!(peers.counters().open, 1);
        assert!(peers.peer(third, other, 0).is_err());
        peers
            .backend()
            .read(peers.peer(second, other, 0)?, 0, &mut got)?;
        assert_eq!(got, [other as u8 + 1; 8]);
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.expect("rank thread")
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}
