//! All-reduces of caller memory that is not peer memory (`all_reduce_device` on CUDA): a
//! registered buffer at the input's address, one slot per call while the stream is being
//! captured, else the staging copy. Tested without a GPU in `engine_capture`.

#[cfg(feature = "cuda")]
use cudarc::driver::{DevicePtr, DevicePtrMut};
#[cfg(feature = "cuda")]
use tpcomm_ipc::{CudaBuffer, DevicePeerMemory};
use tpcomm_ipc::{MemoryRegion, Region};

use super::launch::{byte_count, check_no_alias};
use super::tables::PEER_ALIGN;
use super::CustomAllReduce;
#[cfg(feature = "cuda")]
use crate::backend::cuda::{shareable_input, CudaBackend};
use crate::backend::{Backend, Buffer};
use crate::dispatch::Algorithm;
use crate::dtype::DType;
#[cfg(feature = "cuda")]
use crate::dtype::Element;
use crate::error::{AllReduceError, Result};

/// Fails with [`AllReduceError::BufferTooSmall`] unless an output of `len` elements holds
/// `count`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn output_holds(len: usize, count: usize) -> Result<()> {
    if len < count {
        return Err(AllReduceError::BufferTooSmall {
            buffer: "output",
            len,
            count,
        });
    }
    Ok(())
}

impl<B: Backend> CustomAllReduce<B> {
    /// The all-reduce of a caller's device memory that is not a buffer of the backend's
    /// peer memory (cudarc views on CUDA): `input_addr` holds `count` elements of `dtype`
    /// (the caller's view says so), `out` is the caller's output, already checked to hold
    /// them and to be aligned.
    ///
    /// - a registered buffer at `input_addr`: zero-copy through its slot;
    /// - while the backend records a graph: the call takes the next free slot (one per
    ///   call, in lockstep with every rank). When `shareable()` says this rank's input can
    ///   be exported to peers, the slot names the input (zero-copy); otherwise the
    ///   staging copy (`stage`) is recorded into the graph and the slot names this rank's
    ///   staging buffer. Either way every rank's `k`-th call reads slot `k`, and
    ///   `register_graph_buffers` fills it from whatever each rank exported;
    /// - eager: `stage` copies the input into the staging buffer (stream-ordered), slot 0.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn all_reduce_external(
        &mut self,
        call: &'static str,
        input_addr: u64,
        shareable: impl FnOnce() -> Result<bool>,
        stage: impl FnOnce(&B, &Buffer<B>, usize) -> Result<()>,
        out: u64,
        dtype: DType,
        count: usize,
    ) -> Result<Algorithm> {
        let bytes = byte_count(dtype, count)?;
        let recording = self.backend.capturing()?;
        let registered = self.slot_of(input_addr, bytes);
        // The route first, from the call's shape alone (every rank of a same-shaped call
        // gets the same answer): a rank whose communicator failed, or whose output the
        // kernels cannot write, still takes the fallback its peers take, instead of failing
        // alone while they wait in it. Slot 0 (the staging slot) exactly when neither
        // registered nor recording.
        let algorithm = self.choose(dtype, bytes, registered.is_none() && !recording)?;
        self.lifecycle.check_operation(call)?;
        if !out.is_multiple_of(PEER_ALIGN as u64) {
            return Err(AllReduceError::Misaligned {
                buffer: "output",
                addr: out,
                align: PEER_ALIGN,
            });
        }
        // A registered slot is marked captured by the launch that records it.
        let (slot, staged) = match registered {
            Some(slot) => (slot, false),
            None if recording => {
                // A one-stage output overlapping its input (an in-place call) is served
                // from the staging copy: peers read the input until the end barrier.
                let in_place = check_no_alias(algorithm, input_addr, out, bytes).is_err();
                if !in_place && shareable()? {
                    (
                        self.pending_slot(Region {
                            addr: input_addr,
                            len: bytes,
                        })?,
                        false,
                    )
                } else {
                    let staging = self.resources(call)?.staging.addr();
                    (
                        self.pending_slot(Region {
                            addr: staging,
                            len: bytes,
                        })?,
                        true,
                    )
                }
            }
            None => (0, true),
        };
        if staged {
            let res = self.resources(call)?;
            if let Err(e) = stage(&self.backend, &res.staging, bytes) {
                return Err(self.lifecycle.fail(call, e));
            }
        } else {
            // Passes for a slot taken above (an overlapping call is staged).
            check_no_alias(algorithm, input_addr, out, bytes)?;
        }
        tracing::trace!(
            rank = self.rank,
            slot,
            staged,
            recording,
            "all-reduce of caller memory"
        );
        let launched = self.launch(call, slot, dtype, count, algorithm, out, recording, None);
        if launched.is_err() && registered.is_none() && recording {
            self.give_back_pending(slot);
        }
        launched.map(|()| algorithm)
    }
}

