//! The process checkpoint on a GPU: two processes on one device (this test process as rank
//! 0, a child of the same executable as rank 1, over a Unix-socket pair transport), a custom
//! all-reduce between them on CUDA virtual memory (`CudaVmmMemory`), a CUDA graph of several
//! all-reduces captured before the checkpoint and replayed after it. On legacy CUDA IPC
//! (`CudaMemory`) the same group is refused before anything is suspended: the driver does
//! not open fresh legacy handles between processes after a restore. Run by `cargo xtask gpu-check` (step
//! `checkpoint`); on a machine without a GPU every test records why it skips, and with
//! `TPCOMM_REQUIRE_GPU=1` a skip is a failure.
#![cfg(feature = "cuda")]

use std::time::Instant;

use tpcomm_allreduce::{Config, CudaBackend, CudaOptions, CustomAllReduce, DType, Phase};
use tpcomm_checkpoint::{
    checkpoint_group, CheckpointDriver, CheckpointError, CheckpointOptions, CudaCheckpoint,
    GpuMemory, ProcessState, Reason, Step, Suspendable,
};
use tpcomm_ipc::{CudaBuffer, CudaMemory, CudaVmmMemory, DevicePeerMemory, IpcError, PeerMemory};
use tpcomm_transport::testing::pair;
use tpcomm_transport::testing::skip_without_gpu;
use tpcomm_transport::Communicator;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// True when device 0 and the checkpoint API are usable; otherwise records why the test
/// skips (a failure under `TPCOMM_REQUIRE_GPU=1`).
fn gpu() -> bool {
    match CudaVmmMemory::new(0) {
        Ok(_) => {}
        Err(IpcError::Unsupported { what, .. }) => {
            skip_without_gpu(&format!("the GPU does not support {what}"));
            return false;
        }
        Err(IpcError::NoDevice(why)) => {
            skip_without_gpu(&format!("no CUDA device: {why}"));
            return false;
        }
        Err(e) => panic!("CudaVmmMemory::new(0) failed with {e}"),
    }
    match CudaCheckpoint::load().support() {
        Ok(info) => {
            eprintln!("checkpoint driver: {info:?}");
            true
        }
        Err(why) => {
            skip_without_gpu(&format!("no process-checkpoint support: {why}"));
            false
        }
    }
}

/// Elements of the small and the large all-reduce chains (f32).
const SMALL: usize = 4096;
const LARGE: usize = 256 << 10;
/// Bytes each process allocates on top, so that what a checkpoint releases is unmistakable.
const BALLAST: usize = 256 << 20;

/// Rank `rank`'s input element `i`: a fraction with all mantissa bits in use, so that sums
/// are rounded and a replay reading anything else than before shows.
fn input(rank: usize, i: usize) -> f32 {
    let h = (i as u32)
        .wrapping_mul(0x9E37_79B1)
        .wrapping_add((rank as u32 + 1).wrapping_mul(0x85EB_CA77));
    let h = h ^ (h >> 15);
    (h as f32 / u32::MAX as f32 - 0.5) * 3.0
}

fn upload(memory: &impl PeerMemory, buf: &CudaBuffer, v: &[f32]) -> R<()> {
    Ok(memory.write(buf, 0, bytemuck::cast_slice(v))?)
}

fn download(memory: &impl PeerMemory, buf: &CudaBuffer, count: usize) -> R<Vec<u8>> {
    let mut out = vec![0u8; count * 4];
    memory.read(buf, 0, &mut out)?;
    Ok(out)
}

/// A rank's all-reduce with its graph: `a -> b -> c` (small) and `x -> y -> z` (large),
/// four all-reduces captured into one CUDA graph, the graph buffers registered.
struct Setup<M: DevicePeerMemory> {
    memory: M,
    ar: CustomAllReduce<CudaBackend<M>>,
    graph: tpcomm_allreduce::DeviceGraph,
    bufs: [CudaBuffer; 6],
}

