//! The least two processes do to move a message's bytes through shared memory, for
//! `tpcomm-bench queue` to time next to the queue's large messages in the same run.
//!
//! The writer (rank 0) copies the bytes from a private buffer into a shared-memory buffer of
//! its own, a chunk at a time, storing after each chunk how many bytes are in (release);
//! every reader, on its own core, waits for each chunk (acquire) and copies it out into a
//! private buffer. The two copies overlap chunk by chunk, as the queue's streaming overlaps
//! its writer's and readers' copies, with the queue's chunk size. That is what no
//! shared-memory broadcast of bytes between processes can leave out: the writer's copy in
//! and each reader's copy out, on different cores, with the bytes crossing between their
//! caches. It has nothing else: no encoding or decoding, no ring, no checks, no flow control
//! (the writer never waits: every iteration of the bench starts at a barrier that a reader
//! reaches only after its copy). The copies are the queue's own: the writer's
//! `tpcomm_transport::copy::copy_to_shared` (non-temporal stores from 16 KiB, past the lines
//! the readers cached), each reader's `copy_bytes`.
//!
//! The buffer is a `tpcomm-ipc` host buffer of rank 0's that the others map
//! ([`WriterBuffer`]: one `PeerMappings::exchange`), so the floor runs on threads and on MPI
//! processes of one host alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tpcomm::transport::copy::{copy_bytes, copy_to_shared};
use tpcomm::Communicator;

use crate::engine::error::BenchError;
use crate::peers::WriterBuffer;

/// Bytes before the payload: the progress word, and the rest of a cache line.
const HEADER: usize = 64;
/// How long a reader spins before it yields the CPU between looks (ranks can outnumber
/// cores).
const SPIN: Duration = Duration::from_micros(50);
/// How long a reader waits for the writer before it gives up.
const TIMEOUT: Duration = Duration::from_secs(30);

/// One rank's side of the floor: the writer's buffer, or a reader's mapping of it.
#[derive(Debug)]
pub(crate) struct CopyFloor {
    /// The writer's buffer, or this reader's mapping of it.
    shared: WriterBuffer,
    /// Bytes of every message.
    len: usize,
    /// Bytes the writer publishes at a time.
    chunk: usize,
    /// Bytes moved over all messages so far (the progress word's value after the last one).
    moved: u64,
}

impl CopyFloor {
    /// Collective: rank 0 allocates a shared buffer for messages of `len` bytes (every rank
    /// passes the same `len` and `chunk`) and every other rank maps it.
    pub(crate) fn new<C: Communicator>(
        comm: &C,
        len: usize,
        chunk: usize,
    ) -> Result<Self, BenchError> {
        let shared = WriterBuffer::new(comm, HEADER, len, "copy floor")?;
        Ok(Self {
            shared,
            len,
            chunk: chunk.max(1),
            moved: 0,
        })
    }

    /// The progress word: bytes published over all messages.
    fn progress(&self) -> &AtomicU64 {
        // SAFETY: `base` is the start of a live shared mapping of at least HEADER bytes (the
        // writer's buffer, or a mapping kept by `self.shared`), page aligned, so 8-aligned;
        // every process touches this word only through atomics.
        unsafe { &*self.shared.base.cast::<AtomicU64>() }
    }

    /// Writer: copies `bytes` (the message, `len` bytes) into the shared buffer a chunk at
    /// a time, publishing each.
    pub(crate) fn send(&mut self, bytes: &[u8]) -> Result<(), BenchError> {
        if bytes.len() != self.len {
            return Err(BenchError::Usage(format!(
                "copy floor: a message of {} bytes, the floor moves {}",
                bytes.len(),
                self.len
            )));
        }
        let mut at = 0;
        while at < self.len {
            let n = self.chunk.min(self.len - at);
            // SAFETY: `at + n <= len` bytes from the payload area lie inside the writer's
            // own buffer (HEADER + len bytes), which `bytes`, a private slice, cannot
            // overlap. No reader reads this message's bytes before the progress word says
            // they are in, and the last reader finished the previous message before the
            // barrier that started this iteration.
            unsafe { copy_to_shared(self.shared.base.add(HEADER + at), bytes.as_ptr().add(at), n) };
            at += n;
            self.progress()
                .store(self.moved + at as u64, Ordering::Release);
        }
        self.moved += self.len as u64;
        Ok(())
    }

    /// Reader: copies the next message into `out` (`len` bytes), a chunk as soon as it is
    /// in.
    pub(crate) fn recv_into(&mut self, out: &mut [u8]) -> Result<(), BenchError> {
        if out.len() != self.len {
            return Err(BenchError::Usage(format!(
                "copy floor: a buffer of {} bytes for messages of {}",
                out.len(),
                self.len
            )));
        }
        let start = Instant::now();
        let mut at = 0;
        while at < self.len {
            let n = self.chunk.min(self.len - at);
            let want = self.moved + (at + n) as u64;
            let mut looks = 0u32;
            while self.progress().load(Ordering::Acquire) < want {
                looks = looks.wrapping_add(1);
                if looks.is_multiple_of(64) {
                    let waited = start.elapsed();
                    if waited > TIMEOUT {
                        return Err(BenchError::Usage(format!(
                            "copy floor: byte {want} from rank 0 not in within {TIMEOUT:?}"
                        )));
                    }
                    if waited > SPIN {
                        std::thread::yield_now();
                    }
                }
                std::hint::spin_loop();
            }
            // SAFETY: `at + n <= len` bytes from the payload area lie inside the mapping
            // (checked at creation); the writer wrote them before its release store that
            // the acquire load above saw, and writes them again only after the next
            // barrier, which this rank reaches after the copy; `out` holds `len` bytes.
            unsafe {
                copy_bytes(
                    out.as_mut_ptr().add(at),
                    self.shared.base.add(HEADER + at),
                    n,
                )
            };
            at += n;
        }
        self.moved += self.len as u64;
        Ok(())
    }

    /// Unmaps this rank's mapping of the writer's buffer (none on the writer, whose buffer
    /// goes when `self` drops).
    pub(crate) fn close(self) -> Result<(), BenchError> {
        self.shared.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpcomm::transport::LocalGroup;

    #[test]
    fn every_reader_receives_each_message_chunk_by_chunk() {
        let len = 10_000;
        let results = LocalGroup::new(3).run(|comm| -> Result<(), BenchError> {
            let mut floor = CopyFloor::new(&comm, len, 4096)?;
            for round in 0..3u8 {
                let message: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_add(round)).collect();
                if comm.rank() == 0 {
                    floor.send(&message)?;
                } else {
                    let mut out = vec![0u8; len];
                    floor.recv_into(&mut out)?;
                    assert_eq!(out, message, "round {round}");
                }
                comm.barrier()?;
            }
            let mut wrong = vec![0u8; len - 1];
            if comm.rank() != 0 {
                assert!(floor.recv_into(&mut wrong).is_err());
            }
            floor.close()
        });
        for r in results {
            r.unwrap().unwrap();
        }
    }
}
