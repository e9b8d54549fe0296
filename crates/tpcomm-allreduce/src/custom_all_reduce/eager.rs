//! The eager entry points: host slices (`all_reduce`, `all_reduce_or_transport`) and buffers
//! of the backend's memory (`all_reduce_buffer`, which also reads registered inputs in place
//! and records launches during a capture). The parts of an eager input peers read are staged.

use tpcomm_ipc::{MemoryRegion, PeerMemory, Region};
use tpcomm_transport::Communicator;

use super::launch::check_no_alias;
use super::CustomAllReduce;
use crate::backend::{Backend, Buffer};
use crate::dispatch::{Algorithm, FallbackReason, Reproducibility};
use crate::dtype::{DType, Element};
use crate::error::{AllReduceError, Result};

/// Which path served [`CustomAllReduce::all_reduce_or_transport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRoute {
    /// The custom peer-memory all-reduce, in one launch with this algorithm.
    Custom(Algorithm),
    /// The custom all-reduce in `launches` launches (0 for an empty input), because one
    /// launch cannot take the input, for `reason` (above `max_bytes`, not a multiple of 16
    /// bytes): [`Reproducibility::BitStable`], which gives the same bits as one launch.
    Chunked {
        /// Custom launches that ran.
        launches: usize,
        /// Why one launch could not take it.
        reason: FallbackReason,
    },
    /// The transport's numeric all-reduce ([`Communicator::all_reduce`]), for this reason:
    /// the custom kernels cannot serve the input, or the dispatch table chose the transport
    /// (both with [`Reproducibility::AnyOrder`] only, but for reasons no chunking helps,
    /// such as a world size without kernels).
    Transport(FallbackReason),
}

/// The byte ranges of a `bytes`-byte input that an eager call stages: all of it, or what is
/// left around `private` (elements, from [`Backend::private_part`]), which only this rank
/// reads and the launch takes from the caller's input. Empty ranges are left out.
fn staged_ranges(
    private: Option<std::ops::Range<usize>>,
    dtype: DType,
    bytes: usize,
) -> Result<impl Iterator<Item = std::ops::Range<usize>>> {
    let ranges = match private {
        None => [0..bytes, bytes..bytes],
        Some(part) => {
            let start = part.start.saturating_mul(dtype.size());
            let end = part.end.saturating_mul(dtype.size());
            if start > end || end > bytes {
                return Err(AllReduceError::InvalidArgument(format!(
                    "the backend named bytes {start}..{end} of a {bytes}-byte input as private"
                )));
            }
            [0..start, end..bytes]
        }
    };
    Ok(ranges.into_iter().filter(|r| !r.is_empty()))
}

impl<B: Backend> CustomAllReduce<B> {
    /// Eager all-reduce: copies `input` into the staging buffer and reduces every rank's
    /// staging buffer into `output`. Returns the algorithm used, or
    /// [`AllReduceError::Fallback`] with the reason when the custom path cannot serve it.
    pub fn all_reduce<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<Algorithm> {
        self.check_host_addressable("all_reduce")?;
        if input.len() != output.len() {
            return Err(AllReduceError::InvalidArgument(format!(
                "input has {} elements, output {}",
                input.len(),
                output.len()
            )));
        }
        // The route first, from the shape and the agreed settings alone: a rank whose
        // communicator is Failed or Closed still reports a fallback size as `Fallback`, so
        // that `all_reduce_or_transport` takes the transport with its peers instead of
        // failing alone while they wait there.
        let bytes = std::mem::size_of_val(input);
        let algorithm = self.choose(T::DTYPE, bytes, true)?;
        self.lifecycle.check_operation("all_reduce")?;
        let res = self.resources("all_reduce")?;
        let memory = res.peers.backend();
        let raw: &[u8] = bytemuck::cast_slice(input);
        // Peers read the staging copy; a part that none of them reads (this rank's own part
        // of a two-stage reduction) is read from `input` itself instead, and not copied.
        let private =
            self.backend
                .private_part(algorithm, T::DTYPE, input.len(), self.rank, self.world);
        for range in staged_ranges(private.clone(), T::DTYPE, bytes)? {
            memory.write(&res.staging, range.start, &raw[range])?;
        }
        let own_input = private.map(|part| (input.as_ptr() as u64, part));
        let out = output.as_mut_ptr() as u64;
        self.launch(
            "all_reduce",
            0,
            T::DTYPE,
            input.len(),
            algorithm,
            out,
            false,
            own_input,
        )?;
        Ok(algorithm)
    }

