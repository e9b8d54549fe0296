//! The table of this process's live buffers, shared by every `HostMemory` of the process:
//! by base address for `export`, by descriptor for same-process opens, and the export stamp
//! (its generation).

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::lock;
use crate::error::{IpcError, Result};

/// One live buffer of this process, for `export` by address: the buffer's length and where
/// it lies in its segment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Exportable {
    pub(super) len: usize,
    pub(super) fd: i32,
    pub(super) dev: u64,
    pub(super) inode: u64,
    pub(super) segment_len: usize,
    pub(super) offset: usize,
}

/// Live buffers of this process by base address: every `HostMemory` of the process shares
/// it, so that a handle exported by one thread can be opened by another without going
/// through `/proc`.
static SEGMENTS: Mutex<SegmentTable> = Mutex::new(SegmentTable::new());

/// The live buffers of this process, by base address (for `export`), and the descriptors of
/// their segments with the number of buffers in each (for same-process opens).
pub(super) struct SegmentTable {
    pub(super) by_addr: BTreeMap<usize, Exportable>,
    /// Descriptor -> (inode, live buffers in the segment).
    fds: BTreeMap<i32, (u64, usize)>,
    /// Changes of the table so far (the export stamp).
    generation: u64,
    /// The process that made the last change: a child forked since has its own pid in its
    /// handles, so the stamp means nothing there until it changes the table itself.
    pid: u32,
}

impl SegmentTable {
    pub(super) const fn new() -> Self {
        Self {
            by_addr: BTreeMap::new(),
            fds: BTreeMap::new(),
            generation: 0,
            pid: 0,
        }
    }

    /// `fd` is the descriptor of a segment of this process, `inode`, that holds a live
    /// buffer; otherwise the handle naming them is stale.
    pub(super) fn check_live(&self, fd: i32, inode: u64) -> Result<()> {
        if self.fds.get(&fd).map(|&(i, _)| i) != Some(inode) {
            return Err(IpcError::StaleHandle(format!(
                "no live segment of this process has descriptor {fd} and inode {inode}"
            )));
        }
        Ok(())
    }

    fn changed(&mut self) {
        self.generation += 1;
        self.pid = std::process::id();
    }

    /// The export stamp: the generation, in the process that made it.
    pub(super) fn stamp(&self) -> Option<u64> {
        (self.pid == std::process::id()).then_some(self.generation)
    }

    pub(super) fn insert(&mut self, base: usize, buffer: Exportable) {
        self.changed();
        self.fds.entry(buffer.fd).or_insert((buffer.inode, 0)).1 += 1;
        self.by_addr.insert(base, buffer);
    }

    pub(super) fn remove(&mut self, base: usize) {
        let Some(buffer) = self.by_addr.remove(&base) else {
            return;
        };
        self.changed();
        if let std::collections::btree_map::Entry::Occupied(mut e) = self.fds.entry(buffer.fd) {
            e.get_mut().1 -= 1;
            if e.get().1 == 0 {
                e.remove();
            }
        }
    }
}

pub(super) fn segments() -> std::sync::MutexGuard<'static, SegmentTable> {
    lock(&SEGMENTS)
}
