//! The writer's path: `send` (its checks, the choice between streaming and the writer's
//! buffer), the buffered copy into the ring chunk by chunk, and the wait for the readers to
//! free a chunk.

use serde::Serialize;
use tpcomm_objects::{EncodeError, Shape};
use tpcomm_transport::process::Liveness;
use tpcomm_transport::Communicator;

use super::stream::{encoded_size, SizePass, Streamed, STREAM_MIN_BYTES};
use super::{miscounted, park_of_readers, park_of_writer, BroadcastQueue, Role};
use crate::error::{Corruption, Departure, QueueError, Result};
use crate::layout::{chunk_count, header, piece, ReaderState};
use crate::ring::{self, RingMemory};
use crate::shm::SharedRing;
use crate::wait::{wait_until, wake_if_parked, Interrupted};

impl<C: Communicator> BroadcastQueue<C> {
    /// Sends `value` to every reader (the writer only). Returns once every chunk of it is in
    /// the ring and the transport readers' broadcast is done: a reader on this host that
    /// lags by the whole ring makes it wait, bounded by the timeout.
    ///
    /// A value of few, large pieces (byte strings, strings: a size pass of postcard counts
    /// its bytes, giving up past 64 pieces that average under 64 bytes) of at least 16 KiB or
    /// more than a chunk is encoded straight into the ring's chunks when every reader maps
    /// the ring: each chunk is published as soon as it is full, so that the readers copy it
    /// out while the rest is encoded. Any other value is encoded into the writer's buffer,
    /// then copied into the ring. The size pass runs for the first message and after a
    /// message of 16 KiB or more than a chunk: after a smaller one the next value goes
    /// straight into the buffer (a stream of small values, scheduler steps, pays one
    /// traversal each; a large value after small ones is copied once, and sized next time).
    ///
    /// Fails with [`Encode`](QueueError::Encode) or
    /// [`MessageTooLarge`](QueueError::MessageTooLarge) before anything is sent (the queue
    /// stays usable); with [`UnstableEncoding`](QueueError::UnstableEncoding) when the value
    /// encodes to another length than its size pass counted (failing the queue if a chunk
    /// of it was published already); with [`ReaderTimeout`](QueueError::ReaderTimeout),
    /// [`ReaderGone`](QueueError::ReaderGone) or [`Corrupt`](QueueError::Corrupt) naming the
    /// reader when one does not free its chunk, and then the queue is failed: the writer
    /// marks the ring failed, so that its readers stop waiting with
    /// [`WriterFailed`](QueueError::WriterFailed) naming the same reader.
    pub fn send<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.usable("send")?;
        if !self.is_writer() {
            return Err(QueueError::NotWriter {
                rank: self.rank,
                writer: self.writer,
            });
        }
        let message = self.messages;
        let cap = self.options.max_total_bytes;
        let max_depth = self.options.max_depth;
        let encode = |e| encode_error(self.rank, message, e);
        let too_large = |bytes| QueueError::MessageTooLarge {
            rank: self.rank,
            message,
            bytes,
            cap,
        };
        // A value of few, large pieces (a byte string) of at least `STREAM_MIN_BYTES` or more
        // than a chunk is sized first and encoded straight into the ring; any other, into the
        // writer's buffer and then copied.
        let sized = if self.streams() && self.size_next {
            encoded_size(value, max_depth)
        } else {
            SizePass::Skipped
        };
        let chunk_bytes = self.settings.chunk_bytes;
        let large = |bytes: usize| bytes >= STREAM_MIN_BYTES || bytes as u64 > chunk_bytes;
        match sized {
            SizePass::Bytes(Err(e)) => return Err(encode(e)),
            SizePass::Bytes(Ok((bytes, _))) if bytes > cap => return Err(too_large(bytes)),
            SizePass::Bytes(Ok((bytes, shape))) if large(bytes) => {
                match self.ring_stream(message, value, bytes, shape) {
                    Ok(()) => {}
                    Err(Streamed::Unpublished(e)) => return Err(*e),
                    Err(Streamed::Failed(e)) => return Err(self.fail(*e)),
                }
                self.size_next = true;
            }
            SizePass::Bytes(Ok((_, sized))) => {
                // The size pass went through the bounded encoder: the value nests within
                // `max_depth`, its encoding fits this thread's stack (postcard alone takes
                // less of it than the bounded encoder did), and its shape is known. What is
                // left is postcard's plain encoding, as for any serde value.
                let buf = clear(std::mem::take(&mut self.buf));
                let buf = tpcomm_objects::encode_append(value, buf)
                    .map_err(|source| encode(tpcomm_objects::EncodeError::Postcard(source)))?;
                self.size_next = large(buf.len());
                self.buffered_send(message, buf, sized)?;
            }
            SizePass::GaveUp | SizePass::Skipped => {
                let buf = clear(std::mem::take(&mut self.buf));
                let (buf, shape) =
                    tpcomm_objects::encode_append_shaped(value, buf, max_depth).map_err(encode)?;
                self.size_next = large(buf.len());
                self.buffered_send(message, buf, shape)?;
            }
        }
        self.messages += 1;
        if let Role::Writer {
            ring: Some(ring), ..
        } = &self.role
        {
            ring.header_u64(header::MESSAGES)
                .store(self.messages, std::sync::atomic::Ordering::Release);
        }
        Ok(())
    }

    /// Sends the encoded message `buf` (message `message`, of shape `shape`) through the
    /// ring and the transport, once it is checked against the cap.
    fn buffered_send(&mut self, message: u64, buf: Vec<u8>, shape: Shape) -> Result<()> {
        self.buf = buf;
        let cap = self.options.max_total_bytes;
        if self.buf.len() > cap {
            return Err(QueueError::MessageTooLarge {
                rank: self.rank,
                message,
                bytes: self.buf.len(),
                cap,
            });
        }
        let shape = shape.bits();
        let sent = self
            .ring_send(message, shape)
            .and_then(|()| self.remote_send(message, shape));
        sent.map_err(|e| self.fail(e))
    }

    /// The writer's ring, when some readers map it, with the next chunk to write and the
    /// chunks every reader was known to have released.
    pub(super) fn writer_ring(&self) -> Option<(&SharedRing, u64, u64)> {
        match &self.role {
            Role::Writer {
                ring: Some(ring),
                next_chunk,
                released,
                ..
            } => Some((ring, *next_chunk, *released)),
            _ => None,
        }
    }

    /// Records the writer's next chunk to write and the chunks known released.
    pub(super) fn set_writer_progress(&mut self, next: u64, known: u64) {
        if let Role::Writer {
            next_chunk,
            released,
            ..
        } = &mut self.role
        {
            (*next_chunk, *released) = (next, known);
        }
    }

    /// Writes `self.buf` (message `message`, of shape `shape`) into the ring, chunk by
    /// chunk.
    fn ring_send(&mut self, message: u64, shape: u64) -> Result<()> {
        let Some((ring, mut c, mut known)) = self.writer_ring() else {
            return Ok(());
        };
        let total = self.buf.len() as u64;
        let whole = ring::Message {
            number: message,
            total,
            shape,
        };
        let chunk_bytes = ring.chunk_bytes();
        let readers = park_of_readers(ring);
        let mut offset = 0u64;
        for _ in 0..chunk_count(total, chunk_bytes) {
            let need = ring::needed(ring, c);
            if known < need {
                known = self.wait_for_readers(ring, c, need, message)?;
            }
            let (len, _) = piece(total, chunk_bytes, offset);
            let part = &self.buf[offset as usize..(offset + len) as usize];
            ring::write_chunk(ring, c, whole, offset, part);
            wake_if_parked(readers);
            c += 1;
            offset += len;
        }
        self.set_writer_progress(c, known);
        Ok(())
    }

    /// Waits until every ring reader has released `need` chunks, so that chunk `c` may be
    /// written; returns the chunks they have released (at least `need`).
    pub(super) fn wait_for_readers(
        &self,
        ring: &SharedRing,
        c: u64,
        need: u64,
        message: u64,
    ) -> Result<u64> {
        let Role::Writer {
            active, slot_ranks, ..
        } = &self.role
        else {
            return Ok(need);
        };
        let me = &self.peers[self.rank];
        let other_process = slot_ranks.iter().any(|&r| !self.peers[r].same_process(me));
        let parked = park_of_writer(ring);
        let (mut known, mut lag) = (need, None);
        let ready = || -> Result<bool> {
            match ring::released(ring, c, active) {
                Ok((least, _)) if least >= need => {
                    known = least;
                    Ok(true)
                }
                Ok((_, slot)) => {
                    lag = slot;
                    if let Some(s) = slot {
                        reader_left(ring, s, slot_ranks[s], (self.rank, message))?;
                    }
                    Ok(false)
                }
                Err((s, problem)) => Err(QueueError::Corrupt {
                    rank: self.rank,
                    peer: slot_ranks[s],
                    message,
                    problem,
                }),
            }
        };
        let check = || -> Result<()> {
            for &s in active.iter() {
                let r = slot_ranks[s];
                if self.peers[r].same_host(me)
                    && !self.peers[r].same_process(me)
                    && self.peers[r].liveness() == Liveness::Gone
                {
                    return Err(QueueError::ReaderGone {
                        rank: self.rank,
                        reader: r,
                        message,
                        how: Departure::Exited,
                    });
                }
            }
            Ok(())
        };
        let waited = wait_until(
            &self.budget,
            (self.timeout, self.liveness),
            parked,
            other_process.then_some(self.liveness),
            ready,
            check,
        );
        match waited {
            Ok(()) => Ok(known),
            Err(Interrupted::Failed(e)) => Err(e),
            Err(Interrupted::Miscounted { found }) => Err(QueueError::Corrupt {
                rank: self.rank,
                peer: lag
                    .or(active.first().copied())
                    .map_or(self.writer, |s| slot_ranks[s]),
                message,
                problem: miscounted(parked, found),
            }),
            Err(Interrupted::Timeout(waited)) => {
                let slow = ring::released(ring, c, active)
                    .ok()
                    .and_then(|(_, s)| s)
                    .or(lag);
                Err(QueueError::ReaderTimeout {
                    rank: self.rank,
                    reader: slow.map_or(self.writer, |s| slot_ranks[s]),
                    message,
                    waited,
                })
            }
        }
    }
}

