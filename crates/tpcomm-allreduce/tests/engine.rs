//! The CUDA all-reduce used as an engine uses it: cudarc `CudaSlice`s and views on the
//! engine's own `CudaStream` (`CudaBackend::with_stream`), the engine's own capture of that
//! stream, the graph adopted, registered, replayed, suspended, resumed and replayed again.
//! Ranks are threads of one process sharing device 0 (`CudaMemory::same_process`). Tests
//! skip (saying why) without a GPU and fail instead under `TPCOMM_REQUIRE_GPU=1`; they run in
//! `cargo xtask gpu-check`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::cuda::{gpu, group};
use common::{unwrap_all, unwrap_world, R};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use half::bf16;
use tpcomm_allreduce::{
    Algorithm, AllReduceError, Config, CudaBackend, CudaOptions, CustomAllReduce, Phase,
};
use tpcomm_ipc::{CudaMemory, PeerMemory};
use tpcomm_transport::testing::skip_without_gpu;
use tpcomm_transport::{Communicator, LocalCommunicator};

type Ar = CustomAllReduce<CudaBackend>;

fn drv<T>(call: &str, r: Result<T, DriverError>) -> R<T> {
    r.map_err(|e| AllReduceError::InvalidArgument(format!("{call}: {e:?}")))
}

/// The engine's stream: the primary context of device 0, one stream per context handle.
fn engine_stream() -> R<Arc<CudaStream>> {
    let ctx = drv("CudaContext::new", CudaContext::new(0))?;
    // SAFETY: this context handle is used by one stream only (the engine's), whose work is
    // ordered by the stream itself; without event tracking cudarc records no events, which
    // a capture could not wait on.
    unsafe { ctx.disable_event_tracking() };
    drv("new_stream", ctx.new_stream())
}

/// An all-reduce on the engine's stream, sized for `comm.size()` ranks sharing device 0.
fn engine_ar(comm: &LocalCommunicator, stream: &Arc<CudaStream>) -> R<Ar> {
    let memory = CudaMemory::same_process(0)?;
    let options = CudaOptions {
        ranks_per_device: comm.size(),
        ..CudaOptions::default()
    };
    let backend = CudaBackend::with_stream(comm, &memory, options, stream.clone())?;
    CustomAllReduce::new(backend, memory, comm, Config::default())
}

fn expect_all(stream: &Arc<CudaStream>, y: &CudaSlice<f32>, want: f32) -> R<()> {
    let host = drv("clone_dtoh", stream.clone_dtoh(y))?;
    match host.iter().position(|&v| v != want) {
        None => Ok(()),
        Some(i) => Err(AllReduceError::InvalidArgument(format!(
            "element {i} is {}, expected {want}",
            host[i]
        ))),
    }
}

