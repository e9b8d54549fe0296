//! Element types and reductions of the numeric all-reduce
//! ([`Communicator::all_reduce`](crate::Communicator::all_reduce)).
//!
//! The transport moves bytes; a reduction has to know what the bytes are. A call is
//! described by a [`DataType`] and a [`ReduceOp`], checked against the buffers before
//! anything is sent (lengths a whole number of elements, both buffers the same length).
//! The typed methods take slices of an [`Element`] (a sealed set: the integer types,
//! `f32`, `f64`, `half::f16`, `half::bf16`) and derive the descriptor from the type, so a
//! typed call cannot describe its bytes wrongly.
//!
//! Semantics shared by every backend:
//! - integers wrap on overflow (two's complement) on the local backend; under MPI an
//!   overflowing integer reduction gives what the implementation gives (Open MPI 4.1's AVX
//!   reductions *saturate* 8- and 16-bit sums, open-mpi/ompi#8045, closed as "won't
//!   fix"), so keep integer reductions in range where the backend may be MPI;
//! - `f16` and `bf16` are widened to `f32`, reduced in `f32` and rounded once at the end
//!   (round to nearest even), as the custom all-reduce and NCCL's fp32-accumulating
//!   kernels do;
//! - `Min`/`Max` of floats follow IEEE 754 `minNum`/`maxNum` on the local backend (a NaN
//!   operand is ignored unless both are NaN); MPI's handling of NaN is its own.
//!
//! The local backend reduces every element in rank order `0, 1, ..., size-1`
//! (`((x0 op x1) op x2) ...`), so every rank gets bitwise the same result, and the same
//! result on every run. [`reduce_into`] is that reduction, public so that tests can use it as
//! the reference.

use half::{bf16, f16};

/// The element reduction of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise product.
    Prod,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceOp {
    /// Every reduction, in a fixed order.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];

    /// Its position in [`ALL`](Self::ALL) (how it travels between ranks).
    pub(crate) fn index(self) -> usize {
        Self::ALL
            .iter()
            .position(|&o| o == self)
            .expect("ALL lists every reduction")
    }

    /// Its name in errors and spans (`"sum"`, `"prod"`, `"max"`, `"min"`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// An all-reduce as ranks announce it to each other (`count` elements of the type and op at
/// those positions of [`DataType::ALL`] and [`ReduceOp::ALL`]), for mismatch errors; a
/// position out of range reads `?`.
pub(crate) fn describe_reduction(count: u64, dtype: usize, op: usize) -> String {
    let dtype = DataType::ALL.get(dtype).map_or("?", |d| d.name());
    let op = ReduceOp::ALL.get(op).map_or("?", |o| o.name());
    format!("{count} {dtype} elements ({op})")
}

/// What the bytes of an all-reduce are: the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// `i8`.
    I8,
    /// `u8`.
    U8,
    /// `i16`.
    I16,
    /// `u16`.
    U16,
    /// `i32`.
    I32,
    /// `u32`.
    U32,
    /// `i64`.
    I64,
    /// `u64`.
    U64,
    /// IEEE binary16 (`half::f16`), reduced in `f32`.
    F16,
    /// bfloat16 (`half::bf16`), reduced in `f32`.
    Bf16,
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
}

impl DataType {
    /// Every data type, in a fixed order.
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I16,
        DataType::U16,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::Bf16,
        DataType::F32,
        DataType::F64,
    ];

    /// Its position in [`ALL`](Self::ALL) (how it travels between ranks).
    pub(crate) fn index(self) -> usize {
        Self::ALL
            .iter()
            .position(|&d| d == self)
            .expect("ALL lists every data type")
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::I16 | DataType::U16 | DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// Its name in errors and spans (`"i8"`, ..., `"bf16"`, `"f64"`).
    pub fn name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I16 => "i16",
            DataType::U16 => "u16",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
        }
    }
}

mod sealed {
    #[allow(unreachable_pub)] // the sealed-trait pattern: public, but not nameable outside
    pub trait Sealed {}
}

/// An element type of [`Communicator::all_reduce`](crate::Communicator::all_reduce).
///
/// Sealed: the set is fixed so that the [`DataType`] a call announces always matches the
/// element's size and meaning.
pub trait Element: sealed::Sealed + bytemuck::Pod + PartialEq + Send + Sync + 'static {
    /// Its data type.
    const DTYPE: DataType;
}

