//! The lifecycle as a sans-IO state machine: no memory, no communication, only decisions.
//!
//! ```text
//!            prepare_for_suspend            (failure in any transition or launch)
//!   Active  --------------------->  Suspended          Active/Suspended --> Failed
//!     ^      <---------------------     |                  (terminal; keeps the cause)
//!     |        reinit_after_resume       |
//!     +--------------- close() from any state ---------------> Closed (final)
//! ```
//!
//! Repeating a successful transition is a no-op.
//! [`CustomAllReduce`](crate::CustomAllReduce) asks this machine what to do before each
//! call and reports the outcome after it.

use std::fmt;
use std::sync::Arc;

use crate::error::{AllReduceError, Result};

/// The lifecycle phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Mappings open; all-reduces allowed.
    Active,
    /// Every imported mapping closed; only `reinit_after_resume` and `close` do anything.
    Suspended,
    /// A transition or launch failed; every call returns the cause.
    Failed,
    /// Released; final.
    Closed,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Active => "active",
            Phase::Suspended => "suspended",
            Phase::Failed => "failed",
            Phase::Closed => "closed",
        })
    }
}

/// A transition `CustomAllReduce` may be asked to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// `prepare_for_suspend`.
    Suspend,
    /// `reinit_after_resume`.
    Resume,
}

impl Transition {
    /// The call that runs it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Transition::Suspend => "prepare_for_suspend",
            Transition::Resume => "reinit_after_resume",
        }
    }
}

/// What `CustomAllReduce` must do for a requested transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Run it, then report with [`Lifecycle::finish`].
    Run,
    /// Already in the target phase: nothing to do.
    NoOp,
}

/// The state machine.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    phase: Phase,
    /// The cause, when Failed.
    failure: Option<(&'static str, Arc<AllReduceError>)>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self::new()
    }
}

