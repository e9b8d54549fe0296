//! What a rank posts in a round and how it reads its peers' posts: inline in the slot's
//! words, or a shared buffer (reused from a few spares); written and read under the slot's
//! sequence lock, and checked for the same operation, root and history of calls.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::shared::lock;
use super::slots::{
    history, op_code, op_of, root_code, HISTORY_BITS, INLINE_BYTES, INLINE_META, INLINE_WORDS,
    RING, SHARED_POST,
};
use super::LocalCommunicator;
use crate::copy::extend_from_slice;
use crate::error::{Op, Result};

/// How many posts a communicator keeps for reuse: a post may still be held by a slow peer
/// when the next call starts (an object collective's header, then its payload), and one of
/// the others is free by then.
pub(super) const SPARES: usize = 4;

/// The most bytes (of capacity) of the posts a communicator keeps for reuse (64 MiB). Reuse
/// saves three allocations per call, which matter next to a small collective's
/// sub-microsecond hand-off, and past glibc's mmap threshold (128 KiB at first) the page
/// faults of a fresh buffer (one per 4 KiB, about 3.4 us each on the development VM), which
/// cost more than the copy itself. The price: each communicator holds the memory of its
/// recent posts, up to this size.
pub(super) const SPARE_MAX_BYTES: usize = 64 << 20;

/// What a rank contributes to a round, when it does not fit in a [`Slot`].
#[derive(Debug, Default)]
pub(super) struct Post {
    pub(super) bytes: Vec<u8>,
    /// Op-specific integers (counts, lengths, colors) the peers check against their own.
    pub(super) meta: Vec<usize>,
}

/// A post on its way into this rank's slot.
#[derive(Debug)]
pub(super) enum Outgoing {
    Inline {
        words: [u64; INLINE_WORDS],
        len: usize,
        meta: [u64; INLINE_META],
        count: usize,
    },
    Shared(Arc<Post>),
}

/// How a rank read a peer's post in one round.
#[derive(Debug, Default)]
pub(super) enum Got {
    /// Not read (a rank this round did not need).
    #[default]
    No,
    /// A reference to the peer's shared post.
    Shared(Arc<Post>),
    /// Copied out of the peer's slot into [`Joined::copies`].
    Copied,
}

/// The posts a rank read in one round (for each rank `r` it needed), returned by
/// [`LocalCommunicator::exchange`] and read through [`posted`]. Dropping it gives its
/// vectors back to the communicator.
#[derive(Debug)]
pub(super) struct Joined<'a> {
    pub(super) comm: &'a LocalCommunicator,
    pub(super) got: Vec<Got>,
    /// `copies[r]`: rank `r`'s inline post, when `got[r]` is [`Got::Copied`] (buffers kept
    /// between calls).
    pub(super) copies: Vec<Post>,
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        let mut got = std::mem::take(&mut self.got);
        got.clear();
        let copies = std::mem::take(&mut self.copies);
        *lock(&self.comm.held) = (got, copies);
    }
}

/// A post that `exchange` waited for.
pub(super) fn posted<'j>(joined: &'j Joined<'_>, rank: usize) -> &'j Post {
    match &joined.got[rank] {
        Got::Shared(post) => post,
        Got::Copied => &joined.copies[rank],
        Got::No => unreachable!("exchange returns once every needed post is read"),
    }
}

