//! The queue's one shared-memory module: the ring's segment as typed atomic words and
//! payload copies at offsets computed from the agreed [`Layout`], never from the segment.
//!
//! The segment is a `tpcomm-ipc` host buffer (a sealed memfd) that the writer owns, or a
//! reader's validated mapping of it. Every access is an atomic load or store of an aligned
//! word, or a raw copy of payload bytes (the copies a peer may race with are the documented
//! contract of shared memory: no Rust reference ever points at a payload byte). Every offset
//! is checked against the layout's size, which is checked against the mapping's length when
//! the ring is made: no access can leave the mapping, whatever the peers write.

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use rustix::mm::{madvise, Advice};
use tpcomm_transport::copy::{copy_bytes, copy_to_shared};

use tpcomm_ipc::{
    HostBuffer, HostHandle, HostMapping, HostMemory, IpcError, MemoryRegion, PeerMemory,
};

use crate::error::Corruption;
use crate::layout::{
    header, slot, Field, Layout, ReaderState, WriterState, CHUNK_HEADER_BYTES, HEADER_BYTES, MAGIC,
    VERSION,
};
use crate::ring::RingMemory;

/// The memory behind a ring: the writer's own buffer or a reader's mapping of it.
#[derive(Debug)]
enum Region {
    Owned(HostBuffer),
    Mapped(HostMapping),
}