/// How an element type is reduced: in an accumulator type (`f32` for the half types, the
/// type itself otherwise), with wrapping integer arithmetic and IEEE float arithmetic.
trait Reduce: bytemuck::Pod {
    type Acc: Copy;
    fn widen(self) -> Self::Acc;
    fn narrow(acc: Self::Acc) -> Self;
    fn apply(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
}

macro_rules! integer {
    ($($t:ty => $dt:ident;)*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$dt;
        }
        impl Reduce for $t {
            type Acc = $t;
            #[inline(always)]
            fn widen(self) -> $t { self }
            #[inline(always)]
            fn narrow(acc: $t) -> $t { acc }
            #[inline(always)]
            fn apply(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
        }
    )*};
}

integer! {
    i8 => I8;
    u8 => U8;
    i16 => I16;
    u16 => U16;
    i32 => I32;
    u32 => U32;
    i64 => I64;
    u64 => U64;
}

macro_rules! float {
    ($($t:ty => $dt:ident, $acc:ty, $widen:expr, $narrow:expr;)*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$dt;
        }
        impl Reduce for $t {
            type Acc = $acc;
            #[inline(always)]
            fn widen(self) -> $acc { $widen(self) }
            #[inline(always)]
            fn narrow(acc: $acc) -> $t { $narrow(acc) }
            #[inline(always)]
            fn apply(op: ReduceOp, a: $acc, b: $acc) -> $acc {
                match op {
                    ReduceOp::Sum => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
        }
    )*};
}

float! {
    f32 => F32, f32, |x| x, |x| x;
    f64 => F64, f64, |x| x, |x| x;
    f16 => F16, f32, f16::to_f32, f16::from_f32;
    bf16 => Bf16, f32, bf16::to_f32, bf16::from_f32;
}

/// Reduces `inputs` (the contributions of ranks `0, 1, ...`, each holding the same whole
/// number of `dtype` elements, in native byte order) element-wise into `out`, in rank
/// order: `out[i] = ((in0[i] op in1[i]) op in2[i]) ...`. The reduction every backend
/// documents and the local backend runs; byte slices need no alignment.
///
/// # Panics
///
/// When `inputs` is empty, or a slice's length differs from `out.len()` or is not a whole
/// number of elements (callers check lengths first).
///
/// ```
/// use tpcomm_transport::reduce::{reduce_into, DataType, ReduceOp};
///
/// let a = 3i32.to_ne_bytes();
/// let b = 4i32.to_ne_bytes();
/// let mut out = [0u8; 4];
/// reduce_into(DataType::I32, ReduceOp::Prod, &[&a[..], &b[..]], &mut out);
/// assert_eq!(i32::from_ne_bytes(out), 12);
/// ```
pub fn reduce_into(dtype: DataType, op: ReduceOp, inputs: &[&[u8]], out: &mut [u8]) {
    match dtype {
        DataType::I8 => reduce_typed::<i8>(op, inputs, out),
        DataType::U8 => reduce_typed::<u8>(op, inputs, out),
        DataType::I16 => reduce_typed::<i16>(op, inputs, out),
        DataType::U16 => reduce_typed::<u16>(op, inputs, out),
        DataType::I32 => reduce_typed::<i32>(op, inputs, out),
        DataType::U32 => reduce_typed::<u32>(op, inputs, out),
        DataType::I64 => reduce_typed::<i64>(op, inputs, out),
        DataType::U64 => reduce_typed::<u64>(op, inputs, out),
        DataType::F16 => reduce_typed::<f16>(op, inputs, out),
        DataType::Bf16 => reduce_typed::<bf16>(op, inputs, out),
        DataType::F32 => reduce_typed::<f32>(op, inputs, out),
        DataType::F64 => reduce_typed::<f64>(op, inputs, out),
    }
}

/// Elements reduced per batch: the accumulators of one batch live on the stack.
const BATCH: usize = 512;

fn reduce_typed<T: Reduce>(op: ReduceOp, inputs: &[&[u8]], out: &mut [u8]) {
    let size = std::mem::size_of::<T>();
    assert!(!inputs.is_empty(), "a reduction needs at least one input");
    assert_eq!(
        out.len() % size,
        0,
        "output is not a whole number of elements"
    );
    for input in inputs {
        assert_eq!(input.len(), out.len(), "inputs and output differ in length");
    }
    let read = |bytes: &[u8]| T::widen(bytemuck::pod_read_unaligned::<T>(bytes));
    let batch_bytes = BATCH * size;
    let mut acc: Vec<T::Acc> = Vec::with_capacity(BATCH);
    for (start, out_batch) in (0..).step_by(batch_bytes).zip(out.chunks_mut(batch_bytes)) {
        let end = start + out_batch.len();
        acc.clear();
        acc.extend(inputs[0][start..end].chunks_exact(size).map(read));
        for input in &inputs[1..] {
            for (a, b) in acc.iter_mut().zip(input[start..end].chunks_exact(size)) {
                *a = T::apply(op, *a, read(b));
            }
        }
        for (o, a) in out_batch.chunks_exact_mut(size).zip(&acc) {
            o.copy_from_slice(bytemuck::bytes_of(&T::narrow(*a)));
        }
    }
}

