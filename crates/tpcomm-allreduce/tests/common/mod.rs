//! What the test suites share: deterministic random inputs per (seed, rank, element) and a
//! check of an all-reduce output against the f64 sum of every rank's inputs as rounded to
//! the element type; the group and the host communicator every suite starts from; reading
//! and writing peer memory; error chains; the `Backend` methods a test wrapper of the host
//! backend forwards unchanged ([`forward_to_inner`]). `cuda`: the same for the GPU suites.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tpcomm_allreduce::{AllReduceError, Config, CustomAllReduce, DType, Element, HostBackend};
use tpcomm_ipc::{HostMemory, MemoryRegion, PeerMemory};
use tpcomm_transport::{Communicator, LocalGroup};

pub(crate) type R<T> = tpcomm_allreduce::Result<T>;

/// The threads group of `n` ranks the host suites run on (a 60 s transport timeout).
pub(crate) fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(60))
}

/// A host all-reduce of `comm`'s group on fresh host memory.
pub(crate) fn new_ar<C: Communicator + ?Sized>(
    comm: &C,
    config: Config,
) -> R<CustomAllReduce<HostBackend>> {
    CustomAllReduce::new(HostBackend::new(), HostMemory::new(), comm, config)
}

/// The default settings with every barrier wait bounded by `timeout`.
pub(crate) fn with_timeout(timeout: Duration) -> Config {
    Config {
        timeout,
        ..Config::default()
    }
}

/// `e` and every error below it (`source()`), joined: what a chain printer shows.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        text.push_str(": ");
        text.push_str(&s.to_string());
        next = s.source();
    }
    text
}

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

/// The sum of every rank's elements (`inputs[r]`, equal lengths) in the order the host
/// backend and the CUDA kernels take: rank 0's value widened to f32, each next rank's added
/// in rank order in f32, the sum rounded once to `T` (to nearest, ties to even).
pub(crate) fn rank_order_sum<T: Element>(inputs: &[Vec<T>]) -> Vec<T> {
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for rank in &inputs[1..] {
                acc += rank[i].to_f32();
            }
            T::from_f32(acc)
        })
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

/// The first `count` f32 of `buf`, panicking when it cannot be read.
pub(crate) fn read_f32<M: PeerMemory>(
    memory: &M,
    buf: &impl MemoryRegion,
    count: usize,
) -> Vec<f32> {
    read(memory, buf, count).unwrap()
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
    unwrap_saying(results, "")
}

/// [`unwrap_all`] of a run on `world` ranks, naming the world size in a rank's panic.
pub(crate) fn unwrap_world<T>(
    world: usize,
    results: Vec<tpcomm_transport::Result<tpcomm_allreduce::Result<T>>>,
) -> Vec<T> {
    unwrap_saying(results, &format!("world {world} "))
}

/// Every rank's value; a rank's error panics with `what`, the rank and the error.
fn unwrap_saying<T>(
    results: Vec<tpcomm_transport::Result<tpcomm_allreduce::Result<T>>>,
    what: &str,
) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.expect("rank thread")
                .unwrap_or_else(|e| panic!("{what}rank {rank}: {e}"))
        })
        .collect()
}

/// The `Backend` methods that a test wrapper of the host backend (a struct with an `inner`
/// backend of the same memory) hands to `inner` unchanged, named one by one in an
/// `impl Backend` block: `signal_bytes`, `nonce_offset`, `reset_signal`, `launch` (through
/// `Launch::run_on`), `stage`. Every other method is the wrapper's own (or the trait's
/// default), as the test needs it.
#[allow(unused_macros)] // Not every suite wraps a backend.
macro_rules! forward_to_inner {
    ($($method:ident),* $(,)?) => {
        $(forward_to_inner!(@ $method);)*
    };
    (@ signal_bytes) => {
        fn signal_bytes(&self) -> usize {
            tpcomm_allreduce::Backend::signal_bytes(&self.inner)
        }
    };
    (@ nonce_offset) => {
        fn nonce_offset(&self) -> usize {
            tpcomm_allreduce::Backend::nonce_offset(&self.inner)
        }
    };
    (@ reset_signal) => {
        fn reset_signal(
            &self,
            memory: &Self::Memory,
            signal: &tpcomm_allreduce::backend::Buffer<Self>,
        ) -> tpcomm_allreduce::Result<()> {
            tpcomm_allreduce::Backend::reset_signal(&self.inner, memory, signal)
        }
    };
    (@ launch) => {
        fn launch(
            &self,
            memory: &Self::Memory,
            l: &tpcomm_allreduce::backend::Launch<'_, Self>,
        ) -> tpcomm_allreduce::Result<()> {
            l.run_on(&self.inner, memory)
        }
    };
    (@ stage) => {
        fn stage(
            &self,
            memory: &Self::Memory,
            input: &tpcomm_allreduce::backend::Buffer<Self>,
            staging: &tpcomm_allreduce::backend::Buffer<Self>,
            range: std::ops::Range<usize>,
        ) -> tpcomm_allreduce::Result<()> {
            tpcomm_allreduce::Backend::stage(&self.inner, memory, input, staging, range)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use forward_to_inner;
