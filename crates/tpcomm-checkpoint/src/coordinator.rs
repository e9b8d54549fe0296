//! Runs a [`Sequence`] over a [`Communicator`]: each step's local action on this rank, one
//! all-gather of every rank's [`StepReport`], then the next step. This process's driver
//! state and its undoing live in `process_hold.rs`.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tpcomm_transport::Communicator;

use crate::driver::{CheckpointDriver, DriverInfo, ProcessState, CUDA_ERROR_ILLEGAL_STATE};
use crate::error::{CheckpointError, ExchangeError, Reason};
use crate::process_hold::ProcessHold;
use crate::sequence::{Sequence, Step, StepReport};
use crate::suspend::{BoxError, Suspendable};

/// Settings of [`checkpoint_group`]. `lock_timeout` may differ between ranks.
#[derive(Debug, Clone)]
pub struct CheckpointOptions {
    /// How long `cuCheckpointProcessLock` waits for the process's running CUDA calls before
    /// it fails (1 ms to `u32::MAX` ms; the driver's 0, "wait for ever", is refused).
    /// Default 10 s.
    pub lock_timeout: Duration,
    /// The process this rank runs in, as the driver knows it. Default (`None`): this
    /// process. Tests that model ranks of separate processes with threads (a fake driver)
    /// set it.
    pub pid: Option<u32>,
    /// An identity of the process this rank runs in, the same for every rank in it and
    /// different for every other process, even one with the same pid (pids repeat across
    /// PID namespaces: two containers each run their engine as pid 1; and across hosts).
    /// Default (`None`): a random value drawn once per process. Ranks share a process,
    /// and one driver rank (the lowest), when both this and the pid are equal. Tests that
    /// model separate processes with equal pids set it.
    pub process: Option<u64>,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        Self {
            lock_timeout: Duration::from_secs(10),
            pid: None,
            process: None,
        }
    }
}

impl CheckpointOptions {
    fn check(&self) -> Result<(), String> {
        let ms = self.lock_timeout.as_millis();
        if ms == 0 || ms > u128::from(u32::MAX) {
            return Err(format!(
                "lock_timeout must be 1 ms to {} ms, not {:?}",
                u32::MAX,
                self.lock_timeout
            ));
        }
        Ok(())
    }
}

/// What the pause callback is told: every process of the group is checkpointed.
#[derive(Debug, Clone)]
pub struct Paused {
    /// This rank.
    pub rank: usize,
    /// Its process.
    pub pid: u32,
    /// Whether this rank is its process's driver rank (the one that should dump the
    /// process, when the pause is a CRIU dump: ranks that are threads of one process all
    /// get the callback).
    pub driver_rank: bool,
}

/// How long one step took on this rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTiming {
    /// The step.
    pub step: Step,
    /// This rank's own part (its driver call, its objects, its pause).
    pub local: Duration,
    /// The exchange of every rank's outcome after it (waiting for the slowest rank).
    pub agree: Duration,
}

/// What a successful group checkpoint reports on each rank.
#[derive(Debug, Clone)]
pub struct CheckpointReport {
    /// The pid of every rank.
    pub pids: Vec<u32>,
    /// Whether this rank made its process's driver calls.
    pub driver_rank: bool,
    /// The driver, as this rank's check saw it.
    pub driver: DriverInfo,
    /// Every step this rank ran, in order.
    pub timings: Vec<StepTiming>,
}

impl CheckpointReport {
    /// The timing of `step`, if it ran.
    pub fn timing(&self, step: Step) -> Option<StepTiming> {
        self.timings.iter().find(|t| t.step == step).copied()
    }
}

