//! Cases of the numeric all-reduce (`Communicator::all_reduce`), run by every backend.
//!
//! Values are small multiples of 0.5 (at most 3 significant bits each), so that sums and
//! products of up to 8 ranks are exact in `f32`: any reduction order (MPI's is its own)
//! gives bitwise the reference result. Integer sums and products stay in range for up to 8
//! ranks: what an overflowing integer reduction gives is the MPI implementation's (Open MPI
//! 4.1's AVX reductions saturate 8- and 16-bit sums, open-mpi/ompi#8045), while the local
//! backend wraps (tested in tpcomm-transport).

use tpcomm::transport::reduce::{reduce_into, DataType, ReduceOp};
use tpcomm::transport::Communicator;

use crate::{ok, CaseResult, Rng};

/// An integer input that keeps `op` over up to 8 ranks in range of `dtype`.
fn int_input(rng: &mut Rng, dtype: DataType, op: ReduceOp) -> i64 {
    let signed = matches!(
        dtype,
        DataType::I8 | DataType::I16 | DataType::I32 | DataType::I64
    );
    let pick = |rng: &mut Rng, lo: i64, hi: i64| lo + rng.below((hi - lo + 1) as usize) as i64;
    match (op, dtype.size(), signed) {
        (ReduceOp::Sum, _, true) => pick(rng, -15, 15),
        (ReduceOp::Sum, _, false) => pick(rng, 0, 31),
        (ReduceOp::Prod, 1, true) => pick(rng, -1, 1),
        (ReduceOp::Prod, 1, false) => pick(rng, 0, 1),
        (ReduceOp::Prod, _, true) => pick(rng, -3, 3),
        (ReduceOp::Prod, _, false) => pick(rng, 0, 3),
        (ReduceOp::Max | ReduceOp::Min, _, _) => rng.next_u64() as i64,
    }
}

/// The input bytes of `rank` for one call: `count` elements of `dtype`.
fn input(dtype: DataType, op: ReduceOp, rank: usize, count: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ ((rank as u64 + 1) << 40));
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let k = rng.below(9) as i64 - 4; // -4..=4
        let x = k as f64 * 0.5;
        let int = int_input(&mut rng, dtype, op);
        match dtype {
            DataType::I8 => out.extend((int as i8).to_ne_bytes()),
            DataType::U8 => out.extend((int as u8).to_ne_bytes()),
            DataType::I16 => out.extend((int as i16).to_ne_bytes()),
            DataType::U16 => out.extend((int as u16).to_ne_bytes()),
            DataType::I32 => out.extend((int as i32).to_ne_bytes()),
            DataType::U32 => out.extend((int as u32).to_ne_bytes()),
            DataType::I64 => out.extend(int.to_ne_bytes()),
            DataType::U64 => out.extend((int as u64).to_ne_bytes()),
            DataType::F16 => out.extend(half::f16::from_f64(x).to_ne_bytes()),
            DataType::Bf16 => out.extend(half::bf16::from_f64(x).to_ne_bytes()),
            DataType::F32 => out.extend((x as f32).to_ne_bytes()),
            DataType::F64 => out.extend(x.to_ne_bytes()),
        }
    }
    out
}

/// Every type, every reduction, in place and out of place, for random counts (0 and odd
/// counts among them), against the rank-order reference.
pub fn all_reduce_matches_reference<C: Communicator>(comm: &C) -> CaseResult {
    let mut rng = Rng::new(0xA11_4ED);
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL {
            for in_place in [false, true] {
                let count = match rng.below(4) {
                    0 => 0,
                    1 => 1,
                    2 => 2 * rng.below(500) + 1,
                    _ => rng.below(5000),
                };
                let seed = rng.next_u64();
                let inputs: Vec<Vec<u8>> = (0..comm.size())
                    .map(|r| input(dtype, op, r, count, seed))
                    .collect();
                let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                let mut want = vec![0u8; count * dtype.size()];
                reduce_into(dtype, op, &refs, &mut want);
                let mine = &inputs[comm.rank()];
                let what = format!(
                    "all_reduce of {count} {} ({}, in place: {in_place})",
                    dtype.name(),
                    op.name()
                );
                let got = if in_place {
                    let mut buf = mine.clone();
                    ok(&what, comm.all_reduce_bytes(None, &mut buf, dtype, op))?;
                    buf
                } else {
                    let mut recv = vec![0xEEu8; mine.len()];
                    ok(
                        &what,
                        comm.all_reduce_bytes(Some(mine), &mut recv, dtype, op),
                    )?;
                    recv
                };
                if got != want {
                    let at = got.iter().zip(&want).position(|(a, b)| a != b);
                    let near = |v: &[u8]| {
                        at.map(|i| v[i.saturating_sub(2)..(i + 3).min(v.len())].to_vec())
                    };
                    return Err(format!(
                        "{what}: result differs from the reference at byte {at:?}: got {:?}, \
                         expected {:?}, inputs {:?}",
                        near(&got),
                        near(&want),
                        refs.iter().map(|r| near(r)).collect::<Vec<_>>()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The typed API on a sub-group: f32 sums of ranks' indices over a split.
pub fn typed_all_reduce_on_split_groups<C: Communicator>(comm: &C) -> CaseResult {
    let color = (comm.rank() % 2) as u32;
    let sub = ok("split", comm.split(Some(color), 0))?
        .ok_or_else(|| "split with a color returned no group".to_string())?;
    let mut x = [comm.rank() as f32, 1.0];
    ok(
        "all_reduce_in_place",
        sub.all_reduce_in_place(&mut x, ReduceOp::Sum),
    )?;
    let members: Vec<usize> = (0..comm.size())
        .filter(|r| r % 2 == comm.rank() % 2)
        .collect();
    let want = [members.iter().sum::<usize>() as f32, members.len() as f32];
    if x != want {
        return Err(format!("split all_reduce gave {x:?}, expected {want:?}"));
    }
    Ok(())
}
