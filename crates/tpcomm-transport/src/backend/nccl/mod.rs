//! The NCCL backend (feature `nccl`): a [`DeviceCommunicator`] over an NCCL communicator,
//! bootstrapped through any host [`Communicator`].
//!
//! Three levels, in cudarc's shape: the NCCL *types*, declared by tpcomm (unique id,
//! communicator handle, data types, reductions; not cudarc's `nccl` module, which would make
//! a program that links cudarc link libnccl too), a checked layer here (every function of libnccl this
//! module calls is resolved up front into [`NcclLibrary`], every `ncclResult_t` is checked and
//! becomes [`TransportError::Nccl`] with the call, the raw code, `ncclGetErrorString` and
//! `ncclGetLastError`), and the RAII type [`NcclCommunicator`] (finalized and destroyed on
//! drop).
//!
//! - **Loading, never a panic.** cudarc's NCCL functions resolve their symbol on first call
//!   and panic if it is missing, and its loader does not look for `libnccl.so.2` (the name the
//!   NCCL packages install, the `nvidia-nccl-cu*` wheels included) unless a `libnccl.so`
//!   development link exists (and when the program links cudarc instead of loading, cudarc
//!   has no loader at all). So this module loads libnccl itself with `libloading`: the path
//!   in `TPCOMM_NCCL_LIBRARY` when set, else `libnccl.so.2` and `libnccl.so`, then resolves
//!   every required function, and returns [`TransportError::LibraryMissing`] when the
//!   library or one of them is absent. The CUDA
//!   driver (used through cudarc's safe driver API for the context, the stream and the
//!   buffers) is probed the same way before its first call; a driver that finds no GPU, or an
//!   ordinal out of range, is [`TransportError::NoDevice`].
//! - **Raw codes.** The functions are called through pointer types that return `c_int`, not
//!   cudarc's `ncclResult_t` enum, so a code this build does not know (a newer NCCL) is kept as
//!   is instead of being an invalid enum value.
//! - **Bootstrap.** [`NcclCommunicator::new`] is collective over the host communicator: every
//!   rank sets up its device (and rank 0 asks for `ncclGetUniqueId`), all ranks all-gather one
//!   status byte so that a rank that failed (no library, no device) makes every rank return an
//!   error instead of leaving the others blocked in NCCL's bootstrap, then the 128-byte unique
//!   id is broadcast as host bytes and every rank calls `ncclCommInitRank`. A failure *inside*
//!   `ncclCommInitRank` on one rank can still leave the others waiting in NCCL.
//! - **Threads.** NCCL communicators must not be used by two threads at once: every call into
//!   NCCL takes the communicator's lock, and binds the device's (primary) context to the
//!   calling thread first.
//! - **Suspend / resume.** NCCL 2.29 added `ncclCommSuspend` (flag `NCCL_SUSPEND_MEM`: release
//!   the communicator's GPU memory) and `ncclCommResume`, both collective. They are looked up
//!   separately; [`NcclCommunicator::suspend`] and [`NcclCommunicator::resume`] return
//!   [`TransportError::Unsupported`] when the loaded library lacks them. While suspended,
//!   collectives are refused with [`TransportError::Suspended`]; repeating a transition is a
//!   no-op. A failed transition returns NCCL's error and leaves the recorded state unchanged.
//! - **Errors are enqueue errors.** NCCL collectives are asynchronous: a returned error means
//!   the call was not enqueued. Failures while running show up in
//!   [`DeviceCommunicator::synchronize`] (the stream's error, then `ncclCommGetAsyncError`).
//!   An asynchronous NCCL error aborts the communicator (`ncclCommAbort`): later calls fail
//!   with [`TransportError::Aborted`].
//! - **Bounded waits.** NCCL's kernels wait for their peers without end. With
//!   [`NcclCommunicator::with_timeout`], `synchronize`, `suspend` and the drain before the
//!   communicator is destroyed look at the stream until its work is done or the time runs
//!   out; then the communicator is aborted (its kernels stop) and the call returns
//!   [`TransportError::Unresponsive`]. Without it they block as `cuStreamSynchronize` does,
//!   and dropping a communicator whose peer never came blocks in `ncclCommFinalize`. What
//!   no timeout bounds: the host-side collective calls NCCL blocks in (`ncclCommInitRank`,
//!   `ncclCommSuspend`, `ncclCommResume`) when a peer never makes them.
//!
//! Requires NCCL 2.14 or newer (`ncclCommFinalize`, `ncclGetLastError`, bf16) and a CUDA
//! driver of CUDA 11.4 or newer.

