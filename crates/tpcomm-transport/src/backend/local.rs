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

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::copy::{copy_slice, extend_from_slice};
use super::spin::{later, SpinBudget};
use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use crate::communicator::Communicator;
use crate::error::{Op, Result, TransportError};
use crate::reduce::{describe_reduction, reduce_into, slice_of};

/// Settings of a local group.
#[derive(Debug, Clone)]
pub struct LocalGroupConfig {
    /// Longest time a rank waits for its peers in one wait (default 60 s): for a slot of
    /// the ring to be free, or for a peer's post. A collective waits at most twice (an
    /// all-reduce, two rounds: four times), so a peer that is slow but keeps coming can
    /// stretch one call past this without an error; a peer that does not come is reported
    /// within it.
    pub timeout: Duration,
    /// Largest count one call accepts (default `i32::MAX`, as MPI-3). Lower it to force the
    /// multi-round paths of upper layers in tests.
    pub max_count: usize,
    /// Stack size of each rank's thread in [`LocalGroup::run`], in bytes (default
    /// [`LocalGroupConfig::DEFAULT_STACK_SIZE`], 2 MiB: Rust's default for spawned threads,
    /// smaller than a main thread's usual 8 MiB). Raise it for ranks that recurse deeply,
    /// for example over recursive values.
    pub stack_size: usize,
    /// Longest time a waiting rank spins (watching for its peers without sleeping) before
    /// it parks (default [`LocalGroupConfig::DEFAULT_SPIN`], 50 us). Each rank adapts its
    /// budget from how its last waits ended (this while spins succeed; less, down to none
    /// but for an occasional probe, while waits park anyway); the ranks of a group larger
    /// than the number of CPUs the process may use do not spin.
    /// `Duration::ZERO` parks at once: the least CPU, and the latency of a futex wake and a
    /// context switch on every wait.
    pub spin: Duration,
}

impl LocalGroupConfig {
    /// The default stack size of a rank's thread: 2 MiB, as `std::thread::spawn` gives.
    pub const DEFAULT_STACK_SIZE: usize = 2 << 20;
    /// The default spin budget of a wait: 50 us, several times the spread of ranks arriving
    /// at the same collective, and a small fraction of a wait for a rank that is late.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
}

impl Default for LocalGroupConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            max_count: i32::MAX as usize,
            stack_size: Self::DEFAULT_STACK_SIZE,
            spin: Self::DEFAULT_SPIN,
        }
    }
}

/// Builder of a group of [`LocalCommunicator`]s, one per thread.
///
/// ```
/// use std::time::Duration;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(4)
///     .timeout(Duration::from_secs(5))
///     .run(|comm| {
///         let mut buf = [0u8; 4];
///         if comm.rank() == 2 {
///             buf = *b"tpcm";
///         }
///         comm.broadcast(2, &mut buf)?;
///         Ok::<_, tpcomm_transport::TransportError>(buf)
///     });
/// assert!(results.into_iter().all(|r| r.unwrap().unwrap() == *b"tpcm"));
/// ```
#[derive(Debug, Clone)]
pub struct LocalGroup {
    size: usize,
    config: LocalGroupConfig,
}

impl LocalGroup {
    /// A group of `size` ranks with the default configuration.
    pub fn new(size: usize) -> Self {
        Self {
            size,
            config: LocalGroupConfig::default(),
        }
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: LocalGroupConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets the wait timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Sets `max_count`.
    pub fn max_count(mut self, max_count: usize) -> Self {
        self.config.max_count = max_count;
        self
    }

    /// Sets how long a waiting rank spins before it parks (see
    /// [`LocalGroupConfig::spin`]); `Duration::ZERO` parks at once.
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
        self
    }

    /// Sets the stack size of each rank's thread in [`run`](Self::run), in bytes (default
    /// [`LocalGroupConfig::DEFAULT_STACK_SIZE`], 2 MiB). The OS may round it up to a whole
    /// number of pages.
    ///
    /// ```
    /// use tpcomm_transport::LocalGroup;
    ///
    /// fn depth(n: u32) -> u32 {
    ///     let frame = std::hint::black_box([0u8; 1024]);
    ///     if n == 0 { u32::from(frame[0]) } else { 1 + depth(n - 1) }
    /// }
    /// // About 4 MiB of frames: more than the default 2 MiB stack holds.
    /// let results = LocalGroup::new(2)
    ///     .stack_size(64 << 20)
    ///     .run(|_comm| depth(4096));
    /// assert!(results.into_iter().all(|r| r.unwrap() == 4096));
    /// ```
    pub fn stack_size(mut self, bytes: usize) -> Self {
        self.config.stack_size = bytes;
        self
    }

