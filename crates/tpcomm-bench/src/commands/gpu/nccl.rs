//! The NCCL reference of `gpu`: `ncclAllReduce` on one rank (one GPU cannot host two NCCL
//! ranks: a copy-bound lower bound), `K` per captured graph (eager calls when the capture
//! fails), timed like the custom rows.

use cudarc::driver::{sys, CudaGraph};
use tpcomm::allreduce::DType;
use tpcomm::ipc::{CudaBuffer, CudaMemory, PeerMemory};
use tpcomm::transport::{
    DeviceCommunicator, DeviceElement, LocalGroup, NcclCommunicator, ReduceOp,
};
use tpcomm::TransportError;

use super::replay::{check_bytes, cuda_error, input_bytes, poison_bytes, Timer};
use super::GpuArgs;
use crate::data::elements::expected;
use crate::engine::error::BenchError;
use crate::engine::row::Row;
use crate::engine::session::Session;
use crate::engine::sweep::format_bytes;
use crate::engine::verify::agree;

struct Buffers {
    memory: CudaMemory,
    send: CudaBuffer,
    recv: CudaBuffer,
}

/// `k` all-reduces of `count` elements of `T`, send -> recv.
fn enqueue<T: DeviceElement>(
    comm: &NcclCommunicator,
    b: &Buffers,
    count: usize,
    k: usize,
) -> Result<(), BenchError> {
    let stream = comm.stream();
    let send = b.send.view::<T>(count, stream)?;
    let mut recv = b.recv.view::<T>(count, stream)?;
    for _ in 0..k {
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
    }
    Ok(())
}

fn enqueue_dtype(
    comm: &NcclCommunicator,
    b: &Buffers,
    dtype: DType,
    count: usize,
    k: usize,
) -> Result<(), BenchError> {
    crate::data::elements::with_element!(dtype, T => enqueue::<T>(comm, b, count, k))
}

/// A graph of `k` all-reduces, or `None` when the capture failed (the reason on
/// stderr).
fn capture(
    comm: &NcclCommunicator,
    b: &Buffers,
    dtype: DType,
    count: usize,
    k: usize,
) -> Option<CudaGraph> {
    let stream = comm.stream();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    let captured = stream
        .begin_capture(mode)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            // The capture ends whatever happened, so that the stream is usable again.
            let enqueued = enqueue_dtype(comm, b, dtype, count, k).map_err(|e| e.to_string());
            let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            enqueued.and(ended.map_err(|e| e.to_string()))
        });
    captured.unwrap_or_else(|e| {
        eprintln!("tpcomm-bench gpu: nccl: cannot capture ({e}); timing eager calls");
        None
    })
}

/// The NCCL rows, one per type and size, and the library's description; no rows (and
/// a note) when libnccl or the device is missing.
pub(super) fn reference(
    t: &Session<'_>,
    args: &GpuArgs,
    dtypes: &[DType],
    sizes: &[usize],
) -> Result<(Vec<Row>, Option<String>), BenchError> {
    let host = LocalGroup::new(1).communicators()?.remove(0);
    let comm = match NcclCommunicator::new(&host, args.device as usize) {
        Ok(c) => c,
        Err(e @ (TransportError::LibraryMissing { .. } | TransportError::NoDevice(_))) => {
            t.note(&format!("nccl: reference skipped: {e}"));
            return Ok((Vec::new(), None));
        }
        Err(e) => return Err(e.into()),
    };
    let library = format!("{} ({})", comm.library().version(), comm.library().path());
    t.note(&format!(
        "nccl: ncclAllReduce on 1 rank (one GPU cannot host two NCCL ranks: a copy-bound \
         lower bound, not a multi-GPU all-reduce), K per graph, timed like the rows; \
         library {library}"
    ));
    let memory = CudaMemory::new(args.device)?;
    let max = sizes.iter().copied().max().unwrap_or(16);
    let b = Buffers {
        send: memory.allocate(max)?,
        recv: memory.allocate(max)?,
        memory,
    };
    let k = args.graph_launches as usize;
    let iters = args.iters as usize;
    let stream = comm.stream().clone();
    // One eager call first: NCCL sets up its resources outside any capture.
    enqueue_dtype(&comm, &b, DType::F32, 4, 1)?;
    comm.synchronize()?;
    let mut rows = Vec::new();
    for &dtype in dtypes {
        let mut line = Vec::new();
        for &bytes in sizes {
            let count = bytes / dtype.size();
            let salt = 0x5eed ^ bytes as u64;
            b.memory
                .write(&b.send, 0, &input_bytes(dtype, 0, count, salt))?;
            b.memory.write(&b.recv, 0, &poison_bytes(dtype, count))?;
            let graph = capture(&comm, &b, dtype, count, k);
            let launch = || -> Result<(), BenchError> {
                match &graph {
                    Some(g) => g.launch().map_err(cuda_error("cuGraphLaunch")),
                    None => enqueue_dtype(&comm, &b, dtype, count, k),
                }
            };
            launch()?;
            comm.synchronize()?;
            let mut raw = vec![0u8; bytes];
            b.memory.read(&b.recv, 0, &mut raw)?;
            let problem = check_bytes(dtype, &raw, &expected(1, count, salt));
            agree(&host, problem, || format!("nccl all_reduce of {bytes} B"))?;
            for _ in 0..args.warmup {
                launch()?;
            }
            comm.synchronize()?;
            let timer = Timer::new(stream.context(), iters)?;
            timer.record(&stream, launch)?;
            comm.synchronize()?;
            let samples = timer.per_launch_ns(k)?;
            let mode = if graph.is_some() { "graph" } else { "eager" };
            let table = format!("nccl {} (1 rank)", dtype.name());
            let Some(row) = Row::new(
                &table,
                &bytes.to_string(),
                "nccl",
                bytes,
                args.warmup as usize,
                samples,
            ) else {
                continue;
            };
            line.push(format!(
                "{} {:.2}",
                format_bytes(bytes),
                row.stats.median_us
            ));
            rows.push(
                row.with("type", dtype.name())
                    .with("count", count)
                    .with("mode", mode)
                    .with("graph_launches", k),
            );
        }
        t.note(&format!(
            "nccl {} us per all-reduce: {}",
            dtype.name(),
            line.join(", ")
        ));
    }
    Ok((rows, Some(library)))
}