/// A ring segment, as this process reaches it.
#[derive(Debug)]
pub(crate) struct SharedRing {
    region: Region,
    base: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the region is a HostBuffer or HostMapping (both Send and Sync: a MAP_SHARED mapping
// usable from any thread); the base pointer only reaches that mapping, through atomics and raw
// copies.
unsafe impl Send for SharedRing {}
// SAFETY: as above; `&SharedRing` hands out atomics and makes raw copies only.
unsafe impl Sync for SharedRing {}

/// Why a reader could not join the ring.
#[derive(Debug)]
pub(crate) enum JoinError {
    /// The segment cannot be mapped from here (the transport serves this reader instead).
    Unreachable(IpcError),
    /// The segment is not the ring the ranks agreed on.
    Corrupt(Corruption),
    /// The writer started sending before this reader joined.
    Late { messages: u64 },
}

impl SharedRing {
    /// Wraps `region`, which must hold `layout` whole at an address aligned for atomics.
    fn new(region: Region, layout: Layout) -> Result<Self, Corruption> {
        let (addr, len) = match &region {
            Region::Owned(b) => (b.as_ptr(), b.len()),
            Region::Mapped(m) => (m.as_ptr(), m.len()),
        };
        let base = NonNull::new(addr).ok_or(Corruption::Header {
            field: "address",
            found: 0,
            expected: 1,
        })?;
        if len < layout.total || !(addr as usize).is_multiple_of(crate::layout::LINE) {
            return Err(Corruption::Header {
                field: "mapped length",
                found: len as u64,
                expected: layout.total as u64,
            });
        }
        Ok(Self {
            region,
            base,
            layout,
        })
    }

    /// Allocates and initializes the ring of `layout` (the writer), with reader slot `i`
    /// for rank `slot_ranks[i]`; returns it and the handle readers open.
    pub(crate) fn create(
        memory: &HostMemory,
        layout: Layout,
        id: u64,
        writer: usize,
        slot_ranks: &[usize],
    ) -> Result<(Self, HostHandle), IpcError> {
        let buffer = memory.allocate(layout.total)?;
        let handle = memory.export(buffer.addr(), buffer.len())?;
        let ring = Self::new(Region::Owned(buffer), layout)
            .map_err(|e| IpcError::InvalidAllocation(e.to_string()))?;
        ring.populate(Advice::LinuxPopulateWrite);
        let store = |at: usize, v: u64| ring.u64_at(at).store(v, Ordering::Relaxed);
        store(
            header::VERSION,
            u64::from(VERSION) | (HEADER_BYTES as u64) << 32,
        );
        store(header::QUEUE_ID, id);
        store(header::GEOMETRY, layout.depth | layout.chunk_bytes << 32);
        store(header::STRIDE, layout.stride as u64);
        store(header::SLOTS, layout.readers as u64 | (writer as u64) << 32);
        store(header::READERS_AT, layout.readers_at as u64);
        store(header::CHUNKS_AT, layout.chunks_at as u64);
        store(header::TOTAL, layout.total as u64);
        for (i, &rank) in slot_ranks.iter().enumerate() {
            ring.u32_at(layout.reader(i) + slot::RANK)
                .store(rank as u32, Ordering::Relaxed);
        }
        ring.u64_at(header::MAGIC).store(MAGIC, Ordering::Release);
        Ok((ring, handle))
    }

    /// Maps the writer's ring from `handle` (a reader), checks its header against what the
    /// ranks agreed and that nothing was sent yet, and claims reader slot `slot` for `rank`.
    pub(crate) fn join(
        memory: &HostMemory,
        handle: &HostHandle,
        layout: Layout,
        (id, writer): (u64, usize),
        (slot, rank): (usize, usize),
    ) -> Result<Self, JoinError> {
        let ring = Self::map(memory, handle, layout)?;
        ring.check_header(id, writer).map_err(JoinError::Corrupt)?;
        let messages = ring.header_u64(header::MESSAGES).load(Ordering::SeqCst);
        let published = ring.header_u64(header::PUBLISHED).load(Ordering::SeqCst);
        if messages != 0 || published != 0 {
            return Err(JoinError::Late { messages });
        }
        let claim = claim_word(id, rank);
        let word = ring.u64_at(layout.reader(slot) + slot::CLAIM);
        match word.compare_exchange(0, claim, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => {}
            // A slot claimed already: the ring has its reader.
            Err(found) => {
                return Err(if found == claim {
                    JoinError::Late { messages }
                } else {
                    JoinError::Corrupt(Corruption::Claim {
                        slot,
                        found,
                        expected: claim,
                    })
                })
            }
        }
        ring.reader_state(slot)
            .store(ReaderState::Active as u32, Ordering::SeqCst);
        Ok(ring)
    }

    /// Maps the ring again after a suspend (a reader): the header must still be the agreed
    /// one, the slot this reader's, its progress word `consumed`.
    pub(crate) fn rejoin(
        memory: &HostMemory,
        handle: &HostHandle,
        layout: Layout,
        (id, writer): (u64, usize),
        (slot, rank): (usize, usize),
        consumed: u64,
    ) -> Result<Self, JoinError> {
        let ring = Self::map(memory, handle, layout)?;
        ring.check_header(id, writer).map_err(JoinError::Corrupt)?;
        let claim = claim_word(id, rank);
        let found = ring
            .u64_at(layout.reader(slot) + slot::CLAIM)
            .load(Ordering::SeqCst);
        if found != claim {
            return Err(JoinError::Corrupt(Corruption::Claim {
                slot,
                found,
                expected: claim,
            }));
        }
        let progress = ring.consumed_word(slot).load(Ordering::SeqCst);
        if progress != consumed {
            return Err(JoinError::Corrupt(Corruption::ReaderProgress {
                slot,
                consumed: progress,
                published: consumed,
            }));
        }
        Ok(ring)
    }

    fn map(memory: &HostMemory, handle: &HostHandle, layout: Layout) -> Result<Self, JoinError> {
        let mapping = memory.open(handle).map_err(JoinError::Unreachable)?;
        let ring = Self::new(Region::Mapped(mapping), layout).map_err(JoinError::Corrupt)?;
        ring.populate(Advice::LinuxPopulateRead);
        Ok(ring)
    }

    /// Maps the first [`POPULATE_BYTES`] of the layout (the whole of a ring that size or
    /// smaller, the default's 4 MiB among them) in this process now: the writer allocates
    /// the pages (`MADV_POPULATE_WRITE`), a reader maps them (`MADV_POPULATE_READ`). A fresh
    /// memfd has no pages; without this, the first lap of the ring pays a page fault per 4
    /// KiB on each side in the middle of messages (a 64 KiB message's wait took 65-180 us
    /// instead of 5 us on a KVM guest), which also exhausts the waiters' spin budget. The
    /// pages of a larger ring past that are committed as the first lap reaches them, so
    /// that a ring costs memory for the pages it uses, not for its size at creation. Best
    /// effort: a kernel without the advice (before Linux 5.14) leaves the faults to the
    /// first lap.
    fn populate(&self, advice: Advice) {
        let len = self.layout.total.min(POPULATE_BYTES);
        // SAFETY: the range is the first `len` bytes of the layout, inside this mapping
        // (checked in `new`) and starting at its page-aligned base; populating changes no
        // byte of it.
        let populated = unsafe { madvise(self.base.as_ptr().cast(), len, advice) };
        if let Err(e) = populated {
            tracing::debug!(error = %e, "the ring's pages are not populated ahead");
        }
    }

    /// Unmaps a reader's mapping now, reporting a failure (dropping unmaps too, logging).
    pub(crate) fn unmap(self, memory: &HostMemory) -> Result<(), IpcError> {
        match self.region {
            Region::Mapped(m) => memory.close(m),
            Region::Owned(b) => {
                drop(b);
                Ok(())
            }
        }
    }

    /// Checks every header field against the agreed layout, queue id and writer.
    pub(crate) fn check_header(&self, id: u64, writer: usize) -> Result<(), Corruption> {
        let l = self.layout;
        let word = |at| self.header_u64(at).load(Ordering::Acquire);
        let magic = word(header::MAGIC);
        if magic != MAGIC {
            return Err(Corruption::Magic { found: magic });
        }
        let version = word(header::VERSION);
        if version as u32 != VERSION {
            return Err(Corruption::Version {
                found: version as u32,
                supported: VERSION,
            });
        }
        let fields = [
            ("header bytes", version >> 32, HEADER_BYTES as u64),
            ("queue id", word(header::QUEUE_ID), id),
            (
                "geometry",
                word(header::GEOMETRY),
                l.depth | l.chunk_bytes << 32,
            ),
            ("chunk stride", word(header::STRIDE), l.stride as u64),
            (
                "reader slots and writer",
                word(header::SLOTS),
                l.readers as u64 | (writer as u64) << 32,
            ),
            (
                "reader slot offset",
                word(header::READERS_AT),
                l.readers_at as u64,
            ),
            ("chunk offset", word(header::CHUNKS_AT), l.chunks_at as u64),
            ("layout length", word(header::TOTAL), l.total as u64),
        ];
        for (field, found, expected) in fields {
            if found != expected {
                return Err(Corruption::Header {
                    field,
                    found,
                    expected,
                });
            }
        }
        Ok(())
    }

    /// The word at byte `offset`, which must lie inside the layout and be 8-aligned (an
    /// invariant of the offsets this crate computes; the segment's contents play no part).
    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.layout.total);
        // SAFETY: `offset + 8` lies inside the mapping (the layout fits it: checked in `new`)
        // and the address is 8-aligned (the base is line-aligned, checked in `new`); the
        // mapping lives as long as `self` (the region), and every process touches this word
        // with atomic operations only (the layout gives header words and payload bytes
        // disjoint ranges), so treating it as an `AtomicU64` is sound.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(offset).cast()) }
    }

