//! [`LocalGroup`], the builder of a group, with its settings ([`LocalGroupConfig`]) and
//! [`LocalGroup::run`], which plays each rank on a thread of its own.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use super::shared::Shared;
use super::LocalCommunicator;
use crate::communicator::Communicator;
use crate::error::{Result, TransportError};

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
