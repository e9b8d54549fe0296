//! The host backend: a real CPU all-reduce over shared memory ([`HostMemory`]).
//!
//! A launch runs on the calling thread. It reads the RankSignals table and its RankData
//! slot *when it runs* (so a launch recorded before a suspend uses the addresses written
//! after the resume), then:
//!
//! - before the start barrier, this rank publishes the launch's *shape* (bytes, element
//!   type, RankData slot): the whole word in its own Signal block, and a 32-bit tag of it in
//!   every peer's block, in the cache line of the start flag it stores there next (so the
//!   tag travels with the flag: no extra line moves between cores). After the barrier it
//!   compares every peer's tag with its own. Different shapes (ranks reducing different
//!   counts, types or inputs) skip the work, cross the end barrier and fail with
//!   [`LaunchMismatch`](crate::AllReduceError::LaunchMismatch) on every rank (naming both
//!   shapes, read from the peer's own block), before any peer data is read: no extra round
//!   trip. The tag is the shape itself for launches up to 16 MiB from slots below 512 (so
//!   equal tags mean equal shapes), a 31-bit digest beyond (equal for different shapes with
//!   probability 2^-31).
//! - one-stage: start barrier; reduce every rank's input in rank order with f32
//!   accumulation into the output; end barrier (peers may still read this rank's input
//!   until then);
//! - two-stage: start barrier; reduce this rank's n-th of the elements into its temp
//!   buffer (and into the output, when that is apart from this rank's input or is the input
//!   itself); a release/acquire barrier (peers' temp writes visible); copy the other
//!   ranks' reduced n-ths (and this rank's, when it did not go to the output directly) from
//!   their temp buffers into the output; no end barrier (as the CUDA kernel: peers read
//!   this rank's input only before the mid barrier, and a peer still copying from this
//!   rank's temp buffer finishes before it joins the next launch's start barrier, after
//!   which alone this rank writes that buffer again; `flags`). An eager launch reads this
//!   rank's own n-th from the caller's input ([`Launch::own_input`]): only the parts peers
//!   read were staged.
//!
//! The reduction accumulates in f32, a block of 32 elements at a time whose sums stay in
//! registers across the inputs (one load per input element, one store per output element),
//! in loops the compiler vectorizes; it is built twice, for the baseline CPU and for AVX2 with F16C, and
//! the AVX2 build runs where the CPU has both (detected at run time). That build converts
//! f16 and bf16 with intrinsics in the loop (`wide`), bit for bit as `half` does.
//!
//! Barrier: this rank's epoch of the barrier's kind (its Signal counter of that kind + 1:
//! start, mid and end count apart) is stored with *release* into every peer's slot for
//! this rank, then this rank waits with *acquire* loads until every peer's slot in its own
//! block shows the epoch. Waits spin briefly, then yield, then sleep in
//! short steps (ranks may outnumber cores), and give up at the timeout naming the peer.
//! The barrier, the epoch and the order of a launch's phases live in `flags`, generic
//! over the flag words, so that the same code is model-checked with loom
//! (`cargo xtask loom`); `signal` supplies the shared-memory slots.
//!
//! Files: this one holds the backend and its launch; `signal` the Signal block (layout,
//! flag words, launch shapes); `reduction` the reduction and the one- and two-stage
//! launches around it; `flags` the barrier; `wide` the AVX2 conversions.

mod flags;
mod reduction;
mod signal;
mod wide;

#[cfg(test)]
mod tests;

use std::marker::PhantomData;
use std::ops::Range;

use half::{bf16, f16};
use tpcomm_ipc::{HostBuffer, HostMapping, HostMemory, MemoryRegion, PeerMemory};

use super::{Backend, Buffer, Launch};
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::Result;
use reduction::{part, run};
use signal::{flag, shape_word, Barrier, SignalBlocks, COUNTER, NONCE, SIGNAL_BYTES};

/// The CPU backend over [`HostMemory`] (or a wrapper of it with the same buffers, such as
/// `tpcomm_ipc::FaultInjection<HostMemory>` in tests).
pub struct HostBackend<M = HostMemory>(PhantomData<fn() -> M>);

impl<M> HostBackend<M> {
    /// The backend.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<M> Default for HostBackend<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M> Clone for HostBackend<M> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<M> std::fmt::Debug for HostBackend<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostBackend")
    }
}

fn read_table<M: PeerMemory>(memory: &M, table: &M::Buffer, offset: usize) -> Result<[u64; 8]> {
    let mut raw = [0u8; 64];
    memory.read(table, offset, &mut raw)?;
    let mut out = [0u64; 8];
    for (o, chunk) in out.iter_mut().zip(raw.chunks_exact(8)) {
        *o = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
    }
    Ok(out)
}

