//! The state one group shares: the slots and progress counts, the flags every call reads,
//! the abort, departures and sub-groups under the group's lock, and the epoch and condition
//! variable that wake waiters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::abort::Abort;
use super::slots::{Progress, Slot, RING};
use super::LocalGroupConfig;
use crate::error::{Result, TransportError};

#[derive(Debug)]
pub(super) struct State {
    pub(super) abort: Option<Abort>,
    pub(super) left: Vec<bool>,
    /// Sub-groups being handed out by `split`: (round, color) -> (group, members still to
    /// take it).
    pub(super) children: HashMap<(u64, u32), (Arc<Shared>, usize)>,
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) size: usize,
    pub(super) config: LocalGroupConfig,
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    /// Bumped, under the lock, on every change of `state` a waiter may wait for (an abort, a
    /// rank leaving): spinning waiters watch it without taking the lock.
    pub(super) epoch: Padded<AtomicU64>,
    /// Read by every rank on every call, written rarely: parked ranks (a post wakes them
    /// only when there are some) and whether the group is aborted.
    pub(super) flags: Padded<Flags>,
    /// One per rank.
    pub(super) progress: Box<[Progress]>,
    /// Rank `r`'s post of round `seq` is `slots[r * RING + seq % RING]`.
    pub(super) slots: Box<[Slot]>,
}

#[derive(Debug, Default)]
pub(super) struct Flags {
    /// Ranks parked on `Shared::changed`.
    pub(super) parked: AtomicUsize,
    /// Set with `State::abort`.
    pub(super) aborted: AtomicBool,
    /// Ranks waiting for the others' `done` counts before they reuse a slot (see
    /// [`LocalCommunicator::finish_round`], which wakes them only when there are some).
    pub(super) ring_waiters: AtomicUsize,
}

/// A value alone on its cache line (128 bytes: two 64-byte lines, as adjacent-line
/// prefetchers pair them).
#[derive(Debug)]
#[repr(align(128))]
pub(super) struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// `n` values made by `make`, or the allocation error (never a capacity-overflow panic or
/// an abort when memory runs out).
pub(super) fn table<T>(
    n: usize,
    make: impl FnMut() -> T,
) -> std::result::Result<Vec<T>, std::collections::TryReserveError> {
    let mut values = Vec::new();
    values.try_reserve_exact(n)?;
    values.resize_with(n, make);
    Ok(values)
}

impl Shared {
    /// The shared state of a group of `size` ranks: `RING` slots (128 bytes each) per rank.
    /// A size whose tables overflow or cannot be allocated is a [`TransportError::Setup`],
    /// never a capacity-overflow panic or an abort on allocation failure.
    pub(super) fn new(size: usize, config: LocalGroupConfig) -> Result<Arc<Self>> {
        let too_large = |what: &str| {
            TransportError::Setup(format!(
                "a local group of {size} ranks is too large: {what}"
            ))
        };
        // A slot carries a root in 32 bits (`Slot::root`).
        if u32::try_from(size).map_or(true, |s| s == u32::MAX) {
            return Err(too_large("a root must fit in 32 bits"));
        }
        // `try_reserve_exact` refuses a byte size past `isize::MAX` itself; only the slot
        // count can overflow before it is asked.
        let slot_count = size
            .checked_mul(RING as usize)
            .ok_or_else(|| too_large("its slot table overflows the address space"))?;
        let slots = table(slot_count, Slot::default)
            .map_err(|e| too_large(&format!("cannot allocate its slot table ({e})")))?;
        let progress = table(size, Progress::default)
            .map_err(|e| too_large(&format!("cannot allocate its progress table ({e})")))?;
        let left = table(size, || false)
            .map_err(|e| too_large(&format!("cannot allocate its rank table ({e})")))?;
        Ok(Arc::new(Self {
            size,
            config,
            state: Mutex::new(State {
                abort: None,
                left,
                children: HashMap::new(),
            }),
            changed: Condvar::new(),
            epoch: Padded(AtomicU64::new(0)),
            flags: Padded(Flags::default()),
            progress: progress.into_boxed_slice(),
            slots: slots.into_boxed_slice(),
        }))
    }

    /// Publishes a change of `state` (called with the lock held): spinning waiters see the
    /// epoch move; parked ones are woken, with a system call only when there are some.
    pub(super) fn publish(&self, state: &State) {
        if state.abort.is_some() {
            self.flags.aborted.store(true, Ordering::Release);
        }
        self.epoch.fetch_add(1, Ordering::Release);
        if self.flags.parked.load(Ordering::SeqCst) > 0 {
            self.changed.notify_all();
        }
    }

    /// Rank `rank`'s slot of round `seq`.
    pub(super) fn slot(&self, rank: usize, seq: u64) -> &Slot {
        // `seq % RING < RING`, and `rank < size`: within `slots`.
        &self.slots[rank * RING as usize + (seq % RING) as usize]
    }

    /// The fewest rounds any rank is done with.
    pub(super) fn all_done(&self) -> u64 {
        self.progress
            .iter()
            .map(|p| p.done.load(Ordering::Acquire))
            .min()
            .unwrap_or(0)
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

/// A mutex's contents: no code path panics while holding the transport's locks, and a
/// poisoned one still holds a consistent value.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