//!
//! # Where things are
//!
//! This file holds [`NcclCommunicator`], its bootstrap and its destruction on drop;
//! `library` loads libnccl ([`NcclLibrary`]) and checks its return codes; `cuda` probes the
//! driver and opens the device; `lifecycle` suspends, resumes and aborts; `waits` bounds
//! the waits for the stream; `collectives` is the [`DeviceCommunicator`] impl.

mod collectives;
mod cuda;
mod library;
mod lifecycle;
mod waits;

use std::ffi::{c_char, c_int};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};

use crate::communicator::Communicator;
#[cfg(doc)]
use crate::device::DeviceCommunicator;
use crate::error::{Op, Result, TransportError};

use cuda::{cuda_error, open_device};
use library::{CommHandle, StreamHandle, UniqueId};
pub use library::{NcclLibrary, NCCL_LIBRARY_ENV, UNIQUE_ID_BYTES};
use lifecycle::Lifecycle;

/// An NCCL communicator of one rank on one device, running [`DeviceCommunicator`]
/// collectives on its stream.
///
/// Create it with [`new`](Self::new) (a new stream on the device) or
/// [`with_stream`](Self::with_stream) (the caller's stream), collectively over a host
/// communicator. Dropping it finalizes and destroys the NCCL communicator (failures are
/// logged with `tracing::warn`); with a [timeout](Self::with_timeout) it first drains the
/// stream within it, and aborts the communicator instead when that runs out. See the
/// [module docs](self).
///
/// ```no_run
/// use cudarc::driver::CudaContext;
/// use tpcomm_transport::{DeviceCommunicator, LocalGroup, NcclCommunicator, ReduceOp};
///
/// let host = LocalGroup::new(1).communicators()?.remove(0);
/// let nccl = NcclCommunicator::new(&host, 0)?;
/// let mut x = nccl.stream().clone_htod(&[1.0f32, 2.0, 3.0]).expect("copy");
/// nccl.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
/// nccl.synchronize()?;
/// # Ok::<(), tpcomm_transport::TransportError>(())
/// ```
pub struct NcclCommunicator {
    comm: CommHandle,
    lib: &'static NcclLibrary,
    rank: usize,
    size: usize,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<Lifecycle>,
    /// The bound on waits for the stream ([`with_timeout`](NcclCommunicator::with_timeout)).
    timeout: Option<Duration>,
}

// SAFETY: the NCCL communicator handle may be used from any thread, one at a time; every use
// of `comm` (collectives, suspend/resume, destroy) holds `state`'s lock (or `&mut self` in
// `Drop`), and binds the device context to the calling thread first.
unsafe impl Send for NcclCommunicator {}
// SAFETY: see `Send`: shared access reaches `comm` only under the lock.
unsafe impl Sync for NcclCommunicator {}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.ordinal)
            .field("library", self.lib)
            .finish()
    }
}

impl NcclCommunicator {
    /// Collective over `host`: an NCCL communicator with `host`'s ranks, this rank on device
    /// `device_ordinal`, running collectives on a new stream of that device.
    ///
    /// Fails on every rank when any rank could not load libnccl or libcuda
    /// ([`TransportError::LibraryMissing`]), find its device ([`TransportError::NoDevice`]),
    /// or (rank 0) create the unique id: the failing rank returns its own error, the others
    /// [`TransportError::Setup`] naming the failing ranks. Host communicator errors are
    /// returned as they are; an NCCL failure is [`TransportError::Nccl`]. Never panics.
    pub fn new<C: Communicator>(host: &C, device_ordinal: usize) -> Result<Self> {
        Self::bootstrap(host, || {
            let ctx = open_device(device_ordinal)?;
            let stream = ctx
                .new_stream()
                .map_err(|e| cuda_error(Op::Setup, "cuStreamCreate", e))?;
            Ok(stream)
        })
    }

    /// [`new`](Self::new) with collectives enqueued on `stream` (and its device); for
    /// collectives ordered with the caller's kernels without events.
    pub fn with_stream<C: Communicator>(host: &C, stream: Arc<CudaStream>) -> Result<Self> {
        Self::bootstrap(host, || {
            // The stream exists, so the driver is loaded; probe libnccl next, as `new` does.
            Ok(stream)
        })
    }