    /// Creates the communicators, rank `i` at index `i`; hand each to its own thread.
    ///
    /// Fails with [`TransportError::Setup`] when the size or `max_count` is 0.
    pub fn communicators(&self) -> Result<Vec<LocalCommunicator>> {
        if self.size == 0 {
            return Err(TransportError::Setup(
                "a local group needs at least one rank".into(),
            ));
        }
        if self.config.max_count == 0 {
            return Err(TransportError::Setup("max_count must be at least 1".into()));
        }
        let shared = Shared::new(self.size, self.config.clone())?;
        Ok((0..self.size)
            .map(|rank| LocalCommunicator::new(shared.clone(), rank))
            .collect())
    }

    /// Runs `f` on one thread per rank and returns every rank's result, rank `i` at index
    /// `i`. A rank that panics gives [`TransportError::RankPanicked`]; its communicator is
    /// dropped while unwinding, so its peers stop waiting for it with an error naming it.
    /// A setup failure is returned as the result of every rank.
    pub fn run<T, F>(&self, f: F) -> Vec<Result<T>>
    where
        T: Send,
        F: Fn(LocalCommunicator) -> T + Sync,
    {
        let comms = match self.communicators() {
            Ok(c) => c,
            Err(e) => {
                let msg = e.to_string();
                // One error per rank, unless there are too many to hold (a size too large
                // for memory): then one.
                let mut errors = Vec::new();
                let ranks = if errors.try_reserve_exact(self.size.max(1)).is_ok() {
                    self.size.max(1)
                } else {
                    1
                };
                errors.extend((0..ranks).map(|_| Err(TransportError::Setup(msg.clone()))));
                return errors;
            }
        };
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let rank = comm.rank();
                    std::thread::Builder::new()
                        .name(format!("tpcomm-rank-{rank}"))
                        .stack_size(self.config.stack_size)
                        .spawn_scoped(scope, move || {
                            catch_unwind(AssertUnwindSafe(|| f(comm))).map_err(|payload| {
                                TransportError::RankPanicked {
                                    rank,
                                    message: panic_message(&*payload),
                                }
                            })
                        })
                        .map_err(|e| {
                            TransportError::Setup(format!("cannot spawn rank {rank}: {e}"))
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|payload| {
                        Err(TransportError::RankPanicked {
                            rank,
                            message: panic_message(&*payload),
                        })
                    }),
                    Err(e) => Err(e),
                })
                .collect()
        })
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

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
}

/// How many posts a communicator keeps for reuse: a post may still be held by a slow peer
/// when the next call starts (an object collective's header, then its payload), and one of
/// the others is free by then.
const SPARES: usize = 4;

/// The most bytes (of capacity) of the posts a communicator keeps for reuse (64 MiB). Reuse
/// saves three allocations per call, which matter next to a small collective's
/// sub-microsecond hand-off, and past glibc's mmap threshold (128 KiB at first) the page
/// faults of a fresh buffer (one per 4 KiB, about 3.4 us each on the development VM), which
/// cost more than the copy itself. The price: each communicator holds the memory of its
/// recent posts, up to this size.
const SPARE_MAX_BYTES: usize = 64 << 20;

/// How many rounds a rank may run ahead of the slowest reader of its posts: the slots of
/// one rank in [`Shared::slots`]. A rank that needs no peer's post (a broadcast root) waits,
/// at its `RING + 1`-th round ahead, until every rank is done with the round `RING` before.
const RING: u64 = 64;

/// The most bytes a post carries in its slot itself (six words), and the most counts.
/// Larger posts go through a shared [`Post`].
const INLINE_BYTES: usize = 48;
const INLINE_WORDS: usize = INLINE_BYTES / 8;
const INLINE_META: usize = 3;
// Their sizes fit the fields of `Slot::head` (8 bits each).
const _: () = assert!(INLINE_BYTES < 1 << 8 && INLINE_META < 1 << 8);

/// The bit of [`Slot::head`] that says the post is in [`Slot::post`] rather than inline.
const SHARED_POST: u64 = 1 << 63;

