//! Bounded spin-then-park waits on the ring's words.
//!
//! A waiter first spins for its [`SpinBudget`] (the same adaptive budget as the local
//! transport's rounds: no spinning when the waiters outnumber the CPUs they run on, less after
//! waits that parked anyway), then parks on a futex word in the segment (a shared futex, which
//! works across processes that map the same file). Parking is a handshake with the peer:
//!
//! - the waiter counts itself parked (sequentially consistent), reads the futex word, looks
//!   once more at what it waits for, and sleeps only if the word still holds what it read;
//! - the peer stores what the waiter waits for (sequentially consistent), then reads the
//!   parked count, and only when it is not zero bumps the futex word and wakes the sleepers.
//!
//! Either the waiter's last look sees the store, or the peer sees the waiter parked and its
//! bump makes the sleep return: no wake-up is lost, and the common path (nobody parked)
//! makes no system call. A state change (a close, a failure) bumps the word whoever waits.
//!
//! The parked count lives in shared memory, where a peer (or a third process) can write it.
//! A waiter checks it as it counts itself in (it must leave room for it: at most
//! [`Park::most`] waiters park on one word) and out (it must still hold it); any other count
//! fails the wait ([`Interrupted::Miscounted`]). And no sleep is longer than the
//! [`liveness_interval`]: a wake-up lost to a count overwritten between two checks costs at
//! most that interval, and the next check finds the count.
//!
//! Every wait is bounded by the queue's timeout. While parked, a waiter wakes at least every
//! [`liveness_interval`]; when its peer is another process it checks then that the peer's
//! process still runs (a peer killed with SIGKILL writes nothing), so that a dead peer is an
//! error within that interval, not a timeout. An idle waiter costs a wake-up per interval,
//! no busy CPU.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rustix::thread::futex;
use tpcomm_transport::spin::{later, SpinBudget};

/// How often a parked waiter checks a peer process's liveness: a tenth of the timeout,
/// between 1 ms and 100 ms.
pub(crate) fn liveness_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(100))
}

/// The futex word a waiter parks on and the count of waiters parked on it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Park<'a> {
    pub(crate) word: &'a AtomicU32,
    pub(crate) parked: &'a AtomicU32,
    /// The most waiters that can be parked on it at once (each waiter's count is its own
    /// until it leaves; one killed while parked leaves its count behind, never more).
    pub(crate) most: u32,
    /// What the count is, for the error that names it.
    pub(crate) which: &'static str,
}

/// Why a wait ended without what it waited for.
#[derive(Debug)]
pub(crate) enum Interrupted<E> {
    /// The timeout passed; how long it waited.
    Timeout(Duration),
    /// `ready` or `check` failed.
    Failed(E),
    /// The parked count is one no honest waiter leaves: `found` waiters when this one
    /// counted itself in (more than [`Park::most`] can be) or out (none, although it was
    /// counted). A peer wrote it: the wake-ups that depend on it cannot be trusted.
    Miscounted { found: u32 },
}

impl<E> From<E> for Interrupted<E> {
    fn from(e: E) -> Self {
        Interrupted::Failed(e)
    }
}

