//! Errors of a group checkpoint. Every rank learns every rank's outcome of every step, so a
//! failure agreed in a step is the same [`CheckpointError::Failed`] on every rank (the step,
//! the rank that failed first and why, and what the rollback left behind); only a failed
//! exchange itself ([`CheckpointError::Exchange`]) is local.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::driver::{DriverError, ProcessState, Unsupported};
use crate::sequence::Step;

/// Why one rank failed one step: plain data, exchanged between ranks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Reason {
    /// The process-checkpoint API is not usable on this rank.
    #[error(transparent)]
    Unsupported(Unsupported),
    /// The options are out of range (a lock timeout of zero or above `u32::MAX` ms).
    #[error("invalid options: {0}")]
    InvalidOptions(String),
    /// Ranks registered different numbers of suspendable objects.
    #[error("ranks registered different numbers of suspendable objects: {counts:?} (by rank)")]
    ObjectCountMismatch {
        /// The count of every rank.
        counts: Vec<u32>,
    },
    /// Ranks registered different objects at the same position (compared by name): their
    /// collective transitions would pair with each other.
    #[error("ranks registered different objects as #{object}: {names:?} (by rank)")]
    ObjectMismatch {
        /// The position.
        object: usize,
        /// Every rank's object there (empty: none).
        names: Vec<String>,
    },
    /// A registered object cannot release its device state (NCCL without `ncclCommSuspend`,
    /// an all-reduce that is Failed or Closed).
    #[error("object #{object} ({name}) cannot suspend: {why}")]
    CannotSuspend {
        /// Its index in the registration order.
        object: usize,
        /// What it is.
        name: String,
        /// Why, in words.
        why: String,
    },
    /// `prepare_for_suspend` or `reinit_after_resume` of an object failed.
    #[error("object #{object} ({name}): {message}")]
    Object {
        /// Its index in the registration order.
        object: usize,
        /// What it is.
        name: String,
        /// The object's error, with its causes.
        message: String,
    },
    /// The process still had imported CUDA IPC mappings after every object's
    /// `prepare_for_suspend`: locking was refused (the driver would checkpoint it but not
    /// restore it).
    #[error(
        "process {pid} still has {count} peer allocation(s) imported through CUDA IPC after \
         prepare_for_suspend: the driver checkpoints such a process but cannot restore it \
         (CUDA_ERROR_INVALID_VALUE, left checkpointed), so it was not locked"
    )]
    ImportedMappings {
        /// The process.
        pid: u32,
        /// Its imported allocations.
        count: usize,
    },
    /// The driver cannot tell whether the process imports CUDA IPC memory (the real
    /// driver sees only its own process's mappings: `CheckpointOptions::pid` named another
    /// process): locking was refused, since such a process could not be restored.
    #[error(
        "cannot tell whether process {pid} imports CUDA IPC memory (the driver sees only its \
         own process's mappings), so it was not locked"
    )]
    ImportsUnknown {
        /// The process.
        pid: u32,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(DriverError),
    /// The caller's pause returned an error.
    #[error("the pause failed: {0}")]
    Pause(String),
    /// After the rollback the process is not running (its restore or unlock failed): its
    /// objects were not resumed.
    #[error("process {pid} is left {state}")]
    NotRestored {
        /// The process.
        pid: u32,
        /// The state the driver reports.
        state: ProcessState,
    },
}

/// One rank's failure of one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepFailure {
    /// The step.
    pub step: Step,
    /// The rank.
    pub rank: usize,
    /// Why.
    pub reason: Reason,
}

impl fmt::Display for StepFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on rank {}: {}", self.step, self.rank, self.reason)
    }
}

/// What happened to the registered objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectsLeft {
    /// Nothing was called on them (the check refused).
    Untouched,
    /// Every object was suspended and resumed on every rank (a resume may still have
    /// failed: see the failures).
    Resumed,
    /// They stay where `prepare_for_suspend` left them, not resumed, because a process is
    /// not running again (restore or unlock failed) or an exchange failed. Objects of a
    /// running process can be closed; resuming them is the caller's decision.
    NotResumed,
    /// Per object (registration order): resumed (`true`), or not, because some rank failed
    /// its `prepare_for_suspend` (that rank's copy is Failed; the others stay Suspended,
    /// since resuming is collective and their peer cannot join).
    Partial(Vec<bool>),
}

