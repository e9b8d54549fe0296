//! The host reduction: every rank's input summed in rank order with f32 accumulation, a
//! block of elements at a time in registers, built for the baseline CPU and for AVX2 with
//! F16C (picked at run time); and the one-stage and two-stage launches around it.

use std::ops::Range;

use super::flags;
use super::signal::Barrier;
use super::wide::{self, Wide};
use super::{HostBackend, HostLike};
use crate::backend::Launch;
use crate::dispatch::Algorithm;
use crate::dtype::Element;
use crate::error::Result;

/// Elements per block of the reduction: each block's f32 sums stay in registers (4 AVX2
/// registers of 8 lanes) from the first input to the narrowing store. A larger block does
/// not: 64 was measured 1.4-2.4x slower, its sums going through the stack.
pub(super) const BLOCK: usize = 32;

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
pub(super) unsafe fn reduce<T: Wide>(
    inputs: &[u64],
    out: u64,
    also: Option<u64>,
    range: Range<usize>,
) {
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
pub(super) unsafe fn reduce_blocks<T: Wide, const AVX2: bool>(
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
#[inline]
pub(crate) fn part(count: usize, elem: usize, world: usize, r: usize) -> Range<usize> {
    let per_pack = 16 / elem;
    let packs = count.div_ceil(per_pack);
    let each = packs.div_ceil(world) * per_pack;
    let start = (r * each).min(count);
    start..((r + 1) * each).min(count)
}

pub(super) fn run<T: Wide, M: HostLike>(
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
                // reads; `CustomAllReduce` checked that every rank's region in the slot holds
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
            let direct =
                l.out == own || !crate::backend::overlap(l.out, own, l.count * T::DTYPE.size());
            barrier.launch::<flags::Backoff>(
                true,
                verify,
                || {
                    let mine = part(l.count, T::DTYPE.size(), l.world, l.rank);
                    // SAFETY: as above; `CustomAllReduce` checked that every rank's temp buffer
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
        // mid barrier (release/acquire); `CustomAllReduce` checked that every rank's temp buffer
        // and the output hold `count` elements; the output is the caller's, never a temp
        // buffer. `copy_bytes` keeps the speed of an output 16 bytes into a page (a large `Vec`).
        unsafe {
            tpcomm_transport::copy::copy_bytes(
                (l.out as *mut u8).add(offset),
                (temps[r] as *const u8).add(offset),
                bytes,
            )
        };
    }
}
