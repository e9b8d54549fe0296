//! The chunk protocol of the ring, generic over where its words and payloads live, so that
//! one copy of the logic runs in production (over the shared segment, [`crate::shm`]) and
//! under `loom` (`cargo xtask loom`, the `loom_tests` below).
//!
//! Writer, for chunk `c` (its sequence number since creation) of message `m`: wait until
//! every reader's progress word is at least `c + 1 - depth` (the slot's previous chunk is
//! released by all); write the payload and the header fields; store the stamp `c + 1`
//! (release); store the published count `c + 1` (sequentially consistent: see
//! [`crate::wait`] for the parking handshake it is one half of).
//!
//! Reader, for chunk `c`: load the stamp (acquire). `c + 1`: written, read the fields (each
//! checked against what the message so far implies), copy the payload, fence (acquire) and
//! load the stamp again: still `c + 1`, or the writer rewrote the chunk under the copy
//! ([`Corruption::Overwritten`], which no honest writer does); then store its progress
//! `c + 1` (release the chunk). The slot's previous stamp (`c + 1 - depth`, or 0 on the
//! first lap): not written yet. Anything else: [`Corruption::Stamp`].

use std::sync::atomic::Ordering;

use crate::error::Corruption;
use crate::layout::{piece, Field, FIRST, LAST};

/// One 64-bit word of the ring.
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
}

impl Word for std::sync::atomic::AtomicU64 {
    #[inline(always)]
    fn load(&self, order: Ordering) -> u64 {
        std::sync::atomic::AtomicU64::load(self, order)
    }
    #[inline(always)]
    fn store(&self, value: u64, order: Ordering) {
        std::sync::atomic::AtomicU64::store(self, value, order)
    }
}

/// The ring's words and payloads, wherever they live.
pub(crate) trait RingMemory {
    type W: Word + ?Sized;
    /// Chunks in the ring.
    fn depth(&self) -> u64;
    /// Payload bytes per chunk.
    fn chunk_bytes(&self) -> u64;
    /// A header field of chunk slot `slot` (`slot < depth`).
    fn field(&self, slot: usize, field: Field) -> &Self::W;
    /// Reader slot `reader`'s progress word.
    fn consumed(&self, reader: usize) -> &Self::W;
    /// The writer's count of published chunks.
    fn published(&self) -> &Self::W;
    /// Copies `src` into chunk slot `slot`'s payload at byte `at` (`at + src.len()` at most
    /// `chunk_bytes`).
    fn write_payload(&self, slot: usize, at: usize, src: &[u8]);
    /// Appends `len` bytes (at most `chunk_bytes`) of chunk slot `slot`'s payload to `dst`.
    fn append_payload(&self, slot: usize, len: usize, dst: &mut Vec<u8>);
    /// An acquire fence (loom's, under loom).
    fn acquire_fence(&self);
}

/// Chunk `c`'s slot.
fn slot_of<M: RingMemory + ?Sized>(mem: &M, c: u64) -> usize {
    (c % mem.depth()) as usize
}

/// The chunks every reader of `active` (reader slots) has released, as the writer of chunk
/// `c` reads their progress words (only `c` chunks were published), with the slot of the
/// reader furthest behind; or the slot whose progress word claims chunks not published yet.
/// Chunk `c` may be written once the count is at least `c + 1 - depth`: the writer keeps
/// the count and reads the words again only when it is not.
pub(crate) fn released<M: RingMemory + ?Sized>(
    mem: &M,
    c: u64,
    active: &[usize],
) -> Result<(u64, Option<usize>), (usize, Corruption)> {
    let mut least = (c, None);
    for &r in active {
        let consumed = mem.consumed(r).load(Ordering::SeqCst);
        if consumed > c {
            return Err((
                r,
                Corruption::ReaderProgress {
                    slot: r,
                    consumed,
                    published: c,
                },
            ));
        }
        if consumed < least.0 || least.1.is_none() {
            least = (consumed, Some(r));
        }
    }
    Ok(least)
}

/// The released count chunk `c` needs before it is written: its slot's previous chunk.
pub(crate) fn needed<M: RingMemory + ?Sized>(mem: &M, c: u64) -> u64 {
    (c + 1).saturating_sub(mem.depth())
}

/// Writes chunk `c` of message `message` (`total` bytes): the bytes of `payload` at
/// `offset`, and publishes it. The caller checked [`released`] first.
pub(crate) fn write_chunk<M: RingMemory + ?Sized>(
    mem: &M,
    c: u64,
    message: Message,
    offset: u64,
    payload: &[u8],
) {
    debug_assert_eq!(
        piece(message.total, mem.chunk_bytes(), offset).0,
        payload.len() as u64
    );
    mem.write_payload(slot_of(mem, c), 0, payload);
    publish_chunk(mem, c, message, offset);
}