/// What a rank contributes to a round, when it does not fit in a [`Slot`].
#[derive(Debug, Default)]
struct Post {
    bytes: Vec<u8>,
    /// Op-specific integers (counts, lengths, colors) the peers check against their own.
    meta: Vec<usize>,
}

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
struct Slot {
    /// The round's sequence number plus one; 0 while the slot is (re)written.
    round: AtomicU64,
    /// [`op_code`] of the operation called (bits 0-7); inline, the byte length (bits 8-15)
    /// and the count of `meta` (bits 16-23); or [`SHARED_POST`].
    head: AtomicU64,
    /// The root plus one, 0 for none (bits 0-31), and the upper half of the rank's
    /// [`history`] before this round (bits 32-63).
    root: AtomicU64,
    meta: [AtomicU64; INLINE_META],
    bytes: [AtomicU64; INLINE_WORDS],
    /// The post of the round, when it is not inline; emptied by its rank once every rank is
    /// done with the round.
    post: Mutex<Option<Arc<Post>>>,
}

/// A post on its way into this rank's slot.
#[derive(Debug)]
enum Outgoing {
    Inline {
        words: [u64; INLINE_WORDS],
        len: usize,
        meta: [u64; INLINE_META],
        count: usize,
    },
    Shared(Arc<Post>),
}

/// A rank's progress, on a cache line of its own (written by its rank at every call, read
/// by the others only when they are about to use a slot again or to free posts).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Progress {
    /// Rounds this rank is done reading (it holds its own copies of or references to the
    /// posts it read): the slots of these rounds may be used again.
    done: AtomicU64,
}

/// How a rank read a peer's post in one round.
#[derive(Debug, Default)]
enum Got {
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
struct Joined<'a> {
    comm: &'a LocalCommunicator,
    got: Vec<Got>,
    /// `copies[r]`: rank `r`'s inline post, when `got[r]` is [`Got::Copied`] (buffers kept
    /// between calls).
    copies: Vec<Post>,
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        let mut got = std::mem::take(&mut self.got);
        got.clear();
        let copies = std::mem::take(&mut self.copies);
        *lock(&self.comm.held) = (got, copies);
    }
}

#[derive(Debug, Clone)]
struct Abort {
    by: usize,
    reason: String,
    /// Set when the abort is a peer's timeout: ranks still waiting report their own
    /// `Timeout` (naming the ranks *they* miss) rather than a second-hand abort.
    timed_out: bool,
}

#[derive(Debug)]
struct State {
    abort: Option<Abort>,
    left: Vec<bool>,
    /// Sub-groups being handed out by `split`: (round, color) -> (group, members still to
    /// take it).
    children: HashMap<(u64, u32), (Arc<Shared>, usize)>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    config: LocalGroupConfig,
    state: Mutex<State>,
    changed: Condvar,
    /// Bumped, under the lock, on every change of `state` a waiter may wait for (an abort, a
    /// rank leaving): spinning waiters watch it without taking the lock.
    epoch: Padded<AtomicU64>,
    /// Read by every rank on every call, written rarely: parked ranks (a post wakes them
    /// only when there are some) and whether the group is aborted.
    flags: Padded<Flags>,
    /// One per rank.
    progress: Box<[Progress]>,
    /// Rank `r`'s post of round `seq` is `slots[r * RING + seq % RING]`.
    slots: Box<[Slot]>,
}

#[derive(Debug, Default)]
struct Flags {
    /// Ranks parked on `Shared::changed`.
    parked: AtomicUsize,
    /// Set with `State::abort`.
    aborted: AtomicBool,
    /// Ranks waiting for the others' `done` counts before they reuse a slot (see
    /// [`LocalCommunicator::finish_round`], which wakes them only when there are some).
    ring_waiters: AtomicUsize,
}

