//! The numeric all-reduce on the local backend: every element type, every reduction, in place
//! and out of place, against a reference written the slow obvious way; mismatched calls and
//! bad arguments.

mod common;

use common::{assert_count_too_large, rank_zero};
use half::{bf16, f16};
use proptest::prelude::*;
use tpcomm_transport::{
    ArgumentError, Communicator, DataType, Element, LocalGroup, Op, ReduceOp, TransportError,
};

/// An element type with its reference reduction (rank order, wrapping integers, half types
/// in f32) and a deterministic test value.
trait Reference: Element + std::fmt::Debug {
    fn value(seed: u64, rank: usize, index: usize) -> Self;
    /// Folds `values` (rank order) with `op`, bits of the result returned as bytes.
    fn fold(op: ReduceOp, values: &[Self]) -> Self;
}

macro_rules! int_reference {
    ($($t:ty),*) => {$(
        impl Reference for $t {
            fn value(seed: u64, rank: usize, index: usize) -> Self {
                let x = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add((rank as u64) << 32 | index as u64)
                    .wrapping_mul(1442695040888963407);
                (x >> 17) as $t
            }
            fn fold(op: ReduceOp, values: &[Self]) -> Self {
                let mut acc = values[0];
                for &v in &values[1..] {
                    acc = match op {
                        ReduceOp::Sum => acc.wrapping_add(v),
                        ReduceOp::Prod => acc.wrapping_mul(v),
                        ReduceOp::Max => if v > acc { v } else { acc },
                        ReduceOp::Min => if v < acc { v } else { acc },
                    };
                }
                acc
            }
        }
    )*};
}

int_reference!(i8, u8, i16, u16, i32, u32, i64, u64);

fn float_value(seed: u64, rank: usize, index: usize) -> f64 {
    let k = (seed as usize)
        .wrapping_mul(31)
        .wrapping_add(rank * 7 + index * 13)
        % 37;
    (k as f64 - 18.0) * 0.375
}

fn fold_f64(op: ReduceOp, values: impl Iterator<Item = f64>) -> f64 {
    let mut it = values;
    let mut acc = it.next().expect("at least one rank");
    for v in it {
        acc = match op {
            ReduceOp::Sum => acc + v,
            ReduceOp::Prod => acc * v,
            ReduceOp::Max => acc.max(v),
            ReduceOp::Min => acc.min(v),
        };
    }
    acc
}

fn fold_f32(op: ReduceOp, values: impl Iterator<Item = f32>) -> f32 {
    let mut it = values;
    let mut acc = it.next().expect("at least one rank");
    for v in it {
        acc = match op {
            ReduceOp::Sum => acc + v,
            ReduceOp::Prod => acc * v,
            ReduceOp::Max => acc.max(v),
            ReduceOp::Min => acc.min(v),
        };
    }
    acc
}

impl Reference for f64 {
    fn value(seed: u64, rank: usize, index: usize) -> Self {
        float_value(seed, rank, index) + 1e-9 * index as f64
    }
    fn fold(op: ReduceOp, values: &[Self]) -> Self {
        fold_f64(op, values.iter().copied())
    }
}

impl Reference for f32 {
    fn value(seed: u64, rank: usize, index: usize) -> Self {
        float_value(seed, rank, index) as f32 + 1e-4 * index as f32
    }
    fn fold(op: ReduceOp, values: &[Self]) -> Self {
        fold_f32(op, values.iter().copied())
    }
}

impl Reference for f16 {
    fn value(seed: u64, rank: usize, index: usize) -> Self {
        f16::from_f64(float_value(seed, rank, index))
    }
    fn fold(op: ReduceOp, values: &[Self]) -> Self {
        f16::from_f32(fold_f32(op, values.iter().map(|v| v.to_f32())))
    }
}

impl Reference for bf16 {
    fn value(seed: u64, rank: usize, index: usize) -> Self {
        bf16::from_f64(float_value(seed, rank, index))
    }
    fn fold(op: ReduceOp, values: &[Self]) -> Self {
        bf16::from_f32(fold_f32(op, values.iter().map(|v| v.to_f32())))
    }
}

