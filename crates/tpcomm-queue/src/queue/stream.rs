//! The streaming encoder: a size pass of postcard (given up on values of many small pieces)
//! and a postcard flavor that encodes straight into the ring's chunks, publishing each as
//! soon as it is full, so that the readers copy a chunk out while the writer encodes the next.

use serde::Serialize;
use tpcomm_objects::{EncodeError, Shape};
use tpcomm_transport::Communicator;

use super::send::encode_error;
use super::{park_of_readers, BroadcastQueue, Role};
use crate::error::QueueError;
use crate::ring::{self, RingMemory};
use crate::shm::SharedRing;
use crate::wait::{wake_if_parked, Park};

impl<C: Communicator> BroadcastQueue<C> {
    /// Whether `send` may encode straight into the ring: a ring some readers map, and no
    /// transport reader (whose broadcast needs the encoded bytes in the writer's buffer).
    pub(super) fn streams(&self) -> bool {
        matches!(self.role, Role::Writer { ring: Some(_), .. }) && self.remote.is_none()
    }

    /// Encodes `value` (message `message`, `total` bytes by the size pass) straight into the
    /// ring's chunks, publishing each chunk as soon as it is full, so that the readers copy
    /// it out while the writer encodes the next.
    pub(super) fn ring_stream<T: Serialize + ?Sized>(
        &mut self,
        message: u64,
        value: &T,
        total: usize,
        shape: Shape,
    ) -> std::result::Result<(), Streamed> {
        let Some((ring, first, known)) = self.writer_ring() else {
            return Ok(());
        };
        let mut at = StreamAt {
            c: first,
            known,
            offset: 0,
            fill: 0,
            stopped: None,
        };
        let sink = RingSink {
            queue: self,
            ring,
            readers: park_of_readers(ring),
            message: ring::Message {
                number: message,
                total: total as u64,
                shape: shape.bits(),
            },
            at: &mut at,
        };
        let encoded =
            tpcomm_objects::encode_shaped_with_flavor(value, sink, self.options.max_depth);
        // A failed encoding leaves the next chunk where it was.
        let next = if encoded.is_ok() { at.c } else { first };
        self.set_writer_progress(next, at.known);
        let source = match encoded {
            Ok(_) => return Ok(()),
            Err(source) => source,
        };
        match at.stopped {
            // A wait on the readers failed: the queue fails, as in `ring_send`.
            Some(e @ Stop::Wait(_)) => Err(Streamed::Failed(Box::new(e.into_error()))),
            stopped => {
                let e = match stopped {
                    Some(stop) => stop.into_error(),
                    None => encode_error(self.rank, message, source),
                };
                // Nothing published: the chunks written are never read, the queue is usable.
                if at.c == first {
                    Err(Streamed::Unpublished(Box::new(e)))
                } else {
                    Err(Streamed::Failed(Box::new(e)))
                }
            }
        }
    }
}

/// Values that encode to fewer bytes, and fit in one chunk, go through the writer's buffer
/// even when sized: one local encoding and one copy into the ring cost less than the ring
/// writes of their small pieces (a scheduler step of one request between two processes:
/// 0.67 us streamed), and there is no second chunk to overlap with.
pub(super) const STREAM_MIN_BYTES: usize = 16 << 10;

/// The size pass of `send` counts at most this many pieces (postcard's writes: a varint, a
/// string, a byte string) before it gives up...
const SIZE_PASS_PIECES: usize = 64;
/// ...unless they average at least this many bytes. A size pass costs about what encoding
/// costs per piece (a traversal of the value), and what streaming saves is a copy of the
/// bytes: worth it for byte strings and other large pieces, not for a value of many small
/// fields (a scheduler step of 100,000 requests: a size pass of 2.3 ms where the copy it
/// saves takes 0.6 ms). Giving up after `n` pieces costs at most `n` pieces' traversal, less
/// than the copy of the `n * 64` bytes that streaming would have saved.
const SIZE_PASS_PIECE_BYTES: usize = 64;

/// What the size pass of `send` found.
#[derive(Debug)]
pub(super) enum SizePass {
    /// The value's encoded length and shape, or the encoder's error (nesting past
    /// `max_depth` among them).
    Bytes(std::result::Result<(usize, Shape), EncodeError>),
    /// Too many small pieces: encode into the writer's buffer instead.
    GaveUp,
    /// Not run (the previous message was too small to stream, or the ring is not the only
    /// path): encode into the writer's buffer.
    Skipped,
}

/// The encoded length and shape of `value` (nesting bounded by `max_depth`), unless it has
/// many small pieces ([`SIZE_PASS_PIECES`]).
pub(super) fn encoded_size<T: Serialize + ?Sized>(value: &T, max_depth: usize) -> SizePass {
    let gave_up = std::cell::Cell::new(false);
    let counted = tpcomm_objects::encode_shaped_with_flavor(
        value,
        CountBytes {
            bytes: 0,
            pieces: 0,
            gave_up: &gave_up,
        },
        max_depth,
    );
    if gave_up.get() {
        SizePass::GaveUp
    } else {
        SizePass::Bytes(counted)
    }
}

/// postcard's output counted, not written: the size pass.
struct CountBytes<'a> {
    bytes: usize,
    pieces: usize,
    gave_up: &'a std::cell::Cell<bool>,
}