fn setup<M: DevicePeerMemory>(comm: &pair::Pair, memory: M) -> R<Setup<M>> {
    let options = CudaOptions {
        ranks_per_device: 2,
        ..CudaOptions::default()
    };
    let backend = CudaBackend::new(comm, &memory, options)?;
    let mut ar = CustomAllReduce::new(backend, memory.clone(), comm, Config::default())?;
    let bufs = [SMALL, SMALL, SMALL, LARGE, LARGE, LARGE].map(|n| memory.allocate(n * 4));
    let [a, b, c, x, y, z] = bufs;
    let bufs = [a?, b?, c?, x?, y?, z?];
    let graph = {
        let [a, b, c, x, y, z] = &bufs;
        ar.capture_graph(|ar| {
            ar.all_reduce_buffer(a, b, DType::F32, SMALL)?;
            ar.all_reduce_buffer(b, c, DType::F32, SMALL)?;
            ar.all_reduce_buffer(x, y, DType::F32, LARGE)?;
            ar.all_reduce_buffer(y, z, DType::F32, LARGE)?;
            Ok(())
        })?
    };
    assert_eq!(graph.launches(), 4);
    assert_eq!(ar.register_graph_buffers(comm)?, 4);
    let own = |n: usize| (0..n).map(|i| input(comm.rank(), i)).collect::<Vec<_>>();
    upload(&memory, &bufs[0], &own(SMALL))?;
    upload(&memory, &bufs[3], &own(LARGE))?;
    Ok(Setup {
        memory,
        ar,
        graph,
        bufs,
    })
}

/// Poisons every output, replays the graph on both ranks, returns `c` and `z`.
fn replay<M: DevicePeerMemory>(s: &mut Setup<M>, comm: &pair::Pair) -> R<(Vec<u8>, Vec<u8>)> {
    for (i, n) in [(1, SMALL), (2, SMALL), (4, LARGE), (5, LARGE)] {
        upload(&s.memory, &s.bufs[i], &vec![f32::NAN; n])?;
    }
    comm.barrier()?;
    s.ar.replay_graph(&s.graph)?;
    s.ar.synchronize()?;
    comm.barrier()?;
    Ok((
        download(&s.memory, &s.bufs[2], SMALL)?,
        download(&s.memory, &s.bufs[5], LARGE)?,
    ))
}

/// `c` (or `z`) as the host computes it: two ranks' sum, then that sum doubled (each sum of
/// two f32 is one rounding, whatever the order, so the kernel's result is exact to the bit).
fn expected(n: usize) -> Vec<u8> {
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let b = input(0, i) + input(1, i);
            b + b
        })
        .collect();
    bytemuck::cast_slice(&v).to_vec()
}

