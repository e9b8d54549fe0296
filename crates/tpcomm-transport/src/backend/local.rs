//! The local backend: N communicators for N threads of one process.
//!
//! Every collective is a *round* identified by a per-communicator sequence number (all ranks
//! call collectives in the same order, so the n-th call of every rank meets in round n).
//! A rank joins a round by posting its contribution (a copy of its send bytes plus the
//! counts it was called with), waits on a condition variable until the ranks it depends on
//! have posted, takes shared references to their posts and leaves; the last rank to leave
//! removes the round. Copies out of the posts happen outside the lock.
//!
//! Every wait is bounded by [`LocalGroupConfig::timeout`]. A timeout, a rank that dropped
//! its communicator while others wait for it (a panicking rank does so while unwinding), or
//! two ranks calling different operations at the same point *abort* the group: every rank
//! blocked in it wakes up at once with an error naming the culprit, and every later call
//! fails the same way. No rank is left blocked.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use crate::communicator::Communicator;
use crate::error::{Op, Result, TransportError};
use crate::reduce::{reduce_into, slice_of, DataType, ReduceOp};

/// Settings of a local group.
#[derive(Debug, Clone)]
pub struct LocalGroupConfig {
    /// Longest time a rank waits for its peers in one collective (default 60 s).
    pub timeout: Duration,
    /// Largest count one call accepts (default `i32::MAX`, as MPI-3). Lower it to force the
    /// multi-round paths of upper layers in tests.
    pub max_count: usize,
    /// Stack size of each rank's thread in [`LocalGroup::run`], in bytes (default
    /// [`LocalGroupConfig::DEFAULT_STACK_SIZE`], 2 MiB: Rust's default for spawned threads,
    /// smaller than a main thread's usual 8 MiB). Raise it for ranks that recurse deeply,
    /// for example over recursive values.
    pub stack_size: usize,
}

impl LocalGroupConfig {
    /// The default stack size of a rank's thread: 2 MiB, as `std::thread::spawn` gives.
    pub const DEFAULT_STACK_SIZE: usize = 2 << 20;
}

impl Default for LocalGroupConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            max_count: i32::MAX as usize,
            stack_size: Self::DEFAULT_STACK_SIZE,
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
        let shared = Shared::new(self.size, self.config.clone());
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
                return (0..self.size.max(1))
                    .map(|_| Err(TransportError::Setup(msg.clone())))
                    .collect();
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
#[derive(Debug)]
pub struct LocalCommunicator {
    shared: Arc<Shared>,
    rank: usize,
    seq: AtomicU64,
}

/// What a rank contributes to a round.
#[derive(Debug, Default)]
struct Post {
    bytes: Vec<u8>,
    /// Op-specific integers (counts, lengths, colors) the peers check against their own.
    meta: Vec<usize>,
}

#[derive(Debug)]
struct Round {
    op: Op,
    root: Option<usize>,
    posts: Vec<Option<Arc<Post>>>,
    finished: usize,
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
    rounds: HashMap<u64, Round>,
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
}

/// Which posts a rank needs before it can leave a round.
#[derive(Debug, Clone, Copy)]
enum Needs {
    Nobody,
    Rank(usize),
    Everybody,
}

