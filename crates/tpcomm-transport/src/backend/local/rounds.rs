//! One round of a collective: take the next sequence number, wait until the slot is free
//! again, post, wait for the ranks needed, read their posts, and mark the round done.

use std::sync::atomic::Ordering;

use super::posts::{Got, Joined, Outgoing, Post};
use super::shared::lock;
use super::slots::RING;
use super::LocalCommunicator;
use crate::error::{Op, Result};

/// Which posts a rank needs before it can leave a round.
#[derive(Debug, Clone, Copy)]
pub(super) enum Needs {
    Nobody,
    Rank(usize),
    Everybody,
}

/// The ranks whose posts `needs` names.
pub(super) fn needed_ranks(needs: Needs, size: usize) -> std::ops::Range<usize> {
    match needs {
        Needs::Nobody => 0..0,
        Needs::Rank(r) => r..r + 1,
        Needs::Everybody => 0..size,
    }
}

impl LocalCommunicator {
    /// Joins the next round with `post`, waits until `needs` have posted, and returns their
    /// posts ([`posted`]).
    ///
    /// No lock is shared by all ranks on this path: the rank writes its post into a slot of
    /// its own ([`Slot`]); a rank that waits watches the slots of the ranks it needs
    /// (spinning, then parked on the group's condition variable, which a post signals only
    /// when a rank is parked), then copies each small post out of its slot or takes a
    /// reference to a large one, checks it was made by the same operation, and bumps its
    /// `done` count. A rank uses a slot again `RING` rounds later, once every rank is done
    /// with it.
    pub(super) fn exchange(
        &self,
        op: Op,
        root: Option<usize>,
        post: Outgoing,
        needs: Needs,
    ) -> Result<Joined<'_>> {
        let shared = &*self.shared;
        let size = shared.size;
        if shared.flags.aborted.load(Ordering::Acquire) {
            if let Some(abort) = &shared.lock().abort {
                return Err(self.aborted(op, abort));
            }
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        // The slot of this round was last used by round `seq - RING`: every rank must be
        // done with it, that is, have done `need` rounds.
        let need = (seq + 1).saturating_sub(RING);
        let mut done = self.known_done.load(Ordering::Relaxed);
        if done < need || self.holding.load(Ordering::Relaxed) != 0 {
            done = shared.all_done();
            if done < need {
                let behind = |r: usize| shared.progress[r].done.load(Ordering::Acquire) < need;
                // Counted before the waits' looks at the done counts: a rank that finishes a
                // round after this sees the count and wakes this one (`finish_round`).
                shared.flags.ring_waiters.fetch_add(1, Ordering::SeqCst);
                let waited = self.wait(
                    op,
                    || !(0..size).any(behind),
                    || (0..size).filter(|&r| behind(r)).collect(),
                );
                shared.flags.ring_waiters.fetch_sub(1, Ordering::SeqCst);
                waited?;
                done = shared.all_done();
            }
            self.known_done.store(done, Ordering::Relaxed);
            self.reclaim(done);
        }
        let before = self.publish_post(seq, op, root, post);
        if shared.flags.parked.load(Ordering::SeqCst) > 0 {
            let _state = shared.lock();
            shared.changed.notify_all();
        }
        let arrived = |r: usize| shared.slot(r, seq).round.load(Ordering::Acquire) > seq;
        let ready = || needed_ranks(needs, size).all(arrived);
        if !ready() {
            self.wait(op, ready, || {
                needed_ranks(needs, size).filter(|&r| !arrived(r)).collect()
            })?;
        }
        let (mut got, mut copies) = std::mem::take(&mut *lock(&self.held));
        got.resize_with(size, Got::default);
        copies.resize_with(size, Post::default);
        let mut joined = Joined {
            comm: self,
            got,
            copies,
        };
        for r in needed_ranks(needs, size) {
            joined.got[r] = self.read_post(r, seq, (op, root, before), &mut joined.copies[r])?;
        }
        self.finish_round(seq);
        Ok(joined)
    }

    /// Marks round `seq` done on this rank (its posts read), and wakes the ranks waiting to
    /// reuse a slot, if any: a rank a whole ring ahead (a broadcast root) may be parked
    /// until this count moves, and nothing else would wake it before this rank's next post
    /// (or, when there is none in time, its timeout).
    pub(super) fn finish_round(&self, seq: u64) {
        let shared = &*self.shared;
        shared.progress[self.rank]
            .done
            .fetch_max(seq + 1, Ordering::SeqCst);
        // Pairs with the waiter's count before its looks (both SeqCst): either it sees
        // this count, or this sees it waiting and wakes it under the lock.
        if shared.flags.ring_waiters.load(Ordering::SeqCst) > 0 {
            let _state = shared.lock();
            shared.changed.notify_all();
        }
    }
}