/// This process's identity for [`CheckpointOptions::process`]: 64 random bits (the
/// standard library's per-process random hash keys, over the pid and the time), drawn once.
fn process_identity() -> u64 {
    static IDENTITY: OnceLock<u64> = OnceLock::new();
    *IDENTITY.get_or_init(|| {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        if let Ok(now) = SystemTime::now().duration_since(UNIX_EPOCH) {
            hasher.write_u128(now.as_nanos());
        }
        hasher.finish()
    })
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Checkpoints the process of every rank of `comm` through the CUDA driver, with every
/// registered object suspended around it:
///
/// 1. **check** (every rank): the driver supports it, the options are valid, every object
///    can suspend, every rank registered the same objects (by name, in order); pids and
///    process identities are gathered, and the lowest rank of each process is its *driver
///    rank* (a pid alone does not name a process: two containers may both run theirs as
///    pid 1);
/// 2. **prepare**: `prepare_for_suspend` of every object (collective, in order);
/// 3. **lock** (driver ranks): refused if the process still imports CUDA IPC memory,
///    otherwise `cuCheckpointProcessLock(pid, lock_timeout)`;
/// 4. **checkpoint** (driver ranks): `cuCheckpointProcessCheckpoint`;
/// 5. **pause** (every rank): `pause`, while every process is checkpointed; it must not call
///    into the GPU driver, CUDA or NVML (this process's calls block until the unlock: an
///    NVML read here never returned on driver 580); read GPU figures from another process
///    (`GpuMemory::probe`, feature `cuda`, does);
/// 6. **restore** (driver ranks): `cuCheckpointProcessRestore` of a checkpointed process;
/// 7. **unlock** (driver ranks): `cuCheckpointProcessUnlock` of a locked process;
/// 8. **reinit**: `reinit_after_resume` of every object, once every process runs.
///
/// After every step each rank all-gathers its outcome over `comm` (which must not call
/// CUDA itself: a host transport), so nobody checkpoints before every process is locked and
/// nobody unlocks before every process is restored. A failure at any step on any rank ends
/// the front half and runs the back half (restore what is checkpointed, unlock what is
/// locked, resume what every rank suspended) on every rank; every rank then returns the same
/// [`CheckpointError::Failed`] naming the step and rank, with what was left behind. Every
/// wait is bounded: the lock by `lock_timeout`, the exchanges by `comm`'s own timeout; a
/// failed exchange rolls this rank's process back alone ([`CheckpointError::Exchange`]).
///
/// Self-checkpoint: each process checkpoints itself from one of its own threads (measured
/// on driver 580: lock, checkpoint, restore and unlock of the caller's own pid all succeed),
/// so no controller process or helper binary is needed.
pub fn checkpoint_group<C, D, P>(
    comm: &C,
    driver: &D,
    objects: &mut [&mut dyn Suspendable<C>],
    options: &CheckpointOptions,
    pause: P,
) -> Result<CheckpointReport, CheckpointError>
where
    C: Communicator + ?Sized,
    D: CheckpointDriver + ?Sized,
    P: FnOnce(&Paused) -> Result<(), BoxError>,
{
    let rank = comm.rank();
    let pid = options.pid.unwrap_or_else(std::process::id);
    let process = options.process.unwrap_or_else(process_identity);
    let count = u32::try_from(objects.len()).unwrap_or(u32::MAX);
    let _span = tracing::debug_span!("checkpoint_group", rank, pid).entered();
    let mut seq = Sequence::new(comm.size());
    let mut hold = ProcessHold {
        driver,
        pid,
        state: ProcessState::Running,
        held: false,
        armed: false,
        seen: true,
    };
    let mut pause = Some(pause);
    let mut info = None;
    let mut timings = Vec::new();
    while let Some(step) = seq.step() {
        let started = Instant::now();
        let mut report = StepReport::new(step, pid, count);
        report.process = process;
        let driver_rank = seq.is_driver_rank(rank);
        match step {
            Step::Check => {
                let support = driver.support();
                report.failure = match (&support, options.check()) {
                    (Err(e), _) => Some(Reason::Unsupported(e.clone())),
                    (_, Err(why)) => Some(Reason::InvalidOptions(why)),
                    _ => objects.iter().enumerate().find_map(|(object, o)| {
                        o.suspend_support().err().map(|why| Reason::CannotSuspend {
                            object,
                            name: o.name(),
                            why,
                        })
                    }),
                };
                info = support.ok();
                report.names = objects.iter().map(|o| o.name()).collect();
            }
            Step::Prepare => {
                // Every object's transition is collective: a rank whose earlier object
                // failed still joins the later ones.
                for (object, o) in objects.iter_mut().enumerate() {
                    let outcome = o.prepare_for_suspend(comm);
                    report.suspended.push(outcome.is_ok());
                    if let (Err(e), None) = (outcome, &report.failure) {
                        report.failure = Some(Reason::Object {
                            object,
                            name: o.name(),
                            message: chain(e.as_ref()),
                        });
                    }
                }
            }
            Step::Lock if driver_rank => {
                let imported = driver.imported_ipc_mappings(pid);
                if imported != Some(0) {
                    report.failure = Some(match imported {
                        Some(count) => Reason::ImportedMappings { pid, count },
                        None => Reason::ImportsUnknown { pid },
                    });
                    report.state = Some(hold.state);
                } else {
                    match driver.lock(pid, options.lock_timeout) {
                        Ok(()) => {
                            hold.state = ProcessState::Locked;
                            hold.held = true;
                            hold.armed = true;
                            report.state = Some(hold.state);
                        }
                        Err(e) => {
                            // ILLEGAL_STATE: the process was already locked by someone else
                            // (another tool); that lock is not this sequence's to undo, so
                            // it stays locked and no object is resumed.
                            let ours = e.code != CUDA_ERROR_ILLEGAL_STATE;
                            let seen = match driver.state(pid) {
                                Ok(state) => state,
                                // Unknown: a lock that failed late may hold the process. The
                                // back half unlocks it (an unlock of a running process fails
                                // harmlessly and leaves it reported locked, so no object is
                                // resumed into a process that may be locked).
                                Err(_) if ours => ProcessState::Locked,
                                Err(_) => ProcessState::UNREADABLE,
                            };
                            if ours && seen != ProcessState::Running {
                                // A lock that failed late (a timeout) may still hold the
                                // process: it is this sequence's, undone in the back half.
                                hold.state = seen;
                                hold.held = true;
                                hold.armed = true;
                            }
                            report.failure = Some(Reason::Driver(e));
                            report.state = Some(seen);
                        }
                    }
                }
            }
            Step::Checkpoint if driver_rank => {
                let done = driver.checkpoint(pid);
                let states = (ProcessState::Checkpointed, ProcessState::Checkpointed);
                hold.call(done, states, &mut report.failure);
                report.state = Some(hold.reported());
            }
            Step::Pause => {
                let pause = pause.take().expect("the pause step runs once");
                let paused = Paused {
                    rank,
                    pid,
                    driver_rank,
                };
                if let Err(e) = pause(&paused) {
                    report.failure = Some(Reason::Pause(chain(e.as_ref())));
                }
            }
            Step::Restore if driver_rank => {
                if hold.state == ProcessState::Checkpointed {
                    let done = driver.restore(pid);
                    let states = (ProcessState::Locked, ProcessState::Locked);
                    hold.call(done, states, &mut report.failure);
                }
                // A process this sequence never locked keeps the state its lock step saw.
                report.state = hold.held.then(|| hold.reported());
            }
            Step::Unlock if driver_rank => {
                if hold.state == ProcessState::Locked {
                    let done = driver.unlock(pid);
                    let states = (ProcessState::Running, ProcessState::Locked);
                    hold.call(done, states, &mut report.failure);
                }
                report.state = hold.held.then(|| hold.reported());
                // The back half ran: nothing is left for the guard to undo.
                hold.armed = false;
            }
            Step::Reinit => {
                for (object, o) in objects.iter_mut().enumerate() {
                    if !seq.resumes(object) {
                        continue;
                    }
                    if let (Err(e), None) = (o.reinit_after_resume(comm), &report.failure) {
                        report.failure = Some(Reason::Object {
                            object,
                            name: o.name(),
                            message: chain(e.as_ref()),
                        });
                    }
                }
            }
            // Driver steps on a rank that shares its process with a lower rank.
            Step::Lock | Step::Checkpoint | Step::Restore | Step::Unlock => {}
        }
        let local = started.elapsed();
        if let Some(reason) = &report.failure {
            tracing::warn!(rank, %step, %reason, "checkpoint step failed on this rank");
        }
        let agreed_at = Instant::now();
        let agreed = tpcomm_objects::all_gather(comm, &report)
            .map_err(ExchangeError::from)
            .and_then(|reports| seq.agree(&reports));
        if let Err(source) = agreed {
            // This sequence's lock may still hold after the back half's own steps failed
            // (an unlock that failed, a restore that failed): roll back what it holds.
            let holds = hold.armed || (hold.held && hold.state != ProcessState::Running);
            let driver_rank = seq.driver_rank_of(rank).filter(|_| step >= Step::Lock);
            let local = if holds {
                match hold.roll_back() {
                    Ok(state) => format!("{state} (rolled back alone)"),
                    Err(e) => format!("in an unknown state: the rollback failed: {e}"),
                }
            } else if let Some(driver_rank) = driver_rank.filter(|&d| d != rank) {
                format!(
                    "as rank {driver_rank}, which makes this process's driver calls, leaves \
                     it (it rolls back what this sequence locked); not known on this rank"
                )
            } else if hold.held {
                format!("{} (this sequence's lock was undone before)", hold.state)
            } else {
                "as it was (not locked by this sequence)".to_string()
            };
            return Err(CheckpointError::Exchange {
                step,
                rank,
                local,
                source: Box::new(source),
            });
        }
        timings.push(StepTiming {
            step,
            local,
            agree: agreed_at.elapsed(),
        });
        tracing::debug!(rank, %step, ?local, "checkpoint step agreed");
    }
    hold.armed = false;
    match seq.outcome() {
        Ok(()) => Ok(CheckpointReport {
            pids: seq_pids(&seq, comm.size(), pid),
            driver_rank: seq.is_driver_rank(rank),
            driver: info.expect("the check passed, so the driver is supported"),
            timings,
        }),
        Err((first, also, aftermath)) => Err(CheckpointError::Failed {
            first: Box::new(first),
            also,
            aftermath,
        }),
    }
}

fn seq_pids(seq: &Sequence, size: usize, own: u32) -> Vec<u32> {
    // The pids are in the sequence once Check passed; every rank knows them.
    (0..size).map(|r| seq.pid(r).unwrap_or(own)).collect()
}