/// What every chunk of a message says of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Message {
    /// Its number (messages sent before it).
    pub(crate) number: u64,
    /// Its length.
    pub(crate) total: u64,
    /// The shape of the writer's value (`tpcomm_objects::Shape`).
    pub(crate) shape: u64,
}

/// Copies `src` into chunk `c`'s payload at byte `at` of the chunk, before it is published
/// (the writer fills a chunk piece by piece while it encodes). The caller checked
/// [`released`] first: no reader reads the slot until [`publish_chunk`].
pub(crate) fn fill_chunk<M: RingMemory + ?Sized>(mem: &M, c: u64, at: usize, src: &[u8]) {
    mem.write_payload(slot_of(mem, c), at, src);
}

/// Publishes chunk `c` of `message`, the bytes at `offset` of the message, its payload
/// written already ([`fill_chunk`]): the header fields, then the stamp (release), then the
/// published count (sequentially consistent).
pub(crate) fn publish_chunk<M: RingMemory + ?Sized>(
    mem: &M,
    c: u64,
    message: Message,
    offset: u64,
) {
    let slot = slot_of(mem, c);
    let (len, flags) = piece(message.total, mem.chunk_bytes(), offset);
    mem.field(slot, Field::Message)
        .store(message.number, Ordering::Relaxed);
    mem.field(slot, Field::Total)
        .store(message.total, Ordering::Relaxed);
    mem.field(slot, Field::Shape)
        .store(message.shape, Ordering::Relaxed);
    mem.field(slot, Field::Offset)
        .store(offset, Ordering::Relaxed);
    mem.field(slot, Field::Len).store(len, Ordering::Relaxed);
    mem.field(slot, Field::Flags)
        .store(flags, Ordering::Relaxed);
    mem.field(slot, Field::Stamp)
        .store(c + 1, Ordering::Release);
    mem.published().store(c + 1, Ordering::SeqCst);
}

/// What a look at chunk `c`'s stamp finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// Written: read it.
    Ready,
    /// The slot still holds its previous chunk (or nothing).
    NotYet,
}

/// Looks at chunk `c`'s stamp (acquire).
#[inline]
pub(crate) fn look<M: RingMemory + ?Sized>(mem: &M, c: u64) -> Result<Look, Corruption> {
    let found = mem
        .field(slot_of(mem, c), Field::Stamp)
        .load(Ordering::Acquire);
    let previous = (c + 1).saturating_sub(mem.depth());
    if found == c + 1 {
        Ok(Look::Ready)
    } else if found == previous {
        Ok(Look::NotYet)
    } else {
        Err(Corruption::Stamp {
            chunk: c,
            found,
            expected: c + 1,
            previous,
        })
    }
}

/// Where a reader is in the message it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    /// The message number.
    pub(crate) message: u64,
    /// Bytes received so far.
    pub(crate) offset: u64,
    /// The message's length, once its first chunk arrived.
    pub(crate) total: Option<u64>,
    /// The message's shape, as its first chunk said.
    pub(crate) shape: u64,
}

impl Position {
    /// The start of message `message`.
    pub(crate) fn start(message: u64) -> Self {
        Self {
            message,
            offset: 0,
            total: None,
            shape: 0,
        }
    }

    /// Whether the message is complete.
    pub(crate) fn complete(&self) -> bool {
        self.total == Some(self.offset)
    }
}

