//! The coordination of a group checkpoint as a sans-IO state machine: [`Sequence`] says
//! which step comes next and, given every rank's [`StepReport`] of the current step (the
//! same reports on every rank, from one all-gather), decides the step after it. It calls
//! nobody; [`checkpoint_group`](crate::checkpoint_group) runs the steps and the exchanges.
//!
//! ```text
//! Check -> Prepare -> Lock -> Checkpoint -> Pause -> Restore -> Unlock -> Reinit -> done
//!   |         |         |          |                   ^          |
//!   |         |         +----------+--- a failure -----+          +-- a process not
//!   |         |                                                   |   running: done
//!   |         +--------------- a failure -------------------------+-> Reinit
//!   +-- a failure: done (nothing touched)
//! ```
//!
//! The back half (Restore, Unlock) runs after *any* failure from Lock on: each process's
//! driver rank asks the driver for the process's state and restores a checkpointed process,
//! unlocks a locked one, and leaves a running one alone. So "roll back" and "finish" are the
//! same steps, and the ordering rules hold on both paths: no checkpoint before every
//! process is locked (Checkpoint follows a Lock step every rank passed), no unlock before
//! every process is restored (Unlock follows the Restore step).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::driver::ProcessState;
use crate::error::{Aftermath, ExchangeError, ObjectsLeft, Reason, StepFailure};

/// One step of a group checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Step {
    /// Every rank: the driver supports checkpoints, the options are valid, every object can
    /// suspend, every rank registered the same objects (by name, in order); the pids (one
    /// driver rank per process).
    Check,
    /// Every rank: `prepare_for_suspend` of every object, in registration order.
    Prepare,
    /// Each process's driver rank: refuse if the process imports CUDA IPC memory, else
    /// `cuCheckpointProcessLock` with the timeout.
    Lock,
    /// Each process's driver rank: `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// Every rank: the caller's pause (nothing, a wait, a CRIU dump).
    Pause,
    /// Each process's driver rank: `cuCheckpointProcessRestore` if it is checkpointed.
    Restore,
    /// Each process's driver rank: `cuCheckpointProcessUnlock` if it is locked.
    Unlock,
    /// Every rank: `reinit_after_resume` of every object every rank suspended.
    Reinit,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 8] = [
        Step::Check,
        Step::Prepare,
        Step::Lock,
        Step::Checkpoint,
        Step::Pause,
        Step::Restore,
        Step::Unlock,
        Step::Reinit,
    ];

    /// Lower-case name (`lock`, `checkpoint`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Step::Check => "check",
            Step::Prepare => "prepare",
            Step::Lock => "lock",
            Step::Checkpoint => "checkpoint",
            Step::Pause => "pause",
            Step::Restore => "restore",
            Step::Unlock => "unlock",
            Step::Reinit => "reinit",
        }
    }

    /// Whether the step calls the driver (on one rank per process).
    pub fn is_driver_step(self) -> bool {
        matches!(
            self,
            Step::Lock | Step::Checkpoint | Step::Restore | Step::Unlock
        )
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Marks a report as one of this protocol (a peer in an unrelated collective is detected).
pub(crate) const MAGIC: [u8; 4] = *b"tpK2";

/// One rank's outcome of one step, as all-gathered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReport {
    /// [`MAGIC`].
    pub(crate) magic: [u8; 4],
    /// The step this report is for.
    pub step: Step,
    /// The rank's process, as its driver knows it (its own PID namespace's pid).
    pub pid: u32,
    /// A random identity of the rank's process: with the pid it tells processes apart
    /// where pids repeat (two containers each running their engine as pid 1, two hosts).
    pub process: u64,
    /// The number of objects the rank registered.
    pub objects: u32,
    /// Check: the [`name`](crate::Suspendable::name) of every object the rank registered,
    /// in order (ranks must register the same objects in the same order: each transition
    /// is collective, and pairs with the peers' object at the same position).
    pub names: Vec<String>,
    /// The rank's failure, if it failed.
    pub failure: Option<Reason>,
    /// Prepare: per object, whether its `prepare_for_suspend` succeeded.
    pub suspended: Vec<bool>,
    /// Driver steps on a driver rank: the process's state after the step.
    pub state: Option<ProcessState>,
}