    /// The 32-bit word at byte `offset` (4-aligned, inside the layout).
    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.layout.total);
        // SAFETY: as in `u64_at`, for a 4-byte word at a 4-aligned address.
        unsafe { AtomicU32::from_ptr(self.base.as_ptr().add(offset).cast()) }
    }

    /// A header word.
    pub(crate) fn header_u64(&self, at: usize) -> &AtomicU64 {
        self.u64_at(at)
    }

    /// A 32-bit header word.
    pub(crate) fn header_u32(&self, at: usize) -> &AtomicU32 {
        self.u32_at(at)
    }

    /// Reader slots in the layout.
    pub(crate) fn reader_slots(&self) -> usize {
        self.layout.readers
    }

    /// Reader slot `slot`'s progress word.
    pub(crate) fn consumed_word(&self, slot: usize) -> &AtomicU64 {
        assert!(slot < self.layout.readers);
        self.u64_at(self.layout.reader(slot) + slot::CONSUMED)
    }

    /// Reader slot `slot`'s state word.
    pub(crate) fn reader_state(&self, slot: usize) -> &AtomicU32 {
        assert!(slot < self.layout.readers);
        self.u32_at(self.layout.reader(slot) + slot::STATE)
    }

    /// The writer's state, or the word when it is no state.
    pub(crate) fn writer_state(&self) -> Result<WriterState, u32> {
        let word = self.header_u32(header::STATE).load(Ordering::SeqCst);
        WriterState::from_word(word).ok_or(word)
    }

    /// Sets the writer's state (and the culprit of a failure) and wakes every parked
    /// reader, so that waits see it now.
    pub(crate) fn set_writer_state(&self, state: WriterState, culprit: Option<usize>) {
        let culprit = culprit.map_or(0, |c| c as u32 + 1);
        self.header_u32(header::CULPRIT)
            .store(culprit, Ordering::SeqCst);
        self.header_u32(header::STATE)
            .store(state as u32, Ordering::SeqCst);
        self.header_u32(header::WAKE).fetch_add(1, Ordering::SeqCst);
        crate::wait::wake_all(self.header_u32(header::WAKE));
    }

    /// The rank the writer blamed when it failed the queue, if it said.
    pub(crate) fn culprit(&self) -> Option<usize> {
        let word = self.header_u32(header::CULPRIT).load(Ordering::SeqCst);
        word.checked_sub(1).map(|c| c as usize)
    }

    /// Sets reader slot `slot`'s state and wakes the writer if it is parked.
    pub(crate) fn set_reader_state(&self, slot: usize, state: ReaderState) {
        self.reader_state(slot)
            .store(state as u32, Ordering::SeqCst);
        self.header_u32(header::WRITER_WAKE)
            .fetch_add(1, Ordering::SeqCst);
        crate::wait::wake_all(self.header_u32(header::WRITER_WAKE));
    }

    /// Offset of chunk slot `slot`'s payload, with `len` bytes of it inside the layout.
    fn payload_at(&self, slot: usize, len: usize) -> usize {
        assert!(slot < self.layout.depth as usize && len as u64 <= self.layout.chunk_bytes);
        self.layout.chunk(slot) + CHUNK_HEADER_BYTES
    }
}