#[test]
fn cudarc_slices_on_the_engine_stream_reduce_eagerly_and_inside_the_engines_own_graph() {
    if !gpu() {
        return;
    }
    for world in [2, 4] {
        let results = group(world).run(|comm| -> R<()> {
            let stream = engine_stream()?;
            let mut ar = engine_ar(&comm, &stream)?;
            let memory = ar.memory()?.clone();
            let n = 64 << 10; // 256 KiB of f32
            let rank = comm.rank() as f32 + 1.0;
            let sum = |shift: f32| (1..=world).map(|r| r as f32 + shift).sum::<f32>();
            // cudarc's own allocation: stream-ordered pool memory, not exportable.
            let mut x = drv("clone_htod", stream.clone_htod(&vec![rank; n]))?;
            let mut y = drv("alloc_zeros", stream.alloc_zeros::<f32>(n))?;
            // Exportable memory for zero-copy capture: a CudaMemory buffer seen as a view.
            let buf = memory.allocate(n * 4)?;
            let mut y2 = drv("alloc_zeros", stream.alloc_zeros::<f32>(n))?;

            // Eager: staged, written straight into the engine's output.
            ar.all_reduce_device(&x, &mut y)?;
            ar.synchronize()?;
            expect_all(&stream, &y, sum(0.0))?;
            comm.barrier()?;

            // The engine captures its own stream; the all-reduces inside are recorded.
            let mark = ar.capture_mark();
            drv(
                "begin_capture",
                stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            )?;
            let staged = ar.all_reduce_device(&x, &mut y);
            let view = buf.view::<f32>(n, &stream)?;
            let shared = ar.all_reduce_device(&view, &mut y2);
            let graph = drv(
                "end_capture",
                stream.end_capture(sys::CUgraphInstantiate_flags(0)),
            )?;
            assert_eq!(staged?, Algorithm::OneStage);
            shared?;
            let graph = ar.adopt_graph(graph.expect("a graph"), mark)?;
            assert_eq!(graph.launches(), 2);
            assert_eq!(ar.register_graph_buffers(&comm)?, 2);
            // The pool memory's slot names this rank's staging buffer, the view's the view.
            let staging = ar.base_address(comm.rank(), 1)?;
            let slots: Vec<Vec<u64>> = (1..=2).map(|s| ar.rank_data_slot(s)).collect::<R<_>>()?;
            assert_eq!(slots[0][comm.rank()], staging);
            assert_eq!(slots[1][comm.rank()], buf.device_ptr());

            for (round, shift) in [1.0f32, 10.0].into_iter().enumerate() {
                drv(
                    "memcpy_htod",
                    stream.memcpy_htod(&vec![rank + shift; n], &mut x),
                )?;
                memory.write(
                    &buf,
                    0,
                    bytemuck::cast_slice(&vec![2.0 * (rank + shift); n]),
                )?;
                drv("synchronize", stream.synchronize())?;
                comm.barrier()?;
                ar.replay_graph(&graph)?;
                ar.synchronize()?;
                expect_all(&stream, &y, sum(shift))?;
                expect_all(&stream, &y2, 2.0 * sum(shift))?;
                comm.barrier()?;
                if round == 0 {
                    ar.prepare_for_suspend(&comm)?;
                    ar.reinit_after_resume(&comm)?;
                }
            }
            // Moved to another thread and replayed there: DeviceGraph is Send.
            let graph = std::thread::scope(|s| s.spawn(move || graph).join().expect("thread"));
            comm.barrier()?;
            ar.replay_graph(&graph)?;
            ar.synchronize()?;
            expect_all(&stream, &y2, 2.0 * sum(10.0))?;
            comm.barrier()?;
            ar.close_with(&comm)?;
            Ok(())
        });
        unwrap_world(world, results);
    }
}

#[test]
fn a_short_or_misaligned_output_is_refused_before_anything_runs() {
    if !gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let stream = engine_stream()?;
        let mut ar = engine_ar(&comm, &stream)?;
        let x = drv("alloc_zeros", stream.alloc_zeros::<bf16>(1024))?;
        let mut short = drv("alloc_zeros", stream.alloc_zeros::<bf16>(512))?;
        assert!(matches!(
            ar.all_reduce_device(&x, &mut short),
            Err(AllReduceError::BufferTooSmall {
                buffer: "output",
                len: 512,
                count: 1024
            })
        ));
        let mut y = drv("alloc_zeros", stream.alloc_zeros::<bf16>(2048))?;
        let mut odd = y.slice_mut(1..1025);
        let addr = odd.device_ptr(&stream).0;
        match ar.all_reduce_device(&x, &mut odd) {
            Err(AllReduceError::Misaligned {
                buffer: "output",
                addr: a,
                align: 16,
            }) => assert_eq!(a, addr),
            other => panic!("expected Misaligned, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Active);
        ar.close_with(&comm)?;
        Ok(())
    });
    unwrap_all(results);
}

