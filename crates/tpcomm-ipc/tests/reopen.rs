//! `PeerMappings::reopen_all`: in place when no rank's handles changed, afresh when one
//! rank's did (the others' kept handles serve), and a failed fresh reopen keeps what a
//! retry needs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tpcomm_ipc::{
    HostBuffer, HostHandle, HostMapping, HostMemory, IpcError, MemoryRegion, PeerMappings,
    PeerMemory, Region,
};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::{done, read_peer, R};

/// Host memory whose handles carry an epoch: bumping it changes every handle the backend
/// exports from then on (as a CUDA export does after a process checkpoint); opens can be made
/// to fail.
#[derive(Debug, Clone, Default)]
struct Epochs {
    inner: HostMemory,
    epoch: Arc<AtomicU64>,
    fail_opens: Arc<AtomicBool>,
}

impl PeerMemory for Epochs {
    type Handle = (u64, HostHandle);
    type Buffer = HostBuffer;
    type Mapping = HostMapping;

    fn name(&self) -> &'static str {
        "host-epochs"
    }
    fn allocate(&self, bytes: usize) -> tpcomm_ipc::Result<HostBuffer> {
        self.inner.allocate(bytes)
    }
    fn export(&self, addr: u64, len: usize) -> tpcomm_ipc::Result<Self::Handle> {
        Ok((
            self.epoch.load(Ordering::SeqCst),
            self.inner.export(addr, len)?,
        ))
    }
    fn open(&self, handle: &Self::Handle) -> tpcomm_ipc::Result<HostMapping> {
        if self.fail_opens.load(Ordering::SeqCst) {
            return Err(IpcError::InvalidHandle("opens fail in this test".into()));
        }
        self.inner.open(&handle.1)
    }
    fn close(&self, mapping: HostMapping) -> tpcomm_ipc::Result<()> {
        self.inner.close(mapping)
    }
    fn write<R: MemoryRegion>(&self, r: &R, offset: usize, src: &[u8]) -> tpcomm_ipc::Result<()> {
        self.inner.write(r, offset, src)
    }
    fn read<R: MemoryRegion>(
        &self,
        r: &R,
        offset: usize,
        dst: &mut [u8],
    ) -> tpcomm_ipc::Result<()> {
        self.inner.read(r, offset, dst)
    }
}

/// Runs `f` on 3 ranks, each with two exchanges of small buffers holding its rank number;
/// panics naming every failed rank.
fn run(f: impl Fn(&dyn Communicator, &Epochs, &mut PeerMappings<Epochs>) -> R<()> + Sync) {
    let results = LocalGroup::new(3)
        .timeout(Duration::from_secs(30))
        .run(|comm| -> R<()> {
            let mem = Epochs::default();
            let bufs: Vec<HostBuffer> = (0..3).map(|_| mem.allocate(4096)).collect::<R<_>>()?;
            for b in &bufs {
                mem.write(b, 0, &[comm.rank() as u8 + 1; 8])?;
            }
            let region = |b: &HostBuffer| Region {
                addr: b.addr(),
                len: 4096,
            };
            let mut peers = PeerMappings::new(mem.clone(), &comm)?;
            let a = peers.exchange(&comm, &[region(&bufs[0]), region(&bufs[1])])?;
            let b = peers.exchange(&comm, &[region(&bufs[2])])?;
            f(&comm, &mem, &mut peers)?;
            // Every peer's buffers read back through the current mappings.
            for r in (0..comm.size()).filter(|&r| r != comm.rank()) {
                for (id, index) in [(a, 0), (a, 1), (b, 0)] {
                    let got: [u8; 8] = read_peer(&peers, id, r, index)?;
                    assert_eq!(got, [r as u8 + 1; 8], "rank {r}'s buffer {id:?}/{index}");
                }
            }
            comm.barrier().map_err(IpcError::from)?;
            Ok(())
        });
    done(results);
}

#[test]
fn unchanged_handles_reopen_in_place() {
    run(|comm, _, peers| {
        for _ in 0..3 {
            peers.close_all()?;
            peers.reopen_all(comm)?;
        }
        let c = peers.counters();
        assert_eq!(c.reopens_in_place, 3);
        assert_eq!((c.open, c.opens, c.closes), (6, 24, 18));
        Ok(())
    });
}

#[test]
fn one_rank_with_fresh_handles_makes_every_rank_reopen_afresh() {
    run(|comm, mem, peers| {
        peers.close_all()?;
        if comm.rank() == 1 {
            mem.epoch.fetch_add(1, Ordering::SeqCst);
        }
        peers.reopen_all(comm)?;
        assert_eq!(peers.counters().reopens_in_place, 0);
        // The fresh handles are now the kept ones: the next reopen is in place again.
        peers.close_all()?;
        peers.reopen_all(comm)?;
        assert_eq!(peers.counters().reopens_in_place, 1);
        Ok(())
    });
}

#[test]
fn a_failed_reopen_leaves_every_rank_closed_and_a_retry_succeeds() {
    run(|comm, mem, peers| {
        for fresh in [false, true] {
            peers.close_all()?;
            if fresh && comm.rank() == 2 {
                mem.epoch.fetch_add(1, Ordering::SeqCst);
            }
            mem.fail_opens.store(comm.rank() == 0, Ordering::SeqCst);
            match peers.reopen_all(comm) {
                Err(IpcError::PeerOpenFailed { ranks, local }) => {
                    assert_eq!(ranks, vec![0]);
                    assert_eq!(local.is_some(), comm.rank() == 0);
                }
                other => panic!("expected PeerOpenFailed, got {other:?}"),
            }
            assert!(peers.is_closed());
            assert_eq!(peers.counters().open, 0);
            mem.fail_opens.store(false, Ordering::SeqCst);
            peers.reopen_all(comm)?;
            assert!(!peers.is_closed());
        }
        Ok(())
    });
}
