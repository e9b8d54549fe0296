//! [`Pair`]: two processes as two ranks over one Unix socket, for the GPU suites that run
//! without MPI on the GPU machine (two-process CUDA IPC tests). Only what the all-reduce's
//! setup, exchanges and lifecycle and the checkpoint sequence use is served: barrier,
//! all-gather, varcount all-gather and broadcast. Test support: a length its peer announces is
//! allocated up to 2 GiB - 1 (`max_count`), and it waits at most 60 s for the peer.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use crate::check::{AllGatherArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs};
use crate::{Communicator, Op, TransportError};

type Result<T> = std::result::Result<T, TransportError>;

#[derive(Debug)]
/// One rank of the two-process test transport.
pub struct Pair {
    rank: usize,
    stream: Mutex<UnixStream>,
}

impl Pair {
    /// Rank `rank` (0 or 1) of the pair, over `stream` (one end of a connected socket).
    ///
    /// # Panics
    /// When `rank` is neither 0 nor 1 (a test's own mistake).
    pub fn new(rank: usize, stream: UnixStream) -> Self {
        assert!(rank < 2, "a pair has ranks 0 and 1, not {rank}");
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
            let len = u64::from_le_bytes(len);
            // Never more than a collective of this transport may carry (`max_count`).
            if len > i32::MAX as u64 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the peer announced {len} bytes, more than {}", i32::MAX),
                ));
            }
            let mut theirs = vec![0u8; len as usize];
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

    /// The peer's bytes, checked to be the `expected` length the call agreed on.
    fn expect_len(&self, op: Op, theirs: Vec<u8>, expected: usize) -> Result<Vec<u8>> {
        if theirs.len() != expected {
            return Err(TransportError::Mismatch {
                op,
                rank: self.rank,
                detail: format!(
                    "rank {} contributed {} bytes, this rank expected {expected}",
                    1 - self.rank,
                    theirs.len()
                ),
            });
        }
        Ok(theirs)
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
        args.group()
            .expect(Op::AllGather, self.rank(), self.size())?;
        let block = args.block_len();
        let (send, recv) = args.parts();
        let theirs = self.expect_len(Op::AllGather, self.exchange(send)?, block)?;
        let peer = 1 - self.rank;
        recv[self.rank * block..][..block].copy_from_slice(send);
        recv[peer * block..][..block].copy_from_slice(&theirs);
        Ok(())
    }
    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGatherVarcount, self.rank(), self.size())?;
        let (send, recv, counts, displs) = args.parts();
        let peer = 1 - self.rank;
        let theirs = self.exchange(send)?;
        let theirs = self.expect_len(Op::AllGatherVarcount, theirs, counts[peer])?;
        recv[displs[self.rank]..][..counts[self.rank]].copy_from_slice(send);
        recv[displs[peer]..][..counts[peer]].copy_from_slice(&theirs);
        Ok(())
    }
    fn raw_gather_varcount(&self, _args: GatherArgs<'_>) -> Result<()> {
        Err(self.unsupported("gather"))
    }
    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::Broadcast, self.rank(), self.size())?;
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

/// Env var naming the socket rank 1 connects to.
const SOCKET_VAR: &str = "TPCOMM_TEST_PAIR_SOCKET";
/// Env var naming what rank 1 runs (the test's own mode names).
const MODE_VAR: &str = "TPCOMM_TEST_PAIR_MODE";

/// Rank 0 of a two-process test: spawns this test executable as rank 1 (its ignored test
/// `child_pair_rank`, which calls [`child`] and runs `mode`), runs `body` as rank 0 over the
/// pair, and returns its value once rank 1 succeeded. Panics on any failure of either rank.
pub fn run_pair<T, E: std::fmt::Display>(
    mode: &str,
    body: impl FnOnce(&Pair) -> std::result::Result<T, E>,
) -> T {
    run_pair_under(mode, &[], body)
}

/// The host name rank 1 of [`run_pair_on_another_host`] runs under.
pub const OTHER_HOST_NAME: &str = "tpcomm-other-host";

/// [`run_pair`] with rank 1 on another host as far as tpcomm can tell: in a PID namespace
/// of its own (with its own `/proc`) and a UTS namespace named [`OTHER_HOST_NAME`]
/// (`unshare --pid --fork --mount-proc --uts`, which needs root). Where namespaces cannot be
/// made here, the test is recorded as skipped ([`super::skip`]) and `None` returned;
/// `TPCOMM_REQUIRE_MULTIHOST=1` makes that a failure.
pub fn run_pair_on_another_host<T, E: std::fmt::Display>(
    mode: &str,
    body: impl FnOnce(&Pair) -> std::result::Result<T, E>,
) -> Option<T> {
    let prefix = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--uts",
        "--",
        "sh",
        "-c",
        "hostname \"$TPCOMM_TEST_PAIR_HOST\" && exec \"$0\" \"$@\"",
    ];
    let probe = std::process::Command::new(prefix[0])
        .args(&prefix[1..])
        .arg("true")
        .env("TPCOMM_TEST_PAIR_HOST", OTHER_HOST_NAME)
        .output();
    let refused = match probe {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`unshare --pid --fork --mount-proc --uts` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run unshare: {e}")),
    };
    if let Some(why) = refused {
        let why = format!("no namespaces for another host here (root needed): {why}");
        assert!(
            !super::multihost_required(),
            "TPCOMM_REQUIRE_MULTIHOST=1 but {why}"
        );
        super::skip(&why);
        return None;
    }
    Some(run_pair_under(mode, &prefix, body))
}

/// [`run_pair`] with rank 1's command line prefixed by `prefix` (a program and its
/// arguments that end by running the rest).
fn run_pair_under<T, E: std::fmt::Display>(
    mode: &str,
    prefix: &[&str],
    body: impl FnOnce(&Pair) -> std::result::Result<T, E>,
) -> T {
    let dir = std::env::temp_dir().join(format!("tpcomm-pair-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut command = match prefix.split_first() {
        Some((program, args)) => {
            let mut c = std::process::Command::new(program);
            c.args(args).arg(&exe);
            c
        }
        None => std::process::Command::new(&exe),
    };
    let mut child = command
        .env("TPCOMM_TEST_PAIR_HOST", OTHER_HOST_NAME)
        .args(["--exact", "child_pair_rank", "--ignored", "--nocapture"])
        .env(SOCKET_VAR, &path)
        .env(MODE_VAR, mode)
        // libtest's own summary of the helper would be counted as a test by `xtask test`;
        // failures still show on stderr.
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    let comm = Pair::new(0, stream);
    let outcome = body(&comm);
    drop(comm);
    let status = child.wait().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let value = outcome.unwrap_or_else(|e| panic!("rank 0: {e}"));
    assert!(status.success(), "rank 1 failed: {status}");
    value
}

/// Rank 1 of a two-process test, inside its `child_pair_rank`: the pair connected to rank 0
/// and the mode [`run_pair`] named.
pub fn child() -> (Pair, String) {
    let path = std::env::var(SOCKET_VAR).expect("run by a two-process test");
    let mode = std::env::var(MODE_VAR).expect("run by a two-process test");
    let stream = UnixStream::connect(path).expect("connect to rank 0");
    (Pair::new(1, stream), mode)
}