/// A value alone on its cache line (128 bytes: two 64-byte lines, as adjacent-line
/// prefetchers pair them).
#[derive(Debug)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

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
    fn new(now: Instant, config: &LocalGroupConfig) -> Self {
        Self {
            started: now,
            deadline: later(now, config.timeout),
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

/// Which posts a rank needs before it can leave a round.
#[derive(Debug, Clone, Copy)]
enum Needs {
    Nobody,
    Rank(usize),
    Everybody,
}

/// `n` values made by `make`, or the allocation error (never a capacity-overflow panic or
/// an abort when memory runs out).
fn table<T>(
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
    fn new(size: usize, config: LocalGroupConfig) -> Result<Arc<Self>> {
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
    fn publish(&self, state: &State) {
        if state.abort.is_some() {
            self.flags.aborted.store(true, Ordering::Release);
        }
        self.epoch.fetch_add(1, Ordering::Release);
        if self.flags.parked.load(Ordering::SeqCst) > 0 {
            self.changed.notify_all();
        }
    }

    /// Rank `rank`'s slot of round `seq`.
    fn slot(&self, rank: usize, seq: u64) -> &Slot {
        // `seq % RING < RING`, and `rank < size`: within `slots`.
        &self.slots[rank * RING as usize + (seq % RING) as usize]
    }

    /// The fewest rounds any rank is done with.
    fn all_done(&self) -> u64 {
        self.progress
            .iter()
            .map(|p| p.done.load(Ordering::Acquire))
            .min()
            .unwrap_or(0)
    }

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

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
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
        }
    }

    /// This rank's post of `bytes` and `meta`: inline when they fit in a slot, a shared
    /// [`Post`] otherwise.
    fn post(&self, bytes: &[u8], meta: &[usize]) -> Outgoing {
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
    fn post_owned(&self, bytes: Vec<u8>) -> Outgoing {
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
    fn post_with(&self, fill: impl FnOnce(&mut Post)) -> Arc<Post> {
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
    fn reclaim(&self, done: u64) {
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
    fn publish_post(&self, seq: u64, op: Op, root: Option<usize>, post: Outgoing) -> u64 {
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
    fn read_post(
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

    fn aborted(&self, op: Op, abort: &Abort) -> TransportError {
        TransportError::Aborted {
            op,
            rank: self.rank,
            by: abort.by,
            reason: abort.reason.clone(),
        }
    }

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
    fn exchange(
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
    fn finish_round(&self, seq: u64) {
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

    /// Waits until `ready()`, bounded by the group's timeout, an abort, and the ranks that
    /// `missing()` names dropping their communicators.
    ///
    /// A rank spins for its budget (watching `ready` and the epoch, without the lock), then
    /// parks on the condition variable; each wake-up spins afresh.
    fn wait(
        &self,
        op: Op,
        ready: impl Fn() -> bool,
        missing: impl Fn() -> Vec<usize>,
    ) -> Result<()> {
        let shared = &*self.shared;
        let mut w = Wait::new(Instant::now(), &shared.config);
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
                    "rank {} timed out in {op} after {:?} waiting for ranks {missing:?}",
                    self.rank, shared.config.timeout
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

    fn abort_group(&self, state: &mut State, op: Op, reason: String) -> TransportError {
        let abort = state
            .abort
            .get_or_insert(Abort {
                by: self.rank,
                reason,
                timed_out: false,
            })
            .clone();
        self.shared.publish(state);
        self.aborted(op, &abort)
    }

    fn mismatch(&self, op: Op, detail: String) -> TransportError {
        TransportError::Mismatch {
            op,
            rank: self.rank,
            detail,
        }
    }
}

/// The ranks whose posts `needs` names.
fn needed_ranks(needs: Needs, size: usize) -> std::ops::Range<usize> {
    match needs {
        Needs::Nobody => 0..0,
        Needs::Rank(r) => r..r + 1,
        Needs::Everybody => 0..size,
    }
}

/// A post that `exchange` waited for.
fn posted<'j>(joined: &'j Joined<'_>, rank: usize) -> &'j Post {
    match &joined.got[rank] {
        Got::Shared(post) => post,
        Got::Copied => &joined.copies[rank],
        Got::No => unreachable!("exchange returns once every needed post is read"),
    }
}

/// A mutex's contents: no code path panics while holding the transport's locks, and a
/// poisoned one still holds a consistent value.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every operation, in the order of [`Op`]'s variants: `OPS[op_code(op)] == op`.
const OPS: [Op; 12] = [
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
fn op_code(op: Op) -> u64 {
    op as u64
}

/// `root` plus one, 0 for none: the lower half of [`Slot::root`] (a group's size fits in 32
/// bits).
fn root_code(root: Option<usize>) -> u64 {
    root.map_or(0, |r| r as u64 + 1)
}

/// The bits of [`Slot::root`] that carry the poster's history.
const HISTORY_BITS: u64 = 0xffff_ffff_0000_0000;

/// A rank's history after a call of `op` with `root`, from its history before it (0 before
/// its first call): a digest of every call's operation and root, in order, whose upper half
/// travels with each post. A rank that reads a post checks its operation and root, and that
/// the poster's calls before it were the same as the reader's: ranks that disagreed in a
/// call where neither read the other (two ranks that each took itself for a broadcast's
/// root, gather senders naming different roots) are caught at the next call that reads
/// across them. A digest can collide: such a disagreement goes unseen with a chance of
/// 2^-32 per later call that reads it.
fn history(before: u64, op: Op, root: Option<usize>) -> u64 {
    let call = op_code(op) | root_code(root) << 8;
    (before.rotate_left(23) ^ call).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The operation whose [`op_code`] is `code`, if any.
fn op_of(code: u64) -> Option<Op> {
    OPS.get(usize::try_from(code).ok()?).copied()
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.left[self.rank] = true;
        self.shared.publish(&state);
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn max_count(&self) -> usize {
        self.shared.config.max_count
    }

    fn backend_name(&self) -> &'static str {
        "local"
    }

    fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Self>> {
        const NO_COLOR: usize = usize::MAX;
        let op = Op::Split;
        let meta = vec![color.map_or(NO_COLOR, |c| c as usize), key as i64 as usize];
        let seq = self.seq.load(Ordering::Relaxed);
        let posts = self.exchange(op, None, self.post(&[], &meta), Needs::Everybody)?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..self.size())
            .filter(|&r| posted(&posts, r).meta[0] == color as usize)
            .map(|r| (posted(&posts, r).meta[1] as i64, r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank posted its own color");
        let mut state = self.shared.lock();
        let entry = match state.children.entry((seq, color)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert((
                Shared::new(members.len(), self.shared.config.clone())?,
                members.len(),
            )),
        };
        let child = entry.0.clone();
        entry.1 -= 1;
        if entry.1 == 0 {
            state.children.remove(&(seq, color));
        }
        tracing::debug!(
            rank = self.rank,
            color,
            key,
            new_rank,
            new_size = members.len(),
            "split"
        );
        Ok(Some(LocalCommunicator::new(child, new_rank)))
    }

    fn raw_barrier(&self) -> Result<()> {
        self.exchange(Op::Barrier, None, self.post(&[], &[]), Needs::Everybody)
            .map(drop)
    }

    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGather, self.rank(), self.size())?;
        let op = Op::AllGather;
        let block = args.block_len();
        let post = self.post(args.send(), &[block]);
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        for r in 0..self.size() {
            let len = posted(&posts, r).bytes.len();
            if len != block {
                return Err(self.mismatch(
                    op,
                    format!("rank {r} contributed {len} bytes, this rank {block}"),
                ));
            }
        }
        for (r, chunk) in args
            .recv()
            .chunks_exact_mut(block.max(1))
            .enumerate()
            .take(self.size())
        {
            copy_slice(chunk, &posted(&posts, r).bytes);
        }
        Ok(())
    }

    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGatherVarcount, self.rank(), self.size())?;
        let op = Op::AllGatherVarcount;
        let post = self.post(args.send(), args.counts());
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        let (_, recv, counts, displs) = args.parts();
        for r in 0..self.size() {
            if posted(&posts, r).meta != counts {
                return Err(self.mismatch(
                    op,
                    format!(
                        "rank {r} called with counts {:?}, this rank {counts:?}",
                        posted(&posts, r).meta
                    ),
                ));
            }
        }
        for r in 0..self.size() {
            copy_slice(
                &mut recv[displs[r]..displs[r] + counts[r]],
                &posted(&posts, r).bytes,
            );
        }
        Ok(())
    }

    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::GatherVarcount, self.rank(), self.size())?;
        let op = Op::GatherVarcount;
        let root = args.root();
        let is_root = self.rank == root;
        let post = self.post(args.send(), &[]);
        let needs = if is_root {
            Needs::Everybody
        } else {
            Needs::Nobody
        };
        let posts = self.exchange(op, Some(root), post, needs)?;
        if let (_, Some(layout)) = args.parts() {
            for r in 0..self.size() {
                let got = posted(&posts, r).bytes.len();
                if got != layout.counts[r] {
                    return Err(self.mismatch(
                        op,
                        format!(
                            "rank {r} sent {got} bytes, the root expected {}",
                            layout.counts[r]
                        ),
                    ));
                }
            }
            for r in 0..self.size() {
                let d = layout.displs[r];
                copy_slice(
                    &mut layout.recv[d..d + layout.counts[r]],
                    &posted(&posts, r).bytes,
                );
            }
        }
        Ok(())
    }

    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::Broadcast, self.rank(), self.size())?;
        let op = Op::Broadcast;
        let root = args.root();
        if self.rank == root {
            let post = self.post(args.buf(), &[]);
            self.exchange(op, Some(root), post, Needs::Nobody)?;
            return Ok(());
        }
        let post = self.post(&[], &[args.buf().len()]);
        let posts = self.exchange(op, Some(root), post, Needs::Rank(root))?;
        let data = &posted(&posts, root).bytes;
        let buf = args.buf();
        if data.len() != buf.len() {
            return Err(self.mismatch(
                op,
                format!(
                    "root {root} broadcast {} bytes into a {}-byte buffer",
                    data.len(),
                    buf.len()
                ),
            ));
        }
        copy_slice(buf, data);
        Ok(())
    }

    /// Two rounds, reduce-scatter then all-gather. Round one: every rank posts its input
    /// and its (count, type, op); every rank checks them against its own (a difference is
    /// a `Mismatch` on every rank, since every rank differs from some peer), then reduces
    /// its own slice of the elements (`reduce::slice_of`) over every post in rank order. Round
    /// two: every rank posts its reduced slice and copies every slice into its output.
    /// Each element is reduced once, by one rank, in rank order: bitwise the same result
    /// everywhere.
    fn raw_all_reduce(&self, mut args: AllReduceArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllReduce, self.rank(), self.size())?;
        let op = Op::AllReduce;
        let (dtype, reduce, count) = (args.dtype(), args.op(), args.count());
        let describe = |meta: &[usize]| match meta {
            [count, dtype, reduce] => describe_reduction(*count as u64, *dtype, *reduce),
            _ => format!("{meta:?}"),
        };
        let meta = [count, dtype.index(), reduce.index()];
        let post = self.post(args.input(), &meta);
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        for r in 0..self.size() {
            let theirs = &posted(&posts, r).meta;
            if theirs[..] != meta[..] {
                return Err(self.mismatch(
                    op,
                    format!(
                        "rank {r} called all_reduce with {}, this rank with {}",
                        describe(theirs),
                        describe(&meta)
                    ),
                ));
            }
        }
        if count == 0 {
            return Ok(());
        }
        let elem = dtype.size();
        let (lo, hi) = slice_of(count, self.size(), self.rank);
        let inputs: Vec<&[u8]> = (0..self.size())
            .map(|r| &posted(&posts, r).bytes[lo * elem..hi * elem])
            .collect();
        let mut mine = vec![0u8; (hi - lo) * elem];
        reduce_into(dtype, reduce, &inputs, &mut mine);
        drop(inputs);
        drop(posts);
        let slices = self.exchange(op, None, self.post_owned(mine), Needs::Everybody)?;
        let (_, recv) = args.parts();
        for r in 0..self.size() {
            let (lo, hi) = slice_of(count, self.size(), r);
            copy_slice(&mut recv[lo * elem..hi * elem], &posted(&slices, r).bytes);
        }
        Ok(())
    }

    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllToAllVarcount, self.rank(), self.size())?;
        let op = Op::AllToAllVarcount;
        let send = args.send();
        let post = self.post_with(|p| {
            extend_from_slice(&mut p.bytes, send.buf);
            p.meta.extend_from_slice(send.counts);
            p.meta.extend_from_slice(send.displs);
        });
        let posts = self.exchange(op, None, Outgoing::Shared(post), Needs::Everybody)?;
        let size = self.size();
        let me = self.rank;
        let (_, recv) = args.parts();
        for r in 0..size {
            let p = posted(&posts, r);
            if p.meta[me] != recv.counts[r] {
                return Err(self.mismatch(
                    op,
                    format!(
                        "rank {r} sends {} bytes to rank {me}, which expects {}",
                        p.meta[me], recv.counts[r]
                    ),
                ));
            }
        }
        for r in 0..size {
            let p = posted(&posts, r);
            let (count, displ) = (p.meta[me], p.meta[size + me]);
            let d = recv.displs[r];
            copy_slice(&mut recv.buf[d..d + count], &p.bytes[displ..displ + count]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared posts of rounds every rank is done with leave the ring at their rank's
    /// next call: what the group holds stays bounded by the group, not by the number of
    /// calls (a root running ahead included). Small posts, inline in the slots, take turns
    /// with large ones in the same slots.
    #[test]
    fn posts_of_finished_rounds_are_given_back() {
        let comms = LocalGroup::new(3).communicators().unwrap();
        let shared = comms[0].shared.clone();
        std::thread::scope(|s| {
            for comm in comms {
                s.spawn(move || {
                    for i in 0..500u32 {
                        // Past the inline size every other call.
                        let len = if i % 2 == 0 { 4 } else { 1000 };
                        let mut buf = vec![0u8; len];
                        if comm.rank() == 0 {
                            buf.fill(i as u8);
                        }
                        comm.broadcast(0, &mut buf).unwrap();
                        assert!(buf.iter().all(|&b| b == i as u8));
                        let mut all = [0u8; 3];
                        comm.all_gather(&[comm.rank() as u8], &mut all).unwrap();
                        assert_eq!(all, [0, 1, 2]);
                    }
                });
            }
        });
        assert_eq!(shared.slots.len(), 3 * RING as usize);
        for rank in 0..3 {
            let held = (0..RING)
                .filter(|&seq| lock(&shared.slot(rank, seq).post).is_some())
                .count();
            // The last calls' posts, not yet seen done at a later call of their rank.
            assert!(held <= 3, "rank {rank} holds {held} posts after 1000 calls");
        }
    }

    /// The largest inline post (every inline byte and count in use) reads back whole, with
    /// its operation and root; one byte more goes shared, and reads back whole too.
    #[test]
    fn a_post_at_the_inline_limit_reads_back_whole() {
        let comms = LocalGroup::new(2).communicators().unwrap();
        let (reader, writer) = (&comms[0], &comms[1]);
        let bytes: Vec<u8> = (0..INLINE_BYTES).map(|i| i as u8 ^ 0x5a).collect();
        let meta: Vec<usize> = (0..INLINE_META).map(|i| usize::MAX - i).collect();
        let mut copy = Post::default();
        writer.publish_post(0, Op::GatherVarcount, Some(1), writer.post(&bytes, &meta));
        let got = reader
            .read_post(1, 0, (Op::GatherVarcount, Some(1), 0), &mut copy)
            .unwrap();
        assert!(matches!(got, Got::Copied));
        assert_eq!(
            (copy.bytes.as_slice(), copy.meta.as_slice()),
            (&bytes[..], &meta[..])
        );
        let mut longer = bytes;
        longer.push(1);
        assert!(matches!(
            writer.post_owned(longer.clone()),
            Outgoing::Shared(_)
        ));
        let before = writer.publish_post(1, Op::Broadcast, Some(1), writer.post(&longer, &[]));
        let Got::Shared(post) = reader
            .read_post(1, 1, (Op::Broadcast, Some(1), before), &mut copy)
            .unwrap()
        else {
            panic!("a post past the inline size is shared");
        };
        assert_eq!(post.bytes, longer);
    }

    /// A reader that finds the slot's round changed across its read (what a peer's reuse of
    /// the slot under an overlapping call looks like) aborts the group instead of returning
    /// the words it read.
    #[test]
    fn a_slot_rewritten_under_a_reader_aborts_the_group() {
        let comms = LocalGroup::new(2).communicators().unwrap();
        let (reader, writer) = (&comms[0], &comms[1]);
        let mut copy = Post::default();
        writer.publish_post(0, Op::AllGather, None, writer.post(&[7; 9], &[9]));
        let got = reader
            .read_post(1, 0, (Op::AllGather, None, 0), &mut copy)
            .unwrap();
        assert!(matches!(got, Got::Copied));
        assert_eq!(
            (copy.bytes.as_slice(), copy.meta.as_slice()),
            (&[7u8; 9][..], &[9][..])
        );
        // The round this slot would carry 64 calls later, or the mark of a write under way.
        for round in [RING + 1, 0] {
            writer
                .shared
                .slot(1, 0)
                .round
                .store(round, Ordering::Relaxed);
            let e = reader
                .read_post(1, 0, (Op::AllGather, None, 0), &mut copy)
                .unwrap_err();
            assert!(
                matches!(&e, TransportError::Aborted { reason, .. } if reason.contains("overlapped")),
                "{e:?}"
            );
        }
        // The group stays aborted.
        assert!(matches!(
            reader.barrier(),
            Err(TransportError::Aborted { .. })
        ));
    }

    /// A peer that called another operation or root is named, with what it called.
    #[test]
    fn a_post_of_another_operation_or_root_aborts_naming_it() {
        let comms = LocalGroup::new(2).communicators().unwrap();
        let mut copy = Post::default();
        comms[1].publish_post(0, Op::Broadcast, Some(1), comms[1].post(&[], &[]));
        let e = comms[0]
            .read_post(1, 0, (Op::Broadcast, Some(0), 0), &mut copy)
            .unwrap_err();
        let TransportError::Aborted { reason, .. } = e else {
            panic!("{e:?}");
        };
        assert!(
            reason.contains("rank 1 called broadcast (root Some(1))"),
            "{reason}"
        );
    }

    /// The round, head, root, counts and first two words of inline bytes on the slot's
    /// first 64-byte line, the shared post on the second, and nothing past the pair.
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    #[test]
    fn a_slot_is_two_cache_lines_with_small_posts_on_the_first() {
        assert_eq!(std::mem::offset_of!(Slot, bytes), 48);
        assert!(std::mem::offset_of!(Slot, post) >= 64);
        assert_eq!(std::mem::size_of::<Slot>(), 128);
    }

    #[test]
    fn op_codes_go_both_ways() {
        for (i, &op) in OPS.iter().enumerate() {
            assert_eq!(op_code(op), i as u64);
            assert_eq!(op_of(i as u64), Some(op));
        }
        assert_eq!(op_of(OPS.len() as u64), None);
        assert_eq!(op_of(u64::MAX), None);
    }

    /// The communicators of a group of `size` whose waits park at once (no spin), so that a
    /// test can act while a rank is parked; bounded by a 5 s timeout.
    fn parking_group(size: usize) -> Vec<LocalCommunicator> {
        LocalGroup::new(size)
            .timeout(Duration::from_secs(5))
            .spin(Duration::ZERO)
            .communicators()
            .unwrap()
    }

    /// A root parked at the ring, waiting for its reader to be done with the oldest round,
    /// wakes when the reader finishes that round (what the end of `exchange` does), not
    /// only at the reader's next post or its own timeout.
    #[test]
    fn a_reader_finishing_a_round_wakes_a_root_parked_at_the_ring() {
        let comms = parking_group(2);
        let (root, reader) = (&comms[0], &comms[1]);
        for _ in 0..RING {
            root.broadcast(0, &mut [0u8; 8]).unwrap();
        }
        std::thread::scope(|s| {
            let parked = s.spawn(|| {
                let begun = Instant::now();
                root.broadcast(0, &mut [0u8; 8]).map(|()| begun.elapsed())
            });
            // The reader's first round, done by hand: its post, then (the root parked by
            // then) its done count.
            std::thread::sleep(Duration::from_millis(100));
            reader.seq.store(1, Ordering::Relaxed);
            reader.publish_post(0, Op::Broadcast, Some(0), reader.post(&[], &[8]));
            std::thread::sleep(Duration::from_millis(100));
            reader.finish_round(0);
            let waited = parked.join().unwrap().unwrap();
            assert!(
                waited < Duration::from_secs(2),
                "the root waited {waited:?}, past the reader's done count"
            );
        });
    }

    /// A rank parked in a call whose posts all arrived returns their data when it wakes to
    /// an abort raised since (a peer that completed the call and left, seen by a rank a
    /// call ahead): the call completed on the other ranks too. Its next call fails.
    #[test]
    fn a_call_whose_posts_all_arrived_completes_despite_a_later_abort() {
        let comms = parking_group(3);
        let (root, reader) = (&comms[0], &comms[1]);
        std::thread::scope(|s| {
            let parked = s.spawn(|| {
                let mut buf = [0u8; 8];
                reader.broadcast(0, &mut buf).map(|()| buf)
            });
            std::thread::sleep(Duration::from_millis(100));
            // Under the lock the parked reader needs to look: it sees the root's post and
            // the abort together.
            let shared = &*root.shared;
            let mut state = shared.lock();
            root.seq.store(1, Ordering::Relaxed);
            root.publish_post(0, Op::Broadcast, Some(0), root.post(&[7; 8], &[]));
            state.abort = Some(Abort {
                by: 0,
                reason: "rank 0 dropped its communicator before joining broadcast".into(),
                timed_out: false,
            });
            shared.publish(&state);
            drop(state);
            assert_eq!(parked.join().unwrap().unwrap(), [7; 8]);
        });
        assert!(matches!(
            reader.broadcast(0, &mut [0u8; 8]),
            Err(TransportError::Aborted { by: 0, .. })
        ));
    }

    /// A rank that needs nobody's post runs at most `RING` rounds ahead of a rank that has
    /// not read its posts, then waits for it; nothing is lost.
    #[test]
    fn a_root_runs_at_most_the_ring_ahead_of_its_readers() {
        let ahead = AtomicUsize::new(0);
        let calls = 2 * RING as usize;
        let results = LocalGroup::new(2).run(|comm| {
            let mut got = Vec::new();
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(300));
                let seen = ahead.load(Ordering::SeqCst);
                for _ in 0..calls {
                    let mut buf = [0u8; 8];
                    comm.broadcast(0, &mut buf)?;
                    got.push(u64::from_le_bytes(buf));
                }
                return Ok((seen, got));
            }
            for i in 0..calls as u64 {
                comm.broadcast(0, &mut i.to_le_bytes())?;
                ahead.fetch_add(1, Ordering::SeqCst);
            }
            Ok::<_, TransportError>((0, got))
        });
        let (seen, got) = results[1].as_ref().unwrap().as_ref().unwrap().clone();
        assert_eq!(
            seen, RING as usize,
            "rounds the root ran ahead of a sleeping reader"
        );
        assert_eq!(got, (0..calls as u64).collect::<Vec<_>>());
        assert!(results[0].as_ref().unwrap().is_ok());
    }
}
