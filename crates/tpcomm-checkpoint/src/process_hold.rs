//! [`ProcessHold`]: this process's lock and checkpoint as the sequence holds them. The
//! state is tracked from the driver calls' results (asked from the driver only after a
//! failed call), rolled back on request, and undone by a drop guard when the sequence is
//! abandoned (a panic in the pause, a failed exchange).

use crate::driver::{CheckpointDriver, DriverError, ProcessState};
use crate::error::Reason;

/// This process's lock and checkpoint, undone on drop unless the sequence's own back half
/// ran: a panic in the pause or a failed exchange never leaves the process locked.
///
/// The state is tracked from the calls' results, so the successful path makes exactly the
/// four driver calls (lock, checkpoint, restore, unlock: the sequence measured on driver
/// 580 for a process checkpointing itself); `cuCheckpointProcessGetState` is asked only
/// after a failed call, to learn what the failure left.
pub(crate) struct ProcessHold<'d, D: CheckpointDriver + ?Sized> {
    pub(crate) driver: &'d D,
    pub(crate) pid: u32,
    pub(crate) state: ProcessState,
    /// This sequence's lock succeeded (the state is ours to report and undo).
    pub(crate) held: bool,
    /// A lock succeeded and the back half has not run.
    pub(crate) armed: bool,
    /// `state` was seen (a call's success or the driver's answer), not assumed after a
    /// failed call whose state could not be read: only a seen state is reported.
    pub(crate) seen: bool,
}

impl<D: CheckpointDriver + ?Sized> ProcessHold<'_, D> {
    /// Runs one driver call; on success the process is in `after`, on failure its state is
    /// asked from the driver. When that query fails too, the state is `unknown`: what the
    /// back half must assume so that it still undoes what the call may have done before it
    /// failed (a checkpoint that failed late may have checkpointed the process: assume so,
    /// and the restore is tried; a restore that failed late may have restored it: assume
    /// it is locked, and the unlock is tried; an unlock that failed is assumed not done).
    /// A restore or unlock of a process not in that state fails harmlessly.
    pub(crate) fn call(
        &mut self,
        result: Result<(), DriverError>,
        (after, unknown): (ProcessState, ProcessState),
        failure: &mut Option<Reason>,
    ) {
        match result {
            Ok(()) => (self.state, self.seen) = (after, true),
            Err(e) => {
                failure.get_or_insert(Reason::Driver(e));
                (self.state, self.seen) = match self.driver.state(self.pid) {
                    Ok(state) => (state, true),
                    Err(_) => (unknown, false),
                };
            }
        }
    }

    /// The state to report: the tracked one when it was seen, else unreadable (the back
    /// half still acts on the assumption).
    pub(crate) fn reported(&self) -> ProcessState {
        if self.seen {
            self.state
        } else {
            ProcessState::UNREADABLE
        }
    }

    /// Restores the process if it is checkpointed, then unlocks it if it is locked; returns
    /// the state it is left in.
    pub(crate) fn roll_back(&mut self) -> Result<ProcessState, String> {
        self.armed = false;
        if let Ok(state) = self.driver.state(self.pid) {
            self.state = state;
        }
        let mut restore_failed = None;
        if self.state == ProcessState::Checkpointed {
            if let Err(e) = self.driver.restore(self.pid) {
                match self.driver.state(self.pid) {
                    Ok(state) if state != ProcessState::Locked => {
                        self.state = state;
                        return Err(e.to_string());
                    }
                    // Restored after all, or unknown: as in the sequence's own back half, the
                    // restore may have done its work; the unlock is tried (and refused
                    // harmlessly if it had not).
                    _ => restore_failed = Some(e),
                }
            }
            self.state = ProcessState::Locked;
        }
        if self.state == ProcessState::Locked {
            self.driver
                .unlock(self.pid)
                .map_err(|e| match &restore_failed {
                    Some(restore) => format!("{restore}; then the unlock: {e}"),
                    None => e.to_string(),
                })?;
            self.state = ProcessState::Running;
        }
        Ok(self.state)
    }
}

impl<D: CheckpointDriver + ?Sized> Drop for ProcessHold<'_, D> {
    fn drop(&mut self) {
        if self.armed {
            let pid = self.pid;
            match self.roll_back() {
                Ok(state) => {
                    tracing::warn!(pid, %state, "process checkpoint abandoned; rolled back")
                }
                Err(e) => {
                    tracing::error!(pid, error = %e, "process checkpoint abandoned; rollback failed")
                }
            }
        }
    }
}