/// The bytes of a ring committed at creation ([`SharedRing::populate`]): rings up to this
/// size (the default ring, 16 chunks of 256 KiB, takes 4 MiB) whole, and the first part
/// of larger ones; a multiple of the page size.
const POPULATE_BYTES: usize = 8 << 20;

/// A reader's claim on its slot.
fn claim_word(id: u64, rank: usize) -> u64 {
    id ^ (rank as u64 + 1)
}

impl RingMemory for SharedRing {
    type W = AtomicU64;

    #[inline]
    fn depth(&self) -> u64 {
        self.layout.depth
    }

    #[inline]
    fn chunk_bytes(&self) -> u64 {
        self.layout.chunk_bytes
    }

    #[inline]
    fn field(&self, slot: usize, field: Field) -> &AtomicU64 {
        assert!(slot < self.layout.depth as usize);
        self.u64_at(self.layout.chunk(slot) + field.offset())
    }

    #[inline]
    fn consumed(&self, reader: usize) -> &AtomicU64 {
        self.consumed_word(reader)
    }

    #[inline]
    fn published(&self) -> &AtomicU64 {
        self.u64_at(header::PUBLISHED)
    }

    fn write_payload(&self, slot: usize, at: usize, src: &[u8]) {
        let end = at.checked_add(src.len()).expect("a chunk-sized range");
        let start = self.payload_at(slot, end) + at;
        // SAFETY: `start + src.len()` lies inside the mapping (`payload_at` checked `at +
        // src.len()` against the chunk size the layout reserves); `src` is private memory,
        // which cannot overlap the shared mapping; only raw copies touch payload bytes.
        // The readers last read these lines: `copy_to_shared` streams large copies past them.
        unsafe { copy_to_shared(self.base.as_ptr().add(start), src.as_ptr(), src.len()) };
    }

    fn append_payload(&self, slot: usize, len: usize, dst: &mut Vec<u8>) {
        let at = self.payload_at(slot, len);
        assert!(dst.capacity() - dst.len() >= len);
        let end = dst.len();
        // SAFETY: the source range lies inside the mapping (`payload_at`); the destination is
        // `dst`'s spare capacity, at least `len` bytes (asserted), which no one else reaches;
        // the length grows only over the bytes just copied (every bit pattern is a `u8`).
        unsafe {
            copy_bytes(dst.as_mut_ptr().add(end), self.base.as_ptr().add(at), len);
            dst.set_len(end + len);
        }
    }

    #[inline]
    fn acquire_fence(&self) {
        fence(Ordering::Acquire);
    }
}

#[cfg(test)]
impl SharedRing {
    /// A word of the segment by byte offset, for the tests that corrupt it.
    pub(crate) fn word_for_test(&self, offset: usize) -> &AtomicU64 {
        self.u64_at(offset)
    }

    /// Another mapping of the ring (as a third process would map it), claiming nothing.
    pub(crate) fn map_for_test(memory: &HostMemory, handle: &HostHandle, layout: Layout) -> Self {
        Self::map(memory, handle, layout).expect("the ring maps")
    }

    /// The layout, for the tests that corrupt the segment.
    pub(crate) fn layout_for_test(&self) -> Layout {
        self.layout
    }
}