impl CountBytes<'_> {
    #[inline(always)]
    fn count(&mut self, n: usize) -> postcard::Result<()> {
        self.bytes = self.bytes.saturating_add(n);
        self.pieces += 1;
        if self.pieces > SIZE_PASS_PIECES
            && self.pieces.saturating_mul(SIZE_PASS_PIECE_BYTES) > self.bytes
        {
            self.gave_up.set(true);
            return Err(postcard::Error::SerializeBufferFull);
        }
        Ok(())
    }
}

impl postcard::ser_flavors::Flavor for CountBytes<'_> {
    type Output = usize;

    #[inline(always)]
    fn try_push(&mut self, _byte: u8) -> postcard::Result<()> {
        self.count(1)
    }

    #[inline(always)]
    fn try_extend(&mut self, piece: &[u8]) -> postcard::Result<()> {
        self.count(piece.len())
    }

    fn finalize(self) -> postcard::Result<usize> {
        Ok(self.bytes)
    }
}

/// Why a streamed send did not complete (boxed: the error path of every streamed send stays
/// one word wide).
#[derive(Debug)]
pub(super) enum Streamed {
    /// No chunk of the message was published: the queue is usable.
    Unpublished(Box<QueueError>),
    /// Some chunks were published, or a wait on the readers failed: the queue fails.
    Failed(Box<QueueError>),
}

/// Why the ring sink stopped the encoder.
#[derive(Debug)]
enum Stop {
    /// A wait for the readers to free a chunk failed.
    Wait(QueueError),
    /// The value encoded to more or fewer bytes than its size pass counted.
    Unstable(QueueError),
}

impl Stop {
    fn into_error(self) -> QueueError {
        match self {
            Stop::Wait(e) | Stop::Unstable(e) => e,
        }
    }
}

/// Where a streamed send is: the chunk being filled and what is known of the readers.
#[derive(Debug)]
struct StreamAt {
    /// The chunk being filled.
    c: u64,
    /// Chunks every reader released, as last read.
    known: u64,
    /// The message offset of chunk `c`'s first byte.
    offset: u64,
    /// Bytes written into chunk `c` so far.
    fill: u64,
    stopped: Option<Stop>,
}

/// postcard's output written straight into the ring's chunks: each piece is copied into
/// the chunk being filled (which every reader released: the writer owns it until it
/// publishes it), and a chunk is published as soon as it holds all its bytes, so that the
/// readers copy it out while the encoder fills the next. The message's length is known
/// before the first byte (the size pass): every chunk carries it, and a value that
/// encodes to another length this time stops the encoder.
struct RingSink<'q, C: Communicator> {
    queue: &'q BroadcastQueue<C>,
    ring: &'q SharedRing,
    readers: Park<'q>,
    /// The message (its length and shape from the size pass).
    message: ring::Message,
    at: &'q mut StreamAt,
}

impl<C: Communicator> RingSink<'_, C> {
    /// Stops the encoder with `stop`.
    fn stop(&mut self, stop: Stop) -> postcard::Error {
        self.at.stopped = Some(stop);
        postcard::Error::SerializeBufferFull
    }

    /// The value encodes to another length than its size pass counted.
    fn unstable(&mut self) -> postcard::Error {
        let e = QueueError::UnstableEncoding {
            rank: self.queue.rank,
            message: self.message.number,
            sized: self.message.total as usize,
        };
        self.stop(Stop::Unstable(e))
    }

    /// Makes sure chunk `at.c` is free (released by every reader) before its first byte.
    fn begin_chunk(&mut self) -> postcard::Result<()> {
        let need = ring::needed(self.ring, self.at.c);
        if self.at.known < need {
            match self
                .queue
                .wait_for_readers(self.ring, self.at.c, need, self.message.number)
            {
                Ok(known) => self.at.known = known,
                Err(e) => return Err(self.stop(Stop::Wait(e))),
            }
        }
        Ok(())
    }

    /// Publishes chunk `at.c` (the bytes at `at.offset`, `len` of them) and moves on.
    fn publish(&mut self, len: u64) {
        let at = &mut *self.at;
        ring::publish_chunk(self.ring, at.c, self.message, at.offset);
        wake_if_parked(self.readers);
        at.c += 1;
        at.offset += len;
        at.fill = 0;
    }

    fn write(&mut self, mut piece: &[u8]) -> postcard::Result<()> {
        let chunk_bytes = self.ring.chunk_bytes();
        while !piece.is_empty() {
            if self.at.offset >= self.message.total {
                return Err(self.unstable());
            }
            if self.at.fill == 0 {
                self.begin_chunk()?;
            }
            let (len, _) = crate::layout::piece(self.message.total, chunk_bytes, self.at.offset);
            // `len - fill` is at most a chunk, which fits `usize` (the layout exists).
            let n = ((len - self.at.fill) as usize).min(piece.len());
            ring::fill_chunk(self.ring, self.at.c, self.at.fill as usize, &piece[..n]);
            self.at.fill += n as u64;
            piece = &piece[n..];
            if self.at.fill == len {
                self.publish(len);
            }
        }
        Ok(())
    }
}

impl<C: Communicator> postcard::ser_flavors::Flavor for RingSink<'_, C> {
    type Output = ();

    #[inline]
    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.write(&[byte])
    }

    #[inline]
    fn try_extend(&mut self, piece: &[u8]) -> postcard::Result<()> {
        self.write(piece)
    }

    fn finalize(mut self) -> postcard::Result<()> {
        if self.message.total == 0 {
            // An empty message is one empty chunk.
            self.begin_chunk()?;
            self.publish(0);
            return Ok(());
        }
        if self.at.offset != self.message.total {
            return Err(self.unstable());
        }
        Ok(())
    }
}
