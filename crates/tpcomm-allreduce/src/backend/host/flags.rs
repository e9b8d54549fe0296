//! The flag barrier and the launch protocol of the host backend, generic over where the
//! flag words live so that one copy of the logic runs both in production (over shared
//! memory, [`super`]) and under `loom` (`cargo xtask loom`, the `loom_tests` below).
//!
//! - [`Slot`]: one 32-bit flag word (release stores, acquire loads; relaxed for the
//!   rank-private epoch counter). Implemented for `std`'s `AtomicU32` here and for loom's
//!   in the model tests.
//! - [`Blocks`]: where the slots are: every rank's Signal block as this rank reaches it.
//! - [`Wait`]: the policy between two failed looks at a slot (spin, yield, sleep, time out).
//! - [`next_epoch`]: a barrier's epoch from the rank's counter of its kind.
//! - [`FlagBarrier`]: crossing a barrier, and [`FlagBarrier::launch`], the order of the
//!   barriers and the work of a one- or two-stage launch.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{AllReduceError, Result};

/// One flag word.
pub(crate) trait Slot {
    /// Publishes `value`; every write this thread did before becomes visible to a thread
    /// whose [`Slot::load_acquire`] reads it.
    fn store_release(&self, value: u32);
    /// Reads the word, acquiring the writes published with the value read.
    fn load_acquire(&self) -> u32;
    /// Reads a word only this rank writes (the epoch counter).
    fn load_relaxed(&self) -> u32;
    /// Writes a word only this rank reads (the epoch counter).
    fn store_relaxed(&self, value: u32);
}

impl Slot for AtomicU32 {
    #[inline(always)]
    fn store_release(&self, value: u32) {
        self.store(value, Ordering::Release);
    }

    #[inline(always)]
    fn load_acquire(&self) -> u32 {
        self.load(Ordering::Acquire)
    }

    #[inline(always)]
    fn load_relaxed(&self) -> u32 {
        self.load(Ordering::Relaxed)
    }

    #[inline(always)]
    fn store_relaxed(&self, value: u32) {
        self.store(value, Ordering::Relaxed);
    }
}

/// The three barriers of a launch, each with its own flag array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Before any rank reads a peer's input.
    Start,
    /// Two-stage: every rank's reduced part is in its temp buffer.
    Mid,
    /// No rank reads a peer's buffers any more.
    End,
}

impl Kind {
    /// Its position among the three (its flag array, its epoch counter).
    pub(crate) fn index(self) -> usize {
        match self {
            Kind::Start => 0,
            Kind::Mid => 1,
            Kind::End => 2,
        }
    }

    /// The name a timeout reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Start => "start",
            Kind::Mid => "mid",
            Kind::End => "end",
        }
    }
}

/// Every rank's Signal block, as this rank reaches it.
pub(crate) trait Blocks {
    /// The flag word type.
    type Slot: Slot + ?Sized;
    /// The slot for `writer` in rank `peer`'s `kind` array.
    fn peer(&self, peer: usize, kind: Kind, writer: usize) -> &Self::Slot;
    /// The slot for `writer` in this rank's own `kind` array.
    fn own(&self, kind: Kind, writer: usize) -> &Self::Slot;
}

/// What a rank does between two failed looks at a slot.
pub(crate) trait Wait {
    /// Starts waiting at a barrier (after this rank's stores).
    fn begin(timeout: Duration) -> Self;
    /// After the `spins`-th failed look at one slot (from 1): backs off, or gives up
    /// with how long this barrier has been waited for.
    fn idle(&mut self, spins: u32) -> std::result::Result<(), Duration>;
}

/// Production waiting: spin briefly, then yield, then sleep in 20 us steps (ranks may
/// outnumber cores), and give up at the timeout.
#[derive(Debug)]
pub(crate) struct Backoff {
    started: Instant,
    timeout: Duration,
}

impl Wait for Backoff {
    #[inline(always)]
    fn begin(timeout: Duration) -> Self {
        Self {
            started: Instant::now(),
            timeout,
        }
    }