/// One rank of the full sequence: capture, replay, checkpoint both processes (GPU memory
/// measured while they are checkpointed), restore, resume, replay: bit-identical.
fn checkpoint_rank(comm: &pair::Pair) -> R<()> {
    let mut s = setup(comm, CudaVmmMemory::new(0)?)?;
    // Plain cuMemAlloc memory, which the checkpoint moves to the host and back.
    let legacy = s.memory.legacy().clone();
    let ballast = legacy.allocate(BALLAST)?;
    let pattern: Vec<f32> = (0..(1 << 18)).map(|i| input(7, i)).collect();
    upload(&legacy, &ballast, &pattern)?;
    let peer = 1 - comm.rank();
    let addresses = |ar: &CustomAllReduce<CudaBackend<CudaVmmMemory>>| -> R<Vec<u64>> {
        let mut all: Vec<u64> = (0..3)
            .map(|i| ar.base_address(peer, i))
            .collect::<Result<_, _>>()?;
        for slot in 1..=4 {
            all.extend(ar.rank_data_slot(slot)?);
        }
        Ok(all)
    };
    let before_addresses = addresses(&s.ar)?;
    let writes = s.ar.table_writes();
    let (c0, z0) = replay(&mut s, comm)?;
    assert!(
        c0 == expected(SMALL),
        "rank {}: c is not the exact sum",
        comm.rank()
    );
    assert!(
        z0 == expected(LARGE),
        "rank {}: z is not the exact sum",
        comm.rank()
    );

    let driver = CudaCheckpoint::load();
    let pid = std::process::id();
    // Only rank 0 measures (one reading is enough; both are checkpointed in the
    // pause).
    let before = (comm.rank() == 0).then(GpuMemory::probe);
    let mut during: Option<Result<GpuMemory, String>> = None;
    eprintln!(
        "rank {}: {} allocation(s) imported through CUDA IPC before prepare_for_suspend",
        comm.rank(),
        tpcomm_ipc::cuda_imported_allocations()
    );
    let started = Instant::now();
    let report = {
        let objects: &mut [&mut dyn Suspendable<pair::Pair>] = &mut [&mut s.ar];
        checkpoint_group(comm, &driver, objects, &CheckpointOptions::default(), |p| {
            if p.rank == 0 {
                // Read by another process (nvidia-smi): this one is checkpointed.
                during = Some(GpuMemory::probe());
            }
            Ok(())
        })
    };
    let total = started.elapsed();
    let report = report.map_err(|e| format!("rank {}: {e}", comm.rank()))?;
    assert_eq!(driver.state(pid)?, ProcessState::Running);
    assert_eq!(s.ar.phase(), Phase::Active);
    eprintln!("rank {} checkpoint_group: {total:?}", comm.rank());
    for t in &report.timings {
        eprintln!(
            "rank {}   {:<10} local {:>10.3} ms   agree {:>8.3} ms",
            comm.rank(),
            t.step.name(),
            t.local.as_secs_f64() * 1e3,
            t.agree.as_secs_f64() * 1e3
        );
    }
    if comm.rank() == 0 {
        let after = GpuMemory::probe();
        eprintln!("GPU memory before: {before:?}");
        eprintln!("GPU memory while checkpointed: {during:?}");
        eprintln!("GPU memory after: {after:?}");
        if let (Some(Ok(before)), Some(Ok(during))) = (&before, &during) {
            let released = before.device_used.saturating_sub(during.device_used);
            eprintln!(
                "released while checkpointed: {:.1} MiB on the device; this process {:.1} -> {:.1} MiB",
                released as f64 / (1u64 << 20) as f64,
                before.of_process(pid) as f64 / (1u64 << 20) as f64,
                during.of_process(pid) as f64 / (1u64 << 20) as f64,
            );
            assert!(
                released >= BALLAST as u64,
                "a checkpoint of both processes released only {released} bytes"
            );
        }
    }
    // The ballast came back with its contents, at the same address.
    let mut back = vec![0u8; pattern.len() * 4];
    legacy.read(&ballast, 0, &mut back)?;
    assert_eq!(
        addresses(&s.ar)?,
        before_addresses,
        "rank {}: a peer address the graph reads moved",
        comm.rank()
    );
    assert_eq!(s.ar.table_writes(), writes, "the tables were written again");
    assert!(
        back == bytemuck::cast_slice::<f32, u8>(&pattern),
        "ballast contents changed"
    );

    let first = Instant::now();
    let (c1, z1) = replay(&mut s, comm)?;
    eprintln!(
        "rank {} first replay after restore: {:?}",
        comm.rank(),
        first.elapsed()
    );
    assert!(
        c1 == c0,
        "rank {}: small chain differs after restore",
        comm.rank()
    );
    assert!(
        z1 == z0,
        "rank {}: large chain differs after restore",
        comm.rank()
    );
    s.ar.close_with(comm)?;
    Ok(())
}

