//! Small host buffers carved out of shared chunks.
//!
//! Every segment costs its peers a descriptor fetch, five checks and an `mmap` to open, and
//! an `munmap` (with a TLB shootdown across the threads of the process) to close. An engine
//! registers hundreds or thousands of small graph buffers, and a suspend closes and a resume
//! reopens all of them, so buffers of at most [`HostMemory::CARVE_MAX_BYTES`] are carved out
//! of chunks of [`HostMemory::CHUNK_BYTES`] (each one segment, made like any other): their
//! handles name the chunk and an offset, and a peer maps each chunk once, whatever number of
//! buffers it opens in it (`open` shares one mapping of a segment between every handle of
//! it).
//!
//! A chunk hands out page-granular extents first fit. Freeing is local, as it is for a buffer
//! with a segment of its own: a peer still mapping a freed buffer keeps reading what was
//! there, until its owner hands the extent out again. Only then are its pages punched out
//! of the file (`fallocate(PUNCH_HOLE)`), so that the new buffer reads as zeros, as a fresh
//! segment does (bytes past the chunk's high-water mark were never handed out and read as
//! zeros already). A chunk whose every extent is free is dropped: its memory goes once no
//! buffer and no peer maps it.
//!
//! [`HostMemory::CARVE_MAX_BYTES`]: super::HostMemory::CARVE_MAX_BYTES
//! [`HostMemory::CHUNK_BYTES`]: super::HostMemory::CHUNK_BYTES

use std::collections::BTreeMap;
use std::sync::Arc;

use super::OwnedSegment;
use crate::error::Result;

/// The free extents of one chunk: offset -> length, never adjacent (freed neighbours merge).
#[derive(Debug)]
pub(super) struct Extents {
    free: BTreeMap<usize, usize>,
    len: usize,
    /// Bytes from here on were never handed out (and so read as zeros).
    high: usize,
}

impl Extents {
    /// A chunk of `len` bytes, all free.
    pub(super) fn new(len: usize) -> Self {
        Self {
            free: BTreeMap::from([(0, len)]),
            len,
            high: 0,
        }
    }

    /// Takes `len` bytes from the lowest free extent that holds them: their offset and how
    /// many of them (from the offset) were handed out before and may hold old bytes; `None`
    /// when no extent holds them.
    pub(super) fn take(&mut self, len: usize) -> Option<(usize, usize)> {
        let (&offset, &free) = self.free.iter().find(|(_, &free)| free >= len)?;
        self.free.remove(&offset);
        if free > len {
            self.free.insert(offset + len, free - len);
        }
        let used = self.high.saturating_sub(offset).min(len);
        self.high = self.high.max(offset + len);
        Some((offset, used))
    }

    /// Gives `offset..offset + len` back, merging it with free neighbours. Returns `false`
    /// (and changes nothing) when any of it is free already or lies outside the chunk.
    pub(super) fn put(&mut self, offset: usize, len: usize) -> bool {
        let Some(end) = offset
            .checked_add(len)
            .filter(|&end| end <= self.len && len > 0)
        else {
            return false;
        };
        let below = self.free.range(..end).next_back().map(|(&o, &l)| (o, l));
        if below.is_some_and(|(o, l)| o + l > offset) {
            return false;
        }
        let mut start = offset;
        if let Some((o, l)) = below.filter(|&(o, l)| o + l == offset) {
            self.free.remove(&o);
            start = o;
            debug_assert_eq!(o + l, offset);
        }
        let mut stop = end;
        if let Some(l) = self.free.remove(&end) {
            stop = end + l;
        }
        self.free.insert(start, stop - start);
        true
    }

    /// Whether every byte is free.
    pub(super) fn all_free(&self) -> bool {
        self.free.get(&0) == Some(&self.len)
    }
}

/// The chunks of one backend (a `HostMemory` and its clones).
#[derive(Debug, Default)]
pub(super) struct Arena {
    chunks: Vec<(Arc<OwnedSegment>, Extents)>,
}