/// The elements `lo..hi` that `rank` reduces when `count` elements are split over `size`
/// ranks (reduce-scatter): `count / size` each, the first `count % size` ranks one more.
pub(crate) fn slice_of(count: usize, size: usize, rank: usize) -> (usize, usize) {
    let (base, extra) = (count / size, count % size);
    let lo = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    (lo, lo + len)
}

/// For `f16` and `bf16`, the elements of `bytes` widened to `f32` (how backends without a
/// half-precision type reduce them, MPI among them); `None` for the other types.
pub fn widen_half(dtype: DataType, bytes: &[u8]) -> Option<Vec<f32>> {
    let widen: fn(&[u8]) -> f32 = match dtype {
        DataType::F16 => |b| bytemuck::pod_read_unaligned::<f16>(b).to_f32(),
        DataType::Bf16 => |b| bytemuck::pod_read_unaligned::<bf16>(b).to_f32(),
        _ => return None,
    };
    Some(bytes.chunks_exact(2).map(widen).collect())
}

/// The inverse of [`widen_half`]: rounds each of `wide` (native-endian `f32` bytes, any
/// alignment) to `dtype` (`f16` or `bf16`, nearest even) into `out`, which holds as many
/// elements. Does nothing for other types.
pub fn narrow_half(dtype: DataType, wide: &[u8], out: &mut [u8]) {
    let narrow: fn(f32) -> [u8; 2] = match dtype {
        DataType::F16 => |x| f16::from_f32(x).to_ne_bytes(),
        DataType::Bf16 => |x| bf16::from_f32(x).to_ne_bytes(),
        _ => return,
    };
    for (o, w) in out.chunks_exact_mut(2).zip(wide.chunks_exact(4)) {
        o.copy_from_slice(&narrow(bytemuck::pod_read_unaligned::<f32>(w)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_tile_the_elements_in_rank_order() {
        for size in 1..9 {
            for count in 0..40 {
                let mut next = 0;
                for rank in 0..size {
                    let (lo, hi) = slice_of(count, size, rank);
                    assert_eq!(lo, next);
                    assert!(hi - lo <= count / size + 1);
                    next = hi;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn element_sizes_match_their_data_types() {
        fn size<T: Element>() {
            assert_eq!(
                std::mem::size_of::<T>(),
                T::DTYPE.size(),
                "{}",
                T::DTYPE.name()
            );
        }
        size::<i8>();
        size::<u8>();
        size::<i16>();
        size::<u16>();
        size::<i32>();
        size::<u32>();
        size::<i64>();
        size::<u64>();
        size::<f16>();
        size::<bf16>();
        size::<f32>();
        size::<f64>();
    }

    #[test]
    fn half_types_accumulate_in_f32_and_round_once() {
        // 2048 + 1 + 1 in f16 step by step stays 2048 (1 is below half an ulp there);
        // accumulated in f32 it is 2050, which f16 represents exactly.
        let inputs: Vec<[u8; 2]> = [2048.0f32, 1.0, 1.0]
            .iter()
            .map(|&x| f16::from_f32(x).to_ne_bytes())
            .collect();
        let refs: Vec<&[u8]> = inputs.iter().map(|b| &b[..]).collect();
        let mut out = [0u8; 2];
        reduce_into(DataType::F16, ReduceOp::Sum, &refs, &mut out);
        assert_eq!(f16::from_ne_bytes(out).to_f32(), 2050.0);
    }

    #[test]
    fn integer_sums_wrap() {
        let a = [200u8];
        let b = [100u8];
        let mut out = [0u8];
        reduce_into(DataType::U8, ReduceOp::Sum, &[&a, &b], &mut out);
        assert_eq!(out[0], 44);
    }

    #[test]
    fn unaligned_inputs_are_read_correctly() {
        let values = [1.5f64, -2.0, 3.25];
        // On the heap (at least 8-aligned), so that `storage[1..]` is surely misaligned.
        #[allow(clippy::useless_vec)]
        let mut storage = vec![0u8; 1 + 24];
        storage[1..].copy_from_slice(bytemuck::cast_slice(&values));
        let unaligned = &storage[1..];
        let mut out = vec![0u8; 24];
        reduce_into(
            DataType::F64,
            ReduceOp::Sum,
            &[unaligned, unaligned],
            &mut out,
        );
        let got: Vec<f64> = out
            .chunks_exact(8)
            .map(bytemuck::pod_read_unaligned)
            .collect();
        assert_eq!(got, vec![3.0, -4.0, 6.5]);
    }
}