/// Peer memory whose buffers are host shared memory.
pub trait HostLike: PeerMemory<Buffer = HostBuffer, Mapping = HostMapping> {}
impl<M: PeerMemory<Buffer = HostBuffer, Mapping = HostMapping>> HostLike for M {}

impl<M: HostLike> Backend for HostBackend<M> {
    type Memory = M;

    fn name(&self) -> &'static str {
        "host"
    }

    fn signal_bytes(&self) -> usize {
        SIGNAL_BYTES
    }

    fn nonce_offset(&self) -> usize {
        NONCE
    }

    fn reset_signal(&self, memory: &M, signal: &Buffer<Self>) -> Result<()> {
        Ok(memory.write(signal, 0, &[0u8; NONCE])?)
    }

    fn shape_includes_slot(&self) -> bool {
        // The shape words compared at the start barrier include the slot (see `shape_word`).
        true
    }

    fn builtin_dispatch(&self) -> crate::dispatch::DispatchTable {
        crate::dispatch::DispatchTable::host()
    }

    fn private_part(
        &self,
        algorithm: Algorithm,
        dtype: DType,
        count: usize,
        rank: usize,
        world: usize,
    ) -> Option<Range<usize>> {
        (algorithm == Algorithm::TwoStage).then(|| part(count, dtype.size(), world, rank))
    }

    fn stage(
        &self,
        memory: &M,
        input: &HostBuffer,
        staging: &HostBuffer,
        range: Range<usize>,
    ) -> Result<()> {
        if range.start > range.end || range.end > input.len() {
            return Err(crate::AllReduceError::InvalidArgument(format!(
                "bytes {range:?} do not fit the {}-byte input",
                input.len()
            )));
        }
        // SAFETY: `range` lies inside a live host buffer (checked above), borrowed for the
        // call; only this rank writes its own buffers.
        let src = unsafe {
            std::slice::from_raw_parts((input.addr() as *const u8).add(range.start), range.len())
        };
        // `write` checks the range against the staging buffer.
        Ok(memory.write(staging, range.start, src)?)
    }

    fn launch(&self, memory: &M, l: &Launch<'_, Self>) -> Result<()> {
        let signals = read_table(memory, l.rank_signals, 0)?;
        let temps = read_table(memory, l.rank_signals, 64)?;
        let mut inputs = read_table(memory, l.rank_data, l.slot * super::RANK_DATA_BYTES)?;
        if let Some(own_input) = l.own_input {
            // The eager path staged everything but `private_part`, which only this rank
            // reads: from the caller's input (valid for the launch, per `Launch::own_input`).
            inputs[l.rank] = own_input;
        }
        let own = l.own_signal.addr();
        // Flag and shape words are accessed as atomics: every block must be 8-byte aligned
        // (a block is the start of its own allocation, so a misaligned one is a forged or
        // corrupted handle).
        if let Some(r) = (0..l.world).find(|&r| signals[r] % 8 != 0) {
            return Err(crate::AllReduceError::InvalidArgument(format!(
                "rank {r}'s Signal block is mapped at the misaligned address {:#x}",
                signals[r]
            )));
        }
        // SAFETY: three words of this rank's own Signal block (`signals[rank]`, aligned:
        // checked above; COUNTER + 0, 4, 8 are 4-byte aligned inside its line), alive for
        // the launch.
        let counters = [0, 4, 8].map(|at| unsafe { flag(own, COUNTER + at) });
        // SAFETY: the own block is alive for the launch, and the tables hold live Signal
        // mappings for every rank of the group (`CustomAllReduce` rewrites them after every
        // reopen before any launch, and checked that each holds SIGNAL_BYTES); every block
        // is 8-byte aligned (checked above).
        let blocks = unsafe { SignalBlocks::new(own, &signals) };
        let barrier = Barrier {
            blocks: &blocks,
            rank: l.rank,
            world: l.world,
            counters,
            timeout: l.timeout,
        };
        let inputs = &inputs[..l.world];
        let shape = shape_word(l.dtype, l.count * l.dtype.size(), l.slot);
        blocks.publish_shape(l.rank, l.world, shape);
        let verify = || blocks.check_shapes(l.rank, l.world, shape);
        match l.dtype {
            DType::F32 => run::<f32, M>(l, &temps, inputs, &barrier, verify),
            DType::F16 => run::<f16, M>(l, &temps, inputs, &barrier, verify),
            DType::Bf16 => run::<bf16, M>(l, &temps, inputs, &barrier, verify),
        }
    }
}