impl StepReport {
    /// A report of `step` with nothing failed, for process `pid` of identity 0 (set
    /// [`process`](Self::process) where pids may repeat).
    pub fn new(step: Step, pid: u32, objects: u32) -> Self {
        Self {
            magic: MAGIC,
            step,
            pid,
            process: 0,
            objects,
            names: Vec::new(),
            failure: None,
            suspended: Vec::new(),
            state: None,
        }
    }

    /// Whether the report belongs to this protocol.
    pub(crate) fn is_tagged(&self) -> bool {
        self.magic == MAGIC
    }
}

/// The state machine of one group checkpoint (see the module docs).
#[derive(Debug, Clone)]
pub struct Sequence {
    size: usize,
    step: Option<Step>,
    pids: Vec<u32>,
    /// Each rank's process identity ([`StepReport::process`]).
    identities: Vec<u64>,
    objects: usize,
    failures: Vec<StepFailure>,
    /// Per object: every rank suspended it (filled by Prepare).
    resumable: Vec<bool>,
    prepared: bool,
    processes: Vec<Option<ProcessState>>,
    reinit_ran: bool,
    reinit_skipped: bool,
}

impl Sequence {
    /// A sequence for `size` ranks, at [`Step::Check`].
    pub fn new(size: usize) -> Self {
        Self {
            size,
            step: Some(Step::Check),
            pids: Vec::new(),
            identities: Vec::new(),
            objects: 0,
            failures: Vec::new(),
            resumable: Vec::new(),
            prepared: false,
            processes: vec![None; size],
            reinit_ran: false,
            reinit_skipped: false,
        }
    }

    /// The step to run next; `None` when the sequence is over.
    pub fn step(&self) -> Option<Step> {
        self.step
    }

    /// Whether `rank` makes the driver calls for its process: the lowest rank of its
    /// process, the ranks with both its pid and its process identity (known after
    /// [`Step::Check`]).
    pub fn is_driver_rank(&self, rank: usize) -> bool {
        self.driver_rank_of(rank) == Some(rank)
    }

    /// The driver rank of `rank`'s process: the lowest rank with both its pid and its
    /// process identity (pids alone repeat across containers).
    pub(crate) fn driver_rank_of(&self, rank: usize) -> Option<usize> {
        let process = |r: usize| Some((*self.pids.get(r)?, *self.identities.get(r)?));
        let mine = process(rank)?;
        (0..self.pids.len()).position(|r| process(r) == Some(mine))
    }

