//! Reference data shared by the test suites: deterministic random inputs per (seed, rank,
//! element) and a check of an all-reduce output against the f64 sum of every rank's inputs
//! as rounded to the element type.
#![allow(dead_code)]

use std::time::{SystemTime, UNIX_EPOCH};

use tpcomm_allreduce::{AllReduceError, DType, Element};
use tpcomm_ipc::{MemoryRegion, PeerMemory};

/// A fresh seed per run, so every run sees new data.
pub(crate) fn run_seed() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Deterministic values for (seed, rank, i) in [-2, 2).
pub(crate) fn value(seed: u64, rank: usize, i: usize) -> f32 {
    let mut z = seed ^ ((rank as u64) << 48) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
}

pub(crate) fn inputs<T: Element>(seed: u64, rank: usize, count: usize) -> Vec<T> {
    (0..count)
        .map(|i| T::from_f32(value(seed, rank, i)))
        .collect()
}

/// Checks `out` against the f64 sum of every rank's (rounded) inputs.
pub(crate) fn check<T: Element>(seed: u64, world: usize, out: &[T]) -> Result<(), String> {
    let tolerance = match T::DTYPE {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::Bf16 => 1.6e-2,
    };
    for (i, o) in out.iter().enumerate() {
        let reference: f64 = (0..world)
            .map(|r| f64::from(T::from_f32(value(seed, r, i)).to_f32()))
            .sum();
        let got = f64::from(o.to_f32());
        if (got - reference).abs() > tolerance * (1.0 + reference.abs()) * world as f64 {
            return Err(format!("element {i}: got {got}, reference {reference}"));
        }
    }
    Ok(())
}

/// Writes `count` copies of `value` at the start of `buf`.
pub(crate) fn fill<M: PeerMemory>(
    memory: &M,
    buf: &impl MemoryRegion,
    value: f32,
    count: usize,
) -> tpcomm_allreduce::Result<()> {
    Ok(memory.write(buf, 0, bytemuck::cast_slice(&vec![value; count]))?)
}

/// The first `count` f32 of `buf`.
pub(crate) fn read<M: PeerMemory>(
    memory: &M,
    buf: &impl MemoryRegion,
    count: usize,
) -> tpcomm_allreduce::Result<Vec<f32>> {
    let mut raw = vec![0u8; count * 4];
    memory.read(buf, 0, &mut raw)?;
    Ok(bytemuck::cast_slice(&raw).to_vec())
}

/// The cause of a `Failed` error, or the error itself.
pub(crate) fn cause(e: &AllReduceError) -> &AllReduceError {
    match e {
        AllReduceError::Failed { cause, .. } => cause,
        other => other,
    }
}

/// Every rank's value, panicking with the rank's error otherwise.
pub(crate) fn unwrap_all<T>(
    results: Vec<tpcomm_transport::Result<tpcomm_allreduce::Result<T>>>,
) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.expect("rank thread")
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
        })
        .collect()
}
