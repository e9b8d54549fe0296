//! What more than one test binary of this crate uses: rank groups and their results, whole
//! buffers as regions, byte patterns, descriptor counts, and another process holding a
//! descriptor, the owner named by a forged or foreign handle.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use tpcomm_ipc::{
    ExchangeId, HostBuffer, HostHandle, MemoryRegion, PeerMappings, PeerMemory, Region,
};
use tpcomm_transport::LocalGroup;

pub(crate) type R<T> = tpcomm_ipc::Result<T>;

/// A local group of `n` ranks whose waits time out after 60 s.
pub(crate) fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(60))
}

/// Every rank's value; panics naming every rank that failed (the first failure is often a
/// peer's consequence of another rank's).
pub(crate) fn done<T: std::fmt::Debug>(results: Vec<tpcomm_transport::Result<R<T>>>) -> Vec<T> {
    let mut values = Vec::new();
    let mut failures = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => values.push(v),
            Ok(Err(e)) => failures.push(format!("rank {rank}: {e}")),
            Err(e) => failures.push(format!("rank {rank} died: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("; "));
    values
}

/// The region of all of `buf`.
pub(crate) fn region(buf: &HostBuffer) -> Region {
    Region {
        addr: buf.addr(),
        len: buf.len(),
    }
}

/// The first `N` bytes of region `index` of `rank` in exchange `id`, read through this rank's
/// mapping of it.
pub(crate) fn read_peer<B: PeerMemory, const N: usize>(
    peers: &PeerMappings<B>,
    id: ExchangeId,
    rank: usize,
    index: usize,
) -> R<[u8; N]> {
    let mut got = [0u8; N];
    peers
        .backend()
        .read(peers.peer(id, rank, index)?, 0, &mut got)?;
    Ok(got)
}

/// `len` bytes that differ by rank and buffer.
pub(crate) fn pattern(rank: usize, buffer: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(3) ^ (rank as u8 * 16 + buffer as u8))
        .collect()
}

/// Descriptors this process has open now.
pub(crate) fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The seals of every segment of the host backend.
pub(crate) const SEGMENT_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A memfd of `len` bytes named `name`, made to be sealed, with `seals` added.
pub(crate) fn memfd(name: &str, len: u64, seals: SealFlags) -> OwnedFd {
    let fd =
        rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

/// Another process that holds a file as its descriptor 0 (standard input) until dropped
/// (then it is killed and reaped): the owner named by a forged handle.
pub(crate) struct Holder {
    pub(crate) child: Child,
}

impl Holder {
    pub(crate) fn new(stdin: impl Into<Stdio>) -> Self {
        let child = Command::new("sleep")
            .arg("600")
            .stdin(stdin)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        Self { child }
    }

    /// A holder of a memfd of `len` bytes made like a segment of the host backend, and the
    /// handle of it.
    pub(crate) fn with_segment(len: u64) -> (Self, HostHandle) {
        let file = memfd("tpcomm-peer", len, SEGMENT_SEALS);
        let holder = Self::new(file.try_clone().unwrap());
        let h = holder.handle(&file, len);
        (holder, h)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A handle naming all `len` bytes of `file` (a copy of the holder's descriptor 0), with
    /// its true device and inode: what a forger who knows the file can write.
    pub(crate) fn handle(&self, file: &OwnedFd, len: u64) -> HostHandle {
        let stat = rustix::fs::fstat(file).unwrap();
        HostHandle {
            pid: self.child.id(),
            fd: 0,
            dev: stat.st_dev,
            inode: stat.st_ino,
            segment_len: len,
            offset: 0,
            len,
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
