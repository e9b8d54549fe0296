//! [`DeviceAllReduce`]: the custom CUDA kernels where they serve, NCCL everywhere else.

use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use half::{bf16, f16};
use tpcomm_ipc::{CudaBuffer, CudaMemory, DevicePeerMemory};
use tpcomm_transport::device::{DeviceCommunicator, DeviceElement, ReduceOp};
use tpcomm_transport::{Communicator, NcclCommunicator};

use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::custom_all_reduce::{output_holds, CaptureMark, Config, CustomAllReduce, DeviceGraph};
use crate::dispatch::{Algorithm, FallbackReason, Reproducibility};
use crate::dtype::{DType, Element};
use crate::error::{AllReduceError, Result};
use crate::lifecycle::{join_every_step, Phase};

/// Which path served an all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The custom peer-memory kernel.
    Custom(Algorithm),
    /// The custom kernels in `launches` launches of at most `max_bytes`, for an input above
    /// it: [`Reproducibility::BitStable`], which gives the same bits as one launch.
    Chunked {
        /// Kernel launches issued.
        launches: usize,
        /// Why one launch could not take it ([`FallbackReason::TooLarge`]).
        reason: FallbackReason,
    },
    /// NCCL, for this reason.
    Nccl(FallbackReason),
}

/// The all-reduce of an inference engine on CUDA: the custom kernels
/// ([`CustomAllReduce<CudaBackend>`]) when the devices are fully connected (P2P) and the
/// size, element type and world size have a kernel; NCCL on the same stream otherwise, with
/// the reason traced (`debug`) and returned.
///
/// Both paths are collective: every rank must pass the same element type and count, so that
/// every rank takes the same path.
///
/// With [`Reproducibility::BitStable`] (the default), inputs above `max_bytes` (a multiple
/// of 16 bytes) run through the kernels in pieces of at most `max_bytes` instead of NCCL
/// ([`Route::Chunked`]), so that an element's sum does not depend on the size of the call;
/// NCCL still serves what the kernels cannot take at all (a topology without P2P or
/// NVLink, a world size without kernels, sizes that are not a multiple of 16 bytes), and
/// its order is its own.
#[derive(Debug)]
pub struct DeviceAllReduce<M: DevicePeerMemory = CudaMemory> {
    custom: CustomAllReduce<CudaBackend<M>>,
    nccl: NcclCommunicator,
}

impl<M: DevicePeerMemory> DeviceAllReduce<M> {
    /// Collective: the CUDA backend on `memory`'s device, the custom all-reduce over it and
    /// an NCCL communicator on the backend's stream, bootstrapped through `comm`.
    pub fn new<C: Communicator>(
        comm: &C,
        memory: M,
        options: CudaOptions,
        config: Config,
    ) -> Result<Self> {
        let backend = CudaBackend::new(comm, &memory, options)?;
        Self::on_backend(comm, memory, backend, config)
    }

    /// Collective: [`new`](Self::new) on the caller's stream (an engine's): both paths (the
    /// custom kernels and NCCL) issue their work on `stream`, in order with the caller's own
    /// work there, and a capture the caller runs on `stream` records whichever path serves
    /// each call (NCCL calls are captured as NCCL graph nodes). See
    /// [`CudaBackend::with_stream`] for what the stream must be.
    pub fn with_stream<C: Communicator>(
        comm: &C,
        memory: M,
        options: CudaOptions,
        config: Config,
        stream: Arc<CudaStream>,
    ) -> Result<Self> {
        let backend = CudaBackend::with_stream(comm, &memory, options, stream)?;
        Self::on_backend(comm, memory, backend, config)
    }

    fn on_backend<C: Communicator>(
        comm: &C,
        memory: M,
        backend: CudaBackend<M>,
        config: Config,
    ) -> Result<Self> {
        let nccl = NcclCommunicator::with_stream(comm, backend.stream().clone())?;
        let custom = CustomAllReduce::new(backend, memory, comm, config)?;
        Ok(Self { custom, nccl })
    }

