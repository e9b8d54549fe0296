//! The lifecycle of an [`NcclCommunicator`]: active, suspended (`ncclCommSuspend`, its GPU
//! memory released) or aborted (`ncclCommAbort`), under the lock that serializes NCCL calls.

use std::sync::{MutexGuard, PoisonError};

use super::library::NCCL_SUSPEND_MEM;
use super::NcclCommunicator;
use crate::error::{Op, Result, TransportError};

/// The lifecycle of an [`NcclCommunicator`]; the lock around it serializes NCCL calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Lifecycle {
    Active,
    Suspended,
    /// `ncclCommAbort` was called (a bounded wait ran out, or NCCL reported an asynchronous
    /// error): the handle is gone and every later call fails with this reason.
    Aborted(String),
}

impl NcclCommunicator {
    /// Whether the communicator was aborted (see [`with_timeout`](Self::with_timeout)).
    pub fn is_aborted(&self) -> bool {
        matches!(*self.lock(), Lifecycle::Aborted(_))
    }

    /// Whether the communicator is suspended.
    pub fn is_suspended(&self) -> bool {
        *self.lock() == Lifecycle::Suspended
    }

    /// Collective: releases the communicator's GPU memory (`ncclCommSuspend` with
    /// `NCCL_SUSPEND_MEM`) after waiting for the work enqueued on its stream. A no-op when
    /// already suspended. [`TransportError::Unsupported`] when the library is older than
    /// 2.29; NCCL's failure as [`TransportError::Nccl`].
    pub fn suspend(&self) -> Result<()> {
        let _span = tracing::debug_span!("nccl_suspend", rank = self.rank).entered();
        let mut state = self.lock();
        match &*state {
            Lifecycle::Suspended => return Ok(()),
            Lifecycle::Aborted(reason) => return Err(self.aborted(Op::Suspend, reason)),
            Lifecycle::Active => {}
        }
        let suspend = self
            .lib
            .comm_suspend
            .ok_or_else(|| self.unsupported(Op::Suspend))?;
        self.bind(Op::Suspend)?;
        self.drain(&mut state, Op::Suspend)?;
        // SAFETY: `comm` is live and this thread holds the lock.
        let code = unsafe { suspend(self.comm, NCCL_SUSPEND_MEM) };
        self.lib
            .check(Op::Suspend, "ncclCommSuspend", code, self.comm)?;
        *state = Lifecycle::Suspended;
        tracing::debug!(rank = self.rank, "NCCL communicator suspended");
        Ok(())
    }

    /// Collective: restores what [`suspend`](Self::suspend) released (`ncclCommResume`). A
    /// no-op when active. Errors as for `suspend`.
    pub fn resume(&self) -> Result<()> {
        let _span = tracing::debug_span!("nccl_resume", rank = self.rank).entered();
        let mut state = self.lock();
        match &*state {
            Lifecycle::Active => return Ok(()),
            Lifecycle::Aborted(reason) => return Err(self.aborted(Op::Resume, reason)),
            Lifecycle::Suspended => {}
        }
        let resume = self
            .lib
            .comm_resume
            .ok_or_else(|| self.unsupported(Op::Resume))?;
        self.bind(Op::Resume)?;
        // SAFETY: `comm` is live and this thread holds the lock.
        let code = unsafe { resume(self.comm) };
        self.lib
            .check(Op::Resume, "ncclCommResume", code, self.comm)?;
        *state = Lifecycle::Active;
        tracing::debug!(rank = self.rank, "NCCL communicator resumed");
        Ok(())
    }

    /// Aborts the communicator (`ncclCommAbort`: its kernels stop, its resources are freed,
    /// the handle is gone); `state` records why, for every later call.
    pub(super) fn abort(&self, state: &mut Lifecycle, reason: String) {
        tracing::warn!(rank = self.rank, %reason, "aborting the NCCL communicator");
        // SAFETY: `comm` is live (the state is not Aborted: every path that reaches here
        // checked it under the lock, which the caller holds) and is never used again: the
        // state says Aborted from now on, and `Drop` frees nothing of an aborted one.
        let code = unsafe { (self.lib.comm_abort)(self.comm) };
        if let Err(e) = self
            .lib
            .check(Op::Setup, "ncclCommAbort", code, std::ptr::null_mut())
        {
            tracing::warn!(rank = self.rank, error = %e, "ncclCommAbort failed");
        }
        *state = Lifecycle::Aborted(reason);
    }

    /// The error of a call on an aborted communicator.
    pub(super) fn aborted(&self, op: Op, reason: &str) -> TransportError {
        TransportError::Aborted {
            op,
            rank: self.rank,
            by: self.rank,
            reason: format!("this NCCL communicator was aborted: {reason}"),
        }
    }

    pub(super) fn unsupported(&self, op: Op) -> TransportError {
        TransportError::Unsupported {
            op,
            reason: format!(
                "NCCL {} ({}) has no ncclCommSuspend/ncclCommResume (NCCL 2.29 or newer has)",
                self.lib.version, self.lib.path
            ),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Lifecycle> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the lock for a collective: refused while suspended or after an abort; binds
    /// the context.
    pub(super) fn enter(&self, op: Op) -> Result<MutexGuard<'_, Lifecycle>> {
        let state = self.lock();
        match &*state {
            Lifecycle::Suspended => {
                return Err(TransportError::Suspended {
                    op,
                    rank: self.rank,
                })
            }
            Lifecycle::Aborted(reason) => return Err(self.aborted(op, reason)),
            Lifecycle::Active => {}
        }
        self.bind(op)?;
        Ok(state)
    }
}
