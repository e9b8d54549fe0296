//! Spin-then-park waiting, shared by the waits on peers that live in memory this process can
//! watch: the local backend's rounds and the broadcast queue's shared-memory ring.
//!
//! A waiter that expects its peer within a few microseconds (ranks of one group arrive
//! within a microsecond or two of each other) spins first, watching the memory the peer
//! writes, and parks (a condition variable, a futex) only when its budget runs out: a
//! spin that succeeds costs a cache line moving between cores instead of a wake-up and a
//! context switch (tens of microseconds). [`SpinBudget`] adapts that budget to how the
//! waiter's last waits ended, so that a waiter whose peers are late or share its core stops
//! burning the CPU they need.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `from + after`, saturating: a duration too long for the clock (`Duration::MAX` as "no
/// timeout") gives an instant a century away instead of the overflow panic of `+`.
pub fn later(from: Instant, after: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    from.checked_add(after)
        .or_else(|| from.checked_add(after.min(CENTURY)))
        .unwrap_or(from)
}

/// A waiter's spin budget, adapted to how its waits end (the adaptive mutex's rule): the
/// whole configured budget after a wait that a spin ended; halved by each wait in a row that
/// had to park anyway, down to a sixteenth; nothing after [`SpinBudget::DROP_AFTER`] such
/// waits in a row, but for a full-budget probe every [`SpinBudget::PROBE_EVERY`]th wait, so
/// that the waiter finds out when spinning works again.
///
/// When the peers come within the budget (ranks on cores of their own) every wait spins, and
/// a few late peers in between (a rank that paid page faults the other did not) do not turn
/// spinning off. When spinning never helps, the waiter parks at once, as if it never spun.
/// That case is common on a busy machine: a parked thread is woken on its waker's core when
/// no core is idle, and two ranks sharing a core cannot meet while one of them spins
/// (measured on the 2-CPU development VM with other work running: a fixed 50 us budget made
/// every call cost the whole 50 us).
#[derive(Debug)]
pub struct SpinBudget {
    max: u64,
    /// Waits in a row that parked (only the waiter's thread reads and writes these; atomics
    /// because the owners are `Sync`).
    parked_in_a_row: AtomicU64,
    /// Waits started with no budget, counted to pick the probes.
    idle_waits: AtomicU64,
}

impl SpinBudget {
    /// Waits in a row that must park before a waiter stops spinning.
    pub const DROP_AFTER: u64 = 16;

    /// While a waiter does not spin, one wait in this many spins for the full budget.
    pub const PROBE_EVERY: u64 = 32;

    /// A budget of at most `max` per wait.
    pub fn new(max: Duration) -> Self {
        Self {
            max: u64::try_from(max.as_nanos()).unwrap_or(u64::MAX),
            parked_in_a_row: AtomicU64::new(0),
            idle_waits: AtomicU64::new(0),
        }
    }

    /// A budget of `max` for `waiters` threads that wait on each other: none at all when
    /// they outnumber the CPUs this process may use (a spinning waiter would hold a core
    /// that the peer it waits for may need).
    pub fn for_waiters(max: Duration, waiters: usize) -> Self {
        Self::new(if waiters > cores() {
            Duration::ZERO
        } else {
            max
        })
    }

    /// A budget of `max` for ranks that wait on each other, `in_process` of them threads of
    /// this process and `on_host` of them on this machine in all (these and those of other
    /// processes): none at all when this process's threads outnumber the CPUs it may use, or
    /// the ranks outnumber the machine's online CPUs. Ranks in processes of their own, each
    /// bound to one core (as `mpirun` binds them), spin: each has a core of its own, although
    /// none may use another's.
    pub fn for_ranks(max: Duration, in_process: usize, on_host: usize) -> Self {
        Self::new(if in_process > cores() || on_host > online_cpus() {
            Duration::ZERO
        } else {
            max
        })
    }

    /// The budget of a wait starting now.
    pub fn get(&self) -> Duration {
        let parked = self.parked_in_a_row.load(Ordering::Relaxed);
        if parked < Self::DROP_AFTER {
            return Duration::from_nanos(self.max >> parked.min(4));
        }
        let n = self.idle_waits.fetch_add(1, Ordering::Relaxed);
        if (n + 1).is_multiple_of(Self::PROBE_EVERY) {
            Duration::from_nanos(self.max)
        } else {
            Duration::ZERO
        }
    }