    /// The pid of `rank` (known after [`Step::Check`]).
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.pids.get(rank).copied()
    }

    /// Whether object `index` is resumed in [`Step::Reinit`]: every rank suspended it.
    pub fn resumes(&self, index: usize) -> bool {
        self.resumable.get(index).copied().unwrap_or(false)
    }

    /// The failures agreed so far, in order.
    pub fn failures(&self) -> &[StepFailure] {
        &self.failures
    }

    /// Takes every rank's report of the current step (indexed by rank) and moves to the
    /// next step. Every rank passes the same reports, so every rank takes the same
    /// decision. Refuses, changing nothing, reports that are not one per rank
    /// ([`ExchangeError::ReportCount`]) or one of another step or protocol
    /// ([`ExchangeError::OutOfStep`]). Once the sequence is over it does nothing.
    pub fn agree(&mut self, reports: &[StepReport]) -> Result<(), ExchangeError> {
        let Some(step) = self.step else { return Ok(()) };
        if reports.len() != self.size {
            return Err(ExchangeError::ReportCount {
                expected: self.size,
                got: reports.len(),
            });
        }
        if let Some((rank, other)) = reports
            .iter()
            .enumerate()
            .find(|(_, r)| !r.is_tagged() || r.step != step)
        {
            let found = if other.is_tagged() {
                format!("the checkpoint's {} step", other.step)
            } else {
                "another collective".to_string()
            };
            return Err(ExchangeError::OutOfStep { rank, found });
        }
        for (rank, report) in reports.iter().enumerate() {
            if let Some(reason) = &report.failure {
                self.failures.push(StepFailure {
                    step,
                    rank,
                    reason: reason.clone(),
                });
            }
            if step.is_driver_step() {
                if let Some(state) = report.state {
                    self.processes[rank] = Some(state);
                }
            }
        }
        let failed_now = reports.iter().any(|r| r.failure.is_some());
        self.step = match step {
            Step::Check => {
                self.pids = reports.iter().map(|r| r.pid).collect();
                self.identities = reports.iter().map(|r| r.process).collect();
                let counts: Vec<u32> = reports.iter().map(|r| r.objects).collect();
                if let Some(rank) = counts.iter().position(|&c| c != counts[0]) {
                    self.failures.push(StepFailure {
                        step,
                        rank,
                        reason: Reason::ObjectCountMismatch { counts },
                    });
                } else if let Some((rank, object)) = differing_object(reports) {
                    self.failures.push(StepFailure {
                        step,
                        rank,
                        reason: Reason::ObjectMismatch {
                            object,
                            names: reports
                                .iter()
                                .map(|r| r.names.get(object).cloned().unwrap_or_default())
                                .collect(),
                        },
                    });
                }
                self.objects = reports.first().map_or(0, |r| r.objects as usize);
                if self.failures.is_empty() {
                    Some(Step::Prepare)
                } else {
                    None
                }
            }
            Step::Prepare => {
                self.prepared = true;
                self.resumable = (0..self.objects)
                    .map(|i| reports.iter().all(|r| r.suspended.get(i) == Some(&true)))
                    .collect();
                if failed_now {
                    Some(Step::Reinit)
                } else {
                    Some(Step::Lock)
                }
            }
            Step::Lock if failed_now => Some(Step::Restore),
            Step::Lock => Some(Step::Checkpoint),
            Step::Checkpoint if failed_now => Some(Step::Restore),
            Step::Checkpoint => Some(Step::Pause),
            Step::Pause => Some(Step::Restore),
            Step::Restore => Some(Step::Unlock),
            Step::Unlock => {
                // Resuming objects is collective and runs CUDA: only when every process
                // runs again.
                let mut all_running = true;
                for (rank, state) in self.processes.clone().into_iter().enumerate() {
                    if let Some(state) = state.filter(|s| *s != ProcessState::Running) {
                        all_running = false;
                        let pid = self.pids.get(rank).copied().unwrap_or(0);
                        self.failures.push(StepFailure {
                            step,
                            rank,
                            reason: Reason::NotRestored { pid, state },
                        });
                    }
                }
                if all_running {
                    Some(Step::Reinit)
                } else {
                    self.reinit_skipped = true;
                    None
                }
            }
            Step::Reinit => {
                self.reinit_ran = true;
                None
            }
        };
        Ok(())
    }

    /// The outcome once [`step`](Self::step) is `None`: `Ok` when no rank failed any step,
    /// otherwise the first failure, every later one, and what was left behind.
    #[allow(clippy::result_large_err)] // once per checkpoint
    pub fn outcome(&self) -> Result<(), (StepFailure, Vec<StepFailure>, Aftermath)> {
        let mut failures = self.failures.clone();
        // The earliest step first, then the lowest rank (the push order already is, except
        // for the NotRestored entries of the Unlock step, which come after that step's own).
        failures.sort_by_key(|f| f.step);
        let mut failures = failures.into_iter();
        let Some(first) = failures.next() else {
            return Ok(());
        };
        let objects = if !self.prepared {
            ObjectsLeft::Untouched
        } else if self.reinit_skipped || !self.reinit_ran {
            ObjectsLeft::NotResumed
        } else if self.resumable.iter().all(|&r| r) {
            ObjectsLeft::Resumed
        } else {
            ObjectsLeft::Partial(self.resumable.clone())
        };
        let aftermath = Aftermath {
            processes: self.processes_by_rank(),
            objects,
        };
        Err((first, failures.collect(), aftermath))
    }

    /// The last known state of every rank's process (a rank that is not its process's
    /// driver rank gets its driver rank's).
    fn processes_by_rank(&self) -> Vec<Option<ProcessState>> {
        (0..self.size)
            .map(|rank| self.processes[self.driver_rank_of(rank)?])
            .collect()
    }
}

