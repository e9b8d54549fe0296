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
//! (`cargo xtask loom`); this module supplies the shared-memory slots.

mod flags;
mod wide;

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use half::{bf16, f16};
use tpcomm_ipc::{HostBuffer, HostMapping, HostMemory, MemoryRegion, PeerMemory};

use super::{Backend, Buffer, Launch};
use crate::dispatch::Algorithm;
use crate::dtype::{DType, Element};
use crate::error::Result;
use wide::Wide;

/// Host Signal block: three flag arrays (one 64-byte line each; the start line also holds
/// the shape tags, one 32-bit word per writer, after its 8 flags), the epoch counters (one
/// per barrier kind, in `flags::Kind::index` order), the nonce, the shapes (this rank's 64-bit word of what it launched, at its own index).
/// Offsets in bytes.
const START: usize = 0;
const SHAPE_TAGS: usize = START + 32;
const MID: usize = 64;
const END: usize = 128;
const COUNTER: usize = 192;
const NONCE: usize = 256;
const SHAPES: usize = 320;
const SIGNAL_BYTES: usize = 384;

/// A shape word: bits 0..40 the byte count, 40..44 the element type (code, never 0),
/// 44..64 the RankData slot. `Config` bounds `max_bytes` below 2^40 and the slots to 2^20
/// (`Config::MAX_BYTES`, `Config::MAX_SLOTS`), so every field fits.
const SHAPE_BYTES_BITS: u32 = 40;
const SHAPE_DTYPE_BITS: u32 = 4;
const SHAPE_SLOT_SHIFT: u32 = SHAPE_BYTES_BITS + SHAPE_DTYPE_BITS;

/// The shape word of a launch of `bytes` bytes of `dtype` from `slot` (never 0).
fn shape_word(dtype: DType, bytes: usize, slot: usize) -> u64 {
    let code: u64 = match dtype {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::Bf16 => 3,
    };
    (bytes as u64 & ((1 << SHAPE_BYTES_BITS) - 1))
        | (code << SHAPE_BYTES_BITS)
        | ((slot as u64) << SHAPE_SLOT_SHIFT)
}

/// The 32-bit tag of a shape word that peers compare: the shape itself (bit 31 clear:
/// 16-byte packs in bits 0..20, the element type in 20..22, the slot in 22..31) when the
/// launch is whole packs, at most 2^20 - 1 of them and from a slot below 512; otherwise a
/// digest of the whole word with bit 31 set. So two tags are equal for different shapes only
/// when both are digests that collide.
fn shape_tag(word: u64) -> u32 {
    let bytes = word & ((1 << SHAPE_BYTES_BITS) - 1);
    let code = (word >> SHAPE_BYTES_BITS) & ((1 << SHAPE_DTYPE_BITS) - 1);
    let slot = word >> SHAPE_SLOT_SHIFT;
    let packs = bytes / 16;
    if bytes.is_multiple_of(16) && packs < (1 << 20) && code < 4 && slot < (1 << 9) {
        return (packs | (code << 20) | (slot << 22)) as u32;
    }
    (super::mix64(word.wrapping_add(0x9E37_79B9_7F4A_7C15)) as u32) | 0x8000_0000
}

/// Bytes, element type name and slot of a shape word.
fn decode_shape(word: u64) -> (u64, &'static str, usize) {
    let bytes = word & ((1 << SHAPE_BYTES_BITS) - 1);
    let dtype = match (word >> SHAPE_BYTES_BITS) & ((1 << SHAPE_DTYPE_BITS) - 1) {
        1 => "f32",
        2 => "f16",
        3 => "bf16",
        _ => "unknown",
    };
    (bytes, dtype, (word >> SHAPE_SLOT_SHIFT) as usize)
}

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

/// A flag word of a Signal block at `base + offset`.
///
/// # Safety
/// `base` must be the 8-byte aligned address of a live, mapped Signal block of at least
/// `SIGNAL_BYTES` bytes for as long as the reference is used.
unsafe fn flag<'a>(base: u64, offset: usize) -> &'a AtomicU32 {
    // SAFETY: the caller guarantees an aligned live mapping; offsets are 4-byte aligned
    // inside SIGNAL_BYTES and the memory is only ever accessed atomically.
    unsafe { AtomicU32::from_ptr((base as usize + offset) as *mut u32) }
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

/// The group's Signal blocks as mapped in this process, for [`flags::FlagBarrier`].
struct SignalBlocks<'a> {
    own: u64,
    signals: &'a [u64; 8],
}