/// What a failed checkpoint left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aftermath {
    /// Per rank, the state of its process after the rollback, as its process's driver rank
    /// last saw it (`None` when no driver call was made: the check refused, or the
    /// sequence ended before locking).
    pub processes: Vec<Option<ProcessState>>,
    /// The registered objects.
    pub objects: ObjectsLeft,
}

impl fmt::Display for Aftermath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stuck: Vec<String> = self
            .processes
            .iter()
            .enumerate()
            .filter_map(|(rank, s)| match s {
                Some(ProcessState::Running) | None => None,
                Some(state) => Some(format!("rank {rank}'s process {state}")),
            })
            .collect();
        if stuck.is_empty() {
            f.write_str("every process running")?;
        } else {
            f.write_str(&stuck.join(", "))?;
        }
        match &self.objects {
            ObjectsLeft::Untouched => f.write_str(", objects untouched"),
            ObjectsLeft::Resumed => f.write_str(", objects resumed"),
            ObjectsLeft::NotResumed => f.write_str(", objects not resumed"),
            ObjectsLeft::Partial(resumed) => {
                let not: Vec<usize> = (0..resumed.len()).filter(|&i| !resumed[i]).collect();
                write!(
                    f,
                    ", objects {not:?} not resumed (a rank failed to suspend them)"
                )
            }
        }
    }
}

/// The error of [`checkpoint_group`](crate::checkpoint_group).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A step failed on some rank; every rank returns the same error. `first` is the
    /// earliest failure (lowest step, then lowest rank), `also` every later one (the
    /// rollback's included).
    #[error("process checkpoint failed at {first}; left: {aftermath}")]
    Failed {
        /// The first failure.
        first: Box<StepFailure>,
        /// Failures after it, in order.
        also: Vec<StepFailure>,
        /// What was left behind.
        aftermath: Aftermath,
    },
    /// The exchange of a step's outcomes failed on this rank (a peer died, the transport
    /// timed out, a peer is in another collective). Agreement is lost: this rank rolled back
    /// alone what this sequence still holds of its process (restore if checkpointed, then
    /// unlock; a rank that shares its process with a lower rank leaves that to it), and
    /// resumes no object after the failed exchange (at the reinit step the objects were
    /// resumed before it). `local` says what the process was left in, as far as this rank
    /// knows.
    #[error("rank {rank} could not exchange the outcomes of the {step} step; its own process is left {local}")]
    Exchange {
        /// The step.
        step: Step,
        /// This rank.
        rank: usize,
        /// The local rollback's result (the process's state, or why it is unknown).
        local: String,
        /// The exchange's error.
        #[source]
        source: Box<ExchangeError>,
    },
}

/// Why a step's exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// The object all-gather failed.
    #[error("the all-gather failed")]
    Transport(#[from] tpcomm_objects::ObjectError),
    /// A peer's report is of another step or another protocol.
    #[error("rank {rank} is in {found}, not in this step")]
    OutOfStep {
        /// The peer.
        rank: usize,
        /// What its report says.
        found: String,
    },
    /// Not one report per rank (a [`Sequence`](crate::Sequence) driven by hand).
    #[error("{got} reports for a group of {expected} ranks")]
    ReportCount {
        /// The group's size.
        expected: usize,
        /// The reports passed.
        got: usize,
    },
}

impl CheckpointError {
    /// The step that failed first.
    pub fn step(&self) -> Step {
        match self {
            Self::Failed { first, .. } => first.step,
            Self::Exchange { step, .. } => *step,
        }
    }

    /// The first failure's reason, when agreed.
    pub fn reason(&self) -> Option<&Reason> {
        match self {
            Self::Failed { first, .. } => Some(&first.reason),
            Self::Exchange { .. } => None,
        }
    }

    /// The rank that failed first (for [`Exchange`](Self::Exchange), this rank).
    pub fn rank(&self) -> usize {
        match self {
            Self::Failed { first, .. } => first.rank,
            Self::Exchange { rank, .. } => *rank,
        }
    }
}