/// Runs one all-reduce of `count` elements of `T` on `size` ranks and checks every rank's
/// result bit for bit against the reference.
fn check_against_reference<T: Reference>(
    size: usize,
    count: usize,
    op: ReduceOp,
    in_place: bool,
    seed: u64,
) {
    let input = |rank: usize| -> Vec<T> { (0..count).map(|i| T::value(seed, rank, i)).collect() };
    let expected: Vec<T> = (0..count)
        .map(|i| {
            let column: Vec<T> = (0..size).map(|r| T::value(seed, r, i)).collect();
            T::fold(op, &column)
        })
        .collect();
    let results = LocalGroup::new(size).run(|comm| {
        let send = input(comm.rank());
        if in_place {
            let mut buf = send;
            comm.all_reduce_in_place(&mut buf, op)?;
            Ok::<_, TransportError>(buf)
        } else {
            let mut recv = vec![T::value(seed + 1, 99, 0); count];
            comm.all_reduce(&send, &mut recv, op)?;
            Ok(recv)
        }
    });
    for (rank, result) in results.into_iter().enumerate() {
        let got = result.unwrap().unwrap();
        assert_eq!(
            bytemuck::cast_slice::<T, u8>(&got),
            bytemuck::cast_slice::<T, u8>(&expected),
            "{} {op:?} in_place={in_place} size={size} count={count} rank {rank}: {got:?} != {expected:?}",
            T::DTYPE.name()
        );
    }
}

fn every_type(size: usize, count: usize, op: ReduceOp, in_place: bool, seed: u64) {
    check_against_reference::<i8>(size, count, op, in_place, seed);
    check_against_reference::<u8>(size, count, op, in_place, seed);
    check_against_reference::<i16>(size, count, op, in_place, seed);
    check_against_reference::<u16>(size, count, op, in_place, seed);
    check_against_reference::<i32>(size, count, op, in_place, seed);
    check_against_reference::<u32>(size, count, op, in_place, seed);
    check_against_reference::<i64>(size, count, op, in_place, seed);
    check_against_reference::<u64>(size, count, op, in_place, seed);
    check_against_reference::<f16>(size, count, op, in_place, seed);
    check_against_reference::<bf16>(size, count, op, in_place, seed);
    check_against_reference::<f32>(size, count, op, in_place, seed);
    check_against_reference::<f64>(size, count, op, in_place, seed);
}