    fn bootstrap<C: Communicator>(
        host: &C,
        local: impl FnOnce() -> Result<Arc<CudaStream>>,
    ) -> Result<Self> {
        let (rank, size) = (host.rank(), host.size());
        let _span = tracing::debug_span!("nccl_bootstrap", rank, size).entered();
        let prepared = NcclLibrary::load().and_then(|lib| {
            let stream = local()?;
            let id = if rank == 0 {
                stream
                    .context()
                    .bind_to_thread()
                    .map_err(|e| cuda_error(Op::Setup, "cuCtxSetCurrent", e))?;
                let mut id = UniqueId { internal: [0; 128] };
                // SAFETY: out-pointer to a local of the right type.
                let code = unsafe { (lib.get_unique_id)(&mut id) };
                lib.check(Op::Setup, "ncclGetUniqueId", code, std::ptr::null_mut())?;
                Some(id)
            } else {
                None
            };
            Ok((lib, stream, id))
        });
        // Every rank learns whether every rank is ready before anyone enters NCCL.
        let mut ready = vec![0u8; size];
        host.all_gather(&[u8::from(prepared.is_ok())], &mut ready)?;
        let failed: Vec<usize> = (0..size).filter(|&r| ready[r] == 0).collect();
        let (lib, stream, id) = prepared?;
        if !failed.is_empty() {
            return Err(TransportError::Setup(format!(
                "NCCL communicator not created: ranks {failed:?} could not set up NCCL or \
                 their device (see their errors)"
            )));
        }
        let mut id_bytes = [0u8; UNIQUE_ID_BYTES];
        if let Some(id) = &id {
            for (b, &c) in id_bytes.iter_mut().zip(id.internal.iter()) {
                *b = c as u8;
            }
        }
        host.broadcast(0, &mut id_bytes)?;
        let mut id = UniqueId { internal: [0; 128] };
        for (c, &b) in id.internal.iter_mut().zip(id_bytes.iter()) {
            *c = b as c_char;
        }
        let too_large = |what: &str, v: usize| {
            TransportError::Setup(format!("{what} {v} does not fit NCCL's int"))
        };
        let nranks = c_int::try_from(size).map_err(|_| too_large("size", size))?;
        let my_rank = c_int::try_from(rank).map_err(|_| too_large("rank", rank))?;
        let ctx = stream.context().clone();
        ctx.bind_to_thread()
            .map_err(|e| cuda_error(Op::Setup, "cuCtxSetCurrent", e))?;
        let mut comm: CommHandle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `id` is the id rank 0 created, the same on every
        // rank; rank and size are in range and the device's context is current.
        let code = unsafe { (lib.comm_init_rank)(&mut comm, nranks, id, my_rank) };
        lib.check(Op::Setup, "ncclCommInitRank", code, std::ptr::null_mut())?;
        tracing::debug!(
            rank,
            size,
            device = ctx.ordinal(),
            nccl = lib.version,
            "NCCL communicator created"
        );
        Ok(Self {
            comm,
            lib,
            rank,
            size,
            ordinal: ctx.ordinal(),
            ctx,
            stream,
            state: Mutex::new(Lifecycle::Active),
            timeout: None,
        })
    }

    /// The loaded NCCL library (path, version, whether it can suspend).
    pub fn library(&self) -> &'static NcclLibrary {
        self.lib
    }

    fn bind(&self, op: Op) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error(op, "cuCtxSetCurrent", e))
    }

    fn cu_stream(&self) -> StreamHandle {
        self.stream.cu_stream().cast()
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let rank = self.rank;
        let mut state = std::mem::replace(&mut *self.lock(), Lifecycle::Active);
        if matches!(state, Lifecycle::Aborted(_)) {
            // `ncclCommAbort` freed it already.
            return;
        }
        if let Err(e) = self.bind(Op::Setup) {
            tracing::warn!(rank, error = %e, "cannot bind the device before destroying the NCCL communicator");
        }
        // Finalizing waits for the enqueued work, which a missing peer never lets finish:
        // with a timeout, drain first and abort instead when it runs out.
        if self.timeout.is_some() {
            if let Err(e) = self.drain(&mut state, Op::Setup) {
                tracing::warn!(rank, error = %e, "NCCL communicator dropped with unfinished work");
                if !matches!(state, Lifecycle::Aborted(_)) {
                    self.abort(&mut state, e.to_string());
                }
                return;
            }
        }
        // SAFETY: `comm` is live and used by nobody else (`&mut self`); it is finalized then
        // destroyed once, and never used afterwards.
        let finalized = unsafe { (self.lib.comm_finalize)(self.comm) };
        if let Err(e) = self
            .lib
            .check(Op::Setup, "ncclCommFinalize", finalized, self.comm)
        {
            tracing::warn!(rank, error = %e, "NCCL communicator not finalized");
        }
        // SAFETY: as above; destroy frees the communicator even after a failed finalize.
        let destroyed = unsafe { (self.lib.comm_destroy)(self.comm) };
        if let Err(e) = self.lib.check(
            Op::Setup,
            "ncclCommDestroy",
            destroyed,
            std::ptr::null_mut(),
        ) {
            tracing::warn!(rank, error = %e, "NCCL communicator not destroyed");
        }
    }
}

#[cfg(test)]
mod tests;
