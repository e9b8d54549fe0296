//! A rank's slots: the ring of per-round posts each rank writes as a sequence lock, the
//! progress count each rank bumps, and how a call's operation, root and history travel in
//! a slot's words.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use super::posts::Post;
use crate::error::Op;

/// How many rounds a rank may run ahead of the slowest reader of its posts: the slots of
/// one rank in [`Shared::slots`]. A rank that needs no peer's post (a broadcast root) waits,
/// at its `RING + 1`-th round ahead, until every rank is done with the round `RING` before.
pub(super) const RING: u64 = 64;

/// The most bytes a post carries in its slot itself (six words), and the most counts.
/// Larger posts go through a shared [`Post`].
pub(super) const INLINE_BYTES: usize = 48;
pub(super) const INLINE_WORDS: usize = INLINE_BYTES / 8;
pub(super) const INLINE_META: usize = 3;
// Their sizes fit the fields of `Slot::head` (8 bits each).
const _: () = assert!(INLINE_BYTES < 1 << 8 && INLINE_META < 1 << 8);

/// The bit of [`Slot::head`] that says the post is in [`Slot::post`] rather than inline.
pub(super) const SHARED_POST: u64 = 1 << 63;

/// A rank's post in one round: what it called, and what it contributed, on cache lines of
/// its own. Only its rank writes it, once per round, and only when every rank is done with
/// the round `RING` before that used the slot. A small post (the common case: a barrier, a
/// few bytes, a header) travels in the slot's words, so a reader takes it with the line it
/// waited on; a larger one is a reference to a shared [`Post`].
///
/// Written as a sequence lock: `round` is cleared, the rest written, then `round` set to the
/// round's sequence number plus one (release); a reader loads `round` (acquire), reads the
/// rest, and loads `round` again after an acquire fence. Both loads equal to its round mean
/// it read that round's post whole. Ranks that call in order never see anything else; calls
/// overlapping on one communicator can, and abort the group.
///
/// Laid out so that the first 64-byte line holds the round, the head, the root, the counts
/// and the first 16 inline bytes: a barrier, a few counts or a post of up to 16 bytes is
/// one line. The rest of the inline bytes and a shared post are on the second line of the
/// pair.
#[derive(Debug, Default)]
#[repr(C, align(128))]
pub(super) struct Slot {
    /// The round's sequence number plus one; 0 while the slot is (re)written.
    pub(super) round: AtomicU64,
    /// [`op_code`] of the operation called (bits 0-7); inline, the byte length (bits 8-15)
    /// and the count of `meta` (bits 16-23); or [`SHARED_POST`].
    pub(super) head: AtomicU64,
    /// The root plus one, 0 for none (bits 0-31), and the upper half of the rank's
    /// [`history`] before this round (bits 32-63).
    pub(super) root: AtomicU64,
    pub(super) meta: [AtomicU64; INLINE_META],
    pub(super) bytes: [AtomicU64; INLINE_WORDS],
    /// The post of the round, when it is not inline; emptied by its rank once every rank is
    /// done with the round.
    pub(super) post: Mutex<Option<Arc<Post>>>,
}

/// A rank's progress, on a cache line of its own (written by its rank at every call, read
/// by the others only when they are about to use a slot again or to free posts).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(super) struct Progress {
    /// Rounds this rank is done reading (it holds its own copies of or references to the
    /// posts it read): the slots of these rounds may be used again.
    pub(super) done: AtomicU64,
}

/// Every operation, in the order of [`Op`]'s variants: `OPS[op_code(op)] == op`.
pub(super) const OPS: [Op; 12] = [
    Op::Barrier,
    Op::AllGather,
    Op::AllGatherVarcount,
    Op::GatherVarcount,
    Op::Broadcast,
    Op::AllToAllVarcount,
    Op::Split,
    Op::Setup,
    Op::AllReduce,
    Op::ReduceScatter,
    Op::Suspend,
    Op::Resume,
];

/// How `op` travels in a [`Slot`].
pub(super) fn op_code(op: Op) -> u64 {
    op as u64
}

/// `root` plus one, 0 for none: the lower half of [`Slot::root`] (a group's size fits in 32
/// bits).
pub(super) fn root_code(root: Option<usize>) -> u64 {
    root.map_or(0, |r| r as u64 + 1)
}

/// The bits of [`Slot::root`] that carry the poster's history.
pub(super) const HISTORY_BITS: u64 = 0xffff_ffff_0000_0000;

/// A rank's history after a call of `op` with `root`, from its history before it (0 before
/// its first call): a digest of every call's operation and root, in order, whose upper half
/// travels with each post. A rank that reads a post checks its operation and root, and that
/// the poster's calls before it were the same as the reader's: ranks that disagreed in a
/// call where neither read the other (two ranks that each took itself for a broadcast's
/// root, gather senders naming different roots) are caught at the next call that reads
/// across them. A digest can collide: such a disagreement goes unseen with a chance of
/// 2^-32 per later call that reads it.
pub(super) fn history(before: u64, op: Op, root: Option<usize>) -> u64 {
    let call = op_code(op) | root_code(root) << 8;
    (before.rotate_left(23) ^ call).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The operation whose [`op_code`] is `code`, if any.
pub(super) fn op_of(code: u64) -> Option<Op> {
    OPS.get(usize::try_from(code).ok()?).copied()
}
