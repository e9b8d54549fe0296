//! The engine-path rows: what an engine pays for handing tpcomm its own stream and
//! tensors, against today's private-stream rows.
//!
//! Per world size and size, every rank captures three graphs of `K` all-reduces of one
//! input into one output (the same kernel and algorithm in all three, chosen by size):
//! - `private`: today's path: the backend's own stream ([`CudaBackend::new`]),
//!   [`CudaBuffer`]s, [`CustomAllReduce::capture_graph`];
//! - `caller`: the engine's path: the engine's stream ([`CudaBackend::with_stream`]),
//!   cudarc views of exportable memory ([`CudaBuffer::view`]) through
//!   [`CustomAllReduce::all_reduce_device`], the engine's own `cuStreamBeginCapture`
//!   adopted with [`CustomAllReduce::adopt_graph`]: zero-copy, like `private`;
//! - `caller+stage`: the same with the input in cudarc's pool memory (`CudaSlice`),
//!   which legacy IPC cannot export: the staging copy is captured into the graph.
//!
//! Each graph is verified once (exact sums on every rank), then the three are timed in
//! rounds, rotating which runs first, `iters` replays each per round (each variant on its
//! own stream, drained before the next starts). `caller` is compared with `private` (the
//! target: within 2%), `caller+stage` with `caller` (the staging copy's cost).
//!
//! [`CudaBuffer`]: tpcomm::ipc::CudaBuffer
//! [`CudaBuffer::view`]: tpcomm::ipc::CudaBuffer::view

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use tpcomm::allreduce::{Algorithm, CudaBackend, CustomAllReduce, DType, DeviceGraph, Element};
use tpcomm::ipc::{BufferView, CudaMemory, PeerMemory};
use tpcomm::Communicator;

use super::replay::{
    config, cuda_error, options, teardown, verify_and_time, write_input, CudaAllReduce, Plan,
    Replayed,
};
use super::GpuArgs;
use crate::data::elements::input;
use crate::engine::error::BenchError;
use crate::engine::row::{Bus, Row};
use crate::engine::session::Session;
use crate::engine::summary::{distinct, per_size};
use crate::engine::sweep::format_bytes;
use crate::engine::table::{self, col, Column};
use crate::engine::targets::Target;
use crate::engine::timing::Spec;

/// Today's path.
pub(super) const PRIVATE: &str = "private";
/// The caller's stream and exportable views: zero-copy in the graph.
pub(super) const CALLER: &str = "caller";
/// The caller's stream and pool memory: the staging copy in the graph.
pub(super) const STAGED: &str = "caller+stage";
/// Timing rounds; each runs every variant `iters` times.
const ROUNDS: usize = 3;

pub(super) const COLUMNS: [Column; 10] = [
    Column::fact("ranks", "", 5, "ranks"),
    Column::fact("type", "", 5, "type"),
    col::size(9),
    col::variant("path", 12),
    Column::fact("alg", "", 6, "algorithm"),
    Column::new("iters", "", 5, |r, _| r.iters.to_string()),
    col::time::<2>("time", 9),
    col::min::<2>(9),
    Column::new("vs", "", 8, |r, _| {
        r.peer.clone().unwrap_or_else(|| "-".into())
    }),
    Column::new("ratio", "", 7, |r, _| col::f3(r.vs_peer)),
];

/// One size's graphs on one rank, in [`PRIVATE`], [`CALLER`], [`STAGED`] order.
struct Case {
    bytes: usize,
    count: usize,
    algorithm: Algorithm,
    graphs: [DeviceGraph; 3],
    /// Whether `caller+stage` captured the staging copy (see `run_world`).
    staged: bool,
}