    /// [`all_reduce`](Self::all_reduce) that never leaves an input unserved. When one custom
    /// launch cannot take it ([`AllReduceError::Fallback`]):
    ///
    /// - with [`Reproducibility::BitStable`] (the default), an input above `max_bytes` or
    ///   whose size is not a multiple of 16 bytes is reduced in several custom launches
    ///   (pieces of the staging buffer's size, the last padded to 16 bytes), which give the
    ///   same bits as one launch: [`HostRoute::Chunked`]. An empty input runs nothing;
    /// - otherwise (`AnyOrder`, or a reason no chunking helps) the sum runs through the
    ///   transport's numeric all-reduce ([`Communicator::all_reduce`]: `MPI_Allreduce` under
    ///   MPI, a real reduction on the threads backend) on `comm`: [`HostRoute::Transport`].
    ///
    /// Returns which path ran. Collective like both paths: every rank must pass the same
    /// element type and count, so that every rank takes the same path (the choice depends
    /// only on the size and on the settings every rank agreed on in [`new`](Self::new)). A
    /// rank that passes another size anyway is reported, not summed: by the transport's
    /// agreement check where it has one (threads), or by the custom launch's timeout naming
    /// the rank that did not join.
    ///
    /// ```
    /// use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend, HostRoute};
    /// use tpcomm_ipc::HostMemory;
    /// use tpcomm_transport::{Communicator, LocalGroup};
    ///
    /// let results = LocalGroup::new(2).run(|comm| -> tpcomm_allreduce::Result<Vec<HostRoute>> {
    ///     let mut ar = CustomAllReduce::new(HostBackend::new(), HostMemory::new(), &comm, Config::default())?;
    ///     let mut routes = Vec::new();
    ///     for len in [64, 3] {
    ///         // 64 f32 = 256 bytes: one custom launch; 3 f32 = 12 bytes, not a multiple of
    ///         // 16: one launch padded to 16 bytes (bit-stable, the default).
    ///         let input = vec![comm.rank() as f32 + 1.0; len];
    ///         let mut out = vec![0f32; len];
    ///         routes.push(ar.all_reduce_or_transport(&comm, &input, &mut out)?);
    ///         assert_eq!(out, vec![3.0f32; len]);
    ///     }
    ///     Ok(routes)
    /// });
    /// for r in results {
    ///     let routes = r.unwrap().unwrap();
    ///     assert!(matches!(routes[0], HostRoute::Custom(_)));
    ///     assert!(matches!(routes[1], HostRoute::Chunked { launches: 1, .. }));
    /// }
    /// ```
    pub fn all_reduce_or_transport<T, C>(
        &mut self,
        comm: &C,
        input: &[T],
        output: &mut [T],
    ) -> Result<HostRoute>
    where
        T: Element + tpcomm_transport::reduce::Element,
        C: Communicator + ?Sized,
    {
        match self.all_reduce(input, output) {
            Ok(algorithm) => Ok(HostRoute::Custom(algorithm)),
            Err(AllReduceError::Fallback(reason))
                if self.config.reproducibility == Reproducibility::BitStable
                    && reason.chunkable() =>
            {
                let _span = tracing::debug_span!(
                    "allreduce_chunked",
                    rank = self.rank,
                    reason = %reason
                )
                .entered();
                let launches = self.all_reduce_in_pieces(input, output)?;
                Ok(HostRoute::Chunked { launches, reason })
            }
            Err(AllReduceError::Fallback(reason)) => {
                let _span = tracing::debug_span!(
                    "allreduce_transport_fallback",
                    rank = self.rank,
                    reason = %reason
                )
                .entered();
                comm.all_reduce_bytes(
                    Some(bytemuck::cast_slice(input)),
                    bytemuck::cast_slice_mut(output),
                    <T as tpcomm_transport::reduce::Element>::DTYPE,
                    tpcomm_transport::ReduceOp::Sum,
                )?;
                Ok(HostRoute::Transport(reason))
            }
            Err(e) => Err(e),
        }
    }

