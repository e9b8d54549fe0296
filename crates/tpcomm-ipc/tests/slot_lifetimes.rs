//! Which mappings the registry keeps across `close_all` and reopens: exactly those an
//! exchange refers to. A failed exchange leaves nothing open behind it, and a handle first
//! opened by `import` and then named by an exchange is reopened with the exchange.

use tpcomm_ipc::{HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory, Step};
use tpcomm_transport::Communicator;

mod common;
use common::{done, group, read_peer, region};

/// Bigger than `HostMemory::CARVE_MAX_BYTES`: a segment of its own, gone once freed.
const OWN_SEGMENT: usize = 2 << 20;

/// Rank 1 plays the exchange step with a real handle, then answers the verdict step with
/// another step. Rank 0 opened rank 1's handle before the verdict failed: the mapping is
/// closed with the failure, and once rank 1 frees that buffer, reopens still succeed (they
/// do not try to reopen a handle no exchange refers to).
#[test]
fn a_failed_exchange_verdict_leaves_nothing_open_and_reopen_still_works() {
    let results = group(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let mem = HostMemory::new();
        let kept = mem.allocate(4096)?;
        let mut peers = PeerMappings::new(mem, &comm)?;
        let first = peers.exchange(&comm, &[region(&kept)])?;
        assert_eq!(peers.counters().open, 1);
        if comm.rank() == 0 {
            let own = peers.backend().allocate(OWN_SEGMENT)?;
            let err = peers.exchange(&comm, &[region(&own)]).unwrap_err();
            assert!(
                matches!(err, IpcError::StepMismatch { rank: 1, .. }),
                "rank 0: {err:?}"
            );
            assert_eq!(
                peers.counters().open,
                1,
                "the mapping opened for the failed exchange is closed"
            );
        } else {
            let own = peers.backend().allocate(OWN_SEGMENT)?;
            let handle = peers.backend().export(own.addr(), own.len())?;
            let envelope = peers.envelope(handle);
            peers.agree(&comm, Step::Exchange, &Some(vec![envelope]))?;
            let err = peers.agree(&comm, Step::Close, &true).unwrap_err();
            assert!(matches!(err, IpcError::StepMismatch { rank: 0, .. }));
            // Freed: its handle no longer opens anywhere.
            drop(own);
        }
        comm.barrier()?;
        peers.close_all()?;
        peers.reopen_all(&comm)?;
        assert_eq!(peers.counters().open, 1);
        let other = 1 - comm.rank();
        assert_eq!(peers.region_len(first, other, 0)?, 4096);
        Ok(())
    });
    done(results);
}

/// Rank 0 imports rank 1's handle out of band, then both exchange the same region: the
/// exchange finds the mapping through the memo. After `close_all` and a reopen, the exchange
/// still reaches it on every rank.
#[test]
fn an_imported_handle_later_exchanged_survives_close_and_reopen() {
    let results = group(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let mem = HostMemory::new();
        let buf = mem.allocate(4096)?;
        mem.write(&buf, 0, &[comm.rank() as u8 + 1; 8])?;
        let mut peers = PeerMappings::new(mem, &comm)?;
        let handle = peers.backend().export(buf.addr(), buf.len())?;
        let mine = peers.envelope(handle);
        let envelopes = peers.agree(&comm, Step::Close, &mine)?;
        let other = 1 - comm.rank();
        if comm.rank() == 0 {
            peers.import(other, &envelopes[other])?;
        }
        let id = peers.exchange(&comm, &[region(&buf)])?;
        assert_eq!(peers.counters().open, 1, "the memo opened the handle once");
        for _ in 0..2 {
            peers.close_all()?;
            peers.reopen_all(&comm)?;
            let got: [u8; 8] = read_peer(&peers, id, other, 0)?;
            assert_eq!(got, [other as u8 + 1; 8]);
        }
        Ok(())
    });
    done(results);
}
