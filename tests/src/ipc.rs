//! Peer-memory cases of the conformance suite: host shared memory between the ranks of any
//! communicator (threads of the local group, or processes under MPI).

use tpcomm::ipc::{HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm::transport::Communicator;

use crate::CaseResult;

fn ipc<T>(what: &str, r: Result<T, IpcError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Each rank writes a pattern into two buffers; every peer reads them through its mappings,
/// then again after `close_all` + `reopen_all`, and writes an acknowledgement through the
/// reopened mapping that the owner reads locally.
pub(crate) fn host_peers_read_patterns_across_reopen<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let mem = HostMemory::new();
    let sizes = [4096usize, 100_000];
    let bufs: Vec<_> = ipc(
        "allocate",
        sizes
            .iter()
            .map(|&s| mem.allocate(s))
            .collect::<Result<Vec<_>, _>>(),
    )?;
    for (b, (buf, &s)) in bufs.iter().zip(&sizes).enumerate() {
        ipc("write", mem.write(buf, 0, &crate::filled(me, b, s)))?;
    }
    let regions: Vec<Region> = bufs
        .iter()
        .zip(&sizes)
        .map(|(b, &s)| Region {
            addr: b.addr(),
            len: s,
        })
        .collect();
    let mut peers = ipc("PeerMappings::new", PeerMappings::new(mem, comm))?;
    let id = ipc("exchange", peers.exchange(comm, &regions))?;
    let check_all = |peers: &PeerMappings<HostMemory>, when: &str| -> CaseResult {
        for r in (0..n).filter(|&r| r != me) {
            for (b, &s) in sizes.iter().enumerate() {
                let mut got = vec![0u8; s];
                let m = ipc("peer", peers.peer(id, r, b))?;
                ipc("read", peers.backend().read(m, 0, &mut got))?;
                crate::expect_bytes(
                    &format!("{when}: rank {r} buffer {b}"),
                    &got,
                    &crate::filled(r, b, s),
                )?;
            }
        }
        Ok(())
    };
    check_all(&peers, "first exchange")?;
    let closed = ipc("close_all", peers.close_all())?;
    if closed != 2 * (n - 1) {
        return Err(format!(
            "close_all closed {closed} mappings, expected {}",
            2 * (n - 1)
        ));
    }
    ipc("reopen_all", peers.reopen_all(comm))?;
    check_all(&peers, "after reopen")?;
    // Everybody has read the patterns before anybody overwrites a byte of them.
    crate::ok("barrier", comm.barrier())?;
    // Acknowledge through the reopened mapping of the next rank's first buffer.
    let next = (me + 1) % n;
    if n > 1 {
        let m = ipc("peer", peers.peer(id, next, 0))?;
        ipc("write ack", peers.backend().write(m, 4000, &[me as u8 + 1]))?;
    }
    crate::ok("barrier", comm.barrier())?;
    if n > 1 {
        let prev = (me + n - 1) % n;
        let mut ack = [0u8; 1];
        ipc("read ack", peers.backend().read(&bufs[0], 4000, &mut ack))?;
        if ack[0] != prev as u8 + 1 {
            return Err(format!(
                "ack from rank {prev} not seen in local memory: {}",
                ack[0]
            ));
        }
    }
    crate::ok("barrier", comm.barrier())
}