    /// A spin ran out (or there was none) and the waiter parks.
    pub fn shrink(&self) {
        self.parked_in_a_row.fetch_add(1, Ordering::Relaxed);
    }

    /// A wait ended, after spinning (`spun`) and parking (`parked`) or not: one that a spin
    /// ended restores the whole budget.
    pub fn learn(&self, spun: bool, parked: bool) {
        if spun && !parked {
            self.parked_in_a_row.store(0, Ordering::Relaxed);
        }
    }
}

/// The number of CPUs this process may run on (1 when unknown), read once.
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The number of CPUs online on this machine, whichever this process may use (its own
/// count, [`cores`], when the kernel does not say), read once.
pub fn online_cpus() -> usize {
    static ONLINE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONLINE.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|list| count_cpu_list(&list))
            .unwrap_or_else(cores)
    })
}

/// The CPUs a kernel CPU list names (`0-3,8,10-11`), or `None` for a list it cannot read.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',') {
        let count = match part.split_once('-') {
            Some((first, last)) => {
                let (first, last) = (first.parse::<usize>().ok()?, last.parse::<usize>().ok()?);
                last.checked_sub(first)?.checked_add(1)?
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
        n = n.checked_add(count)?;
    }
    (n > 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spin_budget_halves_on_parks_then_only_probes_and_comes_back_on_a_success() {
        let max = Duration::from_micros(64);
        let b = SpinBudget::new(max);
        assert_eq!(b.get(), max);
        b.shrink();
        assert_eq!(b.get(), max / 2);
        for _ in 1..SpinBudget::DROP_AFTER - 1 {
            b.shrink();
        }
        // Down to a sixteenth while spins fail...
        assert_eq!(b.get(), max / 16);
        // ...then nothing, but one wait in PROBE_EVERY spins the whole budget.
        b.shrink();
        let budgets: Vec<Duration> = (0..2 * SpinBudget::PROBE_EVERY).map(|_| b.get()).collect();
        let probes = budgets.iter().filter(|&&d| d == max).count();
        assert_eq!(probes, 2);
        assert!(budgets.iter().all(|&d| d == max || d == Duration::ZERO));
        // A wait that spun and did not park restores the budget; one that parked does not.
        b.learn(true, true);
        assert_eq!(b.get(), Duration::ZERO);
        b.learn(true, false);
        assert_eq!(b.get(), max);
    }

    #[test]
    fn a_zero_spin_never_spins() {
        let b = SpinBudget::new(Duration::ZERO);
        assert!((0..100).all(|_| b.get() == Duration::ZERO));
    }

    #[test]
    fn more_waiters_than_cores_never_spin() {
        let b = SpinBudget::for_waiters(Duration::from_micros(50), cores() + 1);
        assert_eq!(b.get(), Duration::ZERO);
        let b = SpinBudget::for_waiters(Duration::from_micros(50), 1);
        assert_eq!(b.get(), Duration::from_micros(50));
    }

    #[test]
    fn ranks_in_processes_of_their_own_spin_while_the_machine_has_a_cpu_for_each() {
        let max = Duration::from_micros(50);
        // One thread here, the other ranks in processes of their own: the machine's CPUs
        // decide, not this process's (an `mpirun` binding gives it one).
        assert_eq!(SpinBudget::for_ranks(max, 1, online_cpus()).get(), max);
        assert_eq!(
            SpinBudget::for_ranks(max, 1, online_cpus() + 1).get(),
            Duration::ZERO
        );
        assert_eq!(
            SpinBudget::for_ranks(max, cores() + 1, cores() + 1).get(),
            Duration::ZERO
        );
        assert!(online_cpus() >= cores());
    }

    #[test]
    fn a_cpu_list_counts_its_ranges_and_refuses_what_it_cannot_read() {
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("0-x"), None);
    }

    #[test]
    fn a_duration_past_the_clock_saturates() {
        let now = Instant::now();
        assert!(later(now, Duration::MAX) > now);
        assert_eq!(
            later(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }
}