/// Reads chunk `c` (its stamp seen [`Look::Ready`]) into `dst` and advances `at`, after
/// checking every field against `at` and `cap` (the largest message allowed); `reserve`
/// makes room for the chunk's bytes in `dst` (or fails, and then nothing is read and `at`
/// stays). With no `dst` the chunk is checked and passed over, its bytes not copied (a
/// reader skipping the rest of a message it could not hold). Does not release the chunk.
pub(crate) fn read_chunk<M: RingMemory + ?Sized, E>(
    mem: &M,
    c: u64,
    at: &mut Position,
    cap: u64,
    dst: Option<&mut Vec<u8>>,
    reserve: impl FnOnce(&mut Vec<u8>, usize) -> Result<(), E>,
) -> Result<Result<(), E>, Corruption> {
    let slot = slot_of(mem, c);
    let word = |f| mem.field(slot, f).load(Ordering::Relaxed);
    let (message, total, offset, len, flags, shape) = (
        word(Field::Message),
        word(Field::Total),
        word(Field::Offset),
        word(Field::Len),
        word(Field::Flags),
        word(Field::Shape),
    );
    if message != at.message {
        return Err(Corruption::ChunkMessage {
            chunk: c,
            found: message,
        });
    }
    if at.total.is_none() && total > cap {
        return Err(Corruption::TooLarge { total, cap });
    }
    let chunk_bytes = mem.chunk_bytes();
    let expected_total = at.total.unwrap_or(total);
    // `at.offset <= expected_total` holds: a position only advances by checked lengths.
    let (expected_len, expected_flags) = piece(expected_total, chunk_bytes, at.offset);
    if total != expected_total || offset != at.offset || len != expected_len {
        return Err(Corruption::ChunkFraming {
            chunk: c,
            len,
            offset,
            total,
            expected_offset: at.offset,
            expected_len,
            chunk_bytes,
        });
    }
    if flags != expected_flags {
        return Err(Corruption::Flags {
            chunk: c,
            found: flags,
            expected: expected_flags,
        });
    }
    if at.total.is_some() && shape != at.shape {
        return Err(Corruption::ChunkShape {
            chunk: c,
            found: shape,
            expected: at.shape,
        });
    }
    // `len <= chunk_bytes`, which fits `usize` (the layout exists).
    let n = len as usize;
    if let Some(dst) = dst {
        if let Err(e) = reserve(dst, n) {
            return Ok(Err(e));
        }
        mem.append_payload(slot, n, dst);
    }
    mem.acquire_fence();
    let after = mem.field(slot, Field::Stamp).load(Ordering::Relaxed);
    if after != c + 1 {
        return Err(Corruption::Overwritten {
            chunk: c,
            found: after,
        });
    }
    at.total = Some(total);
    at.shape = shape;
    at.offset += len;
    debug_assert_eq!(flags & LAST != 0, at.complete());
    debug_assert_eq!(flags & FIRST != 0, offset == 0);
    Ok(Ok(()))
}

