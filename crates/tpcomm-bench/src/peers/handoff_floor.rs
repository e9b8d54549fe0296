//! The least a shared-memory hand-off of one encoded value costs, for `tpcomm-bench queue`
//! to time next to the queue in the same run.
//!
//! The writer (rank 0) encodes the value with postcard into a private buffer, copies the
//! bytes into a shared-memory buffer of its own and stores a sequence number (release);
//! every reader spins on that number (acquire), copies the bytes out of the shared buffer
//! and decodes them. That is the work no shared-memory broadcast of a serde value can leave
//! out: the encoding, the hand-off of the bytes between the cores, the copy out of memory a
//! peer can write (decoding in place would let the writer change bytes under the decoder)
//! and the decoding. (Encoding straight into the shared buffer is slower: each line the
//! encoder touches is first taken back from the readers' caches, one small store at a
//! time.) It has none of the queue's ring, checks, flow control or parking: the writer
//! never waits for its readers, because every iteration of the bench starts at a barrier
//! that every reader reaches only after its copy.
//!
//! It bounds the queue's latency from below for values that fit in one of the queue's
//! chunks. Larger values stream through the queue's ring, the readers copying one chunk
//! while the writer fills the next, which this floor does not do.
//!
//! The buffer is a `tpcomm-ipc` host buffer of rank 0's that the others map
//! ([`WriterBuffer`]: one `PeerMappings::exchange`), so the floor runs on threads and on MPI
//! processes of one host alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use tpcomm::Communicator;

use crate::engine::error::BenchError;
use crate::peers::WriterBuffer;

/// Bytes before the payload: the sequence number, the length, and the rest of a cache line
/// (the payload starts on a line of its own).
const HEADER: usize = 64;
/// How long a reader spins before it yields the CPU between looks (ranks can outnumber
/// cores).
const SPIN: Duration = Duration::from_micros(50);
/// How long a reader waits for the writer before it gives up.
const TIMEOUT: Duration = Duration::from_secs(30);

/// One rank's side of the floor: the writer's buffer, or a reader's mapping of it.
#[derive(Debug)]
pub(crate) struct HandoffFloor {
    /// The writer's buffer, or this reader's mapping of it.
    shared: WriterBuffer,
    /// Payload bytes the buffer holds.
    capacity: usize,
    /// The writer's encoding of the value (`capacity` bytes).
    encoded: Vec<u8>,
    writer: bool,
    /// The sequence number of the last value sent (writer) or received (reader).
    seq: u64,
}

impl HandoffFloor {
    /// Collective: rank 0 allocates a shared buffer for values of up to `capacity` encoded
    /// bytes (every rank passes the same) and every other rank maps it.
    pub(crate) fn new<C: Communicator>(comm: &C, capacity: usize) -> Result<Self, BenchError> {
        let writer = comm.rank() == 0;
        let shared = WriterBuffer::new(comm, HEADER, capacity, "hand-off floor")?;
        Ok(Self {
            shared,
            capacity,
            encoded: vec![0; if writer { capacity } else { 0 }],
            writer,
            seq: 0,
        })
    }

    /// The sequence number's word.
    fn seq_word(&self) -> &AtomicU64 {
        // SAFETY: `base` is the start of a live shared mapping of at least HEADER bytes (the
        // writer's buffer, or a mapping kept by `self.shared`), page aligned, so 8-aligned;
        // every process touches this word only through atomics.
        unsafe { &*self.shared.base.cast::<AtomicU64>() }
    }

    /// The length word, written by the writer before it publishes the sequence number.
    fn len_word(&self) -> &AtomicU64 {
        // SAFETY: as in `seq_word`, 8 bytes further (inside the header).
        unsafe { &*self.shared.base.add(8).cast::<AtomicU64>() }
    }

    /// Writer: encodes `value`, copies it into the shared buffer and publishes it.
    pub(crate) fn send<T: Serialize>(&mut self, value: &T) -> Result<(), BenchError> {
        debug_assert!(self.writer);
        let len = postcard::to_slice(value, &mut self.encoded)?.len();
        // SAFETY: `len` bytes from the payload area lie inside the writer's own buffer
        // (HEADER + capacity bytes, `len <= capacity = encoded.len()`), which `encoded`, a
        // private vector, cannot overlap. No reader reads it now: each read the last value
        // before the barrier that started this iteration, and reads the next only after the
        // sequence number below.
        unsafe {
            std::ptr::copy_nonoverlapping(self.encoded.as_ptr(), self.shared.base.add(HEADER), len)
        };
        self.seq += 1;
        self.len_word().store(len as u64, Ordering::Relaxed);
        self.seq_word().store(self.seq, Ordering::Release);
        Ok(())
    }

    /// Reader: waits for the next value and copies its encoded bytes into `out`.
    pub(crate) fn recv_into(&mut self, out: &mut Vec<u8>) -> Result<(), BenchError> {
        debug_assert!(!self.writer);
        let want = self.seq + 1;
        let start = Instant::now();
        let mut looks = 0u32;
        while self.seq_word().load(Ordering::Acquire) != want {
            looks = looks.wrapping_add(1);
            if looks.is_multiple_of(64) {
                let waited = start.elapsed();
                if waited > TIMEOUT {
                    return Err(BenchError::Usage(format!(
                        "hand-off floor: no value {want} from rank 0 within {TIMEOUT:?}"
                    )));
                }
                if waited > SPIN {
                    std::thread::yield_now();
                }
            }
            std::hint::spin_loop();
        }
        self.seq = want;
        let len = self.len_word().load(Ordering::Relaxed) as usize;
        if len > self.capacity {
            return Err(BenchError::Usage(format!(
                "hand-off floor: rank 0 announced {len} bytes, the buffer holds {}",
                self.capacity
            )));
        }
        out.clear();
        out.reserve(len);
        // SAFETY: `len` bytes from the payload area lie inside the mapping (checked against
        // the capacity, which the mapping's length covers); the writer wrote them before its
        // release store that the acquire load above saw, and writes again only after the
        // next barrier, which this rank reaches after the copy. `out` has room for `len`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.shared.base.add(HEADER), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Ok(())
    }

    /// Unmaps this rank's mapping of the writer's buffer (none on the writer, whose buffer
    /// goes when `self` drops).
    pub(crate) fn close(self) -> Result<(), BenchError> {
        self.shared.close()
    }
}
