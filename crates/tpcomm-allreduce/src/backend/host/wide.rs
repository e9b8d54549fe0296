//! How the AVX2 build of the host reduction widens and narrows each element type.
//!
//! f32 needs nothing of its own: its loops ([`Element::accumulate`], [`Element::narrow`])
//! vectorize once they are compiled for AVX2. f16 does: `half` converts its slices through
//! F16C in functions of its own, found at run time, which the AVX2 build cannot inline (a
//! call per batch of elements and a copy through a buffer). Here the F16C conversions
//! (`vcvtph2ps`, and `vcvtps2ph` rounding to nearest even) sit in the reduction's loop
//! itself. bf16's portable loops vectorize, but the compiler narrows them into 16-bit lanes
//! with more shuffles than one pack and one permutation of two registers, written here.
//!
//! Every conversion gives `half`'s result bit for bit, NaNs included (tested below against
//! `half`'s software conversions).

use half::{bf16, f16};

use crate::dtype::Element;

/// An element type of the host reduction.
pub(super) trait Wide: Element {
    /// [`Element::accumulate`], for the AVX2 build.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    #[inline(always)]
    unsafe fn accumulate_avx2(src: &[Self], acc: &mut [f32]) {
        Self::accumulate(src, acc);
    }

    /// [`Element::narrow`], for the AVX2 build.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    #[inline(always)]
    unsafe fn narrow_avx2(acc: &[f32], dst: &mut [Self]) {
        Self::narrow(acc, dst);
    }
}

impl Wide for f32 {}

#[cfg(not(target_arch = "x86_64"))]
impl Wide for bf16 {}

#[cfg(target_arch = "x86_64")]
impl Wide for bf16 {
    #[inline(always)]
    unsafe fn accumulate_avx2(src: &[Self], acc: &mut [f32]) {
        // SAFETY: the caller's contract (the CPU has AVX2).
        unsafe { accumulate_bf16(src, acc) };
    }

    #[inline(always)]
    unsafe fn narrow_avx2(acc: &[f32], dst: &mut [Self]) {
        // SAFETY: the caller's contract (the CPU has AVX2).
        unsafe { narrow_bf16(acc, dst) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Wide for f16 {}

#[cfg(target_arch = "x86_64")]
impl Wide for f16 {
    #[inline(always)]
    unsafe fn accumulate_avx2(src: &[Self], acc: &mut [f32]) {
        // SAFETY: the caller's contract (the CPU has F16C and AVX).
        unsafe { accumulate_f16c(src, acc) };
    }

    #[inline(always)]
    unsafe fn narrow_avx2(acc: &[f32], dst: &mut [Self]) {
        // SAFETY: the caller's contract (the CPU has F16C and AVX).
        unsafe { narrow_f16c(acc, dst) };
    }
}

/// Elements per F16C conversion (one 256-bit register of f32).
#[cfg(target_arch = "x86_64")]
const LANES: usize = 8;

/// `acc[i] += src[i]` widened, 8 elements per `vcvtph2ps`, for `i` below the shorter length.
///
/// # Safety
/// The CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn accumulate_f16c(src: &[f16], acc: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm256_add_ps, _mm256_cvtph_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm_loadu_si128,
    };
    let n = src.len().min(acc.len());
    let whole = n - n % LANES;
    for i in (0..whole).step_by(LANES) {
        // SAFETY: `i + LANES <= n`: 16 readable bytes at `src[i]`, 32 readable and writable
        // at `acc[i]` (unaligned loads and stores); the CPU has F16C and AVX (the contract).
        unsafe {
            let wide = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
            let sum = _mm256_add_ps(_mm256_loadu_ps(acc.as_ptr().add(i)), wide);
            _mm256_storeu_ps(acc.as_mut_ptr().add(i), sum);
        }
    }
    for (a, v) in acc[whole..n].iter_mut().zip(&src[whole..n]) {
        *a += v.to_f32();
    }
}

/// `dst[i] = acc[i]` narrowed (round to nearest even), 8 elements per `vcvtps2ph`, for `i`
/// below the shorter length.
///
/// # Safety
/// The CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn narrow_f16c(acc: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    let n = acc.len().min(dst.len());
    let whole = n - n % LANES;
    for i in (0..whole).step_by(LANES) {
        // SAFETY: `i + LANES <= n`: 32 readable bytes at `acc[i]`, 16 writable at `dst[i]`
        // (unaligned); the CPU has F16C and AVX (the contract). The immediate rounds to
        // nearest even, whatever MXCSR says.
        unsafe {
            let narrow =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(acc.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, narrow);
        }
    }
    for (d, a) in dst[whole..n].iter_mut().zip(&acc[whole..n]) {
        *d = f16::from_f32(*a);
    }
}

/// `acc[i] += src[i]` widened (a bf16 is the upper half of an f32), 8 elements per
/// register, for `i` below the shorter length.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn accumulate_bf16(src: &[bf16], acc: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm256_add_ps, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_loadu_ps,
        _mm256_slli_epi32, _mm256_storeu_ps, _mm_loadu_si128,
    };
    let n = src.len().min(acc.len());
    let whole = n - n % LANES;
    for i in (0..whole).step_by(LANES) {
        // SAFETY: `i + LANES <= n`: 16 readable bytes at `src[i]`, 32 readable and writable
        // at `acc[i]` (unaligned loads and stores); the CPU has AVX2 (the contract).
        unsafe {
            let halves =
                _mm256_cvtepu16_epi32(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
            let wide = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves));
            let sum = _mm256_add_ps(_mm256_loadu_ps(acc.as_ptr().add(i)), wide);
            _mm256_storeu_ps(acc.as_mut_ptr().add(i), sum);
        }
    }
    bf16::accumulate(&src[whole..n], &mut acc[whole..n]);
}

