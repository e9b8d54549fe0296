//! The ring's layout (version 2): where every word of the segment lies, computed from the
//! settings the ranks agreed, never read from the segment.
//!
//! ```text
//! offset                     size            what
//! 0                          512             header (4 lines of 128 bytes)
//! 512                        128 * readers   one slot per reader on this host
//! 512 + 128 * readers        stride * depth  the chunks
//! ```
//!
//! Header (little endian, the host's own atomics):
//!
//! | offset | width | field | written |
//! |--------|-------|-------|---------|
//! | 0   | 8 | magic `tpcQueue` | at creation |
//! | 8   | 4 | layout version (1) | at creation |
//! | 12  | 4 | header bytes (512) | at creation |
//! | 16  | 8 | queue id (the writer's nonce, agreed) | at creation |
//! | 24  | 4 | depth (chunks in the ring) | at creation |
//! | 28  | 4 | chunk bytes (payload per chunk) | at creation |
//! | 32  | 8 | chunk stride | at creation |
//! | 40  | 4 | reader slots | at creation |
//! | 44  | 4 | writer rank | at creation |
//! | 48  | 8 | offset of the reader slots | at creation |
//! | 56  | 8 | offset of the chunks | at creation |
//! | 64  | 8 | bytes the layout takes | at creation |
//! | 128 | 8 | chunks published | by the writer, each chunk |
//! | 136 | 8 | messages sent | by the writer, each message |
//! | 144 | 4 | writer state ([`WriterState`]) | by the writer |
//! | 148 | 4 | culprit of a failure, plus one (0: none) | by the writer |
//! | 152 | 4 | readers' futex word (bumped to wake them) | by the writer |
//! | 156 | 4 | readers parked on it | by the readers |
//! | 256 | 4 | writer's futex word | by the readers |
//! | 260 | 4 | writer parked on it (0 or 1) | by the writer |
//!
//! Reader slot (128 bytes each, one line pair per reader):
//!
//! | offset | width | field |
//! |--------|-------|-------|
//! | 0  | 8 | chunks this reader is done with (its progress) |
//! | 8  | 8 | claim: queue id xor (rank + 1), 0 while free |
//! | 16 | 4 | reader state ([`ReaderState`]) |
//! | 20 | 4 | reader rank (written by the writer) |
//!
//! Chunk `c` (its sequence number since creation) lives in slot `c % depth`, `stride` bytes
//! each: a 64-byte header, then `chunk bytes` of payload.
//!
//! | offset | width | field |
//! |--------|-------|-------|
//! | 0  | 8 | stamp: `c + 1` once written (0 before the first lap) |
//! | 8  | 8 | message number |
//! | 16 | 8 | message length (every chunk of the message carries it) |
//! | 24 | 8 | offset of this chunk's bytes in the message |
//! | 32 | 8 | bytes in this chunk |
//! | 40 | 8 | flags: [`FIRST`] on the message's first chunk, [`LAST`] on its last |
//! | 48 | 8 | the message's shape (`tpcomm_objects::Shape`), in every chunk of the message |

/// The segment's first 8 bytes.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"tpcQueue");
/// The layout version this build writes and reads.
pub(crate) const VERSION: u32 = 2;
/// A cache line pair (adjacent-line prefetchers pair 64-byte lines).
pub(crate) const LINE: usize = 128;
/// Bytes of the header.
pub(crate) const HEADER_BYTES: usize = 4 * LINE;
/// Bytes of one reader slot.
pub(crate) const READER_SLOT_BYTES: usize = LINE;
/// Bytes of a chunk's header, before its payload.
pub(crate) const CHUNK_HEADER_BYTES: usize = 64;

/// Flag of a message's first chunk.
pub(crate) const FIRST: u64 = 1;
/// Flag of a message's last chunk.
pub(crate) const LAST: u64 = 2;

/// Header fields, by byte offset.
pub(crate) mod header {
    pub(crate) const MAGIC: usize = 0;
    pub(crate) const VERSION: usize = 8;
    pub(crate) const QUEUE_ID: usize = 16;
    pub(crate) const GEOMETRY: usize = 24;
    pub(crate) const STRIDE: usize = 32;
    pub(crate) const SLOTS: usize = 40;
    pub(crate) const READERS_AT: usize = 48;
    pub(crate) const CHUNKS_AT: usize = 56;
    pub(crate) const TOTAL: usize = 64;
    pub(crate) const PUBLISHED: usize = 128;
    pub(crate) const MESSAGES: usize = 136;
    pub(crate) const STATE: usize = 144;
    pub(crate) const CULPRIT: usize = 148;
    pub(crate) const WAKE: usize = 152;
    pub(crate) const SLEEPERS: usize = 156;
    pub(crate) const WRITER_WAKE: usize = 256;
    pub(crate) const WRITER_PARKED: usize = 260;
}

/// Reader slot fields, by byte offset in the slot.
pub(crate) mod slot {
    pub(crate) const CONSUMED: usize = 0;
    pub(crate) const CLAIM: usize = 8;
    pub(crate) const STATE: usize = 16;
    pub(crate) const RANK: usize = 20;
}