/// The first rank (and the object) whose registered objects differ from rank 0's by name,
/// given equal counts; a report that lists no names (another version) differs.
fn differing_object(reports: &[StepReport]) -> Option<(usize, usize)> {
    let first = &reports.first()?.names;
    reports.iter().enumerate().find_map(|(rank, r)| {
        let object =
            (0..first.len().max(r.names.len())).find(|&i| r.names.get(i) != first.get(i))?;
        Some((rank, object))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::DriverError;

    fn reports(step: Step, pids: &[u32]) -> Vec<StepReport> {
        pids.iter()
            .map(|&pid| StepReport::new(step, pid, 1))
            .collect()
    }

    fn driver_error(pid: u32) -> Reason {
        Reason::Driver(DriverError {
            entry_point: "cuCheckpointProcessLock".into(),
            pid,
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        })
    }

    /// Runs the sequence with every rank succeeding, returning the steps taken.
    fn walk(seq: &mut Sequence, pids: &[u32], fail: Option<(Step, usize)>) -> Vec<Step> {
        let mut taken = Vec::new();
        while let Some(step) = seq.step() {
            taken.push(step);
            let mut r = reports(step, pids);
            for (rank, report) in r.iter_mut().enumerate() {
                if step == Step::Prepare {
                    report.suspended = vec![fail != Some((Step::Prepare, rank))];
                }
                if step.is_driver_step() && seq.is_driver_rank(rank) {
                    report.state = Some(ProcessState::Running);
                }
                if fail == Some((step, rank)) {
                    report.failure = Some(driver_error(pids[rank]));
                }
            }
            seq.agree(&r).unwrap();
        }
        taken
    }

    #[test]
    fn a_clean_run_takes_every_step_in_order() {
        let mut seq = Sequence::new(3);
        assert_eq!(walk(&mut seq, &[1, 2, 3], None), Step::ALL);
        assert!(seq.outcome().is_ok());
    }

    #[test]
    fn a_failure_in_the_front_half_skips_to_the_back_half() {
        let after = |step| {
            let mut seq = Sequence::new(2);
            walk(&mut seq, &[1, 2], Some((step, 1)))
        };
        use Step::*;
        assert_eq!(after(Check), [Check]);
        assert_eq!(after(Prepare), [Check, Prepare, Reinit]);
        assert_eq!(after(Lock), [Check, Prepare, Lock, Restore, Unlock, Reinit]);
        assert_eq!(
            after(Checkpoint),
            [Check, Prepare, Lock, Checkpoint, Restore, Unlock, Reinit]
        );
        assert_eq!(after(Pause), Step::ALL);
        assert_eq!(after(Restore), Step::ALL);
    }

    #[test]
    fn a_process_left_not_running_ends_the_sequence_before_reinit() {
        let mut seq = Sequence::new(2);
        for step in [Step::Check, Step::Prepare, Step::Lock, Step::Checkpoint] {
            let mut r = reports(step, &[1, 2]);
            if step == Step::Prepare {
                r.iter_mut().for_each(|r| r.suspended = vec![true]);
            }
            seq.agree(&r).unwrap();
        }
        seq.agree(&reports(Step::Pause, &[1, 2])).unwrap();
        let mut r = reports(Step::Restore, &[1, 2]);
        r[1].failure = Some(driver_error(2));
        r[1].state = Some(ProcessState::Checkpointed);
        r[0].state = Some(ProcessState::Locked);
        seq.agree(&r).unwrap();
        let mut r = reports(Step::Unlock, &[1, 2]);
        r[0].state = Some(ProcessState::Running);
        r[1].state = Some(ProcessState::Checkpointed);
        seq.agree(&r).unwrap();
        assert_eq!(seq.step(), None);
        let (first, also, aftermath) = seq.outcome().unwrap_err();
        assert_eq!((first.step, first.rank), (Step::Restore, 1));
        assert!(matches!(
            also.as_slice(),
            [StepFailure {
                step: Step::Unlock,
                rank: 1,
                reason: Reason::NotRestored {
                    pid: 2,
                    state: ProcessState::Checkpointed
                }
            }]
        ));
        assert_eq!(
            aftermath.processes,
            [
                Some(ProcessState::Running),
                Some(ProcessState::Checkpointed)
            ]
        );
        assert_eq!(aftermath.objects, ObjectsLeft::NotResumed);
    }

    #[test]
    fn the_lowest_rank_of_each_pid_is_its_driver_rank() {
        let mut seq = Sequence::new(4);
        seq.agree(&reports(Step::Check, &[9, 7, 9, 7])).unwrap();
        let driver: Vec<bool> = (0..4).map(|r| seq.is_driver_rank(r)).collect();
        assert_eq!(driver, [true, true, false, false]);
        assert_eq!(seq.pid(3), Some(7));
    }

    #[test]
    fn differing_object_counts_fail_the_check_naming_the_first_rank_that_differs() {
        let mut seq = Sequence::new(3);
        let mut r = reports(Step::Check, &[1, 2, 3]);
        r[2].objects = 4;
        seq.agree(&r).unwrap();
        assert_eq!(seq.step(), None);
        let (first, _, aftermath) = seq.outcome().unwrap_err();
        assert_eq!(first.rank, 2);
        assert_eq!(
            first.reason,
            Reason::ObjectCountMismatch {
                counts: vec![1, 1, 4]
            }
        );
        assert_eq!(aftermath.objects, ObjectsLeft::Untouched);
    }

    #[test]
    fn reports_of_the_wrong_count_or_step_are_refused_and_change_nothing() {
        let mut seq = Sequence::new(2);
        let one = reports(Step::Check, &[1]);
        assert!(matches!(
            seq.agree(&one),
            Err(ExchangeError::ReportCount {
                expected: 2,
                got: 1
            })
        ));
        let three = reports(Step::Check, &[1, 2, 3]);
        assert!(matches!(
            seq.agree(&three),
            Err(ExchangeError::ReportCount {
                expected: 2,
                got: 3
            })
        ));
        let mut other = reports(Step::Check, &[1, 2]);
        other[1].step = Step::Lock;
        assert!(matches!(
            seq.agree(&other),
            Err(ExchangeError::OutOfStep { rank: 1, .. })
        ));
        let mut untagged = reports(Step::Check, &[1, 2]);
        untagged[0].magic = *b"tpK1";
        assert!(matches!(
            seq.agree(&untagged),
            Err(ExchangeError::OutOfStep { rank: 0, .. })
        ));
        assert_eq!(seq.step(), Some(Step::Check));
        assert!(seq.failures().is_empty());
        seq.agree(&reports(Step::Check, &[1, 2])).unwrap();
        assert_eq!(seq.step(), Some(Step::Prepare));
    }

    #[test]
    fn ranks_with_one_pid_in_different_processes_each_drive_their_own() {
        let mut seq = Sequence::new(3);
        let mut r = reports(Step::Check, &[1, 1, 1]);
        r[0].process = 7;
        r[1].process = 8;
        r[2].process = 7;
        seq.agree(&r).unwrap();
        let driver: Vec<bool> = (0..3).map(|r| seq.is_driver_rank(r)).collect();
        assert_eq!(driver, [true, true, false]);
    }

    /// Two processes with one pid (two containers): the aftermath reports each process's
    /// own state, not the state of the first process with that pid.
    #[test]
    fn the_aftermath_tells_processes_with_one_pid_apart() {
        let mut seq = Sequence::new(2);
        let mut r = reports(Step::Check, &[1, 1]);
        r[0].process = 7;
        r[1].process = 8;
        seq.agree(&r).unwrap();
        for step in [Step::Prepare, Step::Lock, Step::Checkpoint, Step::Pause] {
            let mut r = reports(step, &[1, 1]);
            if step == Step::Prepare {
                r.iter_mut().for_each(|r| r.suspended = vec![true]);
            }
            seq.agree(&r).unwrap();
        }
        let mut r = reports(Step::Restore, &[1, 1]);
        r[0].state = Some(ProcessState::Locked);
        r[1].state = Some(ProcessState::Checkpointed);
        r[1].failure = Some(driver_error(1));
        seq.agree(&r).unwrap();
        let mut r = reports(Step::Unlock, &[1, 1]);
        r[0].state = Some(ProcessState::Running);
        r[1].state = Some(ProcessState::Checkpointed);
        seq.agree(&r).unwrap();
        let (_, _, aftermath) = seq.outcome().unwrap_err();
        assert_eq!(
            aftermath.processes,
            [
                Some(ProcessState::Running),
                Some(ProcessState::Checkpointed)
            ]
        );
    }
}
