//! Element types: f32, f16 and bf16, all accumulated in f32.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// The element type of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Short name (`"f32"`, `"f16"`, `"bf16"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
}

/// A Rust element type the all-reduce accepts.
pub trait Element: Copy + Send + Sync + 'static + bytemuck::Pod + sealed::Sealed {
    /// Its [`DType`].
    const DTYPE: DType;
    /// Widens to the f32 accumulator.
    fn to_f32(self) -> f32;
    /// Narrows from the accumulator (round to nearest even).
    fn from_f32(v: f32) -> Self;

    /// Adds every element of `src`, widened, to `acc` (same lengths).
    #[inline(always)]
    fn accumulate(src: &[Self], acc: &mut [f32]) {
        for (a, v) in acc.iter_mut().zip(src) {
            *a += v.to_f32();
        }
    }

    /// Narrows every element of `acc` into `dst` (same lengths).
    #[inline(always)]
    fn narrow(acc: &[f32], dst: &mut [Self]) {
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = Self::from_f32(*a);
        }
    }
}

/// Elements widened per batch by the f16 slice conversions, which use SIMD where the CPU
/// has it (F16C, detected at run time) instead of one call per element.
const BATCH: usize = 256;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }

    #[inline(always)]
    fn accumulate(src: &[Self], acc: &mut [f32]) {
        let mut wide = [0f32; BATCH];
        for (s, a) in src.chunks(BATCH).zip(acc.chunks_mut(BATCH)) {
            let w = &mut wide[..s.len()];
            s.convert_to_f32_slice(w);
            for (x, y) in a.iter_mut().zip(w.iter()) {
                *x += *y;
            }
        }
    }

    #[inline(always)]
    fn narrow(acc: &[f32], dst: &mut [Self]) {
        for (a, d) in acc.chunks(BATCH).zip(dst.chunks_mut(BATCH)) {
            d.convert_from_f32_slice(a);
        }
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;

    /// `bf16::to_f32`, without branches: a bf16 is the upper half of an f32, and a NaN gets
    /// its quiet bit set.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let b = u32::from(self.to_bits()) << 16;
        f32::from_bits(if b & 0x7fff_ffff > 0x7f80_0000 {
            b | 0x0040_0000
        } else {
            b
        })
    }

    /// The shift alone: a sum with a NaN is a NaN whether it was quieted first or not (its
    /// payload is unspecified either way), and without the select the loop is faster.
    #[inline(always)]
    fn accumulate(src: &[Self], acc: &mut [f32]) {
        for (a, v) in acc.iter_mut().zip(src) {
            *a += f32::from_bits(u32::from(v.to_bits()) << 16);
        }
    }

    /// `bf16::from_f32`, without branches (the default `narrow` loop of it vectorizes).
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_bits(bf16_bits(v.to_bits()))
    }
}

/// The bits of `bf16::from_f32` of the f32 with bits `b`, without branches (so that loops
/// of it vectorize): round to nearest, ties to even (an f32 above bf16's largest finite
/// value rounds to infinity), and a NaN stays a NaN with its quiet bit set.
#[inline(always)]
fn bf16_bits(b: u32) -> u16 {
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) as u16) | 0x40;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched conversions give exactly what one conversion per element gives.
    fn same_as_per_element<T: Element>() {
        let n = 3 * BATCH + 17;
        let src: Vec<T> = (0..n)
            .map(|i| T::from_f32((i as f32 - 400.0) * 0.37 + (i % 7) as f32 * 1e-3))
            .collect();
        let start: Vec<f32> = (0..n).map(|i| (i % 11) as f32 * 0.5).collect();
        let mut batched = start.clone();
        T::accumulate(&src, &mut batched);
        let expected: Vec<f32> = start
            .iter()
            .zip(&src)
            .map(|(a, v)| a + v.to_f32())
            .collect();
        assert_eq!(batched, expected);
        let mut narrowed = vec![T::from_f32(0.0); n];
        T::narrow(&batched, &mut narrowed);
        for (d, a) in narrowed.iter().zip(&batched) {
            assert_eq!(d.to_f32().to_bits(), T::from_f32(*a).to_f32().to_bits());
        }
    }

    /// Widening: every bf16. Narrowing: every f32 bit pattern whose lower 16 bits are 0, 1,
    /// 0x7fff, 0x8000 (the ties), 0x8001 or 0xffff: every sign and exponent, NaNs and
    /// infinities, and the rounding cases.
    #[test]
    fn bf16_conversions_are_halfs_bit_for_bit() {
        for h in 0..=u16::MAX {
            let x = bf16::from_bits(h);
            assert_eq!(
                Element::to_f32(x).to_bits(),
                bf16::to_f32(x).to_bits(),
                "{h:#06x}"
            );
        }
        for high in 0..=u16::MAX {
            for low in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let b = (u32::from(high) << 16) | low;
                let v = f32::from_bits(b);
                assert_eq!(
                    <bf16 as Element>::from_f32(v).to_bits(),
                    bf16::from_f32(v).to_bits(),
                    "{b:#010x}"
                );
            }
        }
    }

    #[test]
    fn batched_half_conversions_match_per_element_ones() {
        same_as_per_element::<f16>();
        same_as_per_element::<bf16>();
        same_as_per_element::<f32>();
    }
}
