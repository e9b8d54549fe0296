//! The CUDA backend. Tests that need a GPU print why they skip on a machine without one
//! (`skipped: ...: no CUDA device: ...`) and pass; with `TPCOMM_REQUIRE_GPU=1` a skip is a
//! failure. Ranks are threads of one process sharing device 0 (`CudaMemory::same_process`,
//! each rank on its own stream), since CUDA IPC cannot open a handle in the process that
//! exported it; the two-process IPC path is tested in tpcomm-ipc's `cuda` suite.
#![cfg(feature = "cuda")]

use std::time::{Duration, Instant};

use half::{bf16, f16};
use tpcomm_allreduce::dispatch::DispatchTable;
use tpcomm_allreduce::{
    Algorithm, AllReduceError, Config, CudaBackend, CudaOptions, CustomAllReduce, DType, Element,
    FallbackReason, Phase,
};
use tpcomm_ipc::{CudaBuffer, CudaMemory, CudaVmmMemory, DevicePeerMemory, IpcError, PeerMemory};
use tpcomm_transport::{Communicator, LocalCommunicator};

mod common;
use common::cuda::{gpu, group};
use common::{check, inputs, run_seed, unwrap_all, unwrap_world, R};

type Ar = CustomAllReduce<CudaBackend>;

use tpcomm_transport::testing::pair;
use tpcomm_transport::testing::skip_without_gpu;

/// The backend and the all-reduce of one rank on device 0, sized for `world` ranks sharing
/// it.
fn new_ar(comm: &LocalCommunicator, config: Config) -> R<Ar> {
    new_ar_on(comm, config, CudaMemory::same_process(0)?)
}

/// [`new_ar`] on the peer memory given.
fn new_ar_on<M: DevicePeerMemory>(
    comm: &LocalCommunicator,
    config: Config,
    memory: M,
) -> R<CustomAllReduce<CudaBackend<M>>> {
    let options = CudaOptions {
        ranks_per_device: comm.size(),
        ..CudaOptions::default()
    };
    let backend = CudaBackend::new(comm, &memory, options)?;
    CustomAllReduce::new(backend, memory, comm, config)
}

fn to_bytes<T: Element>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn upload<T: Element>(memory: &impl PeerMemory, buf: &CudaBuffer, v: &[T]) -> R<()> {
    Ok(memory.write(buf, 0, &to_bytes(v))?)
}

fn download<T: Element>(memory: &impl PeerMemory, buf: &CudaBuffer, count: usize) -> R<Vec<T>> {
    let mut raw = vec![0u8; count * T::DTYPE.size()];
    memory.read(buf, 0, &mut raw)?;
    Ok(raw
        .chunks_exact(T::DTYPE.size())
        .map(bytemuck::pod_read_unaligned)
        .collect())
}

/// Fills `buf` with 0xff bytes: NaN in every element type.
fn poison(memory: &impl PeerMemory, buf: &CudaBuffer, bytes: usize) -> R<()> {
    Ok(memory.write(buf, 0, &vec![0xffu8; bytes])?)
}

/// Every size and algorithm the kernels serve for `T` on `world` ranks, eager and
/// registered, against the f64 reference.
fn kernels_match_reference<T: Element>(world: usize) {
    kernels_match_reference_on::<T, _>(world, || Ok(CudaMemory::same_process(0)?));
}