impl Arena {
    /// `len` bytes (a multiple of the page size, at most a chunk) from an existing chunk or a
    /// new one of `chunk_len` bytes, reading as zeros: the chunk and the offset in it.
    pub(super) fn carve(
        &mut self,
        len: usize,
        chunk_len: usize,
    ) -> Result<(Arc<OwnedSegment>, usize)> {
        for (chunk, extents) in &mut self.chunks {
            if let Some((offset, used)) = extents.take(len) {
                if used > 0 {
                    chunk.punch(offset, used);
                }
                return Ok((chunk.clone(), offset));
            }
        }
        let chunk = Arc::new(OwnedSegment::new(chunk_len, super::SEGMENT_NAME)?);
        let mut extents = Extents::new(chunk_len);
        let (offset, _) = extents.take(len).ok_or_else(|| {
            crate::error::IpcError::InvalidAllocation(format!(
                "{len} bytes do not fit a {chunk_len}-byte chunk"
            ))
        })?;
        tracing::trace!(chunk_len, chunks = self.chunks.len() + 1, "host chunk made");
        self.chunks.push((chunk.clone(), extents));
        Ok((chunk, offset))
    }

    /// Gives a carved extent back; drops its chunk when nothing of it is in use any more.
    pub(super) fn give_back(&mut self, chunk: &Arc<OwnedSegment>, offset: usize, len: usize) {
        let Some(i) = self.chunks.iter().position(|(c, _)| Arc::ptr_eq(c, chunk)) else {
            tracing::warn!(offset, len, "a carved buffer's chunk is not in its arena");
            return;
        };
        let extents = &mut self.chunks[i].1;
        if !extents.put(offset, len) {
            tracing::warn!(offset, len, "a carved extent was given back twice");
        }
        if extents.all_free() {
            self.chunks.swap_remove(i);
        }
    }

    /// Chunks held now.
    pub(super) fn chunks(&self) -> usize {
        self.chunks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::Extents;

    #[test]
    fn extents_are_taken_first_fit_and_merge_when_given_back() {
        let mut e = Extents::new(10);
        assert_eq!(e.take(3), Some((0, 0)));
        assert_eq!(e.take(3), Some((3, 0)));
        assert_eq!(e.take(3), Some((6, 0)));
        assert_eq!(e.take(2), None);
        assert_eq!(e.take(1), Some((9, 0)));
        assert!(e.put(3, 3));
        // The hole at 3 is the first fit again, and was handed out before.
        assert_eq!(e.take(2), Some((3, 2)));
        assert!(e.put(3, 2));
        assert!(e.put(0, 3));
        assert!(e.put(9, 1));
        assert!(e.put(6, 3));
        assert!(e.all_free());
        assert_eq!(e.take(10), Some((0, 10)));
    }

    #[test]
    fn giving_back_free_or_outside_bytes_is_refused_and_changes_nothing() {
        let mut e = Extents::new(8);
        assert_eq!(e.take(4), Some((0, 0)));
        assert!(!e.put(4, 2), "already free");
        assert!(!e.put(2, 4), "overlaps the free tail");
        assert!(!e.put(6, 4), "past the end");
        assert!(!e.put(0, 0), "empty");
        assert!(!e.put(usize::MAX, 2), "overflows");
        assert!(e.put(0, 4));
        assert!(e.all_free());
        assert!(!e.put(0, 4), "twice");
        assert!(e.all_free());
    }

    #[test]
    fn only_bytes_handed_out_before_are_reported_as_used() {
        let mut e = Extents::new(16);
        assert_eq!(e.take(4), Some((0, 0)));
        assert_eq!(e.take(4), Some((4, 0)));
        assert!(e.put(0, 8));
        // 0..8 was handed out, 8..12 never was.
        assert_eq!(e.take(12), Some((0, 8)));
        assert_eq!(e.take(4), Some((12, 0)));
    }
}