impl<'a> SignalBlocks<'a> {
    /// # Safety
    /// `own` and every `signals[p]` a barrier names (`p < world`) must be live, mapped
    /// Signal blocks of at least `SIGNAL_BYTES` bytes for as long as the value is used.
    unsafe fn new(own: u64, signals: &'a [u64; 8]) -> Self {
        Self { own, signals }
    }

    /// The shape word `writer` publishes in the block at `base`.
    ///
    /// # Safety
    /// `base` is this rank's own block or one of `signals[..world]` (per [`Self::new`]),
    /// and `writer < 8`.
    unsafe fn shape(base: u64, writer: usize) -> &'a AtomicU64 {
        debug_assert!(writer < 8);
        // SAFETY: per the contract, a live block of SIGNAL_BYTES, 8-byte aligned (own block:
        // an allocation's start; peers' blocks: checked in `launch`); SHAPES + 8 * writer
        // keeps that alignment and stays inside the block for `writer < 8`; the word is only
        // ever accessed atomically.
        unsafe { AtomicU64::from_ptr((base as usize + SHAPES + 8 * writer) as *mut u64) }
    }

    /// Stores this rank's shape word into its own block and its tag into every block's tag
    /// for `rank` (before the start barrier, whose release stores publish both).
    fn publish_shape(&self, rank: usize, world: usize, word: u64) {
        // SAFETY: this rank's own block is live (`Self::new`); `rank < world <= 8` (the
        // driver refuses larger groups).
        unsafe { Self::shape(self.own, rank) }.store(word, Ordering::Relaxed);
        let tag = shape_tag(word);
        for p in 0..world {
            // SAFETY: `signals[p]` for `p < world` is a live, 8-byte aligned block
            // (`Self::new`, checked in `launch`); SHAPE_TAGS + 4 * rank stays inside the start
            // line for `rank < 8`; the word is only ever accessed atomically.
            unsafe { flag(self.signals[p], SHAPE_TAGS + 4 * rank) }.store(tag, Ordering::Relaxed);
        }
    }

    /// After the start barrier: the first peer whose published shape differs from `word`.
    fn check_shapes(&self, rank: usize, world: usize, word: u64) -> Result<()> {
        let tag = shape_tag(word);
        for peer in 0..world {
            // SAFETY: this rank's own block is live (`Self::new`); `peer < world <= 8`. The
            // start barrier's acquire loads ordered the peer's store before this load.
            let their_tag =
                unsafe { flag(self.own, SHAPE_TAGS + 4 * peer) }.load(Ordering::Relaxed);
            if their_tag != tag {
                // SAFETY: `signals[peer]` is live and aligned (as above); the peer stored its
                // word before its start flag, which this rank acquired.
                let theirs =
                    unsafe { Self::shape(self.signals[peer], peer) }.load(Ordering::Relaxed);
                let (bytes, dtype, slot) = decode_shape(word);
                let (peer_bytes, peer_dtype, peer_slot) = decode_shape(theirs);
                return Err(crate::AllReduceError::LaunchMismatch {
                    rank,
                    bytes,
                    dtype,
                    slot: Some(slot),
                    peer,
                    peer_bytes,
                    peer_dtype,
                    peer_slot: Some(peer_slot),
                });
            }
        }
        Ok(())
    }
}

fn array(kind: flags::Kind) -> usize {
    match kind {
        flags::Kind::Start => START,
        flags::Kind::Mid => MID,
        flags::Kind::End => END,
    }
}

impl flags::Blocks for SignalBlocks<'_> {
    type Slot = AtomicU32;

    #[inline(always)]
    fn peer(&self, peer: usize, kind: flags::Kind, writer: usize) -> &AtomicU32 {
        // SAFETY: per `SignalBlocks::new`, the tables hold live Signal mappings for every
        // rank of the group (the driver rewrites them after every reopen before any
        // launch); `writer < world <= 8` keeps the slot inside its 64-byte array.
        unsafe { flag(self.signals[peer], array(kind) + 4 * writer) }
    }

    #[inline(always)]
    fn own(&self, kind: flags::Kind, writer: usize) -> &AtomicU32 {
        // SAFETY: this rank's own Signal block, alive for the launch (`SignalBlocks::new`).
        unsafe { flag(self.own, array(kind) + 4 * writer) }
    }
}

type Barrier<'a> = flags::FlagBarrier<'a, SignalBlocks<'a>>;