    /// The stream both paths issue their work on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.custom.backend().stream()
    }

    /// Sums `input` over every rank into the first `input.len()` elements of `output`
    /// (cudarc views of `f32`, `f16`, `bf16`), through the custom kernel
    /// ([`CustomAllReduce::all_reduce_device`]: eager staging copy, or a graph slot while
    /// the stream is being captured) or, for every [`FallbackReason`], NCCL on the same
    /// stream (also inside a capture). Returns which path served it; asynchronous.
    ///
    /// Every rank must pass the same element type and count, so that every rank takes the
    /// same path.
    pub fn all_reduce_device<T, I, O>(&mut self, input: &I, output: &mut O) -> Result<Route>
    where
        T: Element + DeviceElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        match self.custom.all_reduce_device(input, output) {
            Ok(algorithm) => Ok(Route::Custom(algorithm)),
            Err(AllReduceError::Fallback(reason)) if self.chunks(&reason) => {
                let launches = self.custom.all_reduce_device_in_pieces(input, output)?;
                Ok(Route::Chunked { launches, reason })
            }
            Err(AllReduceError::Fallback(reason)) => {
                tracing::debug!(%reason, dtype = T::DTYPE.name(), count = input.len(), "all-reduce falls back to NCCL");
                output_holds(output.len(), input.len())?;
                if output.len() == input.len() {
                    self.nccl.all_reduce(input, output, ReduceOp::Sum)?;
                } else {
                    let mut head = OutputHead {
                        inner: output,
                        len: input.len(),
                        marker: std::marker::PhantomData,
                    };
                    self.nccl.all_reduce(input, &mut head, ReduceOp::Sum)?;
                }
                Ok(Route::Nccl(reason))
            }
            Err(e) => Err(e),
        }
    }

    /// See [`CustomAllReduce::capture_mark`].
    pub fn capture_mark(&self) -> CaptureMark {
        self.custom.capture_mark()
    }

    /// See [`CustomAllReduce::adopt_graph`].
    pub fn adopt_graph(&self, graph: CudaGraph, mark: CaptureMark) -> Result<DeviceGraph> {
        self.custom.adopt_graph(graph, mark)
    }

    /// Collective, after a capture: see [`CustomAllReduce::register_graph_buffers`]. The
    /// NCCL nodes of a graph need nothing.
    pub fn register_graph_buffers<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<usize> {
        self.custom.register_graph_buffers(comm)
    }

    /// Fails unless a graph holding custom all-reduces may be launched now (see
    /// [`CustomAllReduce::check_replay`]).
    pub fn check_replay(&self) -> Result<()> {
        self.custom.check_replay()
    }

    /// Launches an adopted or captured graph after the custom path's checks (see
    /// [`CustomAllReduce::replay_graph`]).
    pub fn replay_graph(&mut self, graph: &DeviceGraph) -> Result<()> {
        self.custom.replay_graph(graph)
    }

    /// The custom all-reduce's lifecycle phase.
    pub fn phase(&self) -> Phase {
        self.custom.phase()
    }

    /// Whether [`prepare_for_suspend`](Self::prepare_for_suspend) would start on this rank
    /// ([`CustomAllReduce::check_suspend`]). Whether NCCL can release its memory is the
    /// library's (`NcclLibrary::supports_suspend`).
    pub fn check_suspend(&self) -> Result<()> {
        self.custom.check_suspend()
    }

    /// [`CustomAllReduce::check_checkpoint`] of the custom part: fails unless every peer
    /// buffer it maps would come back after a process checkpoint.
    pub fn check_checkpoint(&self) -> Result<()> {
        self.custom.check_checkpoint()
    }

    /// The custom all-reduce (registration, capture, suspend/resume).
    pub fn custom(&mut self) -> &mut CustomAllReduce<CudaBackend<M>> {
        &mut self.custom
    }

    /// The NCCL communicator.
    pub fn nccl(&self) -> &NcclCommunicator {
        &self.nccl
    }

    /// Sums the first `count` elements of `input` over every rank into `output`, both on
    /// this rank's device, through the custom kernel or NCCL; returns which served it.
    /// Asynchronous on the backend's stream (see [`synchronize`](Self::synchronize)).
    pub fn all_reduce(
        &mut self,
        input: &CudaBuffer,
        output: &CudaBuffer,
        dtype: DType,
        count: usize,
    ) -> Result<Route> {
        match self.custom.all_reduce_buffer(input, output, dtype, count) {
            Ok(algorithm) => Ok(Route::Custom(algorithm)),
            Err(AllReduceError::Fallback(reason)) if self.chunks(&reason) => {
                let launches = match dtype {
                    DType::F32 => self.buffer_in_pieces::<f32>(input, output, count)?,
                    DType::F16 => self.buffer_in_pieces::<f16>(input, output, count)?,
                    DType::Bf16 => self.buffer_in_pieces::<bf16>(input, output, count)?,
                };
                Ok(Route::Chunked { launches, reason })
            }
            Err(AllReduceError::Fallback(reason)) => {
                tracing::debug!(%reason, dtype = dtype.name(), count, "all-reduce falls back to NCCL");
                match dtype {
                    DType::F32 => self.nccl_sum::<f32>(input, output, count)?,
                    DType::F16 => self.nccl_sum::<f16>(input, output, count)?,
                    DType::Bf16 => self.nccl_sum::<bf16>(input, output, count)?,
                }
                Ok(Route::Nccl(reason))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether an input refused for `reason` runs through the kernels in pieces: an input
    /// above `max_bytes`, with [`Reproducibility::BitStable`].
    fn chunks(&self, reason: &FallbackReason) -> bool {
        self.custom.config().reproducibility == Reproducibility::BitStable
            && matches!(reason, FallbackReason::TooLarge { .. })
    }

    /// [`CustomAllReduce::all_reduce_device_in_pieces`] of the first `count` elements of two
    /// buffers.
    fn buffer_in_pieces<T: Element + DeviceElement>(
        &mut self,
        input: &CudaBuffer,
        output: &CudaBuffer,
        count: usize,
    ) -> Result<usize> {
        let stream = self.nccl.stream().clone();
        let send = input.view::<T>(count, &stream)?;
        let mut recv = output.view::<T>(count, &stream)?;
        self.custom.all_reduce_device_in_pieces(&send, &mut recv)
    }

    fn nccl_sum<T: DeviceElement>(
        &self,
        input: &CudaBuffer,
        output: &CudaBuffer,
        count: usize,
    ) -> Result<()> {
        let stream = self.nccl.stream();
        let send = input.view::<T>(count, stream)?;
        let mut recv = output.view::<T>(count, stream)?;
        Ok(self.nccl.all_reduce(&send, &mut recv, ReduceOp::Sum)?)
    }

    /// Collective: suspends both paths — the custom all-reduce closes every peer mapping
    /// ([`CustomAllReduce::prepare_for_suspend`]), then NCCL releases its memory where the
    /// loaded library has `ncclCommSuspend` (2.29+; older ones keep it, traced).
    ///
    /// A rank whose custom part fails still joins the collective `ncclCommSuspend` (its peers
    /// are in it), then reports the first failure; any failure leaves the custom all-reduce
    /// Failed, so every later call returns it. Refusals that change nothing (a communicator
    /// of another group; a capture running on the stream) return before either path is
    /// touched, as [`CustomAllReduce::prepare_for_suspend`]'s own do.
    pub fn prepare_for_suspend<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.custom.check_communicator(comm)?;
        self.custom.refuse_while_capturing("prepare_for_suspend")?;
        let (custom, nccl) = (&mut self.custom, &self.nccl);
        let mut suspend_custom = || custom.prepare_for_suspend(comm);
        let mut suspend_nccl = || {
            if nccl.is_suspended() {
                // Repeating a successful suspend is a no-op, as for the custom path.
            } else if nccl.library().supports_suspend() {
                nccl.suspend()?;
            } else {
                tracing::debug!(
                    version = nccl.library().version(),
                    "NCCL has no ncclCommSuspend: its memory stays allocated while suspended"
                );
            }
            Ok(())
        };
        let outcome = join_every_step(&mut [&mut suspend_custom, &mut suspend_nccl]);
        outcome.map_err(|e| self.custom.fail("prepare_for_suspend", e))
    }

    /// Collective: the reverse of [`prepare_for_suspend`](Self::prepare_for_suspend): NCCL
    /// resumes (where it was suspended), then the custom all-reduce reopens every mapping and
    /// rewrites its tables ([`CustomAllReduce::reinit_after_resume`]). A rank whose NCCL
    /// resume fails still joins the custom steps, then reports the first failure (the custom
    /// all-reduce is then Failed). Refusals that change nothing return first, as in
    /// [`prepare_for_suspend`](Self::prepare_for_suspend).
    pub fn reinit_after_resume<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.custom.check_communicator(comm)?;
        self.custom.refuse_while_capturing("reinit_after_resume")?;
        let (custom, nccl) = (&mut self.custom, &self.nccl);
        let mut resume_nccl = || {
            if nccl.is_suspended() {
                nccl.resume()?;
            }
            Ok(())
        };
        let mut resume_custom = || custom.reinit_after_resume(comm);
        let outcome = join_every_step(&mut [&mut resume_nccl, &mut resume_custom]);
        outcome.map_err(|e| self.custom.fail("reinit_after_resume", e))
    }

    /// Collective close of the custom path ([`CustomAllReduce::close_with`]): no peer frees
    /// its Signal, staging or temp buffers while this rank may still read them (on CUDA, a
    /// peer's `cuMemFree` under this rank's open IPC mapping is undefined behaviour). The
    /// NCCL communicator is released when `self` is dropped.
    pub fn close_with<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.custom.close_with(comm)
    }

    /// Waits for everything issued on the stream and reports a kernel timeout.
    pub fn synchronize(&mut self) -> Result<()> {
        self.custom.synchronize()?;
        Ok(self.nccl.synchronize()?)
    }
}

/// The first `len` elements of a caller's output, for NCCL (which writes exactly as many
/// elements as it reads).
struct OutputHead<'o, T, O: DevicePtrMut<T>> {
    inner: &'o mut O,
    len: usize,
    marker: std::marker::PhantomData<T>,
}

impl<T, O: DevicePtrMut<T>> DeviceSlice<T> for OutputHead<'_, T, O> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }
}

impl<T, O: DevicePtrMut<T>> DevicePtrMut<T> for OutputHead<'_, T, O> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.inner.device_ptr_mut(stream)
    }
}