impl Lifecycle {
    /// A new communicator starts Active.
    pub fn new() -> Self {
        Self {
            phase: Phase::Active,
            failure: None,
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    fn refuse(&self, call: &'static str) -> AllReduceError {
        match (&self.failure, self.phase) {
            (Some((during, cause)), Phase::Failed) => AllReduceError::Failed {
                during,
                cause: cause.clone(),
            },
            _ => AllReduceError::WrongState {
                call,
                phase: self.phase,
            },
        }
    }

    /// May an all-reduce (or registration, capture, replay) run now? Only while Active.
    pub fn check_operation(&self, call: &'static str) -> Result<()> {
        match self.phase {
            Phase::Active => Ok(()),
            _ => Err(self.refuse(call)),
        }
    }

    /// What to do for `t`: run it, skip it (already there), or refuse it.
    pub fn begin(&self, t: Transition) -> Result<Step> {
        match (self.phase, t) {
            (Phase::Active, Transition::Suspend) | (Phase::Suspended, Transition::Resume) => {
                Ok(Step::Run)
            }
            (Phase::Suspended, Transition::Suspend) | (Phase::Active, Transition::Resume) => {
                Ok(Step::NoOp)
            }
            (Phase::Failed | Phase::Closed, _) => Err(self.refuse(t.name())),
        }
    }

    /// Reports the outcome of a transition that [`begin`](Self::begin) said to run: success
    /// moves to the target phase, failure to Failed for good (the cause is kept and returned).
    pub fn finish(&mut self, t: Transition, outcome: Result<()>) -> Result<()> {
        match outcome {
            Ok(()) => {
                self.phase = match t {
                    Transition::Suspend => Phase::Suspended,
                    Transition::Resume => Phase::Active,
                };
                Ok(())
            }
            Err(e) => Err(self.fail(t.name(), e)),
        }
    }

    /// Records a failure of an operation or transition: the machine is Failed from now on.
    /// Returns the error to hand to the caller (the original cause).
    pub fn fail(&mut self, during: &'static str, cause: AllReduceError) -> AllReduceError {
        if self.phase == Phase::Closed {
            return cause;
        }
        let cause = Arc::new(cause);
        self.phase = Phase::Failed;
        self.failure.get_or_insert((during, cause.clone()));
        AllReduceError::Failed { during, cause }
    }

    /// `close()`: from any phase to Closed. Returns false when already Closed.
    pub fn close(&mut self) -> bool {
        let was_open = self.phase != Phase::Closed;
        self.phase = Phase::Closed;
        was_open
    }
}

/// Runs every collective step of a transition, in order, even after one failed, and
/// returns the first failure: peers are in every step, so a rank that returned early would
/// leave them blocked in the next one (NCCL's `ncclCommSuspend` has no timeout) or pair its
/// next collective with theirs. A failing rank therefore still joins every step, then
/// reports its failure.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn join_every_step(steps: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<()> {
    let mut first = None;
    for step in steps.iter_mut() {
        if let Err(e) = step() {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_step_does_not_skip_the_later_collective_steps() {
        let mut ran = Vec::new();
        let ran_cell = std::cell::RefCell::new(&mut ran);
        let outcome = join_every_step(&mut [
            &mut || {
                ran_cell.borrow_mut().push("custom");
                Err(boom())
            },
            &mut || {
                ran_cell.borrow_mut().push("nccl");
                Err(AllReduceError::UnregisteredGraphBuffers)
            },
            &mut || {
                ran_cell.borrow_mut().push("last");
                Ok(())
            },
        ]);
        assert_eq!(ran, ["custom", "nccl", "last"], "every step ran, in order");
        assert!(
            matches!(outcome, Err(AllReduceError::InvalidArgument(_))),
            "the first failure is the one reported: {outcome:?}"
        );
        assert!(join_every_step(&mut [&mut || Ok(()), &mut || Ok(())]).is_ok());
    }

    fn boom() -> AllReduceError {
        AllReduceError::InvalidArgument("injected".into())
    }

    #[test]
    fn suspend_then_resume_returns_to_active() {
        let mut l = Lifecycle::new();
        assert_eq!(l.begin(Transition::Suspend).unwrap(), Step::Run);
        l.finish(Transition::Suspend, Ok(())).unwrap();
        assert_eq!(l.phase(), Phase::Suspended);
        assert_eq!(l.begin(Transition::Resume).unwrap(), Step::Run);
        l.finish(Transition::Resume, Ok(())).unwrap();
        assert_eq!(l.phase(), Phase::Active);
    }

    #[test]
    fn repeating_a_successful_transition_is_a_no_op() {
        let mut l = Lifecycle::new();
        assert_eq!(l.begin(Transition::Resume).unwrap(), Step::NoOp);
        l.finish(Transition::Suspend, Ok(())).unwrap();
        assert_eq!(l.begin(Transition::Suspend).unwrap(), Step::NoOp);
    }

    #[test]
    fn operations_are_refused_while_suspended_with_the_phase_named() {
        let mut l = Lifecycle::new();
        l.finish(Transition::Suspend, Ok(())).unwrap();
        match l.check_operation("all_reduce") {
            Err(AllReduceError::WrongState {
                call: "all_reduce",
                phase: Phase::Suspended,
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_failed_transition_is_terminal_and_every_call_returns_the_cause() {
        let mut l = Lifecycle::new();
        let e = l.finish(Transition::Suspend, Err(boom())).unwrap_err();
        assert!(matches!(
            e,
            AllReduceError::Failed {
                during: "prepare_for_suspend",
                ..
            }
        ));
        assert_eq!(l.phase(), Phase::Failed);
        for r in [
            l.check_operation("all_reduce"),
            l.begin(Transition::Resume).map(drop),
            l.begin(Transition::Suspend).map(drop),
        ] {
            match r {
                Err(AllReduceError::Failed {
                    during: "prepare_for_suspend",
                    cause,
                }) => {
                    assert!(matches!(*cause, AllReduceError::InvalidArgument(_)))
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn the_first_failure_is_the_one_kept() {
        let mut l = Lifecycle::new();
        l.fail("all_reduce", boom());
        l.fail(
            "reinit_after_resume",
            AllReduceError::UnregisteredGraphBuffers,
        );
        assert!(matches!(
            l.check_operation("x"),
            Err(AllReduceError::Failed {
                during: "all_reduce",
                ..
            })
        ));
    }

    #[test]
    fn close_is_final_from_every_phase() {
        for setup in 0..3 {
            let mut l = Lifecycle::new();
            match setup {
                1 => l.finish(Transition::Suspend, Ok(())).unwrap(),
                2 => drop(l.fail("all_reduce", boom())),
                _ => {}
            }
            assert!(l.close());
            assert!(!l.close(), "closing twice reports nothing left to close");
            assert_eq!(l.phase(), Phase::Closed);
            assert!(l.check_operation("all_reduce").is_err());
            assert!(l.begin(Transition::Resume).is_err());
        }
    }
}