/// Waits until `ready()` says so, bounded by `timeout`; `check()` runs every `liveness`
/// while parked (a peer process that may die), and fails the wait with its error. A parked
/// waiter sleeps at most `nap` at a time (the [`liveness_interval`]), so that a wake-up
/// lost to a parked count a peer overwrote costs at most that, and the count is checked
/// each time the waiter counts itself in and out ([`Interrupted::Miscounted`]).
pub(crate) fn wait_until<E>(
    budget: &SpinBudget,
    (timeout, nap): (Duration, Duration),
    park: Park<'_>,
    liveness: Option<Duration>,
    mut ready: impl FnMut() -> Result<bool, E>,
    mut check: impl FnMut() -> Result<(), E>,
) -> Result<(), Interrupted<E>> {
    if ready()? {
        return Ok(());
    }
    let started = Instant::now();
    let deadline = later(started, timeout);
    let spin = budget.get();
    let spun = !spin.is_zero();
    if spun {
        let until = later(started, spin).min(deadline);
        let mut looks = 0u32;
        loop {
            if ready()? {
                budget.learn(true, false);
                return Ok(());
            }
            looks = looks.wrapping_add(1);
            // The clock costs tens of nanoseconds: read it every 16th look.
            if looks.is_multiple_of(16) && Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
    }
    budget.shrink();
    let mut next_check = started;
    loop {
        count_in(park)?;
        let seen = park.word.load(Ordering::SeqCst);
        // What it waits for first: a peer that delivered and then left (or died) delivered.
        let outcome = match ready() {
            Ok(false) => pause(&mut next_check, deadline, started, liveness, &mut check)
                .map(|sleep| sleep_on(park.word, seen, sleep.min(nap))),
            Ok(true) => {
                count_out(park)?;
                budget.learn(spun, true);
                return Ok(());
            }
            Err(e) => Err(Interrupted::Failed(e)),
        };
        count_out(park)?;
        outcome?;
    }
}

/// Counts this waiter parked; the count it found must leave room for it.
fn count_in<E>(park: Park<'_>) -> Result<(), Interrupted<E>> {
    let found = park.parked.fetch_add(1, Ordering::SeqCst);
    if found >= park.most {
        return Err(Interrupted::Miscounted { found });
    }
    Ok(())
}

/// Counts this waiter out; the count it found must still hold it.
fn count_out<E>(park: Park<'_>) -> Result<(), Interrupted<E>> {
    match park.parked.fetch_sub(1, Ordering::SeqCst) {
        0 => Err(Interrupted::Miscounted { found: 0 }),
        _ => Ok(()),
    }
}

/// Between two looks of a parked wait: runs `check` when it is due, and returns how long to
/// sleep, or the timeout.
fn pause<E>(
    next_check: &mut Instant,
    deadline: Instant,
    started: Instant,
    liveness: Option<Duration>,
    check: &mut impl FnMut() -> Result<(), E>,
) -> Result<Duration, Interrupted<E>> {
    let now = Instant::now();
    if let Some(every) = liveness {
        if now >= *next_check {
            check()?;
            *next_check = later(now, every);
        }
    }
    if now >= deadline {
        return Err(Interrupted::Timeout(now - started));
    }
    let sleep = deadline - now;
    Ok(liveness.map_or(sleep, |every| sleep.min(every)))
}

/// Sleeps until `word` is woken or no longer holds `seen`, or `at_most` passes. Every outcome
/// (woken, changed already, interrupted, timed out) returns: the caller looks again.
fn sleep_on(word: &AtomicU32, seen: u32, at_most: Duration) {
    let timeout = futex::Timespec {
        tv_sec: i64::try_from(at_most.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(at_most.subsec_nanos()),
    };
    if let Err(e) = futex::wait(word, futex::Flags::empty(), seen, Some(&timeout)) {
        if !matches!(
            e,
            rustix::io::Errno::AGAIN | rustix::io::Errno::INTR | rustix::io::Errno::TIMEDOUT
        ) {
            // Not expected on Linux; a short sleep keeps the loop from spinning.
            tracing::debug!(error = %e, "futex wait failed: sleeping instead");
            std::thread::sleep(at_most.min(Duration::from_micros(50)));
        }
    }
}

/// Wakes every waiter parked on `word` (whose value the caller changed).
pub(crate) fn wake_all(word: &AtomicU32) {
    if let Err(e) = futex::wake(word, futex::Flags::empty(), i32::MAX as u32) {
        tracing::debug!(error = %e, "futex wake failed");
    }
}

/// After storing what a peer waits for (sequentially consistent): wakes it if it is parked.
#[inline]
pub(crate) fn wake_if_parked(park: Park<'_>) {
    if park.parked.load(Ordering::SeqCst) > 0 {
        park.word.fetch_add(1, Ordering::SeqCst);
        wake_all(park.word);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use super::*;

    fn words() -> Arc<(AtomicU32, AtomicU32, AtomicBool)> {
        Arc::new((AtomicU32::new(0), AtomicU32::new(0), AtomicBool::new(false)))
    }

    #[test]
    fn a_parked_waiter_is_woken_by_the_store_it_waits_for() {
        let w = words();
        let budget = SpinBudget::new(Duration::ZERO);
        let peer = {
            let w = w.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                w.2.store(true, Ordering::SeqCst);
                wake_if_parked(Park {
                    word: &w.0,
                    parked: &w.1,
                    most: 1,
                    which: "test",
                });
            })
        };
        let started = Instant::now();
        let park = Park {
            word: &w.0,
            parked: &w.1,
            most: 1,
            which: "test",
        };
        let r = wait_until::<()>(
            &budget,
            (Duration::from_secs(30), Duration::from_secs(30)),
            park,
            None,
            || Ok(w.2.load(Ordering::SeqCst)),
            || Ok(()),
        );
        assert!(r.is_ok());
        assert!(started.elapsed() < Duration::from_secs(10));
        peer.join().unwrap();
        assert_eq!(
            w.1.load(Ordering::SeqCst),
            0,
            "nobody is left counted parked"
        );
    }

    #[test]
    fn a_wait_nobody_ends_times_out_with_how_long_it_waited() {
        let w = words();
        let budget = SpinBudget::new(Duration::from_micros(20));
        let park = Park {
            word: &w.0,
            parked: &w.1,
            most: 1,
            which: "test",
        };
        match wait_until::<()>(
            &budget,
            (Duration::from_millis(30), Duration::from_millis(30)),
            park,
            None,
            || Ok(false),
            || Ok(()),
        ) {
            Err(Interrupted::Timeout(waited)) => assert!(waited >= Duration::from_millis(30)),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn a_failing_liveness_check_ends_a_parked_wait_before_the_timeout() {
        let w = words();
        let budget = SpinBudget::new(Duration::ZERO);
        let park = Park {
            word: &w.0,
            parked: &w.1,
            most: 1,
            which: "test",
        };
        let mut checks = 0;
        let started = Instant::now();
        let r = wait_until(
            &budget,
            (Duration::from_secs(30), Duration::from_secs(30)),
            park,
            Some(Duration::from_millis(5)),
            || Ok(false),
            || {
                checks += 1;
                if checks == 3 {
                    Err("peer gone")
                } else {
                    Ok(())
                }
            },
        );
        assert!(matches!(r, Err(Interrupted::Failed("peer gone"))));
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