#[cfg(feature = "nccl")]
#[test]
fn device_all_reduce_routes_to_nccl_inside_the_engines_capture() {
    use tpcomm_allreduce::{DeviceAllReduce, FallbackReason, Route};
    if !gpu() {
        return;
    }
    if let Err(e) = tpcomm_transport::NcclLibrary::load() {
        skip_without_gpu(&format!("no NCCL: {e}"));
        return;
    }
    let results = group(1).run(|comm| -> R<()> {
        let stream = engine_stream()?;
        let memory = CudaMemory::same_process(0)?;
        let mut dar = DeviceAllReduce::with_stream(
            &comm,
            memory,
            CudaOptions::default(),
            Config::default(),
            stream.clone(),
        )?;
        let x = drv("clone_htod", stream.clone_htod(&vec![3.5f32; 1024]))?;
        let mut y = drv("alloc_zeros", stream.alloc_zeros::<f32>(1024))?;
        let mark = dar.capture_mark();
        drv(
            "begin_capture",
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        )?;
        let route = dar.all_reduce_device(&x, &mut y);
        let graph = drv(
            "end_capture",
            stream.end_capture(sys::CUgraphInstantiate_flags(0)),
        )?;
        assert!(
            matches!(route?, Route::Nccl(FallbackReason::NoKernel { .. })),
            "one rank has no custom kernel"
        );
        let graph = dar.adopt_graph(graph.expect("a graph"), mark)?;
        assert_eq!(graph.launches(), 0);
        dar.register_graph_buffers(&comm)?;
        dar.replay_graph(&graph)?;
        dar.synchronize()?;
        expect_all(&stream, &y, 3.5)?;
        dar.close_with(&comm)?;
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn ranks_as_threads_on_every_visible_gpu_reduce_through_peer_access() {
    // One rank per GPU where there are two or more (each context is given access to the
    // other's memory, aliases checked against their device); both ranks on GPU 0 otherwise.
    if !gpu() {
        return;
    }
    let devices = drv("device_count", CudaContext::device_count())
        .unwrap()
        .max(1) as usize;
    let world: usize = 2;
    let per_device = world.div_ceil(devices.min(world));
    eprintln!("{devices} visible GPU(s): {per_device} rank(s) per GPU");
    let results = group(world).run(|comm| -> R<String> {
        let ordinal = comm.rank() % devices;
        let ctx = drv("CudaContext::new", CudaContext::new(ordinal))?;
        // SAFETY: one stream on this context handle (see engine_stream).
        unsafe { ctx.disable_event_tracking() };
        let stream = drv("new_stream", ctx.new_stream())?;
        let memory = CudaMemory::same_process(ordinal as i32)?;
        let options = CudaOptions {
            ranks_per_device: per_device,
            ..CudaOptions::default()
        };
        let backend = CudaBackend::with_stream(&comm, &memory, options, stream.clone())?;
        let reason = backend.topology().reason.clone();
        let mut ar = CustomAllReduce::new(backend, memory, &comm, Config::default())?;
        let x = drv(
            "clone_htod",
            stream.clone_htod(&vec![comm.rank() as f32 + 1.0; 4096]),
        )?;
        let mut y = drv("alloc_zeros", stream.alloc_zeros::<f32>(4096))?;
        ar.all_reduce_device(&x, &mut y)?;
        ar.synchronize()?;
        expect_all(&stream, &y, 3.0)?;
        comm.barrier()?;
        ar.close_with(&comm)?;
        Ok(reason)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let reason = r
            .expect("rank finished")
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        eprintln!("rank {rank}: topology: {reason}");
    }
}

#[test]
fn a_stream_of_another_context_is_refused_on_every_rank() {
    if !gpu() {
        return;
    }
    let results = group(2).run(|comm| -> R<()> {
        let stream = if comm.rank() == 0 {
            let ctx = drv("new_non_primary", CudaContext::new_non_primary(0, 0))?;
            drv("new_stream", ctx.new_stream())?
        } else {
            engine_stream()?
        };
        let memory = CudaMemory::same_process(0)?;
        let options = CudaOptions {
            ranks_per_device: 2,
            ..CudaOptions::default()
        };
        match CudaBackend::with_stream(&comm, &memory, options, stream) {
            Err(AllReduceError::ForeignStream { device: 0, found }) if comm.rank() == 0 => {
                assert!(found.contains("not its primary context"), "{found}")
            }
            Err(AllReduceError::PeerSetup { rank: 0, .. }) if comm.rank() == 1 => {}
            other => panic!("rank {}: {other:?}", comm.rank()),
        }
        Ok(())
    });
    unwrap_all(results);
}