impl LocalCommunicator {
    /// This rank's post of `bytes` and `meta`: inline when they fit in a slot, a shared
    /// [`Post`] otherwise.
    pub(super) fn post(&self, bytes: &[u8], meta: &[usize]) -> Outgoing {
        if bytes.len() > INLINE_BYTES || meta.len() > INLINE_META {
            return Outgoing::Shared(self.post_with(|p| {
                extend_from_slice(&mut p.bytes, bytes);
                p.meta.extend_from_slice(meta);
            }));
        }
        let mut words = [0u64; INLINE_WORDS];
        for (word, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut le = [0u8; 8];
            le[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_le_bytes(le);
        }
        let mut packed = [0u64; INLINE_META];
        for (word, &m) in packed.iter_mut().zip(meta) {
            *word = m as u64;
        }
        Outgoing::Inline {
            words,
            len: bytes.len(),
            meta: packed,
            count: meta.len(),
        }
    }

    /// This rank's post of `bytes` it owns (no counts): inline when they fit, `bytes` itself
    /// shared otherwise.
    pub(super) fn post_owned(&self, bytes: Vec<u8>) -> Outgoing {
        if bytes.len() <= INLINE_BYTES {
            return self.post(&bytes, &[]);
        }
        Outgoing::Shared(Arc::new(Post {
            bytes,
            meta: Vec::new(),
        }))
    }

    /// A post filled by `fill`: a kept post that no peer holds any more (its buffers keep
    /// their capacity; the largest such), a new one otherwise. Keeps a reference to it for
    /// the next calls, within [`SPARES`] posts and [`SPARE_MAX_BYTES`].
    pub(super) fn post_with(&self, fill: impl FnOnce(&mut Post)) -> Arc<Post> {
        let mut spares = lock(&self.spares);
        // A count of 1 is only this reference (no weak ones are made): nobody else can
        // clone it, so it stays unshared.
        let free = (0..spares.len())
            .filter(|&i| Arc::strong_count(&spares[i]) == 1)
            .max_by_key(|&i| spares[i].bytes.capacity());
        let mut post = free.map_or_else(Arc::default, |i| spares.swap_remove(i));
        let p = Arc::get_mut(&mut post).expect("a new or unshared post");
        p.bytes.clear();
        p.meta.clear();
        fill(p);
        let kept = p.bytes.capacity();
        if kept <= SPARE_MAX_BYTES {
            // Make room: the oldest first, until the count and the bytes fit.
            let mut total: usize = spares.iter().map(|s| s.bytes.capacity()).sum();
            while !spares.is_empty() && (spares.len() >= SPARES || total + kept > SPARE_MAX_BYTES) {
                total -= spares.remove(0).bytes.capacity();
            }
            spares.push(post.clone());
        }
        post
    }

    /// Empties this rank's slots that hold a shared post of a round every rank is done with
    /// (before `done`), so that the posts go back to [`Self::post_with`]'s spares or are
    /// freed.
    pub(super) fn reclaim(&self, done: u64) {
        let mut left = self.holding.load(Ordering::Relaxed);
        let mut freed = 0u64;
        while left != 0 {
            let i = u64::from(left.trailing_zeros());
            left &= left - 1;
            let slot = self.shared.slot(self.rank, i);
            // Only this rank writes its slots: `round` is the round whose post it holds.
            if slot.round.load(Ordering::Relaxed) <= done {
                let post = lock(&slot.post).take();
                drop(post);
                freed |= 1 << i;
            }
        }
        // Clears only the bits freed here: a call overlapping on another thread (a usage
        // error, but not one that may leak) may have set others since the load.
        self.holding.fetch_and(!freed, Ordering::Relaxed);
    }

    /// Writes `post` into this rank's slot of round `seq` (see [`Slot`]); returns the
    /// rank's [`history`] before this round, which its reads of the round check the peers'
    /// against.
    pub(super) fn publish_post(
        &self,
        seq: u64,
        op: Op,
        root: Option<usize>,
        post: Outgoing,
    ) -> u64 {
        let slot = self.shared.slot(self.rank, seq);
        let bit = 1u64 << (seq % RING);
        let before = self.history.load(Ordering::Relaxed);
        self.history
            .store(history(before, op, root), Ordering::Relaxed);
        slot.round.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.root
            .store(root_code(root) | before & HISTORY_BITS, Ordering::Relaxed);
        let old = match post {
            Outgoing::Inline {
                words,
                len,
                meta,
                count,
            } => {
                for (cell, &w) in slot.bytes.iter().zip(&words).take(len.div_ceil(8)) {
                    cell.store(w, Ordering::Relaxed);
                }
                for (cell, &m) in slot.meta.iter().zip(&meta).take(count) {
                    cell.store(m, Ordering::Relaxed);
                }
                slot.head.store(
                    op_code(op) | (len as u64) << 8 | (count as u64) << 16,
                    Ordering::Relaxed,
                );
                // A shared post of the round `RING` before, not freed yet.
                if self.holding.load(Ordering::Relaxed) & bit != 0 {
                    self.holding.fetch_and(!bit, Ordering::Relaxed);
                    lock(&slot.post).take()
                } else {
                    None
                }
            }
            Outgoing::Shared(post) => {
                slot.head
                    .store(op_code(op) | SHARED_POST, Ordering::Relaxed);
                self.holding.fetch_or(bit, Ordering::Relaxed);
                lock(&slot.post).replace(post)
            }
        };
        // Pairs with the fence after a parking rank's increment, before its last look:
        // either it sees this post, or this sees it parked and wakes it.
        slot.round.store(seq + 1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        drop(old);
        before
    }

    /// Reads rank `r`'s post of round `seq` into `got` (and `copy`, when inline); checks it
    /// was made by `op` with `root`, after calls of the same operations and roots as this
    /// rank's (whose [`history`] before the round is `before`).
    pub(super) fn read_post(
        &self,
        r: usize,
        seq: u64,
        (op, root, before): (Op, Option<usize>, u64),
        copy: &mut Post,
    ) -> Result<Got> {
        let slot = self.shared.slot(r, seq);
        let first = slot.round.load(Ordering::Acquire);
        let head = slot.head.load(Ordering::Relaxed);
        let word = slot.root.load(Ordering::Relaxed);
        let (their_op, their_root) = (head & 0xff, word & !HISTORY_BITS);
        let got = if head & SHARED_POST != 0 {
            lock(&slot.post).clone().map(Got::Shared)
        } else {
            // Bounded: a torn read of an overlapping call may hold anything.
            let len = ((head >> 8) & 0xff) as usize;
            let count = ((head >> 16) & 0xff) as usize;
            copy.bytes.clear();
            for w in slot.bytes.iter().take(len.div_ceil(8)) {
                copy.bytes
                    .extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
            }
            copy.bytes.truncate(len);
            copy.meta.clear();
            copy.meta.extend(
                slot.meta
                    .iter()
                    .take(count)
                    .map(|m| m.load(Ordering::Relaxed) as usize),
            );
            Some(Got::Copied)
        };
        fence(Ordering::Acquire);
        let second = slot.round.load(Ordering::Relaxed);
        let (Some(got), true) = (got, first == seq + 1 && second == seq + 1) else {
            // Only when calls on one communicator overlap (two threads at once): the ranks'
            // done counts ran ahead of a call still reading, and the peer has used the slot
            // again. The group cannot go on.
            let reason = format!(
                "call #{seq}: rank {} overlapped another call on the same communicator",
                self.rank
            );
            return Err(self.abort_group(&mut self.shared.lock(), op, reason));
        };
        if their_op != op_code(op) || their_root != root_code(root) {
            let reason = format!(
                "call #{seq}: rank {} called {op} (root {root:?}) while rank {r} called {} \
                 (root {:?})",
                self.rank,
                op_of(their_op).map_or("nothing".into(), |o| o.to_string()),
                their_root.checked_sub(1)
            );
            return Err(self.abort_group(&mut self.shared.lock(), op, reason));
        }
        if word & HISTORY_BITS != before & HISTORY_BITS {
            let reason = format!(
                "call #{seq}: rank {r} made calls before this one that differ from rank {}'s \
                 in an operation or a root, unchecked then because one of them read nothing \
                 from the other (a broadcast root, a gather's sender), or two threads called \
                 on one communicator at once",
                self.rank
            );
            return Err(self.abort_group(&mut self.shared.lock(), op, reason));
        }
        Ok(got)
    }
}