/// `dst[i] = acc[i]` narrowed as [`bf16::from_f32`] narrows (round to nearest even, NaNs
/// quieted), 16 elements per step, for `i` below the shorter length.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn narrow_bf16(acc: &[f32], dst: &mut [bf16]) {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_blendv_epi8, _mm256_cmpgt_epi32,
        _mm256_loadu_si256, _mm256_or_si256, _mm256_packus_epi32, _mm256_permute4x64_epi64,
        _mm256_set1_epi32, _mm256_srli_epi32, _mm256_storeu_si256,
    };
    /// The bf16 bits of 8 f32s, one in the low half of each 32-bit lane.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn bits(b: __m256i) -> __m256i {
        let upper = _mm256_srli_epi32::<16>(b);
        let lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
        let magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
        let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
        let quiet = _mm256_or_si256(upper, _mm256_set1_epi32(0x40));
        _mm256_blendv_epi8(rounded, quiet, nan)
    }
    const STEP: usize = 2 * LANES;
    let n = acc.len().min(dst.len());
    let whole = n - n % STEP;
    for i in (0..whole).step_by(STEP) {
        // SAFETY: `i + STEP <= n`: 64 readable bytes at `acc[i]`, 32 writable at `dst[i]`
        // (unaligned); the CPU has AVX2 (the contract). Each lane's value is at most
        // 0xffff, so the unsigned saturating pack keeps it; the pack interleaves the two
        // registers' 128-bit halves, and the permutation puts them back in order.
        unsafe {
            let p = acc.as_ptr().add(i) as *const __m256i;
            let low = bits(_mm256_loadu_si256(p));
            let high = bits(_mm256_loadu_si256(p.add(1)));
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(low, high));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, packed);
        }
    }
    bf16::narrow(&acc[whole..n], &mut dst[whole..n]);
}

/// Whether this CPU runs the AVX2 build (AVX2 and F16C: every x86-64 CPU since 2013 that
/// has the one has the other).
pub(super) fn avx2_build() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Every value of `T` (a 16-bit type), widened by the AVX2 build, as `half`'s software
    /// conversion `reference` widens it (NaNs quieted, payload kept). Each lands in an
    /// accumulator of -0.0, which any f32 plus -0.0 leaves as it is, bit for bit (the sum
    /// quiets a NaN, as the reference does).
    fn widening_is_halfs<T: Wide>(reference: fn(T) -> f32) {
        // Every value, plus 3 for a tail after the last whole register.
        let src: Vec<T> = (0..=u16::MAX)
            .chain([0x3c00, 0x8001, 0x7f81])
            .map(bytemuck::cast::<u16, T>)
            .collect();
        let mut acc = vec![-0.0f32; src.len()];
        // SAFETY: the CPU has AVX2 and F16C (checked by the callers).
        unsafe { T::accumulate_avx2(&src, &mut acc) };
        for (v, a) in src.iter().zip(&acc) {
            let want = -0.0f32 + reference(*v);
            let bits = bytemuck::cast::<T, u16>(*v);
            assert_eq!(a.to_bits(), want.to_bits(), "{:?} {bits:#06x}", T::DTYPE);
        }
    }

    /// f32s narrowed by the AVX2 build as `half`'s software conversion `reference` narrows
    /// them: every sign and exponent with the mantissas around the rounding points of f16
    /// and bf16 (ties of normal and subnormal results, their neighbours, NaN payloads that
    /// only the low bits hold), and a million more from a fixed sequence.
    fn narrowing_is_halfs<T: Wide>(reference: fn(f32) -> T) {
        let mut bits = Vec::new();
        for high in 0..=u16::MAX {
            for low in [
                0u32, 1, 0x0fff, 0x1000, 0x1001, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0xffff,
            ] {
                bits.push((u32::from(high) << 16) | low);
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1 << 20 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bits.push((x >> 32) as u32);
        }
        // A tail after the last whole step.
        bits.extend([0x3f80_0000, 0x7f80_0001, 0x0000_8000]);
        let acc: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut dst = vec![T::from_f32(0.0); acc.len()];
        // SAFETY: the CPU has AVX2 and F16C (checked by the callers).
        unsafe { T::narrow_avx2(&acc, &mut dst) };
        for (a, d) in acc.iter().zip(&dst) {
            assert_eq!(
                bytemuck::cast::<T, u16>(*d),
                bytemuck::cast::<T, u16>(reference(*a)),
                "{:?} {:#010x}",
                T::DTYPE,
                a.to_bits()
            );
        }
    }

    #[test]
    fn f16_and_bf16_conversions_of_the_avx2_build_are_halfs_bit_for_bit() {
        if !avx2_build() {
            eprintln!("skipped: this CPU has no AVX2 and F16C, so the AVX2 build never runs");
            return;
        }
        widening_is_halfs::<f16>(f16::to_f32_const);
        widening_is_halfs::<bf16>(bf16::to_f32_const);
        narrowing_is_halfs::<f16>(f16::from_f32_const);
        narrowing_is_halfs::<bf16>(bf16::from_f32_const);
    }
}