/// The engine's capture of `k` all-reduces of `input` into `output` on `stream` (the
/// all-reduce's stream), adopted by the all-reduce.
fn capture_on_stream<T: Element, I: DevicePtr<T>>(
    ar: &mut CudaAllReduce,
    stream: &Arc<CudaStream>,
    input: &I,
    output: &mut BufferView<'_, T>,
    k: usize,
) -> Result<(DeviceGraph, Algorithm), BenchError> {
    let mark = ar.capture_mark();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(cuda_error("cuStreamBeginCapture"))?;
    let mut issued = Ok(None);
    for _ in 0..k {
        issued = ar.all_reduce_device(input, output).map(Some);
        if issued.is_err() {
            break;
        }
    }
    // The capture ends whatever happened, so that the stream is usable again.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let algorithm = issued?;
    let graph = ended
        .map_err(cuda_error("cuStreamEndCapture"))?
        .ok_or_else(|| BenchError::Usage("the engine's capture recorded nothing".into()))?;
    let graph = ar.adopt_graph(graph, mark)?;
    let algorithm =
        algorithm.ok_or_else(|| BenchError::Usage("--graph-launches must be at least 1".into()))?;
    Ok((graph, algorithm))
}

/// Every size at one world size, on this rank: rank 0's rows (empty on the others).
pub(super) fn run_world<C: Communicator, T: Element + DeviceRepr + ValidAsZeroBits>(
    comm: &C,
    args: &GpuArgs,
) -> Result<Vec<Row>, BenchError> {
    let (rank, world) = (comm.rank(), comm.size());
    let dtype = T::DTYPE;
    let k = args.graph_launches as usize;
    let sizes = &args.engine_sizes;
    let max_bytes = sizes.iter().copied().max().unwrap_or(16);
    let memory = CudaMemory::same_process(args.device)?;
    let config = config(args, max_bytes, 1 + 2 * k * sizes.len());
    let backend = CudaBackend::new(comm, &memory, options(args, world))?;
    let blocks = backend.max_blocks();
    let mut private = CustomAllReduce::new(backend, memory.clone(), comm, config.clone())?;
    // The engine's stream, on a context handle without event tracking, as an engine
    // that captures its step holds it.
    let ctx =
        CudaContext::new(args.device as usize).map_err(cuda_error("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: every slice of this context handle (the pool input) is used on
    // `stream` only, which orders its uses.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?;
    let backend = CudaBackend::with_stream(comm, &memory, options(args, world), stream.clone())?;
    let mut engine = CustomAllReduce::new(backend, memory.clone(), comm, config)?;
    // Separate buffers for the two communicators: each registers its own inputs.
    let (p_in, p_out) = (memory.allocate(max_bytes)?, memory.allocate(max_bytes)?);
    let (e_in, e_out) = (memory.allocate(max_bytes)?, memory.allocate(max_bytes)?);
    let mut pool_in: CudaSlice<T> = stream
        .alloc_zeros(max_bytes / dtype.size())
        .map_err(cuda_error("cuMemAllocAsync"))?;
    stream
        .synchronize()
        .map_err(cuda_error("cuStreamSynchronize"))?;
    comm.barrier()?;

    let mut cases = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let count = bytes / dtype.size();
        let mut algorithm = None;
        let private_graph = private.capture_graph(|ar| {
            for _ in 0..k {
                algorithm = Some(ar.all_reduce_buffer(&p_in, &p_out, dtype, count)?);
            }
            Ok(())
        })?;
        let mut out = e_out.view::<T>(count, &stream)?;
        let e_view = e_in.view::<T>(count, &stream)?;
        let (caller_graph, _) = capture_on_stream(&mut engine, &stream, &e_view, &mut out, k)?;
        let (staged_graph, alg) =
            capture_on_stream(&mut engine, &stream, &pool_in.slice(..count), &mut out, k)?;
        cases.push(Case {
            bytes,
            count,
            algorithm: algorithm.unwrap_or(alg),
            graphs: [private_graph, caller_graph, staged_graph],
            staged: false,
        });
    }
    private.register_graph_buffers(comm)?;
    engine.register_graph_buffers(comm)?;
    // Whether the pool input was staged in the graph: its slots (slot 0 serves eager
    // calls; each case took K for `caller`, then K for `caller+stage`) hold this
    // rank's staging buffer, not the input (a device without memory pools gives
    // cudarc exportable memory, shared zero-copy).
    let staging = engine.base_address(rank, 1)?;
    for (c, case) in cases.iter_mut().enumerate() {
        case.staged = engine.rank_data_slot(1 + 2 * k * c + k)?[rank] == staging;
    }

    let mut rows = Vec::new();
    for (c, case) in cases.iter().enumerate() {
        let count = case.count;
        let shape = (dtype, rank, count);
        let (stream, pool_in) = (&stream, &mut pool_in);
        let stage = move |salt| {
            stream
                .memcpy_htod(&input::<T>(rank, count, salt), pool_in)
                .map_err(cuda_error("cuMemcpyHtoDAsync"))?;
            stream
                .synchronize()
                .map_err(cuda_error("cuStreamSynchronize"))
        };
        let [pg, cg, sg] = &case.graphs;
        let mut runs = [
            Replayed {
                name: PRIVATE,
                ar: 0,
                graph: pg,
                output: &p_out,
                fill: write_input(&memory, &p_in, shape),
            },
            Replayed {
                name: CALLER,
                ar: 1,
                graph: cg,
                output: &e_out,
                fill: write_input(&memory, &e_in, shape),
            },
            Replayed {
                name: STAGED,
                ar: 1,
                graph: sg,
                output: &e_out,
                fill: Box::new(stage),
            },
        ];
        let plan = Plan {
            dtype,
            count,
            salt: ((world as u64) << 40) ^ (0xe9 << 32) ^ ((c as u64) << 8),
            phase: "path",
            k,
            iters: args.iters as usize,
            warmup: args.warmup as usize,
            rounds: ROUNDS,
        };
        let ars = &mut [&mut private, &mut engine];
        let samples = verify_and_time(comm, &memory, ars, &mut runs, plan)?;
        if rank == 0 {
            rows.extend(rows_of(case, samples, world, dtype, blocks, k, plan.warmup));
        }
    }
    let buffers = (p_in, p_out, e_in, e_out, pool_in);
    teardown(comm, vec![private, engine], cases, buffers)?;
    Ok(rows)
}

/// The three rows of one case, each compared with its peer variant.
fn rows_of(
    case: &Case,
    samples: Vec<Vec<u64>>,
    world: usize,
    dtype: DType,
    blocks: u32,
    k: usize,
    warmup: usize,
) -> Vec<Row> {
    let table = format!("engine {world} ranks {}", dtype.name());
    let spec = Spec {
        bus: Some(Bus::AllReduce),
        ..Spec::new(
            &table,
            case.bytes.to_string(),
            case.bytes,
            &[PRIVATE, CALLER, STAGED],
        )
        .with("ranks", world)
        .with("type", dtype.name())
        .with("count", case.count)
        .with("algorithm", case.algorithm.name())
        .with("blocks", blocks)
        .with("graph_launches", k)
    };
    let mut rows = spec.rows(world, warmup, samples);
    crate::engine::row::link_peers(&mut rows, |r| match r.variant.as_str() {
        CALLER => Some(PRIVATE.into()),
        STAGED => Some(CALLER.into()),
        _ => None,
    });
    // The staging copy's cost in microseconds per all-reduce, next to its ratio.
    let caller = rows
        .iter()
        .find(|r| r.is(CALLER))
        .map(|r| r.stats.median_us);
    for r in rows.iter_mut().filter(|r| r.is(STAGED)) {
        let extra = caller.map(|c| r.stats.median_us - c);
        r.info.insert("staging_copy_us".into(), extra.into());
        r.info.insert("staging_in_graph".into(), case.staged.into());
    }
    rows
}

/// The target of the engine path: an engine's own stream and tensors cost nothing.
pub(super) fn targets() -> Vec<Target> {
    vec![Target {
        what: format!(
            "engine path: {CALLER} (the engine's stream and tensors) within 1.02x of \
             {PRIVATE} at every size"
        ),
        why: "an engine that hands the all-reduce its own stream and tensors must not \
              pay for it; 2% is about the noise of these replays",
        line: crate::engine::targets::RatioLine::new(PRIVATE, 1.02),
        judge: crate::engine::targets::within(|r| r.is(CALLER), |x| x, 1.02),
    }]
}

#[test]
fn the_engine_target_is_the_caller_path_within_2_percent_of_the_private_one() {
    let row = |variant, vs| crate::engine::row::row_vs("engine 2 ranks bf16", "32768", variant, vs);
    let judge = |rows: &[Row]| crate::engine::targets::judge(&targets(), rows);
    assert!(judge(&[row(CALLER, 1.019), row(STAGED, 1.4)])[0].met);
    let v = judge(&[row(CALLER, 1.019), row(CALLER, 1.021)]);
    assert!(!v[0].met);
    assert_eq!(
        v[0].detail,
        "1 of 2 rows within; outside, farthest first: engine 2 ranks bf16 32768 caller \
         1.021x"
    );
    assert!(judge(&[row(STAGED, 1.0)]).is_empty());
}

/// Prints the engine-path table; returns its rows (empty when `--engine-worlds none`).
pub(super) fn run(s: &mut Session<'_>, args: &GpuArgs) -> Result<Vec<Row>, BenchError> {
    let worlds = args.engine_worlds();
    if worlds.is_empty() {
        s.note("engine path: skipped (--engine-worlds none)");
        return Ok(Vec::new());
    }
    let dtype = args.dtypes[0].dtype();
    s.note(&format!(
        "engine path ({}, sizes {}): private = CudaBackend::new, CudaBuffers, \
         capture_graph (the rows above); caller = CudaBackend::with_stream on the \
         engine's stream, all_reduce_device on cudarc views of exportable memory, the \
         engine's own capture (adopt_graph); caller+stage = the same with the input in \
         cudarc pool memory (the staging copy captured into the graph). {ROUNDS} rounds \
         rotating the order, {} replays each per round; ratio: time / the `vs` path's",
        dtype.name(),
        args.engine_sizes
            .iter()
            .map(|&b| format_bytes(b))
            .collect::<Vec<_>>()
            .join(", "),
        args.iters
    ));
    s.header(
        "engine path: the caller's stream and tensors (CUDA graphs, ranks as threads on one GPU)",
        &COLUMNS,
    );
    let mut rows = Vec::new();
    for world in worlds {
        let group = tpcomm::transport::LocalGroup::new(world as usize);
        let results = crate::data::elements::with_element!(dtype, T => {
            group.run(|comm| run_world::<_, T>(&comm, args))
        });
        let found = crate::engine::launch::first_rank_output(results)?;
        if s.prints() {
            table::print_rows(&COLUMNS, &found, &[]);
        }
        rows.extend(found);
    }
    summarize(s, &rows);
    Ok(rows)
}

/// Per table: caller / private per size with the geometric mean (target within 2%),
/// and the staging copy's ratio and microseconds per size.
fn summarize(s: &mut Session<'_>, rows: &[Row]) {
    let geo = |g: Option<f64>| g.map_or_else(|| "-".into(), |g| format!("{g:.3}"));
    for table in distinct(rows.iter().map(|r| &r.table)) {
        let of = |variant| {
            rows.iter()
                .filter(move |r| &r.table == table && r.is(variant))
        };
        let (per, g) = per_size(of(CALLER), |r| r.vs_peer, 3);
        let worst = of(CALLER).filter_map(|r| r.vs_peer).fold(0.0f64, f64::max);
        s.summary(format!(
            "{table}: caller/private per size: {per}; geomean {}; worst {worst:.3} \
             (target <= 1.02)",
            geo(g)
        ));
        let (per, g) = per_size(of(STAGED), |r| r.vs_peer, 3);
        let (us, _) = per_size(of(STAGED), |r| r.number("staging_copy_us"), 2);
        let unstaged = of(STAGED).any(|r| r.info.get("staging_in_graph") == Some(&false.into()));
        s.summary(format!(
            "{table}: caller+stage/caller (the staging copy in the graph) per size: {per}; \
             geomean {}; the copy's us per size: {us}{}",
            geo(g),
            if unstaged {
                " (NOT a staging cost: cudarc's memory was exportable here, shared \
                 zero-copy)"
            } else {
                ""
            }
        ));
    }
}
