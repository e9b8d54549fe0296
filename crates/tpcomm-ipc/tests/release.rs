//! `PeerMappings::release` and `region_len`: forgetting one exchange closes only the
//! mappings no other exchange uses, and a reopen exports nothing for it.

use tpcomm_ipc::{HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::{done, read_peer, region};

#[test]
fn releasing_an_exchange_closes_only_its_own_mappings_and_is_not_reopened() {
    let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let memory = HostMemory::new();
        let a = memory.allocate(4096)?;
        let b = memory.allocate(8192)?;
        memory.write(&a, 0, &[comm.rank() as u8 + 1; 8])?;
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
        let got: [u8; 8] = read_peer(&peers, second, other, 0)?;
        assert_eq!(got, [other as u8 + 1; 8]);

        // A reopen exchanges nothing for the released exchanges, `second` as before.
        peers.close_all()?;
        peers.reopen_all(&comm)?;
        assert_eq!(peers.counters().open, 1);
        assert!(peers.peer(third, other, 0).is_err());
        let got: [u8; 8] = read_peer(&peers, second, other, 0)?;
        assert_eq!(got, [other as u8 + 1; 8]);
        Ok(())
    });
    done(results);
}

/// Host memory whose export stamp is this value's own counter, not the process's: ranks
/// that are threads of one process, with stamps that move apart as processes' do.
#[derive(Debug, Clone, Default)]
struct OwnStamp {
    inner: HostMemory,
    stamp: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl PeerMemory for OwnStamp {
    type Handle = tpcomm_ipc::HostHandle;
    type Buffer = tpcomm_ipc::HostBuffer;
    type Mapping = tpcomm_ipc::HostMapping;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn allocate(&self, bytes: usize) -> tpcomm_ipc::Result<Self::Buffer> {
        self.inner.allocate(bytes)
    }
    fn export(&self, addr: u64, len: usize) -> tpcomm_ipc::Result<Self::Handle> {
        self.inner.export(addr, len)
    }
    fn export_stamp(&self) -> Option<u64> {
        Some(self.stamp.load(std::sync::atomic::Ordering::SeqCst))
    }
    fn open(&self, handle: &Self::Handle) -> tpcomm_ipc::Result<Self::Mapping> {
        self.inner.open(handle)
    }
    fn close(&self, mapping: Self::Mapping) -> tpcomm_ipc::Result<()> {
        self.inner.close(mapping)
    }
    fn write<R: MemoryRegion>(
        &self,
        region: &R,
        offset: usize,
        src: &[u8],
    ) -> tpcomm_ipc::Result<()> {
        self.inner.write(region, offset, src)
    }
    fn read<R: MemoryRegion>(
        &self,
        region: &R,
        offset: usize,
        dst: &mut [u8],
    ) -> tpcomm_ipc::Result<()> {
        self.inner.read(region, offset, dst)
    }
}

#[test]
fn a_reopen_after_a_release_agrees_when_only_one_rank_exports_again() {
    // After a release, rank 1's process changed (its stamp moved) and it exports afresh,
    // while rank 0's did not and it announces what it sent before: both must announce
    // nothing for the released exchange, so both reopen.
    let results = LocalGroup::new(2)
        .timeout(std::time::Duration::from_secs(10))
        .run(|comm| -> tpcomm_ipc::Result<()> {
            let memory = OwnStamp::default();
            let a = memory.allocate(4096)?;
            let b = memory.allocate(4096)?;
            let mut peers = PeerMappings::new(memory.clone(), &comm)?;
            let kept = peers.exchange(&comm, &[region(&a)])?;
            let released = peers.exchange(&comm, &[region(&b)])?;
            // Every exchange's stamp is now the one read at this reopen.
            peers.close_all()?;
            peers.reopen_all(&comm)?;
            peers.release(released)?;
            peers.close_all()?;
            if comm.rank() == 1 {
                memory
                    .stamp
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            peers.reopen_all(&comm)?;
            let other = 1 - comm.rank();
            assert_eq!(peers.region_len(kept, other, 0)?, 4096);
            assert!(peers.peer(released, other, 0).is_err());
            Ok(())
        });
    done(results);
}

#[test]
fn a_replaced_region_is_what_peers_open_after_the_next_reopen() {
    let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let memory = HostMemory::new();
        let first = memory.allocate(4096)?;
        let second = memory.allocate(4096)?;
        memory.write(&first, 0, &[1; 8])?;
        memory.write(&second, 0, &[2; 8])?;
        let mut peers = PeerMappings::new(memory, &comm)?;
        let id = peers.exchange(&comm, &[region(&first)])?;
        let other = 1 - comm.rank();
        let shorter = Region {
            addr: second.addr(),
            len: 2048,
        };
        assert!(matches!(
            peers.replace_region(id, 0, shorter),
            Err(IpcError::Mismatch(_))
        ));
        assert!(matches!(
            peers.replace_region(id, 1, region(&second)),
            Err(IpcError::NoSuchMapping(_))
        ));
        peers.replace_region(id, 0, region(&second))?;
        let got: [u8; 8] = read_peer(&peers, id, other, 0)?;
        assert_eq!(got, [1; 8], "peers keep their mapping until the reopen");
        peers.close_all()?;
        drop(first);
        peers.reopen_all(&comm)?;
        let got: [u8; 8] = read_peer(&peers, id, other, 0)?;
        assert_eq!(got, [2; 8]);
        assert_eq!(peers.address(id, comm.rank(), 0)?, second.addr());
        Ok(())
    });
    done(results);
}

#[test]
fn releasing_an_exchange_twice_is_a_typed_error_and_changes_nothing() {
    let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let memory = HostMemory::new();
        let a = memory.allocate(4096)?;
        let b = memory.allocate(4096)?;
        let mut peers = PeerMappings::new(memory, &comm)?;
        let first = peers.exchange(
            &comm,
            &[Region {
                addr: a.addr(),
                len: 4096,
            }],
        )?;
        let second = peers.exchange(
            &comm,
            &[Region {
                addr: b.addr(),
                len: 4096,
            }],
        )?;
        assert_eq!(peers.release(first)?, 1);
        match peers.release(first) {
            Err(IpcError::NoSuchMapping(why)) => assert!(why.contains("released"), "{why}"),
            other => panic!("a second release: {other:?}"),
        }
        assert_eq!(peers.counters().open, 1);
        peers.peer(second, 1 - comm.rank(), 0)?;
        Ok(())
    });
    done(results);
}