/// The writer's error for an encoding of message `message` that failed with `e`: nothing
/// was sent.
pub(super) fn encode_error(rank: usize, message: u64, e: EncodeError) -> QueueError {
    match e {
        EncodeError::TooDeep { limit } | EncodeError::StackShort { level: limit } => {
            QueueError::TooDeep {
                rank,
                message,
                limit,
            }
        }
        EncodeError::Postcard(source) => QueueError::Encode {
            rank,
            message,
            source,
        },
        _ => QueueError::Encode {
            rank,
            message,
            source: postcard::Error::SerdeSerCustom,
        },
    }
}

/// `buf`, emptied (its capacity kept).
fn clear(mut buf: Vec<u8>) -> Vec<u8> {
    buf.clear();
    buf
}

/// A reader slot whose reader left (or whose state word is no state): the writer's error.
fn reader_left(
    ring: &SharedRing,
    slot: usize,
    reader: usize,
    (rank, message): (usize, u64),
) -> Result<()> {
    let word = ring
        .reader_state(slot)
        .load(std::sync::atomic::Ordering::SeqCst);
    let how = match ReaderState::from_word(word) {
        Some(ReaderState::Active) => return Ok(()),
        Some(ReaderState::Closed) => Departure::Closed,
        Some(ReaderState::Dropped) => Departure::Dropped,
        Some(ReaderState::Free) | None => {
            return Err(QueueError::Corrupt {
                rank,
                peer: reader,
                message,
                problem: Corruption::State {
                    which: "reader slot",
                    found: word,
                },
            })
        }
    };
    Err(QueueError::ReaderGone {
        rank,
        reader,
        message,
        how,
    })
}