/// [`kernels_match_reference`] on the peer memory `memory` makes for each rank.
fn kernels_match_reference_on<T: Element, M: DevicePeerMemory>(
    world: usize,
    memory: impl Fn() -> R<M> + Sync,
) {
    let seed = run_seed();
    // 16 bytes, one pack short of / past a block's worth, odd pack counts, 1 MiB, and a
    // size whose packs do not divide by the world size.
    let sizes = [
        16usize,
        8 << 10,
        (8 << 10) + 16,
        48_016,
        1 << 20,
        (3 << 20) + 48,
    ];
    let results = group(world).run(|comm| -> R<usize> {
        let mut checked = 0;
        for algorithm in [Algorithm::OneStage, Algorithm::TwoStage] {
            let config = Config {
                max_bytes: 4 << 20,
                algorithm: Some(algorithm),
                timeout: Duration::from_secs(20),
                ..Config::default()
            };
            let mut ar = new_ar_on(&comm, config, memory()?)?;
            let memory = ar.memory()?.clone();
            let input = memory.allocate(4 << 20)?;
            let output = memory.allocate(4 << 20)?;
            // Registered once (the communicator keeps it); all_reduce_buffer finds it by
            // address (zero-copy).
            let registered = ar.register_buffer(&comm, memory.allocate(4 << 20)?)?;
            let registered_input = registered.buffer();
            for (k, &bytes) in sizes.iter().enumerate() {
                let count = bytes / T::DTYPE.size();
                let case = seed + 1000 * k as u64 + algorithm as u64;
                let data = inputs::<T>(case, comm.rank(), count);
                for zero_copy in [false, true] {
                    let src = if zero_copy { registered_input } else { &input };
                    upload(&memory, src, &data)?;
                    poison(&memory, &output, bytes)?;
                    // Every rank's input is in place before any rank launches.
                    comm.barrier()?;
                    let used = ar.all_reduce_buffer(src, &output, T::DTYPE, count)?;
                    assert_eq!(used, algorithm);
                    ar.synchronize()?;
                    let out = download::<T>(&memory, &output, count)?;
                    check(case, world, &out).map_err(|e| {
                        AllReduceError::InvalidArgument(format!(
                            "{} {} world {world} {bytes} bytes zero_copy={zero_copy}: {e}",
                            T::DTYPE.name(),
                            algorithm.name()
                        ))
                    })?;
                    checked += 1;
                    // Nobody overwrites an input a peer may still read.
                    comm.barrier()?;
                }
            }
            ar.close()?;
        }
        Ok(checked)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let checked = r
            .expect("rank finished")
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(checked, 2 * 2 * sizes.len());
    }
}

#[test]
fn kernels_match_an_f64_reference_for_every_dtype_algorithm_and_world_size() {
    if !gpu() {
        return;
    }
    for world in [2, 4, 6, 8] {
        kernels_match_reference::<f32>(world);
        kernels_match_reference::<f16>(world);
        kernels_match_reference::<bf16>(world);
    }
}

#[test]
fn on_virtual_memory_the_kernels_match_an_f64_reference_eager_and_registered() {
    if !vmm_gpu() {
        return;
    }
    for world in [2, 4] {
        kernels_match_reference_on::<f32, _>(world, || Ok(CudaVmmMemory::same_process(0)?));
        kernels_match_reference_on::<bf16, _>(world, || Ok(CudaVmmMemory::same_process(0)?));
    }
}

#[test]
fn world_sizes_without_a_kernel_fall_back_and_the_communicator_stays_usable() {
    if !gpu() {
        return;
    }
    let results = group(3).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let buf = memory.allocate(1 << 10)?;
        let out = memory.allocate(1 << 10)?;
        match ar.all_reduce_buffer(&buf, &out, DType::F32, 256) {
            Err(AllReduceError::Fallback(FallbackReason::NoKernel { reason })) => {
                assert!(reason.contains("world size 3"), "{reason}");
            }
            other => panic!("expected NoKernel, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Active);
        // A size that is not a multiple of 16 is refused before the backend is asked.
        assert!(matches!(
            ar.all_reduce_buffer(&buf, &out, DType::F32, 3),
            Err(AllReduceError::Fallback(
                FallbackReason::SizeNotMultipleOf16 { bytes: 12 }
            ))
        ));
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn host_slices_are_refused_by_the_device_backend() {
    if !gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let input = vec![1f32; 64];
        let mut out = vec![0f32; 64];
        let err = ar.all_reduce(&input, &mut out).unwrap_err();
        assert!(err.to_string().contains("all_reduce_buffer"), "{err}");
        assert_eq!(ar.phase(), Phase::Active);
        Ok(())
    });
    unwrap_all(results);
}

/// Sets every element of `buf` on this rank to `rank + 1 + shift`: sums are exact.
fn fill_rank<T: Element>(
    memory: &impl PeerMemory,
    buf: &CudaBuffer,
    rank: usize,
    shift: f32,
    count: usize,
) -> R<()> {
    upload(
        memory,
        buf,
        &vec![T::from_f32(rank as f32 + 1.0 + shift); count],
    )
}

fn expect_all<T: Element>(
    memory: &impl PeerMemory,
    buf: &CudaBuffer,
    count: usize,
    want: f32,
) -> R<()> {
    let out = download::<T>(memory, buf, count)?;
    if let Some((i, v)) = out.iter().enumerate().find(|(_, v)| v.to_f32() != want) {
        return Err(AllReduceError::InvalidArgument(format!(
            "element {i} is {}, expected {want}",
            v.to_f32()
        )));
    }
    Ok(())
}

#[test]
fn a_graph_captured_before_suspend_replays_correctly_after_resume() {
    if !gpu() {
        return;
    }
    for world in [2, 4] {
        let results = group(world).run(|comm| -> R<()> {
            let mut ar = new_ar(&comm, Config::default())?;
            let memory = ar.memory()?.clone();
            // One size served by one-stage, one by two-stage at 4 ranks.
            let small = 1024usize; // f32 elements: 4 KiB
            let large = 256 << 10; // 1 MiB
            let a = memory.allocate(small * 4)?;
            let b = memory.allocate(large * 4)?;
            let out_a = memory.allocate(small * 4)?;
            let out_b = memory.allocate(large * 4)?;
            let graph = ar.capture_graph(|ar| {
                let first = ar.all_reduce_buffer(&a, &out_a, DType::F32, small)?;
                let second = ar.all_reduce_buffer(&b, &out_b, DType::F32, large)?;
                // vLLM's NVLink cut-offs: 2 ranks always one-stage, 4 ranks from 512 KiB
                // two-stage.
                let large_algorithm = if world == 2 {
                    Algorithm::OneStage
                } else {
                    Algorithm::TwoStage
                };
                assert_eq!((first, second), (Algorithm::OneStage, large_algorithm));
                Ok(())
            })?;
            assert_eq!(graph.launches(), 2);
            assert_eq!(ar.pending_graph_buffers(), 2);
            // Replaying before the slots are written would read empty table entries.
            assert!(matches!(
                ar.replay_graph(&graph),
                Err(AllReduceError::UnregisteredGraphBuffers)
            ));
            assert_eq!(ar.register_graph_buffers(&comm)?, 2);
            assert_eq!(ar.pending_graph_buffers(), 0);

            let sum = |shift: f32| (1..=comm.size()).map(|r| r as f32 + shift).sum::<f32>();
            for (round, shift) in [0.0f32, 10.0].into_iter().enumerate() {
                fill_rank::<f32>(&memory, &a, comm.rank(), shift, small)?;
                fill_rank::<f32>(&memory, &b, comm.rank(), 2.0 * shift, large)?;
                comm.barrier()?;
                ar.replay_graph(&graph)?;
                ar.synchronize()?;
                expect_all::<f32>(&memory, &out_a, small, sum(shift))?;
                expect_all::<f32>(&memory, &out_b, large, sum(2.0 * shift))?;
                comm.barrier()?;
                if round == 0 {
                    ar.prepare_for_suspend(&comm)?;
                    assert_eq!(ar.phase(), Phase::Suspended);
                    assert_eq!(ar.peer_mappings()?.counters().open, 0);
                    assert!(matches!(
                        ar.replay_graph(&graph),
                        Err(AllReduceError::WrongState { .. })
                    ));
                    ar.reinit_after_resume(&comm)?;
                    assert_eq!(ar.phase(), Phase::Active);
                }
            }
            Ok(())
        });
        unwrap_world(world, results);
    }
}

#[test]
fn inputs_captured_twice_take_a_slot_per_call_and_registration_waits_for_the_capture_to_end() {
    if !gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(4096)?;
        let out = memory.allocate(4096)?;
        let graph = ar.capture_graph(|ar| {
            ar.all_reduce_buffer(&input, &out, DType::Bf16, 2048)?;
            ar.all_reduce_buffer(&input, &out, DType::Bf16, 2048)?;
            // Tables are never written while capturing: refused before anything changes.
            match ar.register_graph_buffers(&comm) {
                Err(AllReduceError::InvalidArgument(why)) => {
                    assert!(why.contains("captur"), "{why}")
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
            Ok(())
        })?;
        assert_eq!(ar.phase(), Phase::Active);
        assert_eq!(
            graph.launches(),
            2,
            "the refused registration recorded nothing"
        );
        // One slot per captured call, as vLLM: never deduplicated by address.
        assert_eq!(ar.pending_graph_buffers(), 2);
        assert_eq!(ar.register_graph_buffers(&comm)?, 2);
        fill_rank::<bf16>(&memory, &input, comm.rank(), 0.0, 2048)?;
        comm.barrier()?;
        ar.replay_graph(&graph)?;
        ar.synchronize()?;
        // Replayed twice into the same output from the same input: 1 + 2.
        expect_all::<bf16>(&memory, &out, 2048, 3.0)?;
        comm.barrier()?;
        // A graph belongs to the communicator that captured it.
        let mut other = new_ar(&comm, Config::default())?;
        assert!(matches!(
            other.replay_graph(&graph),
            Err(AllReduceError::ForeignToken {
                what: "a device graph",
                ..
            })
        ));
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_rank_that_never_launches_makes_its_peer_time_out_naming_it() {
    if !gpu() {
        return;
    }
    let timeout = Duration::from_millis(300);
    let results = group(2).run(|comm| -> R<Option<Duration>> {
        let config = Config {
            timeout,
            ..Config::default()
        };
        let mut ar = new_ar(&comm, config)?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(4096)?;
        let out = memory.allocate(4096)?;
        let mut waited = None;
        if comm.rank() == 0 {
            let start = Instant::now();
            ar.all_reduce_buffer(&input, &out, DType::F32, 1024)?;
            // The failure is kept as the communicator's cause: every later call returns it.
            match ar.synchronize() {
                Err(AllReduceError::Failed { during, cause }) => {
                    assert_eq!(during, "synchronize");
                    match &*cause {
                        AllReduceError::Timeout {
                            rank,
                            peer,
                            barrier,
                            waited,
                        } => {
                            assert_eq!((*rank, *peer, *barrier), (0, 1, "start"));
                            assert_eq!(*waited, timeout);
                        }
                        other => panic!("expected a timeout naming rank 1, got {other:?}"),
                    }
                }
                other => panic!("expected a failure caused by a timeout, got {other:?}"),
            }
            waited = Some(start.elapsed());
            assert_eq!(ar.phase(), Phase::Failed);
            assert!(matches!(
                ar.all_reduce_buffer(&input, &out, DType::F32, 1024),
                Err(AllReduceError::Failed { .. })
            ));
        }
        // Rank 1 keeps its buffers alive until rank 0 has given up.
        comm.barrier()?;
        Ok(waited)
    });
    let waited = results[0].as_ref().unwrap().as_ref().unwrap().unwrap();
    assert!(waited >= timeout, "gave up after {waited:?}");
    assert!(
        waited < timeout + Duration::from_secs(10),
        "gave up after {waited:?}"
    );
    results[1].as_ref().unwrap().as_ref().unwrap();
}

#[test]
fn an_unusable_device_ordinal_is_a_typed_error() {
    match CudaMemory::same_process(4096) {
        Err(IpcError::NoDevice(why)) => assert!(!why.is_empty()),
        other => panic!("expected NoDevice, got {other:?}"),
    }
}

#[cfg(feature = "nccl")]
#[test]
fn one_rank_falls_back_to_nccl_and_sums_correctly_across_a_suspend() {
    use tpcomm_allreduce::{DeviceAllReduce, Route};
    if !gpu() {
        return;
    }
    if let Err(e) = tpcomm_transport::NcclLibrary::load() {
        skip_without_gpu(&format!("no NCCL: {e}"));
        return;
    }
    let results = group(1).run(|comm| -> R<()> {
        let memory = CudaMemory::same_process(0)?;
        let mut dar = DeviceAllReduce::new(
            &comm,
            memory.clone(),
            CudaOptions::default(),
            Config::default(),
        )?;
        let input = memory.allocate(4096)?;
        let out = memory.allocate(4096)?;
        upload(&memory, &input, &vec![3.5f32; 1024])?;
        poison(&memory, &out, 4096)?;
        let route = dar.all_reduce(&input, &out, DType::F32, 1024)?;
        assert!(
            matches!(route, Route::Nccl(FallbackReason::NoKernel { .. })),
            "{route:?}"
        );
        dar.synchronize()?;
        expect_all::<f32>(&memory, &out, 1024, 3.5)?;
        // Both paths through a suspend and resume, then again.
        dar.prepare_for_suspend(&comm)?;
        assert_eq!(dar.custom().phase(), Phase::Suspended);
        dar.reinit_after_resume(&comm)?;
        assert_eq!(dar.custom().phase(), Phase::Active);
        poison(&memory, &out, 4096)?;
        dar.all_reduce(&input, &out, DType::F32, 1024)?;
        dar.synchronize()?;
        expect_all::<f32>(&memory, &out, 1024, 3.5)?;
        Ok(())
    });
    unwrap_all(results);
}

/// One rank of the host all-reduce across two processes (memfd peer memory): checks the
/// pair transport itself on every machine, GPU or not.
fn host_pair_rank(comm: &pair::Pair) -> R<()> {
    use tpcomm_allreduce::HostBackend;
    use tpcomm_ipc::HostMemory;
    let mut ar = CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        Config::default(),
    )?;
    let input = vec![comm.rank() as f32 + 1.0; 4096];
    let mut out = vec![f32::NAN; 4096];
    for _ in 0..2 {
        ar.all_reduce(&input, &mut out)?;
        assert!(
            out.iter().all(|&v| v == 3.0),
            "host all-reduce over the pair transport"
        );
        ar.prepare_for_suspend(comm)?;
        ar.reinit_after_resume(comm)?;
    }
    comm.barrier()?;
    Ok(())
}

#[test]
fn the_pair_transport_carries_the_host_all_reduce_across_two_processes() {
    pair::run_pair("host", host_pair_rank);
}

/// One rank of the two-process test: real CUDA IPC between the processes. Captures a graph
/// of a one-stage and a two-stage all-reduce, replays it, suspends, holds every address the
/// peer's mappings had (so the reopen must place them elsewhere), resumes, and replays the
/// same graph on new data. Returns whether the peer mappings moved.
fn two_process_rank(comm: &pair::Pair) -> R<bool> {
    let memory = CudaMemory::new(0)?;
    let (mut ar, calls) = TwoCalls::capture(comm, &memory)?;
    let peer = 1 - comm.rank();
    calls.replay(comm, &mut ar, &memory, 0.0)?;
    let before: Vec<u64> = (0..3)
        .map(|i| ar.base_address(peer, i))
        .chain([1, 2].map(|slot| ar.rank_data_slot(slot).map(|s| s[peer])))
        .collect::<R<_>>()?;
    ar.prepare_for_suspend(comm)?;
    let holds: Vec<_> = before
        .iter()
        .map(|&addr| memory.hold_address(addr, 1))
        .collect();
    let held = holds.iter().all(Result::is_ok);
    ar.reinit_after_resume(comm)?;
    drop(holds);
    let after: Vec<u64> = (0..3)
        .map(|i| ar.base_address(peer, i))
        .chain([1, 2].map(|slot| ar.rank_data_slot(slot).map(|s| s[peer])))
        .collect::<R<_>>()?;
    let moved = before.iter().zip(&after).all(|(x, y)| x != y);
    if held {
        assert!(
            moved,
            "every old address was held, yet {before:x?} -> {after:x?}"
        );
    }
    // The graph captured before the suspend, on the tables rewritten in place.
    calls.replay(comm, &mut ar, &memory, 10.0)?;
    ar.close()?;
    Ok(moved)
}

/// A graph of two f32 all-reduces (4 KiB: one-stage; 1 MiB: two-stage from 4 ranks) of one
/// rank, registered, with its buffers.
struct TwoCalls {
    a: CudaBuffer,
    b: CudaBuffer,
    out_a: CudaBuffer,
    out_b: CudaBuffer,
    graph: tpcomm_allreduce::DeviceGraph,
}

impl TwoCalls {
    const SMALL: usize = 1024;
    const LARGE: usize = 256 << 10;

    /// Collective: an all-reduce on `memory` (every rank on device 0) and its captured,
    /// registered graph.
    fn capture<C: Communicator, M: DevicePeerMemory>(
        comm: &C,
        memory: &M,
    ) -> R<(CustomAllReduce<CudaBackend<M>>, Self)> {
        let options = CudaOptions {
            // Every rank on device 0, threads or processes.
            ranks_per_device: comm.size(),
            ..CudaOptions::default()
        };
        let backend = CudaBackend::new(comm, memory, options)?;
        let mut ar = CustomAllReduce::new(backend, memory.clone(), comm, Config::default())?;
        let a = memory.allocate(Self::SMALL * 4)?;
        let b = memory.allocate(Self::LARGE * 4)?;
        let out_a = memory.allocate(Self::SMALL * 4)?;
        let out_b = memory.allocate(Self::LARGE * 4)?;
        let graph = ar.capture_graph(|ar| {
            ar.all_reduce_buffer(&a, &out_a, DType::F32, Self::SMALL)?;
            ar.all_reduce_buffer(&b, &out_b, DType::F32, Self::LARGE)?;
            Ok(())
        })?;
        assert_eq!(ar.register_graph_buffers(comm)?, 2);
        let calls = Self {
            a,
            b,
            out_a,
            out_b,
            graph,
        };
        Ok((ar, calls))
    }

    /// Collective: fills the inputs with `rank + 1 + shift` (and twice `shift` for the large
    /// one), replays the graph and checks both sums exactly.
    fn replay<C: Communicator, M: DevicePeerMemory>(
        &self,
        comm: &C,
        ar: &mut CustomAllReduce<CudaBackend<M>>,
        memory: &M,
        shift: f32,
    ) -> R<()> {
        let sum = |shift: f32| (1..=comm.size()).map(|r| r as f32 + shift).sum::<f32>();
        fill_rank::<f32>(memory, &self.a, comm.rank(), shift, Self::SMALL)?;
        fill_rank::<f32>(memory, &self.b, comm.rank(), 2.0 * shift, Self::LARGE)?;
        comm.barrier()?;
        ar.replay_graph(&self.graph)?;
        ar.synchronize()?;
        expect_all::<f32>(memory, &self.out_a, Self::SMALL, sum(shift))?;
        expect_all::<f32>(memory, &self.out_b, Self::LARGE, sum(2.0 * shift))?;
        comm.barrier()?;
        Ok(())
    }
}

#[test]
#[ignore = "helper process (rank 1) of the two-process tests"]
fn child_pair_rank() {
    let (comm, mode) = pair::child();
    let outcome = match mode.as_str() {
        "host" => host_pair_rank(&comm),
        "cuda" => two_process_rank(&comm).map(drop),
        "cuda-vmm" => two_process_vmm_rank(&comm),
        other => panic!("unknown two-process mode {other:?}"),
    };
    outcome.unwrap_or_else(|e| panic!("rank 1: {e}"));
}

#[test]
fn two_processes_replay_a_graph_after_resume_with_moved_mappings() {
    if !gpu() {
        return;
    }
    let moved = pair::run_pair("cuda", two_process_rank);
    eprintln!("peer mappings moved on resume: {moved}");
}

/// The bands a CUDA table can hold (the same for staged and registered inputs: the kernels'
/// shapes leave the slot out): one algorithm everywhere, or one-stage up to 256 bytes and
/// two-stage above, for `world` ranks and every element type.
fn cuda_table(world: usize, cut: Option<usize>, first: Algorithm) -> DispatchTable {
    use tpcomm_allreduce::dispatch::{Band, Choice, Input, Key};
    let bands = match cut {
        None => vec![Band::new(0, usize::MAX, Choice::Custom(first))],
        Some(cut) => vec![
            Band::new(0, cut, Choice::Custom(Algorithm::OneStage)),
            Band::new(cut + 1, usize::MAX, Choice::Custom(Algorithm::TwoStage)),
        ],
    };
    let keys = [DType::F32, DType::F16, DType::Bf16]
        .into_iter()
        .flat_map(|dtype| {
            Input::ALL.map(|input| {
                let key = Key {
                    ranks: world,
                    dtype,
                    input,
                };
                (key, bands.clone())
            })
        })
        .collect::<Vec<_>>();
    DispatchTable::from_bands("cuda", "a generated CUDA table", keys).expect("valid bands")
}

/// On this rank: rows of 8 elements, each alone and in batches of every row count up to
/// and past `max_bytes` (`all_reduce_device_in_pieces`: launches of at most `max_bytes`),
/// and the batches that fit through a registered buffer; each row's bits against the host
/// backend's rank-order sum. `Err` names the first difference.
fn gpu_rows_have_the_host_orders_bits<T: Element>(
    comm: &LocalCommunicator,
    ar: &mut Ar,
    seed: u64,
) -> R<Result<(), String>> {
    const ROW: usize = 8;
    let max = ar.config().max_bytes;
    let n = 2 * max / (ROW * T::DTYPE.size()) + 3;
    let value = |rank: usize, i: usize| {
        let v = common::value(seed, rank, i);
        v * 2f32.powi((common::value(seed ^ 0x5a5a, rank, i) * 6.0) as i32)
    };
    let all: Vec<Vec<T>> = (0..comm.size())
        .map(|r| (0..n * ROW).map(|i| T::from_f32(value(r, i))).collect())
        .collect();
    let want = common::rank_order_sum(&all);
    let memory = ar.memory()?.clone();
    let stream = ar.backend().stream().clone();
    let bytes = n * ROW * T::DTYPE.size();
    let (input, output) = (memory.allocate(bytes)?, memory.allocate(bytes)?);
    let registered = ar.register_buffer(comm, memory.allocate(max)?)?;
    let mut batches: Vec<(usize, usize)> = (0..n).map(|row| (row, 1)).collect();
    batches.extend((1..=n).map(|k| ((k * 7) % (n - k + 1), k)));
    for (first, k) in batches {
        let at = first * ROW..(first + k) * ROW;
        let mine = &all[comm.rank()][at.clone()];
        let count = at.len();
        for zero_copy in [false, true] {
            if zero_copy && count * T::DTYPE.size() > max {
                continue;
            }
            let src = if zero_copy {
                registered.buffer()
            } else {
                &input
            };
            upload(&memory, src, mine)?;
            poison(&memory, &output, bytes)?;
            comm.barrier()?;
            if zero_copy {
                ar.all_reduce_buffer(src, &output, T::DTYPE, count)?;
            } else {
                let send = src.view::<T>(count, &stream)?;
                let mut recv = output.view::<T>(count, &stream)?;
                ar.all_reduce_device_in_pieces(&send, &mut recv)?;
            }
            ar.synchronize()?;
            let got = download::<T>(&memory, &output, count)?;
            comm.barrier()?;
            if to_bytes(&got) != to_bytes(&want[at.clone()]) {
                let i = (0..count)
                    .find(|&i| {
                        to_bytes(&got[i..=i]) != to_bytes(&want[at.start + i..=at.start + i])
                    })
                    .unwrap_or(0);
                return Ok(Err(format!(
                    "{} rows {first}..{} (zero_copy={zero_copy}), element {i}: got {}, the \
                     host's rank-order sum is {}",
                    T::DTYPE.name(),
                    first + k,
                    got[i].to_f32(),
                    want[at.start + i].to_f32()
                )));
            }
        }
    }
    drop(ar.unregister(comm, registered)?);
    Ok(Ok(()))
}

/// `Reproducibility::BitStable` on the GPU: the kernels sum in the host backend's order
/// (rank order, f32 accumulation, rounded once), so a row's sum has the same bits alone and
/// inside any batch, on every table (one-stage, two-stage, mixed, the built-in one), and
/// equals the host's (`docs/all-reduce.md`, "The CUDA kernels' order").
#[test]
fn on_the_gpu_a_rows_sum_has_the_host_orders_bits_alone_and_in_every_batch() {
    if !gpu() {
        return;
    }
    let seed = run_seed();
    for world in [2, 4] {
        let tables = [
            DispatchTable::cuda(),
            cuda_table(world, None, Algorithm::OneStage),
            cuda_table(world, None, Algorithm::TwoStage),
            cuda_table(world, Some(256), Algorithm::OneStage),
        ];
        for (t, table) in tables.into_iter().enumerate() {
            let results = group(world).run(|comm| -> R<Result<(), String>> {
                let config = Config {
                    max_bytes: 2048,
                    dispatch: Some(table.clone()),
                    timeout: Duration::from_secs(20),
                    ..Config::default()
                };
                let mut ar = new_ar(&comm, config)?;
                let verdict = gpu_rows_have_the_host_orders_bits::<f32>(&comm, &mut ar, seed)?
                    .and(gpu_rows_have_the_host_orders_bits::<f16>(
                        &comm, &mut ar, seed,
                    )?)
                    .and(gpu_rows_have_the_host_orders_bits::<bf16>(
                        &comm, &mut ar, seed,
                    )?);
                ar.close_with(&comm)?;
                Ok(verdict)
            });
            for (rank, r) in results.into_iter().enumerate() {
                let verdict = r
                    .expect("rank finished")
                    .unwrap_or_else(|e| panic!("world {world}, table {t}, rank {rank}: {e}"));
                assert_eq!(verdict, Ok(()), "world {world}, table {t}, seed {seed}");
            }
        }
    }
}

#[test]
fn ranks_launching_different_counts_fail_with_a_launch_mismatch_on_the_gpu() {
    // The start flags carry each launch's shape: rank 0 reduces 1024 f32, rank 1 2048 (one
    // block each), so both see the other's shape, skip the reduction, cross the end barrier
    // and record the mismatch; synchronize reports it naming both sizes.
    if !gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(8192)?;
        let out = memory.allocate(8192)?;
        let count = if comm.rank() == 0 { 1024 } else { 2048 };
        comm.barrier()?;
        ar.all_reduce_buffer(&input, &out, DType::F32, count)?;
        let (mine, theirs) = if comm.rank() == 0 {
            (4096, 8192)
        } else {
            (8192, 4096)
        };
        match ar.synchronize() {
            Err(AllReduceError::Failed { cause, .. }) => match cause.as_ref() {
                AllReduceError::LaunchMismatch {
                    rank,
                    bytes,
                    dtype: "f32",
                    peer,
                    peer_bytes,
                    peer_dtype: "f32",
                    ..
                } if *rank == comm.rank()
                    && *bytes == mine
                    && *peer == 1 - comm.rank()
                    && *peer_bytes == theirs => {}
                other => panic!("expected a LaunchMismatch, got {other:?}"),
            },
            other => panic!("expected a failed synchronize, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Failed);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_graph_reading_an_unregistered_buffer_is_refused() {
    if !gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let out = memory.allocate(4096)?;
        let input = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let slot = input.slot();
        let graph = ar.capture_graph(|ar| {
            ar.all_reduce_buffer(input.buffer(), &out, DType::F32, 1024)
                .map(drop)
        })?;
        ar.check_replay()?;
        drop(ar.unregister(&comm, input)?);
        match ar.replay_graph(&graph) {
            Err(AllReduceError::UnregisteredInput { slot: s }) if s == slot => {}
            other => panic!("expected UnregisteredInput, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Active);
        Ok(())
    });
    unwrap_all(results);
}

// ------------------------------------------------------ virtual memory (CudaVmmMemory)

/// True when device 0 supports virtual memory with POSIX descriptors; otherwise records why
/// the test skips (a failure under `TPCOMM_REQUIRE_GPU=1`).
fn vmm_gpu() -> bool {
    match CudaVmmMemory::same_process(0) {
        Ok(_) => true,
        Err(IpcError::NoDevice(why)) => {
            skip_without_gpu(&format!("no CUDA device: {why}"));
            false
        }
        Err(IpcError::Unsupported { what, .. }) => {
            skip_without_gpu(&format!("the GPU does not support {what}"));
            false
        }
        Err(e) => panic!("CudaVmmMemory::same_process(0) failed with {e}"),
    }
}

/// Free device memory now (`cuMemGetInfo`).
fn free_device_memory() -> usize {
    cudarc::driver::result::mem_get_info()
        .expect("cuMemGetInfo")
        .0
}

/// Captures a graph of a one-stage and a two-stage all-reduce on `memory`, replays it,
/// suspends (which releases the buffers' memory), resumes and replays it again, checking
/// that every address the launches read and every table entry stayed as it was; returns
/// the bytes this rank's suspend released.
fn replay_across_a_releasing_suspend<C: Communicator, M: DevicePeerMemory>(
    comm: &C,
    memory: M,
) -> R<usize> {
    let (mut ar, calls) = TwoCalls::capture(comm, &memory)?;
    let world = comm.size();
    calls.replay(comm, &mut ar, &memory, 0.0)?;
    let addresses = |ar: &CustomAllReduce<CudaBackend<M>>| -> R<Vec<u64>> {
        let mut all = vec![ar.rank_signals_address()?];
        for r in 0..world {
            all.extend(
                (0..3)
                    .map(|i| ar.base_address(r, i))
                    .collect::<R<Vec<_>>>()?,
            );
        }
        for slot in [1, 2] {
            all.extend(ar.rank_data_slot(slot)?);
        }
        Ok(all)
    };
    let before = addresses(&ar)?;
    let writes = ar.table_writes();
    let free_active = free_device_memory();
    ar.prepare_for_suspend(comm)?;
    comm.barrier()?;
    let released = ar.released_bytes();
    let free_suspended = free_device_memory();
    eprintln!(
        "rank {}: the suspend released {released} bytes; free device memory {free_active} -> \
         {free_suspended}",
        comm.rank()
    );
    assert!(released >= 2 * Config::default().max_bytes, "{released}");
    assert!(
        free_suspended > free_active,
        "no device memory came back: {free_active} -> {free_suspended}"
    );
    ar.reinit_after_resume(comm)?;
    assert_eq!(addresses(&ar)?, before, "an address the graph reads moved");
    assert_eq!(ar.table_writes(), writes, "the tables were written again");
    calls.replay(comm, &mut ar, &memory, 10.0)?;
    ar.close()?;
    Ok(released)
}

/// Ranks as threads on one GPU: the helper over `CudaVmmMemory::same_process`.
#[test]
fn a_graph_on_virtual_memory_replays_after_a_suspend_that_released_its_buffers_with_every_address_kept(
) {
    if !vmm_gpu() {
        return;
    }
    for world in [2, 4] {
        let results = group(world).run(|comm| -> R<usize> {
            replay_across_a_releasing_suspend(&comm, CudaVmmMemory::same_process(0)?)
        });
        unwrap_world(world, results);
    }
}

/// One rank of the two-process virtual-memory test: descriptors fetched across the
/// processes, imports detached and reattached at their kept addresses.
fn two_process_vmm_rank(comm: &pair::Pair) -> R<()> {
    replay_across_a_releasing_suspend(comm, CudaVmmMemory::new(0)?).map(drop)
}

#[test]
fn two_processes_on_virtual_memory_replay_a_graph_after_a_suspend_with_every_address_kept() {
    if !vmm_gpu() {
        return;
    }
    pair::run_pair("cuda-vmm", two_process_vmm_rank);
}

/// Legacy IPC ranks and virtual-memory ranks cannot open each other's handles: the kind of
/// peer memory is agreed at creation, and a mismatch is refused on every rank.
#[test]
fn ranks_on_different_kinds_of_cuda_peer_memory_are_refused_at_creation() {
    if !vmm_gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let options = CudaOptions {
            ranks_per_device: 2,
            ..CudaOptions::default()
        };
        let created = if comm.rank() == 0 {
            let memory = CudaMemory::same_process(0)?;
            let backend = CudaBackend::new(&comm, &memory, options)?;
            CustomAllReduce::new(backend, memory, &comm, Config::default()).map(drop)
        } else {
            let memory = CudaVmmMemory::same_process(0)?;
            let backend = CudaBackend::new(&comm, &memory, options)?;
            CustomAllReduce::new(backend, memory, &comm, Config::default()).map(drop)
        };
        match created {
            Err(AllReduceError::ConfigMismatch { field, .. }) => assert_eq!(field, "memory"),
            other => panic!("{other:?}"),
        }
        Ok(())
    });
    unwrap_all(results);
}