    /// All-reduce of the first `count` elements of `input` into `output`, both buffers of
    /// this backend's memory (device buffers for CUDA): the entry point of device backends,
    /// and of host programs that keep their tensors in shared memory.
    ///
    /// - `input` registered ([`register_buffer`](Self::register_buffer)): zero-copy through
    ///   its RankData slot.
    /// - While the backend is capturing a device graph ([`Backend::capturing`]): the input
    ///   takes the next free RankData slot and the launch is recorded; call
    ///   [`register_graph_buffers`](Self::register_graph_buffers) (collective) after the
    ///   capture, before the first replay. Nothing is copied between host and device.
    /// - Otherwise (eager, also for an input captured before): `input` is copied into the
    ///   staging buffer first; on the host backend, all but this rank's own part of a
    ///   two-stage reduction ([`Backend::private_part`]), which the launch reads from `input`.
    ///
    /// Returns the algorithm, or [`AllReduceError::Fallback`] with the reason when the
    /// custom path cannot serve it (nothing ran; the communicator stays usable).
    pub fn all_reduce_buffer(
        &mut self,
        input: &Buffer<B>,
        output: &Buffer<B>,
        dtype: DType,
        count: usize,
    ) -> Result<Algorithm> {
        self.lifecycle.check_operation("all_reduce_buffer")?;
        let bytes = self.checked_bytes(dtype, count, input.len(), output.len())?;
        let recording = self.backend.capturing()?;
        let registered = self.slot_of(input.addr(), bytes);
        // Slot 0 (the staging slot) exactly when neither registered nor recording.
        let algorithm = self.choose(dtype, bytes, registered.is_none() && !recording)?;
        if registered.is_some() || recording {
            // Before a slot is taken: a refused call takes none.
            check_no_alias(algorithm, input.addr(), output.addr(), bytes)?;
        }
        let slot = match registered {
            Some(slot) => Some(slot),
            None if recording => Some(self.pending_slot(Region {
                addr: input.addr(),
                len: bytes,
            })?),
            None => None,
        };
        match slot {
            Some(slot) => {
                let launched = self.launch(
                    "all_reduce_buffer",
                    slot,
                    dtype,
                    count,
                    algorithm,
                    output.addr(),
                    recording,
                    None,
                );
                if launched.is_err() && registered.is_none() {
                    self.give_back_pending(slot);
                }
                launched?;
            }
            None => {
                // As `all_reduce`: peers read the staging copy, but not this rank's own
                // part of a two-stage reduction, which the launch reads from `input`.
                let private = self
                    .backend
                    .private_part(algorithm, dtype, count, self.rank, self.world);
                let ranges = staged_ranges(private.clone(), dtype, bytes)?;
                let res = self.resources("all_reduce_buffer")?;
                for range in ranges {
                    if let Err(e) =
                        self.backend
                            .stage(res.peers.backend(), input, &res.staging, range)
                    {
                        return Err(self.lifecycle.fail("all_reduce_buffer", e));
                    }
                }
                self.launch(
                    "all_reduce_buffer",
                    0,
                    dtype,
                    count,
                    algorithm,
                    output.addr(),
                    false,
                    private.map(|part| (input.addr(), part)),
                )?;
            }
        }
        Ok(algorithm)
    }
}
