//! Custom all-reduce cases of the conformance suite: the host backend between the ranks of
//! any communicator (threads of the local group, or processes under MPI).

use tpcomm::allreduce::{AllReduceError, Config, CustomAllReduce, DType, Element, HostBackend};
use tpcomm::ipc::{HostMemory, PeerMemory};
use tpcomm::transport::Communicator;

use crate::{CaseResult, Rng};

fn ar<T>(what: &str, r: Result<T, AllReduceError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// A host all-reduce between the ranks of `comm`, default configuration.
fn host_all_reduce<C: Communicator>(comm: &C) -> Result<CustomAllReduce<HostBackend>, String> {
    ar(
        "new",
        CustomAllReduce::new(
            HostBackend::new(),
            HostMemory::new(),
            comm,
            Config::default(),
        ),
    )
}

/// Rank `rank`'s value at `i` for `seed`, in [-2, 2).
fn value(seed: u64, rank: usize, i: usize) -> f32 {
    let mut rng = Rng::new(seed ^ ((rank as u64) << 40) ^ (i as u64).wrapping_mul(0x9E37_79B9));
    (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
}

fn check<T: Element>(what: &str, seed: u64, n: usize, out: &[T]) -> CaseResult {
    let tolerance = match T::DTYPE {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::Bf16 => 1.6e-2,
    };
    for (i, o) in out.iter().enumerate() {
        let reference: f64 = (0..n)
            .map(|r| f64::from(T::from_f32(value(seed, r, i)).to_f32()))
            .sum();
        let got = f64::from(o.to_f32());
        if (got - reference).abs() > tolerance * (1.0 + reference.abs()) * n as f64 {
            return Err(format!(
                "{what}: element {i} is {got}, reference {reference}"
            ));
        }
    }
    Ok(())
}

fn eager<T: Element, C: Communicator>(
    x: &mut CustomAllReduce<HostBackend>,
    comm: &C,
    seed: u64,
    bytes: usize,
) -> CaseResult {
    let count = bytes / T::DTYPE.size();
    let input: Vec<T> = (0..count)
        .map(|i| T::from_f32(value(seed, comm.rank(), i)))
        .collect();
    let mut out = vec![T::from_f32(f32::NAN); count];
    ar("all_reduce", x.all_reduce(&input, &mut out))?;
    check(
        &format!("{} {bytes} bytes", T::DTYPE.name()),
        seed,
        comm.size(),
        &out,
    )
}

/// Eager all-reduces of every dtype from 16 B to 1 MiB (and f32 at 8 MiB) against an f64
/// reference, on whichever algorithm the dispatcher picks, then a
/// captured plan replayed before and after a suspend/resume.
pub(crate) fn host_matches_reference_and_survives_suspend_resume<C: Communicator>(
    comm: &C,
) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let mut x = host_all_reduce(comm)?;
    for (k, bytes) in [16usize, 4096, 65_536, 1 << 20].into_iter().enumerate() {
        let seed = 1000 + k as u64;
        eager::<f32, C>(&mut x, comm, seed, bytes)?;
        eager::<half::f16, C>(&mut x, comm, seed, bytes)?;
        eager::<half::bf16, C>(&mut x, comm, seed, bytes)?;
    }
    // The largest size the default configuration serves, two-stage on every world size.
    eager::<f32, C>(&mut x, comm, 2000, 8 << 20)?;
    let mem = ar("memory", x.memory())?.clone();
    let input = mem.allocate(1 << 20).map_err(|e| e.to_string())?;
    let output = mem.allocate(1 << 20).map_err(|e| e.to_string())?;
    let count = (1 << 20) / 4;
    let fill = |scale: f32| {
        let v: Vec<f32> = (0..count).map(|i| value(7, me, i) * scale).collect();
        mem.write(&input, 0, bytemuck_f32(&v))
            .map_err(|e| e.to_string())
    };
    let plan = ar(
        "capture",
        x.capture(|cap| cap.all_reduce(&input, &output, DType::F32, count).map(drop)),
    )?;
    ar("register_graph_buffers", x.register_graph_buffers(comm))?;
    for (round, scale) in [(0, 1.0f32), (1, 3.0)] {
        if round == 1 {
            ar("prepare_for_suspend", x.prepare_for_suspend(comm))?;
            ar("reinit_after_resume", x.reinit_after_resume(comm))?;
        }
        fill(scale)?;
        ar("replay", plan.replay(&mut x))?;
        let mut raw = vec![0u8; count * 4];
        mem.read(&output, 0, &mut raw).map_err(|e| e.to_string())?;
        for (i, chunk) in raw.chunks_exact(4).enumerate().step_by(997) {
            let got = f32::from_le_bytes(chunk.try_into().expect("4 bytes"));
            let want: f32 = (0..n).map(|r| value(7, r, i) * scale).sum();
            if (got - want).abs() > 1e-4 * (1.0 + want.abs()) {
                return Err(format!(
                    "replay round {round}: element {i} is {got}, expected {want}"
                ));
            }
        }
    }
    ar("close", x.close())
}

/// Rank 0 reduces 1024 f32 elements, every other rank 2048: every rank must fail with
/// `LaunchMismatch` naming itself and a rank of the other size (before: Ok with stale peer
/// data), and the communicator is Failed afterwards on every rank.
pub(crate) fn host_launches_of_different_sizes_fail_on_every_rank<C: Communicator>(
    comm: &C,
) -> CaseResult {
    if comm.size() == 1 {
        return Ok(()); // one rank cannot disagree with itself
    }
    let me = comm.rank();
    let mut x = host_all_reduce(comm)?;
    let count = |rank: usize| if rank == 0 { 1024usize } else { 2048 };
    let input = vec![1f32; count(me)];
    let mut out = vec![0f32; count(me)];
    let outcome = x.all_reduce(&input, &mut out);
    let cause = match &outcome {
        Err(AllReduceError::Failed { cause, .. }) => cause.as_ref(),
        Err(e) => e,
        Ok(_) => return Err("ranks of different sizes returned Ok".into()),
    };
    match cause {
        AllReduceError::LaunchMismatch {
            rank,
            bytes,
            peer,
            peer_bytes,
            ..
        } if *rank == me
            && *bytes == 4 * count(me) as u64
            && *peer_bytes == 4 * count(*peer) as u64
            && count(*peer) != count(me) => {}
        other => return Err(format!("expected a LaunchMismatch, got {other}")),
    }
    if x.all_reduce(&[1f32; 16], &mut [0f32; 16]).is_ok() {
        return Err("the communicator is usable after a launch mismatch".into());
    }
    ar("close", x.close())
}

/// The bytes of an f32 slice (little-endian hosts).
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}
