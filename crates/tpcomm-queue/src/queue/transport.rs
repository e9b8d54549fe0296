//! The transport path, for the readers that do not map the ring (on other hosts, or asked
//! to): each message is one broadcast of a 256-byte frame (a header and the first bytes) in
//! the sub-communicator of the writer and those readers, plus broadcasts of the rest in
//! pieces that grow with what arrived (one piece up to 1 MiB).

use tpcomm_transport::{Communicator, TransportError};

use super::BroadcastQueue;
use crate::error::{Corruption, QueueError, Result};

/// Bytes of a transport frame: a [`HEADER`] and the first [`INLINE`] bytes.
pub(super) const FRAME: usize = 256;
/// Bytes of a frame's header: magic, version, kind, message number, length, shape.
const HEADER: usize = 32;
/// Message bytes a frame carries.
const INLINE: usize = FRAME - HEADER;
/// A frame's first bytes.
const FRAME_MAGIC: [u8; 4] = *b"tpQF";
/// The frame format's version.
const FRAME_VERSION: u16 = 2;
/// Frame kinds.
pub(super) const DATA: u8 = 1;
pub(super) const END: u8 = 2;

impl<C: Communicator> BroadcastQueue<C> {
    /// Broadcasts `self.buf` (message `message`, of shape `shape`) to the transport
    /// readers: one frame, and the rest of the bytes when they do not fit in it.
    pub(super) fn remote_send(&mut self, message: u64, shape: u64) -> Result<()> {
        let Some(remote) = &self.remote else {
            return Ok(());
        };
        let total = self.buf.len();
        let inline = total.min(INLINE);
        write_frame(&mut self.frame, DATA, message, (total as u64, shape));
        self.frame[HEADER..HEADER + inline].copy_from_slice(&self.buf[..inline]);
        let (rank, writer, readers) = (self.rank, self.writer, &self.locality.transport);
        let transport = |source| writer_error(rank, (writer, readers), message, source);
        remote.broadcast(0, &mut self.frame).map_err(transport)?;
        let mut sent = inline;
        while sent < total {
            let n = next_piece(sent, total, remote.max_count());
            remote
                .broadcast(0, &mut self.buf[sent..sent + n])
                .map_err(transport)?;
            sent += n;
        }
        Ok(())
    }

    /// Receives the next message's frame (and the rest of its bytes) from the transport;
    /// returns its shape.
    pub(super) fn remote_recv(&mut self) -> Result<u64> {
        let (rank, message) = (self.rank, self.messages);
        let Some(remote) = &self.remote else {
            return Err(self.refused("recv"));
        };
        let (writer, readers) = (self.writer, &self.locality.transport);
        let transport = |source| reader_error(rank, (writer, readers), message, source);
        remote.broadcast(0, &mut self.frame).map_err(transport)?;
        let corrupt = |problem| QueueError::Corrupt {
            rank,
            peer: self.writer,
            message,
            problem,
        };
        let (kind, number, (total, shape)) = read_frame(&self.frame).map_err(corrupt)?;
        if kind == END {
            return Err(QueueError::Closed {
                rank,
                writer: self.writer,
                messages: message,
            });
        }
        if number != message {
            return Err(corrupt(Corruption::Frame("a message number out of order")));
        }
        let cap = self.options.max_total_bytes as u64;
        if total > cap {
            return Err(corrupt(Corruption::TooLarge { total, cap }));
        }
        // `total <= cap <= isize::MAX`.
        let total = total as usize;
        let inline = total.min(INLINE);
        self.buf.clear();
        self.buf
            .extend_from_slice(&self.frame[HEADER..HEADER + inline]);
        // The rest arrives in pieces, each reserved only when the one before it is in: what
        // a frame alone makes this reader reserve is one piece ([`AHEAD`]), not the length
        // it announces.
        while self.buf.len() < total {
            let at = self.buf.len();
            let n = next_piece(at, total, remote.max_count());
            if self.buf.try_reserve(n).is_err() {
                return Err(QueueError::Allocation {
                    rank,
                    message,
                    bytes: at + n,
                });
            }
            self.buf.resize(at + n, 0);
            remote
                .broadcast(0, &mut self.buf[at..])
                .map_err(transport)?;
        }
        Ok(shape)
    }
}

/// The most bytes of a message a transport reader reserves before they arrive: the first
/// piece after the frame.
const AHEAD: usize = 1 << 20;

