//! The readers' path: `recv` and `recv_borrowed`, and reading a message out of the ring
//! chunk by chunk, each checked, copied out and released at once.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use tpcomm_objects::{DecodeError, ObjectError, Shape};
use tpcomm_transport::process::Liveness;
use tpcomm_transport::Communicator;

use super::{miscounted, park_of_readers, park_of_writer, BroadcastQueue, Life, Role};
use crate::error::{Corruption, Departure, QueueError, Result};
use crate::layout::WriterState;
use crate::ring::{self, Look, Position, RingMemory};
use crate::shm::SharedRing;
use crate::wait::{wait_until, wake_if_parked, Interrupted};

impl<C: Communicator> BroadcastQueue<C> {
    /// Receives the next message as an owned value (a reader only).
    ///
    /// Waits (bounded by the timeout, on the ring and on the transport path alike) for the
    /// writer. Fails with [`Decode`](QueueError::Decode) when the bytes are not a `T`, or
    /// [`TypeMismatch`](QueueError::TypeMismatch) when they decode but the writer's value had
    /// another shape (the message is consumed; the next call reads the next one);
    /// [`Allocation`](QueueError::Allocation) when the receive buffer cannot grow to hold
    /// it (a ring reader passes over the rest of the message, and the next call reads the
    /// next one; a transport reader's queue fails);
    /// [`WriterTimeout`](QueueError::WriterTimeout) when nothing of it came in time (a ring
    /// reader may call again; a transport reader's queue fails, its sub-communicator
    /// aborted); [`Closed`](QueueError::Closed) once the writer closed the queue and every
    /// message was received; and otherwise ([`Corrupt`](QueueError::Corrupt),
    /// [`WriterGone`](QueueError::WriterGone), [`WriterFailed`](QueueError::WriterFailed),
    /// a timeout in the middle of a message) fails the queue.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T> {
        self.recv_bytes()?;
        self.decode()
    }

    /// Receives the next message as a value that borrows from this queue's receive buffer
    /// (`&str`, `&[u8]` with `serde_bytes`, ...), valid until the next call on the queue.
    /// The bytes are copied out of shared memory first: the value never points into memory
    /// a peer can write. Fails as [`recv`](Self::recv).
    pub fn recv_borrowed<'a, T: Deserialize<'a>>(&'a mut self) -> Result<T> {
        self.recv_bytes()?;
        self.decode()
    }

    /// Decodes the message just received, with the agreed depth limit, as a `T` whose shape
    /// must be the writer's value's.
    fn decode<'a, T: Deserialize<'a>>(&'a self) -> Result<T> {
        let (rank, writer, message) = (self.rank, self.writer, self.messages - 1);
        let sent = Shape::from_bits(self.shape);
        tpcomm_objects::decode_shaped(writer, &self.buf, &self.options, sent).map_err(|source| {
            match source {
                ObjectError::Decode {
                    source: DecodeError::ShapeMismatch { sent, found },
                    ..
                } => QueueError::TypeMismatch {
                    rank,
                    writer,
                    message,
                    sent,
                    found,
                },
                source => QueueError::Decode {
                    rank,
                    writer,
                    message,
                    source,
                },
            }
        })
    }

    /// Receives the next message's bytes into `self.buf`.
    fn recv_bytes(&mut self) -> Result<()> {
        if let Life::Ended = self.life {
            return Err(QueueError::Closed {
                rank: self.rank,
                writer: self.writer,
                messages: self.messages,
            });
        }
        self.usable("recv")?;
        let received = match self.role {
            Role::Writer { .. } => return Err(QueueError::NotReader { rank: self.rank }),
            Role::Reader { .. } => self.ring_recv(),
            Role::Remote => self.remote_recv(),
        };
        match received {
            Ok(shape) => {
                self.shape = shape;
                self.messages += 1;
                Ok(())
            }
            Err(e @ QueueError::Closed { .. }) => {
                self.life = Life::Ended;
                Err(e)
            }
            // A timeout before the message started: nothing of it was read.
            Err(e @ QueueError::WriterTimeout { .. }) if !matches!(self.role, Role::Remote) => {
                Err(e)
            }
            // The ring reader passed over the message it could not hold: the next `recv`
            // reads the next one.
            Err(e @ QueueError::Allocation { .. }) if matches!(self.role, Role::Reader { .. }) => {
                self.messages += 1;
                Err(e)
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Reads the next message out of the ring, chunk by chunk, releasing each as soon as
    /// it is copied; returns its shape.
    fn ring_recv(&mut self) -> Result<u64> {
        let Role::Reader {
            ring: Some(ring),
            slot,
            next_chunk,
            ..
        } = &mut self.role
        else {
            return Err(self.refused("recv"));
        };
        let (rank, writer, message, size) = (self.rank, self.writer, self.messages, self.size);
        let cap = self.options.max_total_bytes as u64;
        let park = park_of_readers(ring);
        let writer_park = park_of_writer(ring);
        let writer_id = self.peers[writer];
        let other_process = !writer_id.same_process(&self.peers[rank]);
        let corrupt = |problem| QueueError::Corrupt {
            rank,
            peer: writer,
            message,
            problem,
        };
        let mut at = Position::start(message);
        // Set when the buffer could not grow: the bytes the message needed by then.
        let mut refused = None;
        self.buf.clear();
        loop {
            let c = *next_chunk;
            let started = at.total.is_some();
            let ready = || -> Result<bool> {
                match ring::look(ring, c).map_err(corrupt)? {
                    Look::Ready => return Ok(true),
                    Look::NotYet => {}
                }
                // The park handshake's look: published (sequentially consistent) after the
                // stamp, so a count past `c` means the stamp is there.
                if ring.published().load(std::sync::atomic::Ordering::SeqCst) > c {
                    return Ok(ring::look(ring, c).map_err(corrupt)? == Look::Ready);
                }
                writer_ended(ring, (rank, writer, message, size), started)?;
                Ok(false)
            };
            let check = || -> Result<()> {
                // A writer that failed the queue (or closed it) and then exited said so first.
                writer_ended(ring, (rank, writer, message, size), started)?;
                if writer_id.liveness() == Liveness::Gone {
                    return Err(QueueError::WriterGone {
                        rank,
                        writer,
                        message,
                        how: Departure::Exited,
                    });
                }
                Ok(())
            };
            match wait_until(
                &self.budget,
                (self.timeout, self.liveness),
                park,
                other_process.then_some(self.liveness),
                ready,
                check,
            ) {
                Ok(()) => {}
                Err(Interrupted::Failed(e)) => return Err(e),
                Err(Interrupted::Miscounted { found }) => {
                    return Err(corrupt(miscounted(park, found)))
                }
                Err(Interrupted::Timeout(waited)) => {
                    let e = QueueError::WriterTimeout {
                        rank,
                        writer,
                        message,
                        waited,
                    };
                    // In the middle of a message the stream cannot be resumed.
                    return Err(if started { self.fail(e) } else { e });
                }
            }
            let dst = refused.is_none().then_some(&mut self.buf);
            let reserved = ring::read_chunk(ring, c, &mut at, cap, dst, |v, n| {
                v.try_reserve(n).map_err(|_| v.len() + n)
            })
            .map_err(corrupt)?;
            if let Err(bytes) = reserved {
                // The buffer cannot hold the message: the rest of it is passed over (checked,
                // released, not copied), so that the next `recv` starts at the next message
                // and the writer is not held up by what this reader cannot hold.
                refused = Some(bytes);
                continue;
            }
            ring::release(ring, *slot, c);
            wake_if_parked(writer_park);
            *next_chunk = c + 1;
            if at.complete() {
                return match refused {
                    None => Ok(at.shape),
                    Some(bytes) => Err(QueueError::Allocation {
                        rank,
                        message,
                        bytes,
                    }),
                };
            }
        }
    }
}

/// The writer's state seen by a reader of a group of `size` ranks waiting for message
/// `message` (`started`: some of it arrived): an error when the writer will send nothing
/// more.
fn writer_ended(
    ring: &SharedRing,
    (rank, writer, message, size): (usize, usize, u64, usize),
    started: bool,
) -> Result<()> {
    let how = match ring.writer_state() {
        Ok(WriterState::Creating | WriterState::Open) => return Ok(()),
        Ok(WriterState::Closed) if !started => {
            return Err(QueueError::Closed {
                rank,
                writer,
                messages: message,
            })
        }
        Ok(WriterState::Closed) => Departure::Closed,
        Ok(WriterState::Dropped) => Departure::Dropped,
        Ok(WriterState::Failed) => {
            // The culprit is a rank number a peer wrote: one outside the group is no rank.
            let culprit = match ring.culprit() {
                None => writer,
                Some(c) if c < size => c,
                Some(c) => {
                    return Err(QueueError::Corrupt {
                        rank,
                        peer: writer,
                        message,
                        problem: Corruption::Rank {
                            which: "culprit",
                            found: c as u64,
                            size,
                        },
                    })
                }
            };
            return Err(QueueError::WriterFailed {
                rank,
                writer,
                message,
                culprit,
            });
        }
        Err(found) => {
            return Err(QueueError::Corrupt {
                rank,
                peer: writer,
                message,
                problem: Corruption::State {
                    which: "writer",
                    found,
                },
            })
        }
    };
    Err(QueueError::WriterGone {
        rank,
        writer,
        message,
        how,
    })
}