    #[inline(always)]
    fn idle(&mut self, spins: u32) -> std::result::Result<(), Duration> {
        if spins < 256 {
            std::hint::spin_loop();
        } else if spins < 1024 {
            std::thread::yield_now();
        } else {
            let waited = self.started.elapsed();
            if waited >= self.timeout {
                return Err(waited);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(())
    }
}

/// Advances one of this rank's epoch counters and returns the barrier's epoch (counter + 1,
/// wrapping). Only this rank touches its counters, so relaxed accesses suffice.
#[inline]
pub(crate) fn next_epoch<S: Slot + ?Sized>(counter: &S) -> u32 {
    let epoch = counter.load_relaxed().wrapping_add(1);
    counter.store_relaxed(epoch);
    epoch
}

/// One launch's barriers for one rank.
///
/// Crossing a barrier of kind `k`: advance this rank's counter of `k` to the barrier's
/// epoch, store it with release into every peer's `k` slot for this rank, then wait with
/// acquire loads until every slot of this rank's own `k` array shows the epoch. Equality is
/// enough: a peer can only store the next epoch of `k` after this rank has passed the `k`
/// barrier that consumed the current one (every rank crosses the same barriers in the same
/// order), and a slot holds the previous epoch of its own kind, never the current one: one
/// counter per kind, so a kind left unused for any number of launches (2^32 included) is
/// not passed by the value its slots kept.
#[derive(Debug)]
pub(crate) struct FlagBarrier<'a, B: Blocks> {
    /// The Signal blocks.
    pub(crate) blocks: &'a B,
    /// This rank.
    pub(crate) rank: usize,
    /// Ranks in the group.
    pub(crate) world: usize,
    /// This rank's epoch counter of each kind, by [`Kind::index`] ([`next_epoch`]).
    pub(crate) counters: [&'a B::Slot; 3],
    /// How long one barrier may wait.
    pub(crate) timeout: Duration,
}

impl<B: Blocks> FlagBarrier<'_, B> {
    /// Publishes this rank's epoch to every peer's `kind` array, then waits for every
    /// peer's in its own.
    #[inline]
    pub(crate) fn cross<W: Wait>(&self, kind: Kind) -> Result<()> {
        let epoch = next_epoch(self.counters[kind.index()]);
        for p in 0..self.world {
            self.blocks.peer(p, kind, self.rank).store_release(epoch);
        }
        let mut wait = W::begin(self.timeout);
        for p in 0..self.world {
            let slot = self.blocks.own(kind, p);
            let mut spins = 0u32;
            while slot.load_acquire() != epoch {
                spins += 1;
                if let Err(waited) = wait.idle(spins) {
                    return Err(AllReduceError::Timeout {
                        rank: self.rank,
                        peer: p,
                        barrier: kind.name(),
                        waited,
                    });
                }
            }
        }
        Ok(())
    }

    /// A launch: start barrier; `verify` (that every rank launched the same thing: what
    /// the peers published before their start flags is visible now); `reduce` (one-stage:
    /// the whole output; two-stage: this rank's part into its temp buffer); then
    /// - one-stage: end barrier (peers read this rank's input until they pass it);
    /// - two-stage: mid barrier, then `gather` (every rank's part from its owner's temp
    ///   buffer), and no end barrier. The mid barrier already proves that every peer has
    ///   read all it reads of this rank's input and of the Signal words published before the
    ///   start barrier; a peer still gathering from this rank's temp buffer is done before it
    ///   arrives at the next launch's start barrier, which this rank crosses before it writes
    ///   that buffer again. Each flag array is still never written twice by a rank before
    ///   every peer has seen the first value: consecutive start flags are separated by a
    ///   mid or end barrier, consecutive mid and end flags by a start barrier.
    ///
    /// When `verify` fails the work is skipped and only the end barrier is crossed before
    /// the error is returned. `verify` must fail on every rank when it fails on one (it
    /// does when each rank compares every peer's announcement with its own): then no rank
    /// waits in a mid barrier that its peers skip, and no rank's next launch overwrites
    /// what a peer is still verifying.
    #[inline]
    pub(crate) fn launch<W: Wait>(
        &self,
        two_stage: bool,
        verify: impl FnOnce() -> Result<()>,
        reduce: impl FnOnce(),
        gather: impl FnOnce(),
    ) -> Result<()> {
        self.cross::<W>(Kind::Start)?;
        if let Err(e) = verify() {
            self.cross::<W>(Kind::End)?;
            return Err(e);
        }
        reduce();
        if two_stage {
            self.cross::<W>(Kind::Mid)?;
            gather();
            return Ok(());
        }
        self.cross::<W>(Kind::End)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks in ordinary memory: `slots[owner][kind][writer]`.
    struct Local {
        rank: usize,
        slots: std::sync::Arc<Vec<[[AtomicU32; 8]; 3]>>,
    }

    impl Blocks for Local {
        type Slot = AtomicU32;
        fn peer(&self, peer: usize, kind: Kind, writer: usize) -> &AtomicU32 {
            &self.slots[peer][kind.index()][writer]
        }
        fn own(&self, kind: Kind, writer: usize) -> &AtomicU32 {
            self.peer(self.rank, kind, writer)
        }
    }

    /// Threads through launches whose epochs cross `u32::MAX`, checking every launch
    /// passes its barriers (no false pass is checked by the loom models).
    #[test]
    fn epochs_wrap_with_real_threads() {
        let world = 3;
        let start = u32::MAX - 2;
        let slots = std::sync::Arc::new(
            (0..world)
                .map(|_| std::array::from_fn(|_| std::array::from_fn(|_| AtomicU32::new(start))))
                .collect::<Vec<_>>(),
        );
        let threads: Vec<_> = (0..world)
            .map(|rank| {
                let slots = slots.clone();
                std::thread::spawn(move || {
                    let counters: [AtomicU32; 3] = std::array::from_fn(|_| AtomicU32::new(start));
                    let blocks = Local { rank, slots };
                    let barrier = FlagBarrier {
                        blocks: &blocks,
                        rank,
                        world,
                        counters: counters.each_ref(),
                        timeout: Duration::from_secs(30),
                    };
                    for launch in 0..6 {
                        barrier
                            .launch::<Backoff>(launch % 2 == 0, || Ok(()), || {}, || {})
                            .expect("barrier");
                    }
                    counters.map(|c| c.load_relaxed())
                })
            })
            .collect();
        for t in threads {
            // Six starts; three two-stage launches (mid), three one-stage (end).
            let want = [6, 3, 3].map(|n| start.wrapping_add(n));
            assert_eq!(t.join().expect("rank thread"), want);
        }
    }

    /// Rank 0 of two crossing `kind` with its counters at `counters`, every flag at 0 and
    /// rank 1 absent; 20 ms timeout.
    fn cross_alone(counters: [u32; 3], kind: Kind) -> Result<()> {
        let slots = std::sync::Arc::new(
            (0..2)
                .map(|_| std::array::from_fn(|_| std::array::from_fn(|_| AtomicU32::new(0))))
                .collect::<Vec<_>>(),
        );
        let blocks = Local { rank: 0, slots };
        let counters = counters.map(AtomicU32::new);
        let barrier = FlagBarrier {
            blocks: &blocks,
            rank: 0,
            world: 2,
            counters: counters.each_ref(),
            timeout: Duration::from_millis(20),
        };
        barrier.cross::<Backoff>(kind)
    }

    #[test]
    fn a_missing_peer_times_out_naming_it() {
        match cross_alone([0; 3], Kind::Mid) {
            Err(AllReduceError::Timeout {
                rank: 0,
                peer: 1,
                barrier: "mid",
                ..
            }) => {}
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
    }

    /// After 2^32 - 1 launches that never crossed a mid barrier (every one one-stage since
    /// the reset), the mid slots still hold 0, the value the reset left: a two-stage launch
    /// must still wait for its peers there (with one epoch for every kind, its epoch was 0
    /// and the mid barrier passed at once, peers absent).
    #[test]
    fn a_barrier_kind_unused_for_2_pow_32_launches_is_not_passed_by_its_stale_flags() {
        // Start and end crossed 2^32 - 1 times (wrapped to u32::MAX), mid never.
        assert!(
            matches!(
                cross_alone([u32::MAX, 0, u32::MAX], Kind::Mid),
                Err(AllReduceError::Timeout { peer: 1, .. })
            ),
            "the mid barrier passed without its peer"
        );
    }
}

/// Model checks (`cargo xtask loom`): the same [`FlagBarrier`] over loom's atomics, with
/// each rank's input and temp buffer as a loom `UnsafeCell`, so a missing happens-before
/// edge is reported as a data race and a stale read as a wrong value.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicU32 as LoomU32;
    use loom::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    const KINDS: usize = 3;

    /// A loom flag word whose publishing store is release (`RELEASE`) or relaxed, and whose
    /// observing load is acquire (`ACQUIRE`) or relaxed: one type for the real protocol and
    /// its deliberately broken variants.
    struct LoomSlot<const RELEASE: bool, const ACQUIRE: bool>(LoomU32);
    /// The flag word of the real protocol.
    type Good = LoomSlot<true, true>;
    /// The deliberately broken protocol: relaxed instead of release.
    type RelaxedStore = LoomSlot<false, true>;
    /// The deliberately broken protocol: relaxed instead of acquire.
    type RelaxedLoad = LoomSlot<true, false>;

    impl<const RELEASE: bool, const ACQUIRE: bool> Slot for LoomSlot<RELEASE, ACQUIRE> {
        fn store_release(&self, value: u32) {
            let order = if RELEASE {
                Ordering::Release
            } else {
                Ordering::Relaxed
            };
            self.0.store(value, order);
        }
        fn load_acquire(&self) -> u32 {
            self.0.load(if ACQUIRE {
                Ordering::Acquire
            } else {
                Ordering::Relaxed
            })
        }
        fn load_relaxed(&self) -> u32 {
            self.0.load(Ordering::Relaxed)
        }
        fn store_relaxed(&self, value: u32) {
            self.0.store(value, Ordering::Relaxed);
        }
    }

    trait NewSlot: Slot + Send + Sync + 'static {
        fn new(value: u32) -> Self;
    }
    impl<const RELEASE: bool, const ACQUIRE: bool> NewSlot for LoomSlot<RELEASE, ACQUIRE> {
        fn new(value: u32) -> Self {
            Self(LoomU32::new(value))
        }
    }

    /// Shared state of a model: flags `[owner][kind][writer]`, and per rank an input
    /// word (written before the start barrier, read by every rank after it) and a temp
    /// word (its reduced part, written before the mid barrier, read by every rank after).
    struct Group<S> {
        world: usize,
        flags: Vec<S>,
        inputs: Vec<UnsafeCell<u64>>,
        temps: Vec<UnsafeCell<u64>>,
    }

    struct View<'a, S> {
        group: &'a Group<S>,
        rank: usize,
    }