/// Elements per block of the reduction: each block's f32 sums stay in registers (4 AVX2
/// registers of 8 lanes) from the first input to the narrowing store. A larger block does
/// not: 64 was measured 1.4-2.4x slower, its sums going through the stack.
const BLOCK: usize = 32;

/// `out[i] = sum over r in rank order of inputs[r][i]` for `i` in `range`, f32 accumulation
/// from `-0.0` (the identity of IEEE addition, so the sum is the inputs' own: all `-0.0`
/// inputs sum to `-0.0`); also into `also[i]` when given (each block copied there after it
/// is written to `out`).
///
/// # Safety
/// Every `inputs[r]` must point to at least `range.end` readable elements of `T` and
/// `out` (and `also`) to at least `range.end` writable ones, none written concurrently;
/// `also` overlaps neither `out` nor any input, or is exactly one of the inputs (each block
/// is read before it is written).
unsafe fn reduce<T: Wide>(inputs: &[u64], out: u64, also: Option<u64>, range: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if wide::avx2_build() {
        // SAFETY: the caller's contract; the CPU has AVX2 and F16C (checked just above).
        unsafe { reduce_avx2::<T>(inputs, out, also, range) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { reduce_blocks::<T, false>(inputs, out, also, range) };
}

/// [`reduce_blocks`] compiled for AVX2 and F16C (a block's conversions and sums are
/// loops the compiler vectorizes, 8 lanes instead of the baseline's 4; f16 converts with
/// F16C in the loop: [`Wide`]).
///
/// # Safety
/// As [`reduce`], and the CPU has AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_avx2<T: Wide>(inputs: &[u64], out: u64, also: Option<u64>, range: Range<usize>) {
    // SAFETY: the caller's contract (AVX2 and F16C included).
    unsafe { reduce_blocks::<T, true>(inputs, out, also, range) };
}

/// The body of [`reduce`], inlined into each build of it; `AVX2` picks the element
/// conversions of the AVX2 build ([`Wide`]). Whole blocks first (arrays of constant
/// length, which the compiler keeps in registers), then the last partial block.
///
/// # Safety
/// As [`reduce`], and with `AVX2` the CPU has AVX2 and F16C.
#[inline(always)]
unsafe fn reduce_blocks<T: Wide, const AVX2: bool>(
    inputs: &[u64],
    out: u64,
    also: Option<u64>,
    range: Range<usize>,
) {
    let mut start = range.start;
    while start + BLOCK <= range.end {
        let mut acc = [-0.0f32; BLOCK];
        for &input in inputs {
            // SAFETY: per the function contract, `start + BLOCK <= range.end` readable
            // elements; `[T; BLOCK]` has `T`'s alignment.
            let src = unsafe { &*((input as *const T).add(start) as *const [T; BLOCK]) };
            if AVX2 {
                // SAFETY: with `AVX2`, the CPU has AVX2 and F16C (the contract).
                unsafe { T::accumulate_avx2(src, &mut acc) };
            } else {
                T::accumulate(src, &mut acc);
            }
        }
        // SAFETY: per the function contract, writable and not read by anyone else now.
        let dst = unsafe { &mut *((out as *mut T).add(start) as *mut [T; BLOCK]) };
        if AVX2 {
            // SAFETY: with `AVX2`, the CPU has AVX2 and F16C (the contract).
            unsafe { T::narrow_avx2(&acc, dst) };
        } else {
            T::narrow(&acc, dst);
        }
        if let Some(also) = also {
            // SAFETY: per the function contract, `also` holds `range.end` writable elements,
            // apart from `out`, and no input is read at this block again.
            unsafe { *((also as *mut T).add(start) as *mut [T; BLOCK]) = *dst };
        }
        start += BLOCK;
    }
    let n = range.end.saturating_sub(start);
    if n == 0 {
        return;
    }
    let mut acc = [-0.0f32; BLOCK];
    for &input in inputs {
        // SAFETY: per the function contract, `start + n == range.end` readable elements.
        let src = unsafe { std::slice::from_raw_parts((input as *const T).add(start), n) };
        T::accumulate(src, &mut acc[..n]);
    }
    // SAFETY: per the function contract.
    let dst = unsafe { std::slice::from_raw_parts_mut((out as *mut T).add(start), n) };
    T::narrow(&acc[..n], dst);
    if let Some(also) = also {
        // SAFETY: as for whole blocks; `also` is apart from `out`.
        unsafe { std::ptr::copy_nonoverlapping(dst.as_ptr(), (also as *mut T).add(start), n) };
    }
}

/// The part of `count` elements that rank `r` of `world` reduces in two-stage: equal
/// parts rounded to 16-byte packs, the last one taking the rest.
pub(crate) fn part(count: usize, elem: usize, world: usize, r: usize) -> Range<usize> {
    let per_pack = 16 / elem;
    let packs = count.div_ceil(per_pack);
    let each = packs.div_ceil(world) * per_pack;
    let start = (r * each).min(count);
    start..((r + 1) * each).min(count)
}

fn run<T: Wide, M: HostLike>(
    l: &Launch<'_, HostBackend<M>>,
    temps: &[u64; 8],
    inputs: &[u64],
    barrier: &Barrier<'_>,
    verify: impl FnOnce() -> Result<()>,
) -> Result<()> {
    match l.algorithm {
        Algorithm::OneStage => barrier.launch::<flags::Backoff>(
            false,
            verify,
            || {
                // SAFETY: the start barrier ordered every rank's input writes before these
                // reads; the driver checked that every rank's region in the slot holds
                // `count` elements and that the output does, `verify` that every rank
                // launched `count` elements; no rank writes an input before the end
                // barrier.
                unsafe { reduce::<T>(inputs, l.out, None, 0..l.count) };
            },
            || {},
        ),
        Algorithm::TwoStage => {
            // This rank's own part goes into the output as it is reduced (no copy back from
            // the temp buffer after the mid barrier) when the output is apart from this
            // rank's input or is the input itself: each block is read before it is written,
            // and peers read only their own parts of this input. An output shifted against
            // the input would overwrite what a peer reads until the mid barrier.
            let own = inputs[l.rank];
            let direct = l.out == own || !super::overlap(l.out, own, l.count * T::DTYPE.size());
            barrier.launch::<flags::Backoff>(
                true,
                verify,
                || {
                    let mine = part(l.count, T::DTYPE.size(), l.world, l.rank);
                    // SAFETY: as above; the driver checked that every rank's temp buffer
                    // holds `count` elements; only this rank writes its own, before the mid
                    // barrier. The output is the caller's (never a temp buffer or a peer's
                    // input); with `direct` it is this rank's input or apart from it.
                    unsafe { reduce::<T>(inputs, temps[l.rank], direct.then_some(l.out), mine) };
                },
                || gather::<T, M>(l, temps, direct),
            )
        }
    }
}

/// Two-stage, after the mid barrier: every rank's part from its owner's temp buffer (but
/// this rank's own when `own_done`: written to the output by the reduction already).
fn gather<T: Element, M: HostLike>(
    l: &Launch<'_, HostBackend<M>>,
    temps: &[u64; 8],
    own_done: bool,
) {
    for r in (0..l.world).filter(|&r| !(own_done && r == l.rank)) {
        let p = part(l.count, T::DTYPE.size(), l.world, r);
        let bytes = p.len() * T::DTYPE.size();
        let offset = p.start * T::DTYPE.size();
        // SAFETY: rank r finished writing its part of its temp buffer before the
        // mid barrier (release/acquire); the driver checked that every rank's temp buffer
        // and the output hold `count` elements; the output is the caller's, never a temp
        // buffer. `copy_bytes` keeps the speed of an output 16 bytes into a page (a large `Vec`).
        unsafe {
            tpcomm_transport::backend::copy::copy_bytes(
                (l.out as *mut u8).add(offset),
                (temps[r] as *const u8).add(offset),
                bytes,
            )
        };
    }
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

    fn staged_one_stage_table(&self) -> &'static [usize; crate::dispatch::MAX_RANKS + 1] {
        // The shape words compared at the start barrier include the slot (see `shape_word`).
        &crate::dispatch::STAGED_ONE_STAGE_MAX_BYTES
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
        // mappings for every rank of the group (the driver rewrites them after every
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

#[cfg(test)]
mod tests {
    use super::wide::Wide;
    use super::{decode_shape, part, reduce, reduce_blocks, shape_tag, shape_word, BLOCK};
    use crate::dtype::DType;
    use half::{bf16, f16};

    /// `reduce` (the AVX2 build where the CPU has it) and the portable build both give what
    /// one f32 sum per element in rank order from `-0.0` gives, bit for bit (every element
    /// that is `-0.0` on every rank sums to `-0.0`), for 1 to 8 inputs, and write only
    /// `range` (whole blocks and a partial one, starting off a block boundary).
    fn reductions_match_the_scalar_sum<T: Wide>() {
        let n = 40 * BLOCK + 37;
        let range = 5..n - 3;
        for ranks in [1, 2, 3, 8] {
            let inputs: Vec<Vec<T>> = (0..ranks)
                .map(|r| {
                    (0..n)
                        .map(|i| match i % 11 {
                            0 => T::from_f32(-0.0),
                            _ => T::from_f32(((i * 7 + r * 13) % 97) as f32 * 0.37 - 17.0),
                        })
                        .collect()
                })
                .collect();
            let addresses: Vec<u64> = inputs.iter().map(|v| v.as_ptr() as u64).collect();
            let zero = T::from_f32(0.0);
            let want: Vec<T> = (0..n)
                .map(|i| match range.contains(&i) {
                    true => T::from_f32(inputs.iter().fold(-0.0, |acc, v| acc + v[i].to_f32())),
                    false => zero,
                })
                .collect();
            assert!(want[range.start.next_multiple_of(11)]
                .to_f32()
                .is_sign_negative());
            let bits = |v: &[T]| v.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
            let mut portable = vec![zero; n];
            let mut dispatched = vec![zero; n];
            let mut also = vec![zero; n];
            // SAFETY: every input holds `n` elements; the outputs hold `n` each and are three
            // separate vectors, apart from the inputs.
            unsafe {
                reduce_blocks::<T, false>(
                    &addresses,
                    portable.as_mut_ptr() as u64,
                    None,
                    range.clone(),
                );
                reduce::<T>(
                    &addresses,
                    dispatched.as_mut_ptr() as u64,
                    Some(also.as_mut_ptr() as u64),
                    range.clone(),
                );
            }
            let what = format!("{:?}, {ranks} inputs", T::DTYPE);
            assert_eq!(bits(&portable), bits(&want), "{what}: portable");
            assert_eq!(bits(&dispatched), bits(&want), "{what}: dispatched");
            assert_eq!(bits(&also), bits(&want), "{what}: also");
        }
    }

    #[test]
    fn every_build_of_the_reduction_sums_like_the_scalar_loop() {
        reductions_match_the_scalar_sum::<f32>();
        reductions_match_the_scalar_sum::<f16>();
        reductions_match_the_scalar_sum::<bf16>();
    }

    #[test]
    fn shape_tags_are_exact_for_ordinary_launches_and_flagged_digests_beyond() {
        let base = shape_word(DType::F32, 4096, 3);
        assert_eq!(shape_tag(base) >> 31, 0);
        // Exact: one field differs, the tag differs.
        for other in [
            shape_word(DType::F32, 4112, 3),
            shape_word(DType::F16, 4096, 3),
            shape_word(DType::F32, 4096, 4),
            shape_word(DType::F32, (1 << 24) - 16, 511),
        ] {
            assert_ne!(shape_tag(base), shape_tag(other));
            assert_eq!(shape_tag(other) >> 31, 0);
        }
        // Beyond the exact range (16 MiB, slot 512): digests, never equal to an exact tag.
        let big = shape_word(DType::F32, 1 << 24, 3);
        let far = shape_word(DType::F32, 4096, 512);
        assert_eq!(shape_tag(big) >> 31, 1);
        assert_eq!(shape_tag(far) >> 31, 1);
        assert_ne!(shape_tag(big), shape_tag(far));
        assert_ne!(
            shape_tag(big),
            shape_tag(shape_word(DType::F32, (1 << 24) + 16, 3))
        );
    }

    #[test]
    fn shape_words_round_trip_and_differ_in_every_field() {
        let base = shape_word(DType::F32, 4096, 3);
        assert_eq!(decode_shape(base), (4096, "f32", 3));
        assert_eq!(
            decode_shape(shape_word(DType::Bf16, 16, 0)),
            (16, "bf16", 0)
        );
        assert_ne!(base, 0);
        assert_ne!(base, shape_word(DType::F32, 4112, 3));
        assert_ne!(base, shape_word(DType::F16, 4096, 3));
        assert_ne!(base, shape_word(DType::F32, 4096, 4));
        assert_eq!(decode_shape(base | (0xf << 40)).1, "unknown");
    }

    #[test]
    fn parts_cover_every_element_once_in_whole_packs() {
        for world in 1..=8 {
            for count in [4usize, 8, 12, 1000, 4096, 4100] {
                let mut next = 0;
                for r in 0..world {
                    let p = part(count, 4, world, r);
                    assert_eq!(p.start, next);
                    assert!(p.start.is_multiple_of(4) || p.is_empty());
                    next = p.end;
                }
                assert_eq!(next, count);
            }
        }
    }
}