#[cfg(feature = "cuda")]
impl<M: DevicePeerMemory> CustomAllReduce<CudaBackend<M>> {
    /// All-reduce (sum) of a caller's device memory, vLLM's `custom_all_reduce(tensor)`:
    /// `input` and `output` are any cudarc views ([`CudaSlice`](cudarc::driver::CudaSlice),
    /// [`CudaView`](cudarc::driver::CudaView), [`CudaBuffer::view`](tpcomm_ipc::CudaBuffer::view))
    /// of `f32`, `f16` or `bf16`; the whole input (`input.len()` elements) is reduced into
    /// the first `input.len()` elements of `output`. Everything is issued on the backend's
    /// stream ([`CudaBackend::with_stream`]: the caller's), asynchronously.
    ///
    /// - **Eager**: the input is copied into the registered staging buffer
    ///   (stream-ordered), the kernel writes straight into `output`. A registered input
    ///   ([`register_buffer`](Self::register_buffer), passed as its
    ///   [`view`](tpcomm_ipc::CudaBuffer::view)) is reduced without the copy.
    /// - **During a capture of the stream** (the caller's own `cuStreamBeginCapture`, or
    ///   [`capture_graph`](Self::capture_graph)): the call takes the next RankData slot (one
    ///   per call), filled by [`register_graph_buffers`](Self::register_graph_buffers) after
    ///   the capture. Memory that legacy CUDA IPC can export (`cuMemAlloc`, e.g.
    ///   [`CudaMemory::allocate`](tpcomm_ipc::PeerMemory::allocate)) and is 16-byte
    ///   aligned is shared zero-copy; anything else (cudarc's own allocations come from the
    ///   stream-ordered pool, which legacy IPC cannot export) has its staging copy captured
    ///   into the graph, so the graph is correct either way.
    ///
    /// Errors, before anything runs on this rank: [`AllReduceError::BufferTooSmall`]
    /// (output shorter than the input), then [`AllReduceError::Fallback`] (empty, a size
    /// not a multiple of 16 bytes, above `max_bytes`, no kernel or no peer access: every
    /// rank of a same-shaped call gets the same reason, decided before this rank's phase or
    /// output alignment is looked at, so that a rank whose communicator failed or whose
    /// output is misaligned still joins its peers in the fallback), then the phase, then
    /// [`AllReduceError::Misaligned`] (output not 16-byte aligned, for a call the kernels
    /// serve). The checks of every launch (shape word at the start barrier, region limits
    /// of every slot) apply as for [`all_reduce_buffer`](Self::all_reduce_buffer).
    pub fn all_reduce_device<T, I, O>(&mut self, input: &I, output: &mut O) -> Result<Algorithm>
    where
        T: Element,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let count = input.len();
        output_holds(output.len(), count)?;
        let memory = self.memory()?.clone();
        let stream = self.backend().stream().clone();
        // cudarc's protocol: the stream waits for earlier writes of the input and for earlier
        // reads and writes of the output (where the caller's context tracks events); the
        // guards record this call's use when they drop, after everything is issued.
        let (input_addr, _input_guard) = input.device_ptr(&stream);
        let (out, _output_guard) = output.device_ptr_mut(&stream);
        let bytes = count.saturating_mul(T::DTYPE.size());
        let stage_captured = self.backend().options().stage_captured_inputs;
        let shareable = || Ok(!stage_captured && shareable_input(&memory, input_addr, bytes)?);
        let stage = |backend: &CudaBackend<M>, staging: &CudaBuffer, bytes: usize| {
            // The input view holds `count` elements, `bytes` bytes, and its guard is held
            // until the copy is issued.
            backend.stage_from(input_addr, staging, 0, bytes)
        };
        self.all_reduce_external(
            "all_reduce_device",
            input_addr,
            shareable,
            stage,
            out,
            T::DTYPE,
            count,
        )
    }
}