    impl<S: Slot> Blocks for View<'_, S> {
        type Slot = S;
        fn peer(&self, peer: usize, kind: Kind, writer: usize) -> &S {
            let w = self.group.world;
            &self.group.flags[(peer * KINDS + kind.index()) * w + writer]
        }
        fn own(&self, kind: Kind, writer: usize) -> &S {
            self.peer(self.rank, kind, writer)
        }
    }

    /// Loom waiting: yield to the scheduler (a spin loop must), never time out; a peer
    /// that never arrives shows up as loom's branch limit being exceeded.
    struct LoomYield;
    impl Wait for LoomYield {
        fn begin(_timeout: Duration) -> Self {
            LoomYield
        }
        fn idle(&mut self, _spins: u32) -> std::result::Result<(), Duration> {
            loom::thread::yield_now();
            Ok(())
        }
    }

    /// The value rank `r` contributes in launch `n`.
    fn input(n: u32, r: usize) -> u64 {
        (u64::from(n) << 8) | (r as u64 + 1)
    }

    /// One rank's launches; `two_stage(n)` chooses the algorithm of launch `n`.
    fn rank_body<S: Slot>(
        group: &Group<S>,
        rank: usize,
        counters: &[S; KINDS],
        launches: u32,
        two_stage: fn(u32) -> bool,
    ) {
        let world = group.world;
        let view = View { group, rank };
        let barrier = FlagBarrier {
            blocks: &view,
            rank,
            world,
            counters: counters.each_ref(),
            timeout: Duration::from_secs(1),
        };
        for n in 0..launches {
            // The staging copy of this launch's input, before the start barrier (the
            // previous launch's end barrier, or mid barrier for two-stage, keeps it from
            // racing peers' reads).
            // SAFETY: loom checks this access against every other (a race panics).
            group.inputs[rank].with_mut(|p| unsafe { *p = input(n, rank) });
            let sum = || {
                (0..world)
                    // SAFETY: loom checks this access against every other.
                    .map(|r| group.inputs[r].with(|p| unsafe { *p }))
                    .sum::<u64>()
            };
            let want: u64 = (0..world).map(|r| input(n, r)).sum();
            let two = two_stage(n);
            barrier
                .launch::<LoomYield>(
                    two,
                    || Ok(()),
                    || {
                        let s = sum();
                        assert_eq!(s, want, "rank {rank} launch {n}: stale input");
                        if two {
                            // This rank's "part": the sum tagged with its rank.
                            // SAFETY: loom checks this access against every other.
                            group.temps[rank].with_mut(|p| unsafe { *p = s + rank as u64 });
                        }
                    },
                    || {
                        for r in 0..world {
                            // SAFETY: loom checks this access against every other.
                            let got = group.temps[r].with(|p| unsafe { *p });
                            assert_eq!(
                                got,
                                want + r as u64,
                                "rank {rank} launch {n}: stale temp of {r}"
                            );
                        }
                    },
                )
                .expect("loom waits never time out");
        }
    }

    /// Runs `world` ranks (rank 0 on the model's main thread) for `launches` launches with
    /// every counter and flag at `start`, as after a launch that ended at epoch `start`.
    /// `budget`: stop exploring after this long (the model is then bounded, not exhaustive).
    /// Returns the iterations explored.
    fn model<S: NewSlot>(
        world: usize,
        launches: u32,
        start: u32,
        two_stage: fn(u32) -> bool,
        preemptions: usize,
        budget: Option<Duration>,
    ) -> usize {
        let iterations = std::sync::Arc::new(AtomicUsize::new(0));
        let count = iterations.clone();
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = builder.preemption_bound.or(Some(preemptions));
        builder.max_branches = 100_000;
        builder.max_duration = budget;
        let began = std::time::Instant::now();
        builder.check(move || {
            count.fetch_add(1, Ordering::Relaxed);
            let group = Arc::new(Group {
                world,
                flags: (0..world * KINDS * world).map(|_| S::new(start)).collect(),
                inputs: (0..world).map(|_| UnsafeCell::new(0)).collect(),
                temps: (0..world).map(|_| UnsafeCell::new(0)).collect(),
            });
            let peers: Vec<_> = (1..world)
                .map(|rank| {
                    let group = group.clone();
                    loom::thread::spawn(move || {
                        let counters: [S; KINDS] = std::array::from_fn(|_| S::new(start));
                        rank_body(&group, rank, &counters, launches, two_stage);
                        // Every launch crosses one start barrier.
                        counters[Kind::Start.index()].load_relaxed()
                    })
                })
                .collect();
            let counters: [S; KINDS] = std::array::from_fn(|_| S::new(start));
            rank_body(&group, 0, &counters, launches, two_stage);
            assert_eq!(
                counters[Kind::Start.index()].load_relaxed(),
                start.wrapping_add(launches)
            );
            for p in peers {
                assert_eq!(p.join().expect("rank"), start.wrapping_add(launches));
            }
        });
        let n = iterations.load(Ordering::Relaxed);
        eprintln!(
            "loom: {world} ranks, {launches} launches from epoch {start}, preemption bound {:?}: {n} interleavings in {:.1?} ({})",
            builder.preemption_bound,
            began.elapsed(),
            match budget {
                Some(b) if began.elapsed() >= b => "time budget reached: bounded, not exhaustive",
                _ => "exhaustive within the bound",
            }
        );
        n
    }

    fn alternate(n: u32) -> bool {
        n.is_multiple_of(2)
    }

    fn always(_: u32) -> bool {
        true
    }

    #[test]
    fn loom_two_ranks_consecutive_launches() {
        // Two-stage, one-stage, two-stage: epochs 1..=3, every barrier kind reused.
        assert!(model::<Good>(2, 3, 0, alternate, 3, None) > 1);
    }

    #[test]
    fn loom_two_ranks_two_stage_launches_in_a_row() {
        // Two-stage has no end barrier: a rank's next staging write and temp write must
        // still come after every peer's reads of them (loom reports a race otherwise).
        assert!(model::<Good>(2, 3, 0, always, 3, None) > 1);
    }

    /// Three ranks exceed minutes even at preemption bound 1 (every load may read any
    /// value its coherence order allows), so their exploration is bounded in time.
    const THREE_RANK_BUDGET: Option<Duration> = Some(Duration::from_secs(45));

    #[test]
    fn loom_three_ranks_two_stage_handoff() {
        assert!(model::<Good>(3, 2, 0, always, 2, THREE_RANK_BUDGET) > 1);
    }

    #[test]
    fn loom_epoch_counter_wraps() {
        // Epochs u32::MAX, 0, 1 after flags and counters left at u32::MAX - 1.
        assert!(model::<Good>(2, 3, u32::MAX - 1, alternate, 3, None) > 1);
    }

    #[test]
    fn loom_three_ranks_epoch_counter_wraps() {
        assert!(model::<Good>(3, 2, u32::MAX, always, 2, THREE_RANK_BUDGET) > 1);
    }

    /// Runs a model that must fail; returns loom's panic message.
    fn must_fail(run: fn()) -> String {
        let result = std::panic::catch_unwind(run);
        let err = result.expect_err("loom accepted a broken barrier");
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    }

    #[test]
    fn loom_catches_relaxed_store() {
        let msg = must_fail(|| {
            model::<RelaxedStore>(2, 2, 0, always, 3, None);
        });
        eprintln!("loom on a relaxed store: {msg}");
    }

    #[test]
    fn loom_catches_relaxed_load() {
        let msg = must_fail(|| {
            model::<RelaxedLoad>(2, 2, 0, always, 3, None);
        });
        eprintln!("loom on a relaxed load: {msg}");
    }
}