/// Chunk header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Field {
    Stamp,
    Message,
    Total,
    Offset,
    Len,
    Flags,
    Shape,
}

impl Field {
    /// Byte offset in the chunk header.
    pub(crate) fn offset(self) -> usize {
        match self {
            Field::Stamp => 0,
            Field::Message => 8,
            Field::Total => 16,
            Field::Offset => 24,
            Field::Len => 32,
            Field::Flags => 40,
            Field::Shape => 48,
        }
    }
}

/// The writer's state word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriterState {
    /// Being created (readers may join).
    Creating = 0,
    /// Sending.
    Open = 1,
    /// Closed by its writer: every published message stays readable.
    Closed = 2,
    /// Dropped without a close.
    Dropped = 3,
    /// Failed (the culprit word says why).
    Failed = 4,
}

impl WriterState {
    pub(crate) fn from_word(word: u32) -> Option<Self> {
        Some(match word {
            0 => WriterState::Creating,
            1 => WriterState::Open,
            2 => WriterState::Closed,
            3 => WriterState::Dropped,
            4 => WriterState::Failed,
            _ => return None,
        })
    }
}

/// A reader slot's state word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReaderState {
    /// Not claimed.
    Free = 0,
    /// Reading.
    Active = 1,
    /// Closed by its reader.
    Closed = 2,
    /// Dropped without a close.
    Dropped = 3,
}

impl ReaderState {
    pub(crate) fn from_word(word: u32) -> Option<Self> {
        Some(match word {
            0 => ReaderState::Free,
            1 => ReaderState::Active,
            2 => ReaderState::Closed,
            3 => ReaderState::Dropped,
            _ => return None,
        })
    }
}

/// Where everything lies for one set of agreed settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) depth: u64,
    pub(crate) chunk_bytes: u64,
    pub(crate) readers: usize,
    pub(crate) stride: usize,
    pub(crate) readers_at: usize,
    pub(crate) chunks_at: usize,
    pub(crate) total: usize,
}

impl Layout {
    /// The layout of `depth` chunks of `chunk_bytes` with `readers` reader slots; `None`
    /// when the sizes overflow (the settings' ranges keep them far from it).
    pub(crate) fn new(depth: u64, chunk_bytes: u64, readers: usize) -> Option<Self> {
        let payload = usize::try_from(chunk_bytes).ok()?;
        let stride = CHUNK_HEADER_BYTES
            .checked_add(payload)?
            .checked_next_multiple_of(LINE)?;
        let readers_at = HEADER_BYTES;
        let chunks_at = readers_at.checked_add(readers.checked_mul(READER_SLOT_BYTES)?)?;
        let total = chunks_at.checked_add(stride.checked_mul(usize::try_from(depth).ok()?)?)?;
        Some(Self {
            depth,
            chunk_bytes,
            readers,
            stride,
            readers_at,
            chunks_at,
            total,
        })
    }

    /// Offset of chunk slot `slot`'s header.
    pub(crate) fn chunk(&self, slot: usize) -> usize {
        self.chunks_at + slot * self.stride
    }

    /// Offset of reader slot `slot`.
    pub(crate) fn reader(&self, slot: usize) -> usize {
        self.readers_at + slot * READER_SLOT_BYTES
    }
}

/// What a chunk at `offset` of a `total`-byte message must say: its length and flags. A
/// message of 0 bytes is one empty chunk.
pub(crate) fn piece(total: u64, chunk_bytes: u64, offset: u64) -> (u64, u64) {
    let len = (total - offset).min(chunk_bytes);
    let mut flags = 0;
    if offset == 0 {
        flags |= FIRST;
    }
    if offset + len == total {
        flags |= LAST;
    }
    (len, flags)
}

/// Chunks a `total`-byte message takes.
pub(crate) fn chunk_count(total: u64, chunk_bytes: u64) -> u64 {
    total.div_ceil(chunk_bytes).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_keeps_every_part_on_its_own_lines() {
        let l = Layout::new(4, 1000, 3).unwrap();
        assert_eq!(l.readers_at, 512);
        assert_eq!(l.chunks_at, 512 + 3 * 128);
        assert_eq!(l.stride, 1152);
        assert_eq!(l.total, l.chunks_at + 4 * 1152);
        assert_eq!(l.chunk(3) + l.stride, l.total);
        assert!(l.chunk(1).is_multiple_of(LINE) && l.reader(2).is_multiple_of(LINE));
        assert!(Layout::new(u64::MAX, 1 << 30, 1).is_none());
    }

    #[test]
    fn pieces_cover_a_message_with_first_and_last_marked_once() {
        assert_eq!(piece(0, 8, 0), (0, FIRST | LAST));
        assert_eq!(piece(8, 8, 0), (8, FIRST | LAST));
        assert_eq!(piece(20, 8, 0), (8, FIRST));
        assert_eq!(piece(20, 8, 8), (8, 0));
        assert_eq!(piece(20, 8, 16), (4, LAST));
        assert_eq!(chunk_count(0, 8), 1);
        assert_eq!(chunk_count(16, 8), 2);
        assert_eq!(chunk_count(17, 8), 3);
    }
}
