//! Aborting a group: the record that every blocked and later call reports (a timeout, a
//! departed rank, calls that differ), and the errors made from it.

use super::shared::State;
use super::LocalCommunicator;
use crate::error::{Op, TransportError};

#[derive(Debug, Clone)]
pub(super) struct Abort {
    pub(super) by: usize,
    pub(super) reason: String,
    /// Set when the abort is a peer's timeout: ranks still waiting report their own
    /// `Timeout` (naming the ranks *they* miss) rather than a second-hand abort.
    pub(super) timed_out: bool,
}

impl LocalCommunicator {
    pub(super) fn aborted(&self, op: Op, abort: &Abort) -> TransportError {
        TransportError::Aborted {
            op,
            rank: self.rank,
            by: abort.by,
            reason: abort.reason.clone(),
        }
    }

    pub(super) fn abort_group(&self, state: &mut State, op: Op, reason: String) -> TransportError {
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

    pub(super) fn mismatch(&self, op: Op, detail: String) -> TransportError {
        TransportError::Mismatch {
            op,
            rank: self.rank,
            detail,
        }
    }
}