impl Shared {
    fn new(size: usize, config: LocalGroupConfig) -> Arc<Self> {
        Arc::new(Self {
            size,
            config,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                abort: None,
                left: vec![false; size],
                children: HashMap::new(),
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock; a poisoned lock still holds
        // consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl LocalCommunicator {
    fn new(shared: Arc<Shared>, rank: usize) -> Self {
        Self {
            shared,
            rank,
            seq: AtomicU64::new(0),
        }
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
    /// posts (indexed by rank; `None` for ranks not needed).
    fn exchange(
        &self,
        op: Op,
        root: Option<usize>,
        post: Post,
        needs: Needs,
    ) -> Result<Vec<Option<Arc<Post>>>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let shared = &*self.shared;
        let mut state = shared.lock();
        if let Some(abort) = &state.abort {
            return Err(self.aborted(op, abort));
        }
        let size = shared.size;
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            op,
            root,
            posts: vec![None; size],
            finished: 0,
        });
        if round.op != op || round.root != root {
            let reason = format!(
                "call #{seq}: rank {} called {op} (root {root:?}) while a peer called {} (root {:?})",
                self.rank, round.op, round.root
            );
            return Err(self.abort_group(&mut state, op, reason));
        }
        round.posts[self.rank] = Some(Arc::new(post));
        shared.changed.notify_all();

        let deadline = Instant::now() + shared.config.timeout;
        let started = Instant::now();
        loop {
            let round = state
                .rounds
                .get(&seq)
                .expect("a round stays until every rank finished it");
            let missing: Vec<usize> = match needs {
                Needs::Nobody => Vec::new(),
                Needs::Rank(r) => round.posts[r].is_none().then_some(r).into_iter().collect(),
                Needs::Everybody => (0..size).filter(|&r| round.posts[r].is_none()).collect(),
            };
            if missing.is_empty() {
                break;
            }
            let timeout = TransportError::Timeout {
                op,
                rank: self.rank,
                waited: started.elapsed(),
                missing: missing.clone(),
            };
            if let Some(abort) = &state.abort {
                return Err(if abort.timed_out {
                    timeout
                } else {
                    self.aborted(op, abort)
                });
            }
            if let Some(&gone) = missing.iter().find(|&&r| state.left[r]) {
                let reason = format!("rank {gone} dropped its communicator before joining {op}");
                let abort = Abort {
                    by: gone,
                    reason,
                    timed_out: false,
                };
                state.abort = Some(abort.clone());
                shared.changed.notify_all();
                return Err(self.aborted(op, &abort));
            }
            let now = Instant::now();
            if now >= deadline {
                let reason = format!(
                    "rank {} timed out in {op} after {:?} waiting for ranks {missing:?}",
                    self.rank, shared.config.timeout
                );
                state.abort.get_or_insert(Abort {
                    by: self.rank,
                    reason,
                    timed_out: true,
                });
                shared.changed.notify_all();
                return Err(timeout);
            }
            state = shared
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let round = state.rounds.get_mut(&seq).expect("checked above");
        let posts = match needs {
            Needs::Nobody => Vec::new(),
            Needs::Rank(r) => {
                let mut v = vec![None; size];
                v[r] = round.posts[r].clone();
                v
            }
            Needs::Everybody => round.posts.clone(),
        };
        round.finished += 1;
        if round.finished == size {
            state.rounds.remove(&seq);
        }
        Ok(posts)
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
        self.shared.changed.notify_all();
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

/// Unwraps a post that `exchange` guarantees to be present.
fn posted(posts: &[Option<Arc<Post>>], rank: usize) -> &Post {
    posts[rank]
        .as_deref()
        .expect("exchange returns every needed post")
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.left[self.rank] = true;
        self.shared.changed.notify_all();
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
        let posts = self.exchange(
            op,
            None,
            Post {
                bytes: Vec::new(),
                meta,
            },
            Needs::Everybody,
        )?;
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
        let entry = state.children.entry((seq, color)).or_insert_with(|| {
            (
                Shared::new(members.len(), self.shared.config.clone()),
                members.len(),
            )
        });
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
        self.exchange(Op::Barrier, None, Post::default(), Needs::Everybody)
            .map(drop)
    }

    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> Result<()> {
        let op = Op::AllGather;
        let block = args.block_len();
        let post = Post {
            bytes: args.send().to_vec(),
            meta: vec![block],
        };
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
            chunk.copy_from_slice(&posted(&posts, r).bytes);
        }
        Ok(())
    }

    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        let op = Op::AllGatherVarcount;
        let post = Post {
            bytes: args.send().to_vec(),
            meta: args.counts().to_vec(),
        };
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
            recv[displs[r]..displs[r] + counts[r]].copy_from_slice(&posted(&posts, r).bytes);
        }
        Ok(())
    }

    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> Result<()> {
        let op = Op::GatherVarcount;
        let root = args.root();
        let is_root = self.rank == root;
        let post = Post {
            bytes: args.send().to_vec(),
            meta: Vec::new(),
        };
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
                layout.recv[d..d + layout.counts[r]].copy_from_slice(&posted(&posts, r).bytes);
            }
        }
        Ok(())
    }

    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        let op = Op::Broadcast;
        let root = args.root();
        if self.rank == root {
            let post = Post {
                bytes: args.buf().to_vec(),
                meta: Vec::new(),
            };
            self.exchange(op, Some(root), post, Needs::Nobody)?;
            return Ok(());
        }
        let post = Post {
            bytes: Vec::new(),
            meta: vec![args.buf().len()],
        };
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
        buf.copy_from_slice(data);
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
        let op = Op::AllReduce;
        let (dtype, reduce, count) = (args.dtype(), args.op(), args.count());
        let describe = |meta: &[usize]| match meta {
            [count, dtype, reduce] => format!(
                "{count} {} elements ({})",
                DataType::ALL[*dtype].name(),
                ReduceOp::ALL[*reduce].name()
            ),
            _ => format!("{meta:?}"),
        };
        let meta = vec![count, dtype_index(dtype), op_index(reduce)];
        let post = Post {
            bytes: args.input().to_vec(),
            meta: meta.clone(),
        };
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        for r in 0..self.size() {
            let theirs = &posted(&posts, r).meta;
            if *theirs != meta {
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
        let post = Post {
            bytes: mine,
            meta: Vec::new(),
        };
        let slices = self.exchange(op, None, post, Needs::Everybody)?;
        let (_, recv) = args.parts();
        for r in 0..self.size() {
            let (lo, hi) = slice_of(count, self.size(), r);
            recv[lo * elem..hi * elem].copy_from_slice(&posted(&slices, r).bytes);
        }
        Ok(())
    }

    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> Result<()> {
        let op = Op::AllToAllVarcount;
        let send = args.send();
        let mut meta = send.counts.to_vec();
        meta.extend_from_slice(send.displs);
        let post = Post {
            bytes: send.buf.to_vec(),
            meta,
        };
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
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
            recv.buf[d..d + count].copy_from_slice(&p.bytes[displ..displ + count]);
        }
        Ok(())
    }
}

/// The position of `dtype` in [`DataType::ALL`] (how it travels in a post's `meta`).
fn dtype_index(dtype: DataType) -> usize {
    DataType::ALL
        .iter()
        .position(|&d| d == dtype)
        .expect("ALL lists every data type")
}

/// The position of `op` in [`ReduceOp::ALL`].
fn op_index(op: ReduceOp) -> usize {
    ReduceOp::ALL
        .iter()
        .position(|&o| o == op)
        .expect("ALL lists every reduction")
}
