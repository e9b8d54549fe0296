//! The launch every entry point ends in: the size and alias checks, the algorithm (or the
//! fallback reason), the slot's checks (pending, retired, region limits) and the backend's
//! launch, whose failure leaves the communicator Failed; `synchronize` waits for launches.

use super::{CustomAllReduce, SlotSource};
use crate::backend::{Backend, Launch};
use crate::dispatch::{self, Algorithm, Choice, FallbackReason, Input};
use crate::dtype::DType;
use crate::error::{AllReduceError, Result};

pub(super) fn check_no_alias(
    algorithm: Algorithm,
    input: u64,
    output: u64,
    bytes: usize,
) -> Result<()> {
    if algorithm == Algorithm::OneStage && crate::backend::overlap(input, output, bytes) {
        return Err(AllReduceError::InvalidArgument(
            "the one-stage output must not overlap its input (peers read the input until the end barrier)".into(),
        ));
    }
    Ok(())
}

/// The bytes of `count` elements of `dtype`, refused when they overflow.
pub(super) fn byte_count(dtype: DType, count: usize) -> Result<usize> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| AllReduceError::InvalidArgument(format!("{count} elements overflow")))
}

impl<B: Backend> CustomAllReduce<B> {
    pub(super) fn checked_bytes(
        &self,
        dtype: DType,
        count: usize,
        input_len: usize,
        output_len: usize,
    ) -> Result<usize> {
        let bytes = byte_count(dtype, count)?;
        if bytes > input_len || bytes > output_len {
            return Err(AllReduceError::InvalidArgument(format!(
                "{count} {} elements ({bytes} bytes) do not fit the input ({input_len} bytes) or output ({output_len} bytes)",
                dtype.name()
            )));
        }
        Ok(bytes)
    }

    /// Runs one launch; a failure leaves the communicator Failed. `recording` (a device
    /// graph capture) may name a slot still waiting for `register_graph_buffers`, since
    /// nothing runs until the graph is replayed. `own_input`: [`Launch::own_input`] with the
    /// private part of the input it serves ([`Backend::private_part`], already computed by
    /// the caller to stage the rest).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch(
        &mut self,
        call: &'static str,
        slot: usize,
        dtype: DType,
        count: usize,
        algorithm: Algorithm,
        out: u64,
        recording: bool,
        own_input: Option<(u64, std::ops::Range<usize>)>,
    ) -> Result<()> {
        self.lifecycle.check_operation(call)?;
        let source = self.slots.get(slot).copied().flatten();
        let pending = source == Some(SlotSource::Pending);
        if pending && !recording {
            return Err(AllReduceError::UnregisteredGraphBuffers);
        }
        if source == Some(SlotSource::Retired) {
            return Err(AllReduceError::UnregisteredInput { slot });
        }
        // What every rank's region in the slot holds bounds what the launch reads (a
        // pending slot, only while recording, is checked by register_graph_buffers: every
        // rank's region there is exactly the captured size).
        let bytes = count.saturating_mul(dtype.size());
        let (limit, smallest) = self
            .slot_limits
            .get(slot)
            .copied()
            .unwrap_or((0, self.rank));
        if !pending && bytes > limit {
            return Err(AllReduceError::RegionTooSmall {
                buffer: "input",
                slot,
                bytes,
                rank: smallest,
                region_bytes: limit,
            });
        }
        if algorithm == Algorithm::TwoStage && bytes > self.temp_limit.0 {
            return Err(AllReduceError::RegionTooSmall {
                buffer: "temp",
                slot,
                bytes,
                rank: self.temp_limit.1,
                region_bytes: self.temp_limit.0,
            });
        }
        let res = self.resources(call)?;
        let launch = Launch {
            algorithm,
            dtype,
            count,
            rank: self.rank,
            world: self.world,
            rank_signals: &res.rank_signals,
            rank_data: &res.rank_data,
            slot,
            own_signal: &res.signal,
            out,
            own_input: own_input.as_ref().map(|(addr, _)| *addr),
            timeout: self.config.timeout,
            checked: crate::backend::Checked {
                signal_bytes: self.backend.signal_bytes(),
                host_addressable: self.backend.host_addressable(),
                private: own_input.map(|(_, private)| private),
            },
        };
        let _span = tracing::trace_span!(
            "allreduce",
            rank = self.rank,
            dtype = dtype.name(),
            count,
            algorithm = algorithm.name(),
            slot
        )
        .entered();
        match self.backend.launch(res.peers.backend(), &launch) {
            Ok(()) => {
                if recording {
                    self.recorded.push(slot);
                    self.captured[slot] = true;
                }
                Ok(())
            }
            Err(e) => Err(self.lifecycle.fail(call, e)),
        }
    }

    pub(super) fn check_host_addressable(&self, call: &'static str) -> Result<()> {
        if self.backend.host_addressable() {
            Ok(())
        } else {
            Err(AllReduceError::InvalidArgument(format!(
                "{call} takes host slices, but the {} backend reduces device buffers: use \
                 all_reduce_buffer",
                self.backend.name()
            )))
        }
    }

    /// The algorithm for `bytes` of `dtype`, or the reason the fallback must serve it;
    /// `staged`: a launch from the staging slot (slot 0). A function of the call's shape and
    /// the agreed settings alone (the table, `max_bytes`, a forced algorithm), so that every
    /// rank of a same-shaped call gets the same answer.
    pub(super) fn choose(&self, dtype: DType, bytes: usize, staged: bool) -> Result<Algorithm> {
        dispatch::check_size(bytes, self.world, self.config.max_bytes)
            .map_err(AllReduceError::Fallback)?;
        let input = if staged {
            Input::Staged
        } else {
            Input::Registered
        };
        let algorithm = match self.config.algorithm {
            Some(forced) => forced,
            None => match self.dispatch.choice(self.world, dtype, input, bytes) {
                Some(Choice::Custom(algorithm)) => algorithm,
                Some(Choice::Transport) => {
                    return Err(AllReduceError::Fallback(
                        FallbackReason::TableChoosesTransport { bytes },
                    ))
                }
                // Unreachable: `new` took the table over the backend's built-in one, which
                // covers every key, and checked that every key's bands reach `inf`.
                None => {
                    return Err(AllReduceError::InvalidArgument(format!(
                        "the dispatch table has no algorithm for {bytes} bytes of {} on {} ranks",
                        dtype.name(),
                        self.world
                    )))
                }
            },
        };
        self.backend
            .supports(self.world, dtype, bytes, algorithm)
            .map_err(AllReduceError::Fallback)?;
        Ok(algorithm)
    }

    /// Waits for every launch issued so far (device backends run them asynchronously) and
    /// reports a barrier timeout a launch recorded; a failure leaves the communicator
    /// Failed.
    pub fn synchronize(&mut self) -> Result<()> {
        self.lifecycle.check_operation("synchronize")?;
        // A capturing stream refuses to synchronize: that is the caller's mistake, not a
        // failure of the communicator.
        self.refuse_while_capturing("synchronize")?;
        let res = self.resources("synchronize")?;
        match self.backend.synchronize(res.peers.backend(), &res.signal) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.lifecycle.fail("synchronize", e)),
        }
    }
}
