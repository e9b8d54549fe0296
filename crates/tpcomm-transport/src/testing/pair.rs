//! [`Pair`]: two processes as two ranks over one Unix socket, for the GPU suites that run
//! without MPI on the GPU machine (two-process CUDA IPC tests). Only what the all-reduce's
//! setup, exchanges and lifecycle and the checkpoint sequence use is served: barrier,
//! all-gather, varcount all-gather and broadcast. Test support: it trusts its peer (a length
//! it announces is allocated as is) and waits at most 60 s for it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use crate::check::{AllGatherArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs};
use crate::{Communicator, TransportError};

type Result<T> = std::result::Result<T, TransportError>;

#[derive(Debug)]
/// One rank of the two-process test transport.
pub struct Pair {
    rank: usize,
    stream: Mutex<UnixStream>,
}

impl Pair {
    /// Rank `rank` (0 or 1) of the pair, over `stream` (one end of a connected socket).
    pub fn new(rank: usize, stream: UnixStream) -> Self {
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("socket timeout");
        Self {
            rank,
            stream: Mutex::new(stream),
        }
    }

    fn io(&self, what: &str, e: std::io::Error) -> TransportError {
        TransportError::Setup(format!(
            "rank {}: {what} rank {}: {e}",
            self.rank,
            1 - self.rank
        ))
    }

    /// Sends `mine` to the peer and returns the peer's bytes; rank 0 writes first, so
    /// two large writes never wait on each other.
    fn exchange(&self, mine: &[u8]) -> Result<Vec<u8>> {
        let mut s = self.stream.lock().unwrap();
        let send = |s: &mut UnixStream| -> std::io::Result<()> {
            s.write_all(&(mine.len() as u64).to_le_bytes())?;
            s.write_all(mine)
        };
        let recv = |s: &mut UnixStream| -> std::io::Result<Vec<u8>> {
            let mut len = [0u8; 8];
            s.read_exact(&mut len)?;
            let mut theirs = vec![0u8; u64::from_le_bytes(len) as usize];
            s.read_exact(&mut theirs)?;
            Ok(theirs)
        };
        if self.rank == 0 {
            send(&mut s).map_err(|e| self.io("sending to", e))?;
            recv(&mut s).map_err(|e| self.io("receiving from", e))
        } else {
            let theirs = recv(&mut s).map_err(|e| self.io("receiving from", e))?;
            send(&mut s).map_err(|e| self.io("sending to", e))?;
            Ok(theirs)
        }
    }

    fn unsupported(&self, op: &str) -> TransportError {
        TransportError::Setup(format!("{op} is not served by the test pair transport"))
    }
}

impl Communicator for Pair {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        2
    }
    fn max_count(&self) -> usize {
        i32::MAX as usize
    }
    fn backend_name(&self) -> &'static str {
        "test-pair"
    }
    fn split(&self, _color: Option<u32>, _key: i32) -> Result<Option<Self>> {
        Err(self.unsupported("split"))
    }
    fn raw_barrier(&self) -> Result<()> {
        self.exchange(&[]).map(drop)
    }
    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> Result<()> {
        let block = args.block_len();
        let (send, recv) = args.parts();
        let theirs = self.exchange(send)?;
        let peer = 1 - self.rank;
        recv[self.rank * block..][..block].copy_from_slice(send);
        recv[peer * block..][..block].copy_from_slice(&theirs);
        Ok(())
    }
    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        let (send, recv, counts, displs) = args.parts();
        let theirs = self.exchange(send)?;
        let peer = 1 - self.rank;
        recv[displs[self.rank]..][..counts[self.rank]].copy_from_slice(send);
        recv[displs[peer]..][..counts[peer]].copy_from_slice(&theirs);
        Ok(())
    }
    fn raw_gather_varcount(&self, _args: GatherArgs<'_>) -> Result<()> {
        Err(self.unsupported("gather"))
    }
    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        let root = args.root();
        let buf = args.buf();
        if root == self.rank {
            self.exchange(buf).map(drop)
        } else {
            let theirs = self.exchange(&[])?;
            if theirs.len() != buf.len() {
                return Err(TransportError::Setup(format!(
                    "broadcast: root sent {} bytes, rank {} expected {}",
                    theirs.len(),
                    self.rank,
                    buf.len()
                )));
            }
            buf.copy_from_slice(&theirs);
            Ok(())
        }
    }
    fn raw_all_to_all_varcount(&self, _args: AllToAllArgs<'_>) -> Result<()> {
        Err(self.unsupported("all-to-all"))
    }
}
