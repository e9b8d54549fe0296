//! Bounded waits on peers: spin for the rank's adaptive budget, then park on the group's
//! condition variable, until the awaited posts are there, the group aborts, a peer leaves
//! or the timeout passes.

use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::abort::Abort;
use super::shared::Shared;
use super::LocalCommunicator;
use crate::error::{Op, Result, TransportError};
use crate::spin::later;

/// The clock of one wait in a round, started when the rank first finds a post missing (a
/// rank whose peers are all there never reads the clock).
#[derive(Debug)]
struct Wait {
    started: Instant,
    deadline: Instant,
    /// End of the current spin: set when a spin starts, cleared after each park.
    spin_until: Option<Instant>,
    /// Whether this wait spun, and whether it parked.
    spun: bool,
    parked: bool,
}

impl Wait {
    fn new(now: Instant, timeout: Duration) -> Self {
        Self {
            started: now,
            deadline: later(now, timeout),
            spin_until: None,
            spun: false,
            parked: false,
        }
    }

    /// The end of a spin of `budget` starting at `from`, never past the deadline.
    fn spin_end(&self, from: Instant, budget: Duration) -> Instant {
        later(from, budget).min(self.deadline)
    }
}

impl Shared {
    /// Spins until `ready()`, the epoch differs from `seen`, or `until` passes, whichever
    /// is first. One pause instruction between looks (about 30 ns on the development VM;
    /// every further one delays the moment a rank sees its peer's post by as much): a look
    /// at an unchanged line costs no coherence traffic, and the pause leaves the core's other
    /// hardware thread its share.
    fn spin(&self, ready: &impl Fn() -> bool, seen: u64, until: Instant) {
        let mut looks = 0u32;
        loop {
            if ready() || self.epoch.load(Ordering::Acquire) != seen {
                return;
            }
            looks = looks.wrapping_add(1);
            // The clock costs tens of nanoseconds: read it every 16th look.
            if looks.is_multiple_of(16) && Instant::now() >= until {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

impl LocalCommunicator {
    /// Waits until `ready()`, bounded by the group's timeout, an abort, and the ranks that
    /// `missing()` names dropping their communicators.
    ///
    /// A rank spins for its budget (watching `ready` and the epoch, without the lock), then
    /// parks on the condition variable; each wake-up spins afresh.
    pub(super) fn wait(
        &self,
        op: Op,
        ready: impl Fn() -> bool,
        missing: impl Fn() -> Vec<usize>,
    ) -> Result<()> {
        let shared = &*self.shared;
        let timeout = self.timeout.unwrap_or(shared.config.timeout);
        let mut w = Wait::new(Instant::now(), timeout);
        // The first spin takes no lock: its peers usually come within it.
        if !shared.flags.aborted.load(Ordering::Acquire) {
            let seen = shared.epoch.load(Ordering::Acquire);
            let until = w.spin_end(w.started, self.spin.get());
            w.spin_until = Some(until);
            if until > w.started && self.spin_until_ready(&mut w, &ready, seen, until) {
                return Ok(());
            }
        }
        let mut state = shared.lock();
        loop {
            let now = Instant::now();
            // Readiness first: a call whose peers all posted completes even when the group
            // aborted since (a rank that completed it and left, seen by a rank a call
            // ahead), as it did on the ranks that saw it before the abort; the next call
            // fails.
            if ready() {
                drop(state);
                self.spin.learn(w.spun, w.parked);
                return Ok(());
            }
            if let Some(abort) = &state.abort {
                return Err(if abort.timed_out {
                    TransportError::Timeout {
                        op,
                        rank: self.rank,
                        waited: now - w.started,
                        missing: missing(),
                    }
                } else {
                    self.aborted(op, abort)
                });
            }
            if let Some(&gone) = missing().iter().find(|&&r| state.left[r]) {
                let reason = format!("rank {gone} dropped its communicator before joining {op}");
                let abort = Abort {
                    by: gone,
                    reason,
                    timed_out: false,
                };
                state.abort = Some(abort.clone());
                shared.publish(&state);
                return Err(self.aborted(op, &abort));
            }
            if now >= w.deadline {
                let missing = missing();
                let reason = format!(
                    "rank {} timed out in {op} after {timeout:?} waiting for ranks {missing:?}",
                    self.rank
                );
                state.abort.get_or_insert(Abort {
                    by: self.rank,
                    reason,
                    timed_out: true,
                });
                shared.publish(&state);
                return Err(TransportError::Timeout {
                    op,
                    rank: self.rank,
                    waited: now - w.started,
                    missing,
                });
            }
            // Aborts and departures are published under the lock: the epoch read here is
            // the one the state above was seen at.
            let seen = shared.epoch.load(Ordering::Relaxed);
            let spin_until = match w.spin_until {
                Some(until) => until,
                None => *w.spin_until.insert(w.spin_end(now, self.spin.get())),
            };
            if now < spin_until {
                drop(state);
                if self.spin_until_ready(&mut w, &ready, seen, spin_until) {
                    return Ok(());
                }
                state = shared.lock();
                continue;
            }
            if !w.parked {
                w.parked = true;
                // A spin that ran out: the next ones (after a wake-up in this wait too)
                // are shorter.
                self.spin.shrink();
            }
            // Counted before the last look: a post after it sees the count and wakes this
            // rank under the lock, which the wait below releases only once parked.
            shared.flags.parked.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if !ready() {
                state = shared
                    .changed
                    .wait_timeout(state, w.deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            shared.flags.parked.fetch_sub(1, Ordering::SeqCst);
            // Woken by a change: the next wait spins afresh.
            w.spin_until = None;
        }
    }

    /// Spins (without the lock) until `ready()`, the epoch moves from `seen`, or `until`;
    /// returns whether `ready()` holds, and then tells the spin budget this wait's spin
    /// ended it.
    fn spin_until_ready(
        &self,
        w: &mut Wait,
        ready: &impl Fn() -> bool,
        seen: u64,
        until: Instant,
    ) -> bool {
        w.spun = true;
        self.shared.spin(ready, seen, until);
        let done = ready();
        if done {
            self.spin.learn(w.spun, w.parked);
        }
        done
    }
}
