//! An engine's decode step with the all-reduce inside the engine's own CUDA graph.
//!
//! What an engine team copies: cudarc tensors (`CudaSlice<f32>`) on the engine's own stream,
//! the tensor-parallel all-reduce issued on that stream (`CudaBackend::with_stream`), the
//! whole step captured by the engine into ONE graph, the graph adopted by the all-reduce
//! (so its replays are checked), `register_graph_buffers` after the capture, replays, a
//! suspend / resume (peer mappings closed and reopened), replays again, every result checked
//! against a single-rank reference computed on the host.
//!
//! The "step" here is a stand-in without cuBLAS: a device copy (where an engine runs its
//! row-parallel GEMM into `partial`), the all-reduce of `partial` into `hidden`, and a
//! second all-reduce of `hidden` (a second layer's output). Ranks are threads, one per
//! visible GPU (several ranks share a GPU when there are fewer GPUs than ranks).
//!
//! ```text
//! cargo run -p tpcomm-allreduce --features cuda --example engine_step -- 2
//! ```

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use tpcomm_allreduce::{Config, CudaBackend, CudaOptions, CustomAllReduce};
use tpcomm_ipc::{CudaMemory, IpcError};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// One rank: the engine's stream and tensors, the all-reduce, the captured step.
fn rank(comm: &LocalCommunicator, devices: usize) -> Result<(), Error> {
    let world = comm.size();
    let ordinal = comm.rank() % devices;
    // The engine's context and stream. One stream per context handle, no cudarc event
    // tracking: the stream orders everything, and a capture cannot wait on events recorded
    // outside it.
    let ctx = CudaContext::new(ordinal)?;
    // SAFETY: this handle's slices are only used on `stream`, which orders their accesses.
    unsafe { ctx.disable_event_tracking() };
    let stream: Arc<CudaStream> = ctx.new_stream()?;

    // The all-reduce on the engine's stream.
    let memory = CudaMemory::same_process(ordinal as i32)?;
    let options = CudaOptions {
        ranks_per_device: world.div_ceil(devices.min(world)),
        ..CudaOptions::default()
    };
    let backend = CudaBackend::with_stream(comm, &memory, options, stream.clone())?;
    println!("rank {}: {}", comm.rank(), backend.topology().reason);
    let mut ar = CustomAllReduce::new(backend, memory, comm, Config::default())?;

    // The engine's tensors (cudarc pool memory: the all-reduce captures its staging copy).
    let n = 8192; // hidden size
    let mut activations: CudaSlice<f32> = stream.alloc_zeros(n)?;
    let mut partial: CudaSlice<f32> = stream.alloc_zeros(n)?;
    let mut hidden: CudaSlice<f32> = stream.alloc_zeros(n)?;
    let mut output: CudaSlice<f32> = stream.alloc_zeros(n)?;

    // Capture the whole step on the engine's stream.
    let mark = ar.capture_mark();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let step = (|| -> Result<(), Error> {
        stream.memcpy_dtod(&activations, &mut partial)?; // the engine's GEMM goes here
        ar.all_reduce_device(&partial, &mut hidden)?; // row-parallel output, summed
        ar.all_reduce_device(&hidden, &mut output)?; // a second layer's all-reduce
        Ok(())
    })();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
    step?;
    let graph = ar.adopt_graph(graph.ok_or("the capture recorded nothing")?, mark)?;
    // Collective, after the capture: fills the graph's RankData slots.
    ar.register_graph_buffers(comm)?;

    for round in 0..4 {
        // Inputs of this step: rank r holds (r + 1) * (round + 1) everywhere.
        let value = (comm.rank() + 1) as f32 * (round + 1) as f32;
        stream.memcpy_htod(&vec![value; n], &mut activations)?;
        ar.replay_graph(&graph)?;
        ar.synchronize()?;
        // Single-rank reference: sum over ranks, then the second all-reduce multiplies by
        // the world size.
        let sum: f32 = (1..=world).map(|r| (r * (round + 1)) as f32).sum();
        let want = sum * world as f32;
        let got = stream.clone_dtoh(&output)?;
        if let Some(i) = got.iter().position(|&v| v != want) {
            return Err(
                format!("round {round}: element {i} is {}, expected {want}", got[i]).into(),
            );
        }
        if round == 1 {
            // The engine suspends (every peer mapping closed) and resumes (reopened,
            // possibly elsewhere); the graph captured before stays valid.
            ar.prepare_for_suspend(comm)?;
            ar.reinit_after_resume(comm)?;
        }
    }
    ar.close_with(comm)?;
    println!(
        "rank {}: 4 replays checked against the reference",
        comm.rank()
    );
    Ok(())
}

fn main() -> Result<(), Error> {
    let world: usize = std::env::args().nth(1).map_or(Ok(2), |a| a.parse())?;
    let devices = match CudaMemory::same_process(0) {
        Ok(_) => CudaContext::device_count()?.max(1) as usize,
        Err(IpcError::NoDevice(why)) => {
            if std::env::var("TPCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
                return Err(format!("TPCOMM_REQUIRE_GPU=1 but no CUDA device: {why}").into());
            }
            println!("skipped: no CUDA device: {why}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let results = LocalGroup::new(world).run(|comm| rank(&comm, devices));
    for (r, result) in results.into_iter().enumerate() {
        result
            .map_err(|e| format!("rank {r}: {e}"))?
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    Ok(())
}