/// The length of the piece of a `total`-byte message that follows its first `received`
/// bytes: as many bytes as arrived before it (at least [`AHEAD`]), so that a reader never
/// reserves more than twice what it received plus [`AHEAD`], and a message of `n` bytes
/// takes about `log2(n / AHEAD)` broadcasts; never more than the transport's `max_count`.
pub(super) fn next_piece(received: usize, total: usize, max_count: usize) -> usize {
    (total - received)
        .min(received.max(AHEAD))
        .min(max_count.max(1))
}

/// Writes a frame's header: its kind, the message number, the message's length and shape.
pub(super) fn write_frame(
    frame: &mut [u8; FRAME],
    kind: u8,
    message: u64,
    (total, shape): (u64, u64),
) {
    frame[..4].copy_from_slice(&FRAME_MAGIC);
    frame[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
    frame[6] = kind;
    frame[7] = 0;
    frame[8..16].copy_from_slice(&message.to_le_bytes());
    frame[16..24].copy_from_slice(&total.to_le_bytes());
    frame[24..32].copy_from_slice(&shape.to_le_bytes());
}

/// A frame's kind, message number, and the message's length and shape, checked.
pub(super) fn read_frame(
    frame: &[u8; FRAME],
) -> std::result::Result<(u8, u64, (u64, u64)), Corruption> {
    if frame[..4] != FRAME_MAGIC {
        return Err(Corruption::Frame("no frame magic"));
    }
    if frame[4..6] != FRAME_VERSION.to_le_bytes() {
        return Err(Corruption::Frame("another frame version"));
    }
    if frame[7] != 0 || !matches!(frame[6], DATA | END) {
        return Err(Corruption::Frame("an unknown frame kind"));
    }
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&frame[at..at + 8]);
        u64::from_le_bytes(w)
    };
    Ok((frame[6], word(8), (word(16), word(24))))
}

/// The queue rank of rank `split_rank` of the transport path's split: the writer is its rank
/// 0, the transport readers (`readers`, ascending) follow in rank order.
fn queue_rank(split_rank: usize, (writer, readers): (usize, &[usize])) -> Option<usize> {
    match split_rank {
        0 => Some(writer),
        r => readers.get(r - 1).copied(),
    }
}

/// A transport reader's error for the broadcast of message `message` failing with `source`:
/// a wait past the bound (the queue's timeout, see [`Communicator::bound_waits`]) is
/// [`QueueError::WriterTimeout`] naming the writer, the root of every broadcast it waits in.
fn reader_error(
    rank: usize,
    (writer, readers): (usize, &[usize]),
    message: u64,
    source: TransportError,
) -> QueueError {
    match source {
        TransportError::Timeout { waited, .. } | TransportError::Unresponsive { waited, .. } => {
            QueueError::WriterTimeout {
                rank,
                writer,
                message,
                waited,
            }
        }
        source => renumbered(rank, (writer, readers), message, source),
    }
}

/// [`QueueError::Transport`] for `source`, its culprit renumbered from the split's ranks to
/// the queue's.
fn renumbered(
    rank: usize,
    (writer, readers): (usize, &[usize]),
    message: u64,
    source: TransportError,
) -> QueueError {
    QueueError::Transport {
        rank,
        message,
        culprit: source
            .culprit()
            .and_then(|r| queue_rank(r, (writer, readers))),
        source: Box::new(source),
    }
}

/// The writer's error for the broadcast of message `message` to the transport readers
/// failing with `source`: a wait past the bound is [`QueueError::TransportTimeout`] naming
/// the readers the transport blames in the queue's numbering (every transport reader when it
/// blames none); any other failure is [`QueueError::Transport`] with its culprit renumbered.
fn writer_error(
    rank: usize,
    (writer, readers): (usize, &[usize]),
    message: u64,
    source: TransportError,
) -> QueueError {
    let blamed: Vec<usize> = match &source {
        TransportError::Timeout { missing, .. } => missing.clone(),
        TransportError::Unresponsive { gone, silent, .. } => {
            gone.iter().chain(silent.iter()).copied().collect()
        }
        _ => return renumbered(rank, (writer, readers), message, source),
    };
    let mut named: Vec<usize> = blamed
        .into_iter()
        .filter_map(|r| queue_rank(r, (writer, readers)))
        .filter(|&r| r != writer)
        .collect();
    if named.is_empty() {
        named = readers.to_vec();
    }
    QueueError::TransportTimeout {
        rank,
        message,
        readers: named,
        source: Box::new(source),
    }
}
