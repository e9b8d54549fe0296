//! The local backend: N communicators for N threads of one process.
//!
//! Every collective is a *round* identified by a per-communicator sequence number (all ranks
//! call collectives in the same order, so the n-th call of every rank meets in round n).
//! A rank joins a round by writing its contribution (its send bytes plus the counts it was
//! called with, and the operation it called) into a *slot* of its own, one of a ring of 64
//! per rank, and marking the slot with the round; it waits until the slots of the ranks it
//! depends on carry the round, reads their posts, checks that they called the same
//! operation with the same root after the same earlier calls (a digest of those travels
//! with every post: a disagreement in a call where nobody read, such as two self-styled
//! broadcast roots, is caught at the next call that reads), and bumps its `done` count. A
//! small post (up to 48 bytes and three counts: a barrier, a few bytes, an object
//! collective's header) travels in the slot's own words, so a reader takes it with the
//! cache line it waited on; a larger one is a shared buffer the reader takes a reference
//! to. No lock is shared by all ranks on this path: each rank writes only its own slots
//! and count, and reads the others' counts only when it is about to use a slot again. A
//! rank uses a slot again `RING` rounds later, after every rank is done with it (a rank
//! that needs nobody's post, such as a broadcast root, waits there for slow readers), and
//! frees its shared posts of the rounds every rank is done with at its next call, so that
//! their buffers are reused or freed.
//!
//! Waiting: a waiting rank first spins without any lock, watching the slots it waits for
//! and an *epoch* that aborts and departures bump, and parks on a condition variable only
//! when its spin budget runs out; a post or a change wakes parked ranks only when some are
//! parked (no system call on the common path). Ranks of one group usually arrive within a
//! microsecond or two of each other, so most waits end while spinning, at the cost of a cache line
//! moving between cores instead of a futex wake and a context switch (tens of
//! microseconds). The budget adapts per rank, as an adaptive mutex's does:
//! [`LocalGroupConfig::spin`] (default 50 us) after a wait a spin ended, halved by each wait
//! in a row that parks anyway (a late peer, or one the scheduler put on this rank's core,
//! which no spin can let run), and none at all after 16 of them, but for an occasional
//! probe. Ranks of a group larger than the number of CPUs the process may use never spin. A
//! rank waiting for an absent peer spins once, then sleeps until something changes or its
//! timeout: no busy wait.
//!
//! Every wait is bounded by [`LocalGroupConfig::timeout`]. A timeout, a rank that dropped
//! its communicator while others wait for it (a panicking rank does so while unwinding), or
//! two ranks calling different operations at the same point *abort* the group: every rank
//! blocked in it wakes up at once with an error naming the culprit, and every later call
//! fails the same way (a rank that reads no post in that round, such as a broadcast root,
//! learns of it at its next call). Calls that overlap on one communicator (one rank used by
//! two threads at once) abort it too, when a peer's slot shows it. No rank is left blocked.
//!
//! # Where things are
//!
//! This file holds [`LocalCommunicator`] and its departure on drop; `group` the builder
//! ([`LocalGroup`]); `shared` the state a group shares; `slots` and `posts` what a rank
//! writes and reads in a round; `rounds` a round from post to done; `waits` the bounded
//! spin-then-park waits; `abort` the group's abort; `collectives` the [`Communicator`]
//! impl.

mod abort;
mod collectives;
mod group;
mod posts;
mod rounds;
mod shared;
mod slots;
mod waits;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

#[cfg(doc)]
use crate::communicator::Communicator;
#[cfg(doc)]
use crate::error::TransportError;
use crate::spin::SpinBudget;

pub use group::{LocalGroup, LocalGroupConfig};
use posts::{Got, Post, SPARES};
use shared::Shared;

/// One rank of a local group. Send it to the thread that plays that rank.
///
/// Dropping it tells the group this rank is gone: peers blocked waiting for it fail with
/// [`TransportError::Aborted`] naming it instead of waiting for the timeout.
///
/// Calls on one communicator must not overlap (as with MPI): two threads calling on it at
/// once abort the group. A rank whose calls need no peer's data (a broadcast root, a
/// gather's non-root ranks) runs at most 64 calls ahead of its slowest peer; its next call
/// waits, within the group's timeout, until that peer catches up.
#[derive(Debug)]
pub struct LocalCommunicator {
    shared: Arc<Shared>,
    rank: usize,
    /// The sequence number of this rank's next round.
    seq: AtomicU64,
    /// The [`history`] of this rank's calls so far.
    history: AtomicU64,
    /// How long this rank's waits spin before parking.
    spin: SpinBudget,
    /// Rounds every rank is done with, as last read from their progress (a lower bound:
    /// re-read only when this rank is about to reuse a slot or has shared posts to free).
    known_done: AtomicU64,
    /// Bit `i`: this rank's slot `i` holds a shared post (see
    /// [`LocalCommunicator::reclaim`]).
    holding: AtomicU64,
    /// This rank's last shared posts, reused for the next ones when the peers have let go
    /// of them (see [`LocalCommunicator::post_with`]).
    spares: Mutex<Vec<Arc<Post>>>,
    /// The vectors a [`Joined`] holds the posts it read in, kept between calls.
    held: Mutex<(Vec<Got>, Vec<Post>)>,
    /// This rank's bound on a wait, when [`Communicator::bound_waits`] set one (otherwise
    /// the group's [`LocalGroupConfig::timeout`]).
    timeout: Option<std::time::Duration>,
}

impl LocalCommunicator {
    fn new(shared: Arc<Shared>, rank: usize) -> Self {
        Self {
            spin: SpinBudget::for_waiters(shared.config.spin, shared.size),
            held: Mutex::new((Vec::with_capacity(shared.size), Vec::new())),
            shared,
            rank,
            seq: AtomicU64::new(0),
            history: AtomicU64::new(0),
            known_done: AtomicU64::new(0),
            holding: AtomicU64::new(0),
            spares: Mutex::new(Vec::with_capacity(SPARES)),
            timeout: None,
        }
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.left[self.rank] = true;
        self.shared.publish(&state);
    }
}

#[cfg(test)]
mod tests;