/// One rank of the refusal: peer mappings open (no `prepare_for_suspend`), so each
/// process imports its peer's memory and the checkpoint must be refused before locking.
fn refuse_rank(comm: &pair::Pair) -> R<()> {
    let mut s = setup(comm, CudaMemory::new(0)?)?;
    let (c0, _) = replay(&mut s, comm)?;
    let driver = CudaCheckpoint::load();
    let pid = std::process::id();
    let out = checkpoint_group(
        comm,
        &driver,
        &mut [],
        &CheckpointOptions::default(),
        |_| -> Result<(), tpcomm_checkpoint::BoxError> {
            panic!("no pause: the checkpoint must be refused")
        },
    );
    let Err(CheckpointError::Failed { first, also, .. }) = out else {
        panic!("rank {}: expected a refusal, got {out:?}", comm.rank())
    };
    eprintln!("rank {}: refused: {first}; also {also:?}", comm.rank());
    assert_eq!((first.step, first.rank), (Step::Lock, 0));
    assert!(
        matches!(first.reason, Reason::ImportedMappings { count, .. } if count > 0),
        "{first}"
    );
    assert!(also
        .iter()
        .any(|f| f.rank == 1 && matches!(f.reason, Reason::ImportedMappings { .. })));
    assert_eq!(driver.state(pid)?, ProcessState::Running, "left locked");
    // Nothing was touched: the communicator still reduces.
    let (c1, _) = replay(&mut s, comm)?;
    assert!(c1 == c0);
    s.ar.close_with(comm)?;
    drop(s);
    eprintln!(
        "rank {}: {} allocation(s) still imported after close_with",
        comm.rank(),
        tpcomm_ipc::cuda_imported_allocations()
    );
    Ok(())
}

/// One rank of the legacy refusal: the same group on legacy CUDA IPC is refused at the
/// check, before anything is suspended or locked, naming a peer buffer and the driver's
/// reason; the communicator is left as it was.
fn legacy_refused_rank(comm: &pair::Pair) -> R<()> {
    let mut s = setup(comm, CudaMemory::new(0)?)?;
    let (c0, _) = replay(&mut s, comm)?;
    let driver = CudaCheckpoint::load();
    let out = {
        let objects: &mut [&mut dyn Suspendable<pair::Pair>] = &mut [&mut s.ar];
        checkpoint_group(
            comm,
            &driver,
            objects,
            &CheckpointOptions::default(),
            |_| panic!("no pause: the checkpoint must be refused at the check"),
        )
    };
    let Err(CheckpointError::Failed { first, .. }) = out else {
        panic!("rank {}: expected a refusal, got {out:?}", comm.rank())
    };
    eprintln!("rank {}: refused: {first}", comm.rank());
    assert_eq!(first.step, Step::Check);
    let Reason::CannotSuspend { why, .. } = &first.reason else {
        panic!("{first}")
    };
    assert!(
        why.contains("legacy CUDA IPC") && why.contains("NOT_PERMITTED"),
        "{why}"
    );
    assert_eq!(s.ar.phase(), Phase::Active);
    let (c1, _) = replay(&mut s, comm)?;
    assert!(c1 == c0);
    s.ar.close_with(comm)?;
    Ok(())
}

#[test]
fn a_two_process_checkpoint_on_legacy_ipc_is_refused_up_front_with_the_drivers_reason() {
    if !gpu() {
        return;
    }
    pair::run_pair("legacy-refused", legacy_refused_rank);
}

#[test]
fn two_processes_checkpoint_restore_and_replay_a_graph_bit_identically() {
    if !gpu() {
        return;
    }
    pair::run_pair("checkpoint", checkpoint_rank);
}

#[test]
fn a_checkpoint_without_prepare_for_suspend_is_refused_and_nothing_is_left_locked() {
    if !gpu() {
        return;
    }
    pair::run_pair("refuse", refuse_rank);
}

#[test]
#[ignore = "helper process (rank 1) of the two-process tests"]
fn child_pair_rank() {
    let (comm, mode) = pair::child();
    let outcome = match mode.as_str() {
        "checkpoint" => checkpoint_rank(&comm),
        "refuse" => refuse_rank(&comm),
        "legacy-refused" => legacy_refused_rank(&comm),
        other => panic!("unknown two-process mode {other:?}"),
    };
    outcome.unwrap_or_else(|e| panic!("rank 1: {e}"));
}