/// Releases chunk `c` for reader slot `reader`.
#[inline]
pub(crate) fn release<M: RingMemory + ?Sized>(mem: &M, reader: usize, c: u64) {
    mem.consumed(reader).store(c + 1, Ordering::SeqCst);
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Model checks of the chunk flags: one writer racing two readers over a ring of two
    //! chunks of two bytes, with a message of each shape (one chunk, two chunks, one that
    //! laps the ring). loom explores every interleaving (within its preemption bound) and
    //! checks that no payload is written while a reader copies it (the payloads are loom
    //! cells), that every reader receives every message whole and in order, and that no
    //! honest interleaving looks corrupt.

    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{fence, AtomicU64};
    use loom::sync::Arc;

    use super::*;

    impl Word for AtomicU64 {
        fn load(&self, order: Ordering) -> u64 {
            AtomicU64::load(self, order)
        }
        fn store(&self, value: u64, order: Ordering) {
            AtomicU64::store(self, value, order)
        }
    }

    const DEPTH: u64 = 2;
    const CHUNK: u64 = 2;
    const READERS: usize = 2;

    struct Model {
        fields: Vec<[AtomicU64; 7]>,
        consumed: Vec<AtomicU64>,
        published: AtomicU64,
        payload: Vec<UnsafeCell<[u8; CHUNK as usize]>>,
    }

    fn index(f: Field) -> usize {
        f.offset() / 8
    }

    impl RingMemory for Model {
        type W = AtomicU64;
        fn depth(&self) -> u64 {
            DEPTH
        }
        fn chunk_bytes(&self) -> u64 {
            CHUNK
        }
        fn field(&self, slot: usize, field: Field) -> &AtomicU64 {
            &self.fields[slot][index(field)]
        }
        fn consumed(&self, reader: usize) -> &AtomicU64 {
            &self.consumed[reader]
        }
        fn published(&self) -> &AtomicU64 {
            &self.published
        }
        fn write_payload(&self, slot: usize, at: usize, src: &[u8]) {
            self.payload[slot].with_mut(|p| {
                // SAFETY: loom checks that no other access to this cell overlaps.
                let p = unsafe { &mut *p };
                p[at..at + src.len()].copy_from_slice(src);
            });
        }
        fn append_payload(&self, slot: usize, len: usize, dst: &mut Vec<u8>) {
            self.payload[slot].with(|p| {
                // SAFETY: loom checks that no write to this cell overlaps.
                let p = unsafe { &*p };
                dst.extend_from_slice(&p[..len]);
            });
        }
        fn acquire_fence(&self) {
            fence(Ordering::Acquire);
        }
    }

    fn model() -> Model {
        let word = || AtomicU64::new(0);
        Model {
            fields: (0..DEPTH)
                .map(|_| [word(), word(), word(), word(), word(), word(), word()])
                .collect(),
            consumed: (0..READERS).map(|_| word()).collect(),
            published: word(),
            payload: (0..DEPTH)
                .map(|_| UnsafeCell::new([0; CHUNK as usize]))
                .collect(),
        }
    }

    /// The writer: every message, chunk by chunk, yielding while a reader lags. A chunk's
    /// payload is filled one byte at a time before it is published (as the streamed send
    /// fills it while it encodes), except on even message numbers, written whole
    /// ([`write_chunk`], the send from the writer's buffer).
    fn write_all(mem: &Model, messages: &[&[u8]], readers: usize) {
        let active: Vec<usize> = (0..readers).collect();
        let mut c = 0;
        for (m, bytes) in messages.iter().enumerate() {
            let total = bytes.len() as u64;
            let mut offset = 0;
            loop {
                while released(mem, c, &active).expect("honest readers").0 < needed(mem, c) {
                    loom::thread::yield_now();
                }
                let (len, _) = piece(total, CHUNK, offset);
                let part = &bytes[offset as usize..(offset + len) as usize];
                let message = Message {
                    number: m as u64,
                    total,
                    shape: 0,
                };
                if m % 2 == 0 {
                    write_chunk(mem, c, message, offset, part);
                } else {
                    for (at, byte) in part.iter().enumerate() {
                        fill_chunk(mem, c, at, std::slice::from_ref(byte));
                    }
                    publish_chunk(mem, c, message, offset);
                }
                c += 1;
                offset += len;
                if offset == total {
                    break;
                }
            }
        }
    }

    /// A reader: `count` messages, chunk by chunk.
    fn read_all(mem: &Model, reader: usize, count: usize) -> Vec<Vec<u8>> {
        let mut c = 0;
        let mut out = Vec::new();
        for m in 0..count {
            let mut at = Position::start(m as u64);
            let mut bytes = Vec::new();
            while !at.complete() {
                while look(mem, c).expect("an honest writer") == Look::NotYet {
                    loom::thread::yield_now();
                }
                read_chunk(mem, c, &mut at, 64, Some(&mut bytes), |_, _| {
                    Ok::<(), ()>(())
                })
                .expect("an honest writer")
                .unwrap();
                release(mem, reader, c);
                c += 1;
            }
            out.push(bytes);
        }
        out
    }

    /// Explores the writer sending `messages` to `readers` readers (up to
    /// [`READERS`]), within `preemptions` and, when set, a time budget (the exploration is
    /// then bounded, not exhaustive); prints what it explored.
    fn check(
        messages: &'static [&'static [u8]],
        readers: usize,
        preemptions: usize,
        budget: Option<std::time::Duration>,
    ) {
        let iterations = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = iterations.clone();
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = builder.preemption_bound.or(Some(preemptions));
        builder.max_branches = 100_000;
        builder.max_duration = budget;
        let began = std::time::Instant::now();
        builder.check(move || {
            count.fetch_add(1, Ordering::Relaxed);
            let mem = Arc::new(model());
            let handles: Vec<_> = (0..readers)
                .map(|r| {
                    let mem = mem.clone();
                    loom::thread::spawn(move || read_all(&mem, r, messages.len()))
                })
                .collect();
            write_all(&mem, messages, readers);
            for r in handles {
                let got = r.join().unwrap();
                let want: Vec<Vec<u8>> = messages.iter().map(|m| m.to_vec()).collect();
                assert_eq!(got, want);
            }
        });
        let n = iterations.load(Ordering::Relaxed);
        eprintln!(
            "loom: {readers} readers, {} messages, preemption bound {:?}: {n} interleavings in {:.1?} ({})",
            messages.len(),
            builder.preemption_bound,
            began.elapsed(),
            match budget {
                Some(b) if began.elapsed() >= b => "time budget reached: bounded, not exhaustive",
                _ => "exhaustive within the bound",
            }
        );
        assert!(n > 1);
    }

    #[test]
    fn loom_a_reader_gets_a_one_chunk_message_then_a_two_chunk_message_whole() {
        check(&[b"ab", b"cdef"], 1, 3, None);
    }

    #[test]
    fn loom_a_writer_that_laps_the_ring_waits_for_its_reader() {
        check(&[b"a", b"", b"bc"], 1, 3, None);
    }

    /// Two readers: every load may read any value its coherence order allows, so the
    /// exploration is bounded in time.
    #[test]
    fn loom_two_readers_race_the_writer_over_a_lapped_ring() {
        check(
            &[b"ab", b"cdef"],
            2,
            2,
            Some(std::time::Duration::from_secs(60)),
        );
    }
}
