//! Bounded waits for the stream ([`NcclCommunicator::with_timeout`]): the stream and NCCL's
//! asynchronous error looked at until the work is done or the time runs out, when the
//! communicator is aborted; without a timeout, `cuStreamSynchronize`.

use std::time::{Duration, Instant};

use cudarc::driver::DriverError;

use super::cuda::cuda_error;
use super::library::NCCL_SUCCESS;
use super::lifecycle::Lifecycle;
use super::NcclCommunicator;
use crate::error::{Op, Result, TransportError};

/// The longest pause between two looks at the stream in a bounded wait.
const MAX_POLL_PAUSE: Duration = Duration::from_micros(200);

/// Calls `done` until it says `true` (then `Ok(true)`), fails, or `timeout` has passed since
/// the first call (then `Ok(false)`), pausing between calls from 1 us, doubled each time up
/// to [`MAX_POLL_PAUSE`].
pub(super) fn poll_until(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<bool> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(1);
    loop {
        if done()? {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_POLL_PAUSE);
    }
}

impl NcclCommunicator {
    /// Bounds every wait for this communicator's stream by `timeout`: `synchronize`,
    /// `suspend`, and the drain before the communicator is destroyed. NCCL's kernels wait
    /// for their peers without end, so without a bound a peer that never launches its part
    /// keeps `synchronize` waiting for good, and `Drop` too (in `ncclCommFinalize`).
    ///
    /// When a bounded wait runs out, the communicator is aborted (`ncclCommAbort`, which
    /// also stops its kernels) and the call returns [`TransportError::Unresponsive`], naming
    /// every peer as unchecked (NCCL does not say which one is missing); an asynchronous
    /// NCCL error seen while waiting aborts it too. Every later call then fails with
    /// [`TransportError::Aborted`], and dropping it frees nothing more. Without a timeout a
    /// wait is `cuStreamSynchronize`. Not collective: each rank sets its own. The bound
    /// covers all the work on the stream (on a caller's stream, the caller's own kernels
    /// too), and a zero timeout aborts a communicator with any work in flight at its first
    /// wait. The lock is held while waiting, as it is in `cuStreamSynchronize`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The bound set by [`with_timeout`](Self::with_timeout), if any.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Waits for the work enqueued on the stream (called with the lock held and the context
    /// bound): `cuStreamSynchronize` without a timeout; with one, looks at the stream and at
    /// NCCL's asynchronous error until the work is done, and aborts the communicator when
    /// the time runs out or NCCL reports an error.
    pub(super) fn drain(&self, state: &mut Lifecycle, op: Op) -> Result<()> {
        let Some(timeout) = self.timeout else {
            return self
                .stream
                .synchronize()
                .map_err(|e| cuda_error(op, "cuStreamSynchronize", e));
        };
        let stream = self.stream.cu_stream();
        let finished = poll_until(timeout, || {
            // SAFETY: `stream` is this communicator's stream, kept alive by `self.stream`;
            // the context is bound.
            match unsafe { cudarc::driver::sys::cuStreamQuery(stream) } {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(true),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {
                    self.async_error(op).map(|()| false)
                }
                code => Err(cuda_error(op, "cuStreamQuery", DriverError(code))),
            }
        });
        match finished {
            Ok(true) => Ok(()),
            Ok(false) => {
                let error = TransportError::Unresponsive {
                    op,
                    rank: self.rank,
                    waited: timeout,
                    gone: Box::default(),
                    silent: Box::default(),
                    unchecked: (0..self.size).filter(|&r| r != self.rank).collect(),
                };
                self.abort(state, error.to_string());
                Err(error)
            }
            Err(e) => {
                if matches!(e, TransportError::Nccl { .. }) {
                    self.abort(state, e.to_string());
                }
                Err(e)
            }
        }
    }

    /// NCCL's asynchronous error of the communicator (called with the lock held).
    pub(super) fn async_error(&self, op: Op) -> Result<()> {
        let mut async_error = NCCL_SUCCESS;
        // SAFETY: out-pointer to a local; `comm` is live under the lock.
        let code = unsafe { (self.lib.comm_get_async_error)(self.comm, &mut async_error) };
        self.lib
            .check(op, "ncclCommGetAsyncError", code, self.comm)?;
        self.lib
            .check(op, "asynchronous NCCL error", async_error, self.comm)
    }
}