#[test]
fn every_type_and_op_matches_the_reference_in_place_and_out_of_place() {
    for op in ReduceOp::ALL {
        for in_place in [false, true] {
            every_type(4, 1037, op, in_place, 7);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_count_and_size_matches_the_reference(
        size in 1usize..6,
        count in prop_oneof![Just(0usize), Just(1usize), 0usize..70],
        op_pick in 0usize..4,
        in_place in any::<bool>(),
        seed in any::<u64>(),
    ) {
        every_type(size, count, ReduceOp::ALL[op_pick], in_place, seed);
    }
}

/// Asserts that every rank got `Mismatch` for the all-reduce.
fn assert_mismatch_everywhere(results: Vec<Result<Result<(), TransportError>, TransportError>>) {
    for (rank, result) in results.into_iter().enumerate() {
        match result.unwrap() {
            Err(TransportError::Mismatch {
                op: Op::AllReduce,
                rank: r,
                detail,
            }) => {
                assert_eq!(r, rank);
                assert!(detail.contains("all_reduce"), "{detail}");
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn ranks_passing_different_counts_get_a_mismatch_on_every_rank() {
    assert_mismatch_everywhere(LocalGroup::new(3).run(|comm| {
        let mut buf = vec![1u32; 4 + usize::from(comm.rank() == 2)];
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
    }));
}

#[test]
fn ranks_passing_different_types_get_a_mismatch_on_every_rank() {
    assert_mismatch_everywhere(LocalGroup::new(2).run(|comm| {
        // Same byte length (8), different element types.
        if comm.rank() == 0 {
            comm.all_reduce_in_place(&mut [1u32; 2], ReduceOp::Sum)
        } else {
            comm.all_reduce_in_place(&mut [1f32; 2], ReduceOp::Sum)
        }
    }));
}

#[test]
fn ranks_passing_different_ops_get_a_mismatch_on_every_rank() {
    assert_mismatch_everywhere(LocalGroup::new(4).run(|comm| {
        let op = if comm.rank() == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Min
        };
        comm.all_reduce_in_place(&mut [1i64; 3], op)
    }));
}

#[test]
fn the_group_stays_usable_after_a_mismatch() {
    let results = LocalGroup::new(2).run(|comm| {
        let mut buf = vec![1u8; 1 + comm.rank()];
        assert!(comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).is_err());
        let mut x = [comm.rank() as u16 + 1];
        comm.all_reduce_in_place(&mut x, ReduceOp::Prod)?;
        Ok::<_, TransportError>(x[0])
    });
    for r in results {
        assert_eq!(r.unwrap().unwrap(), 2);
    }
}

#[test]
fn bytes_that_are_not_whole_elements_are_rejected_before_sending() {
    let results = LocalGroup::new(1).run(|comm| {
        let mut recv = [0u8; 6];
        comm.all_reduce_bytes(None, &mut recv, DataType::F32, ReduceOp::Sum)
    });
    match rank_zero(results) {
        Err(TransportError::InvalidArgument {
            op: Op::AllReduce,
            source:
                ArgumentError::PartialElement {
                    which: "receive",
                    len: 6,
                    elem: 4,
                    ..
                },
            ..
        }) => {}
        other => panic!("expected a partial-element error, got {other:?}"),
    }
}

#[test]
fn send_and_receive_of_different_lengths_are_rejected() {
    let results = LocalGroup::new(1).run(|comm| {
        let mut recv = [0f64; 2];
        comm.all_reduce(&[1.0f64; 3], &mut recv, ReduceOp::Sum)
    });
    match rank_zero(results) {
        Err(TransportError::InvalidArgument {
            source:
                ArgumentError::SendLength {
                    expected: 16,
                    actual: 24,
                },
            ..
        }) => {}
        other => panic!("expected a send-length error, got {other:?}"),
    }
}

#[test]
fn a_count_above_max_count_elements_is_rejected() {
    let results = LocalGroup::new(1)
        .max_count(3)
        .run(|comm| comm.all_reduce_in_place(&mut [0u16; 4], ReduceOp::Sum));
    assert_count_too_large(rank_zero(results), 4, 3);
}

#[test]
fn unaligned_byte_buffers_reduce_like_typed_ones() {
    let results = LocalGroup::new(3).run(|comm| {
        let values = [comm.rank() as f64 + 0.5, -(comm.rank() as f64)];
        // On the heap (at least 8-aligned), so that `storage[1..]` is surely misaligned.
        #[allow(clippy::useless_vec)]
        let mut storage = vec![0u8; 17];
        storage[1..].copy_from_slice(bytemuck::cast_slice(&values));
        comm.all_reduce_bytes(None, &mut storage[1..], DataType::F64, ReduceOp::Sum)?;
        let out: Vec<f64> = storage[1..]
            .chunks_exact(8)
            .map(bytemuck::pod_read_unaligned)
            .collect();
        Ok::<_, TransportError>(out)
    });
    for r in results {
        assert_eq!(r.unwrap().unwrap(), vec![4.5, -3.0]);
    }
}

/// A backend without its own reduction: every hook forwarded to the local backend except
/// `raw_all_reduce`, which keeps the trait's default (all-to-all, then all-gather).
struct Composed(tpcomm_transport::LocalCommunicator);

impl Communicator for Composed {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn max_count(&self) -> usize {
        self.0.max_count()
    }
    fn backend_name(&self) -> &'static str {
        "composed"
    }
    fn split(&self, color: Option<u32>, key: i32) -> tpcomm_transport::Result<Option<Self>> {
        Ok(self.0.split(color, key)?.map(Composed))
    }
    fn raw_barrier(&self) -> tpcomm_transport::Result<()> {
        self.0.raw_barrier()
    }
    fn raw_all_gather(
        &self,
        args: tpcomm_transport::check::AllGatherArgs<'_>,
    ) -> tpcomm_transport::Result<()> {
        self.0.raw_all_gather(args)
    }
    fn raw_all_gather_varcount(
        &self,
        args: tpcomm_transport::check::VarcountArgs<'_>,
    ) -> tpcomm_transport::Result<()> {
        self.0.raw_all_gather_varcount(args)
    }
    fn raw_gather_varcount(
        &self,
        args: tpcomm_transport::check::GatherArgs<'_>,
    ) -> tpcomm_transport::Result<()> {
        self.0.raw_gather_varcount(args)
    }
    fn raw_broadcast(
        &self,
        args: tpcomm_transport::check::BroadcastArgs<'_>,
    ) -> tpcomm_transport::Result<()> {
        self.0.raw_broadcast(args)
    }
    fn raw_all_to_all_varcount(
        &self,
        args: tpcomm_transport::check::AllToAllArgs<'_>,
    ) -> tpcomm_transport::Result<()> {
        self.0.raw_all_to_all_varcount(args)
    }
}

/// The composed default on ranks passing different counts (3 and 4 elements: only one
/// rank's all-to-all slices differ), types or ops: every rank gets `Mismatch`, and the group
/// stays in step for the next call.
#[test]
fn the_default_all_reduce_reports_a_count_type_or_op_mismatch_on_every_rank() {
    type Call = fn(&Composed) -> tpcomm_transport::Result<()>;
    let cases: [(&str, Call); 3] = [
        ("count", |c| {
            let n = 3 + c.rank();
            c.all_reduce(&vec![1f32; n], &mut vec![0f32; n], ReduceOp::Sum)
        }),
        ("type", |c| {
            if c.rank() == 0 {
                c.all_reduce(&[1f32; 4], &mut [0f32; 4], ReduceOp::Sum)
            } else {
                c.all_reduce(&[1i32; 4], &mut [0i32; 4], ReduceOp::Sum)
            }
        }),
        ("op", |c| {
            let op = if c.rank() == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            c.all_reduce(&[1f32; 4], &mut [0f32; 4], op)
        }),
    ];
    for (what, call) in cases {
        let results = LocalGroup::new(2)
            .timeout(std::time::Duration::from_secs(5))
            .run(|comm| {
                let comm = Composed(comm);
                let first = call(&comm);
                let mut next = [comm.rank() as u32 + 1; 2];
                comm.all_reduce_in_place(&mut next, ReduceOp::Sum)?;
                Ok::<_, TransportError>((first, next))
            });
        for (rank, r) in results.into_iter().enumerate() {
            let (first, next) = r
                .unwrap()
                .unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}"));
            assert!(
                matches!(first, Err(TransportError::Mismatch { .. })),
                "{what}: rank {rank}: {first:?}"
            );
            assert_eq!(next, [3, 3], "{what}: rank {rank}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn the_default_composed_reduction_matches_the_reference(
        size in 1usize..6,
        count in prop_oneof![Just(0usize), 0usize..70],
        op_pick in 0usize..4,
        in_place in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let op = ReduceOp::ALL[op_pick];
        let results = LocalGroup::new(size).run(|comm| {
            let comm = Composed(comm);
            let send: Vec<f32> = (0..count).map(|i| f32::value(seed, comm.rank(), i)).collect();
            let mut out = vec![0f32; count];
            if in_place {
                out.copy_from_slice(&send);
                comm.all_reduce_in_place(&mut out, op)?;
            } else {
                comm.all_reduce(&send, &mut out, op)?;
            }
            let mut wide: Vec<i64> = (0..count).map(|i| i64::value(seed, comm.rank(), i)).collect();
            comm.all_reduce_in_place(&mut wide, op)?;
            Ok::<_, TransportError>((out, wide))
        });
        for result in results {
            let (got, wide) = result.unwrap().unwrap();
            for i in 0..count {
                let column: Vec<f32> = (0..size).map(|r| f32::value(seed, r, i)).collect();
                prop_assert_eq!(got[i].to_bits(), f32::fold(op, &column).to_bits());
                let column: Vec<i64> = (0..size).map(|r| i64::value(seed, r, i)).collect();
                prop_assert_eq!(wide[i], i64::fold(op, &column));
            }
        }
    }
}
