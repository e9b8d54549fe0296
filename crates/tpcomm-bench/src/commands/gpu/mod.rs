//! `tpcomm-bench gpu`: the CUDA backend of the custom all-reduce on one GPU, captured into
//! CUDA graphs and replayed, before and after a suspend/resume, with NCCL as the reference.
//!
//! Ranks are threads of this process sharing one device (`CudaMemory::same_process` or
//! `CudaVmmMemory::same_process`, `--memory legacy,vmm`: every rank opens its peers' buffers
//! as aliases, and `CudaOptions::ranks_per_device` gives each rank's launch an equal share of
//! the multiprocessors, so that every rank's blocks are resident at once). Per kind of peer
//! memory, world size (2, 4, 8) and forced algorithm (`Config::algorithm`):
//!
//! 1. every rank captures, per element type and size, one CUDA graph of `K` all-reduces of
//!    one input buffer into one output buffer (`CustomAllReduce::capture_graph`), then
//!    registers the captured inputs in one collective call (`register_graph_buffers`);
//! 2. per graph: a check (every rank's input filled with small integers, the output
//!    poisoned, one replay, the output compared bit for bit with the exact sum on every
//!    rank, agreed across ranks), warm-up replays, then timed replays: each rank thread
//!    replays its own graph (the kernels spin-wait on each other, so all ranks launch
//!    concurrently) between CUDA events on its backend stream; a replay's time is the
//!    slowest rank's, divided by `K`;
//! 3. `prepare_for_suspend` + `reinit_after_resume` (each timed; the device memory the
//!    suspend gave back read with `cuMemGetInfo`: virtual memory releases the Signal,
//!    staging and temp buffers), then step 2 again on the *same* graphs (new input values,
//!    so a graph that reads stale tables cannot pass). The closing lines give vmm / legacy
//!    per size (expected near 1: the kernels read the same tables).
//!
//! The engine path (`--engine-worlds`, `--engine-sizes`), after the custom rows: the same
//! kernel reached as an engine reaches it, on the engine's stream with cudarc views inside
//! the engine's own capture (`caller`), against today's private-stream path (`private`,
//! target: within 2%), and with the input in cudarc's pool memory, whose staging copy is
//! captured into the graph (`caller+stage`, its cost against `caller`); see `mod engine`.
//!
//! The NCCL reference (feature `nccl`), measured after the custom rows (so that an NCCL
//! failure or hang cannot cost them; the JSON report is written before and after it):
//! `ncclAllReduce` on one rank (one GPU cannot host two NCCL ranks), `K` per graph, timed
//! the same way; it is a copy-bound lower bound, not a multi-GPU all-reduce. The closing
//! lines give custom / NCCL per size.
//!
//! Nothing here synchronizes the whole context (`cuCtxSynchronize`) while kernels may run:
//! waits are per stream or per event, and allocations and frees happen only after every
//! rank drained its stream and passed a barrier.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::engine::error::BenchError;
use crate::engine::options::{DTypeArg, MemoryArg};
use crate::engine::summary::distinct;
use crate::engine::sweep::{parse_bytes, SweepArgs};

/// Options of `tpcomm-bench gpu`.
#[derive(Debug, Clone, Args, Serialize)]
#[command(mut_arg("min_bytes", |a| a.default_value("1KiB")))]
#[command(mut_arg("max_bytes", |a| a.default_value("8MiB")))]
#[command(mut_arg("factor", |a| a.default_value("4")))]
pub(crate) struct GpuArgs {
    /// World sizes (ranks as threads on one GPU), comma-separated; the kernels serve 2, 4,
    /// 6 and 8.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "2,4,8",
        value_parser = clap::value_parser!(u32).range(2..=8),
        value_name = "N,.."
    )]
    pub(crate) worlds: Vec<u32>,

    /// Element types timed at every world size.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "bf16",
        value_name = "DTYPES"
    )]
    pub(crate) dtypes: Vec<DTypeArg>,

    /// World sizes at which f32 is timed too (`none` for none).
    #[arg(long, value_delimiter = ',', default_value = "2", value_parser = parse_world_or_none, value_name = "N,..")]
    pub(crate) f32_worlds: Vec<Option<u32>>,

    /// Peer memory of every row's buffers: legacy CUDA IPC (`CudaMemory`) and the driver's
    /// virtual memory (`CudaVmmMemory`, whose suspend releases the all-reduce's buffers and
    /// whose resume keeps every address). The kernels read the same tables on both: the
    /// vmm / legacy ratio is expected near 1.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "legacy,vmm",
        value_name = "KINDS"
    )]
    pub(crate) memory: Vec<MemoryArg>,

    /// Algorithms, each forced through `Config::algorithm`.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "1stage,2stage",
        value_name = "ALGS"
    )]
    pub(crate) algorithms: Vec<AlgorithmArg>,

    /// Sizes (here 1 KiB to 8 MiB by 4 by default, multiples of 16: the kernels move
    /// 16-byte packs; the largest size is always measured, even off the factor's steps).
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) sweep: SweepArgs,

    /// All-reduces captured in each graph (K).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256), value_name = "K")]
    pub(crate) graph_launches: u32,

    /// Timed graph replays per row, before and after the resume each.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=10000), value_name = "N")]
    pub(crate) iters: u32,

    /// Untimed graph replays before the timed ones.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub(crate) warmup: u32,

    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    pub(crate) device: i32,

    /// Upper bound on the blocks of one launch [default: CudaOptions' default]; each rank
    /// gets at most multiprocessors / ranks anyway.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64), value_name = "N")]
    pub(crate) max_blocks: Option<u32>,

    /// Bound on every barrier wait inside a kernel, in seconds (a hung kernel becomes a
    /// Timeout error naming the missing peer).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..), value_name = "S")]
    pub(crate) kernel_timeout_s: u64,

    /// World sizes of the engine-path rows (`none` for none): the caller's stream and cudarc
    /// views (`CudaBackend::with_stream`, `all_reduce_device`, the engine's own capture)
    /// against the private-stream path, and the staging copy captured for pool memory.
    #[arg(long, value_delimiter = ',', default_value = "2,4", value_parser = parse_world_or_none, value_name = "N,..")]
    pub(crate) engine_worlds: Vec<Option<u32>>,

    /// Sizes of the engine-path rows (multiples of 16 bytes), in the first of `--dtypes`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "32KiB,256KiB,2MiB",
        value_parser = parse_bytes,
        value_name = "BYTES,.."
    )]
    pub(crate) engine_sizes: Vec<usize>,

    /// Skip the NCCL reference.
    #[arg(long)]
    pub(crate) no_nccl: bool,

    /// Also write every figure (and every replay's time) to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

/// `none` or a world size 2..=8.
fn parse_world_or_none(text: &str) -> Result<Option<u32>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match text.parse::<u32>() {
        Ok(n) if (2..=8).contains(&n) => Ok(Some(n)),
        _ => Err(format!("`{text}` is not a world size 2..=8 or `none`")),
    }
}

/// An algorithm on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub(crate) enum AlgorithmArg {
    /// One-stage: every rank reads every peer's whole input.
    #[value(name = "1stage")]
    #[serde(rename = "1stage")]
    OneStage,
    /// Two-stage: reduce-scatter into temp buffers, then all-gather.
    #[value(name = "2stage")]
    #[serde(rename = "2stage")]
    TwoStage,
}

impl GpuArgs {
    /// The sweep's sizes, and `--max-bytes` when off the factor's steps.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn sizes(&self) -> Vec<usize> {
        let mut sizes = self.sweep.sizes();
        if sizes.last() != Some(&self.sweep.max_bytes) {
            sizes.push(self.sweep.max_bytes);
        }
        sizes
    }

    /// The element types timed at `world` ranks, in order, without repeats.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn dtypes_for(&self, world: u32) -> Vec<DTypeArg> {
        let f32_too = self
            .f32_worlds
            .contains(&Some(world))
            .then_some(DTypeArg::F32);
        distinct(self.dtypes.iter().copied().chain(f32_too))
    }

    /// The world sizes of the engine-path rows, in order, without repeats.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn engine_worlds(&self) -> Vec<u32> {
        distinct(self.engine_worlds.iter().flatten().copied())
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.sweep.validate()?;
        let engine_sizes = self.engine_sizes.iter().map(|&v| ("--engine-sizes", v));
        for (name, v) in [
            ("--min-bytes", self.sweep.min_bytes),
            ("--max-bytes", self.sweep.max_bytes),
        ]
        .into_iter()
        .chain(engine_sizes)
        {
            if v == 0 || !v.is_multiple_of(16) {
                return Err(BenchError::Usage(format!(
                    "{name} ({v}) must be a positive multiple of 16 bytes: the kernels move \
                     16-byte packs"
                )));
            }
        }
        if let Some(w) = self
            .worlds
            .iter()
            .chain(&self.engine_worlds())
            .find(|&&w| w % 2 == 1)
        {
            return Err(BenchError::Usage(format!(
                "world size {w}: the CUDA kernels serve 2, 4, 6 and 8 ranks"
            )));
        }
        if self.worlds.is_empty()
            || self.dtypes.is_empty()
            || self.algorithms.is_empty()
            || self.memory.is_empty()
        {
            return Err(BenchError::Usage(
                "--worlds, --dtypes, --algorithms and --memory need at least one value".into(),
            ));
        }
        if self.engine_sizes.is_empty() && !self.engine_worlds().is_empty() {
            return Err(BenchError::Usage(
                "--engine-sizes needs at least one value (or --engine-worlds none)".into(),
            ));
        }
        if self.device < 0 {
            return Err(BenchError::Usage("--device must be 0 or more".into()));
        }
        Ok(())
    }
}

/// Runs the subcommand.
pub(crate) fn run(args: &GpuArgs) -> Result<(), BenchError> {
    args.validate()?;
    #[cfg(not(feature = "cuda"))]
    return Err(BenchError::WithoutCuda);
    #[cfg(feature = "cuda")]
    imp::run(args)
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};
    use serde::Serialize;
    use tpcomm::allreduce::{
        Algorithm, Backend, Config, CudaBackend, CudaOptions, CustomAllReduce, DType, DeviceGraph,
        Element,
    };
    use tpcomm::ipc::{
        CudaBuffer, CudaMemory, CudaVmmMemory, DevicePeerMemory, IpcError, PeerMemory,
    };
    use tpcomm::transport::LocalGroup;
    use tpcomm::Communicator;

    use super::{AlgorithmArg, GpuArgs};
    use crate::data::elements::with_element;
    use crate::data::elements::{check, expected, input};
    use crate::engine::error::BenchError;
    use crate::engine::launch::{self, RunInfo};
    use crate::engine::options::DTypeArg;
    use crate::engine::options::MemoryArg;
    use crate::engine::row::{Bus, Row, Stats};
    use crate::engine::session::Session;
    use crate::engine::summary::{distinct, per_size};
    use crate::engine::sweep::format_bytes;
    use crate::engine::table::{self, col, Column};
    use crate::engine::timing::{elapsed_ns, slowest, Order, Spec};
    use crate::engine::verify::agree;

    type CudaAllReduce<M = CudaMemory> = CustomAllReduce<CudaBackend<M>>;

    /// Hardware work queues asked for when the environment does not say: every rank's
    /// stream gets its own queue, so that no rank's kernel waits in a queue behind a peer's
    /// kernel that spins waiting for it.
    const DEVICE_MAX_CONNECTIONS: &str = "32";

    pub(super) fn cuda_error(call: &'static str) -> impl FnOnce(DriverError) -> BenchError {
        move |e| BenchError::Cuda {
            call,
            detail: e.to_string(),
        }
    }

    fn algorithm_of(a: AlgorithmArg) -> Algorithm {
        match a {
            AlgorithmArg::OneStage => Algorithm::OneStage,
            AlgorithmArg::TwoStage => Algorithm::TwoStage,
        }
    }

    /// What the JSON report records besides the options.
    #[derive(Debug, Serialize)]
    struct Settings<'a> {
        #[serde(flatten)]
        args: &'a GpuArgs,
        sizes: Vec<usize>,
        device: String,
        driver: String,
        nccl_library: Option<String>,
        /// False for the report written before the NCCL reference.
        complete: bool,
        cuda_device_max_connections: Option<String>,
        cuda_module_loading: Option<String>,
        elapsed_s: f64,
    }

    /// Two decimals of a number fact.
    fn f2(x: Option<f64>) -> String {
        x.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
    }

    const COLUMNS: [Column; 14] = [
        Column::new("ranks", "", 5, |r, _| r.text("ranks")),
        Column::new("type", "", 5, |r, _| r.text("type")),
        Column::new("mem", "", 6, |r, _| r.text("memory")),
        col::size(9),
        col::variant("alg", 6),
        Column::new("blk", "", 4, |r, _| r.text("blocks")),
        Column::new("iters", "", 5, |r, _| r.iters.to_string()),
        col::time::<2>("time", 9),
        col::min::<2>(9),
        Column::new("busbw", "(GB/s)", 8, |r, _| f2(r.busbw_gbps)),
        Column::new("after", "(us)", 9, |r, _| f2(r.number("after_median_us"))),
        Column::new("aft/bef", "", 7, |r, _| {
            col::f3(r.number("after_over_before"))
        }),
        Column::new("s+r", "(us)", 9, |r, _| {
            r.number("suspend_resume_us")
                .map_or_else(|| "-".into(), |x| format!("{x:.0}"))
        }),
        Column::new("freed", "(MiB)", 7, |r, _| {
            r.number("device_freed_bytes").map_or_else(
                || "-".into(),
                |x| format!("{:.0}", x / f64::from(1u32 << 20)),
            )
        }),
    ];

    /// Free device memory now (`cuMemGetInfo`).
    fn free_device_memory() -> Result<usize, BenchError> {
        cudarc::driver::result::mem_get_info()
            .map(|(free, _)| free)
            .map_err(cuda_error("cuMemGetInfo_v2"))
    }

    /// Timing events around each of `n` launches on one stream.
    struct Timer {
        events: Vec<CudaEvent>,
    }

    impl Timer {
        fn new(ctx: &Arc<CudaContext>, launches: usize) -> Result<Self, BenchError> {
            let events = (0..=launches)
                .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(cuda_error("cuEventCreate"))?;
            Ok(Self { events })
        }

        /// Records an event before the first launch and after each of `launch`'s calls (as
        /// many as there are events after the first).
        fn record(
            &self,
            stream: &CudaStream,
            mut launch: impl FnMut() -> Result<(), BenchError>,
        ) -> Result<(), BenchError> {
            let record = |e: &CudaEvent| e.record(stream).map_err(cuda_error("cuEventRecord"));
            record(&self.events[0])?;
            for event in &self.events[1..] {
                launch()?;
                record(event)?;
            }
            Ok(())
        }

        /// After the stream drained: each launch's time divided by `per`, nanoseconds.
        fn per_launch_ns(&self, per: usize) -> Result<Vec<u64>, BenchError> {
            self.events
                .windows(2)
                .map(|w| {
                    let ms = w[0]
                        .elapsed_ms(&w[1])
                        .map_err(cuda_error("cuEventElapsedTime"))?;
                    Ok((f64::from(ms) * 1e6 / per.max(1) as f64).round() as u64)
                })
                .collect()
        }
    }

    /// Bytes of this rank's input for `salt` (small integers: exact sums in every type).
    fn input_bytes(dtype: DType, rank: usize, count: usize, salt: u64) -> Vec<u8> {
        with_element!(dtype, T => bytemuck::cast_slice(&input::<T>(rank, count, salt)).to_vec())
    }

    /// `count` NaNs of `dtype`.
    fn poison_bytes(dtype: DType, count: usize) -> Vec<u8> {
        with_element!(dtype, T => {
            bytemuck::cast_slice(&vec![T::from_f32(f32::NAN); count]).to_vec()
        })
    }

    /// What is wrong with `raw` (elements of `dtype`) against `want`, if anything.
    fn check_bytes(dtype: DType, raw: &[u8], want: &[f32]) -> Option<String> {
        with_element!(dtype, T => {
            let mut got =
                vec![<T as bytemuck::Zeroable>::zeroed(); raw.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut got).copy_from_slice(raw);
            check(&got, want)
        })
    }

    /// The launch options of `world` ranks sharing the device.
    fn options(args: &GpuArgs, world: usize) -> CudaOptions {
        CudaOptions {
            max_blocks: args.max_blocks.unwrap_or(CudaOptions::default().max_blocks),
            ranks_per_device: world,
            ..CudaOptions::default()
        }
    }

    /// The all-reduce's configuration: `slots` RankData slots at least (every captured call
    /// takes its own, plus slot 0).
    fn config(args: &GpuArgs, max_bytes: usize, slots: usize) -> Config {
        let config = Config {
            max_bytes,
            timeout: Duration::from_secs(args.kernel_timeout_s),
            ..Config::default()
        };
        Config {
            slots: config.slots.max(slots),
            ..config
        }
    }

    /// One captured graph of a case, as [`verify_and_time`] runs it.
    struct Replayed<'a> {
        /// The variant's name (the row's, and in a verification failure).
        name: &'a str,
        /// Which of the all-reduces replays it.
        ar: usize,
        graph: &'a DeviceGraph,
        /// Where it writes the sum.
        output: &'a CudaBuffer,
        /// Writes this rank's input for a salt.
        fill: Box<dyn FnMut(u64) -> Result<(), BenchError> + 'a>,
    }

    /// The `fill` of a graph that reads `buffer`: this rank's input of `count` `dtype`s.
    fn write_input<'a, M: PeerMemory>(
        memory: &'a M,
        buffer: &'a CudaBuffer,
        (dtype, rank, count): (DType, usize, usize),
    ) -> Box<dyn FnMut(u64) -> Result<(), BenchError> + 'a> {
        Box::new(move |salt| Ok(memory.write(buffer, 0, &input_bytes(dtype, rank, count, salt))?))
    }

    /// How the graphs of a case are checked and timed.
    #[derive(Debug, Clone, Copy)]
    struct Plan<'a> {
        dtype: DType,
        count: usize,
        salt: u64,
        /// Said in a verification failure after the variant's name.
        phase: &'a str,
        /// All-reduces per graph.
        k: usize,
        iters: usize,
        warmup: usize,
        /// Timing rounds, each running every graph `iters` times, rotating which runs first.
        rounds: usize,
    }

    /// Collective: every graph of `runs` verified once (this rank's input written for its
    /// salt, the output poisoned, one replay, the output compared bit for bit with the exact
    /// sum on every rank, agreed across ranks), then timed in `plan.rounds` rounds
    /// ([`time_replays`]). Per graph, every replay's slowest-rank time per all-reduce.
    fn verify_and_time<C: Communicator, M: DevicePeerMemory>(
        comm: &C,
        memory: &M,
        ars: &mut [&mut CudaAllReduce<M>],
        runs: &mut [Replayed<'_>],
        plan: Plan<'_>,
    ) -> Result<Vec<Vec<u64>>, BenchError> {
        let Plan { dtype, count, .. } = plan;
        for (v, run) in runs.iter_mut().enumerate() {
            let salt = plan.salt ^ ((v as u64) << 56);
            (run.fill)(salt)?;
            memory.write(run.output, 0, &poison_bytes(dtype, count))?;
            comm.barrier()?;
            ars[run.ar].replay_graph(run.graph)?;
            ars[run.ar].synchronize()?;
            let mut raw = vec![0u8; count * dtype.size()];
            memory.read(run.output, 0, &mut raw)?;
            let problem = check_bytes(dtype, &raw, &expected(comm.size(), count, salt));
            agree(comm, problem, || {
                format!("cuda {} {} of {} B", run.name, plan.phase, raw.len())
            })?;
        }
        let mut samples = vec![Vec::new(); runs.len()];
        for round in 0..plan.rounds {
            for v in Order::Rotate.of(runs.len(), round) {
                let ar = &mut *ars[runs[v].ar];
                let graph = runs[v].graph;
                samples[v].extend(time_replays(comm, ar, graph, plan)?);
            }
        }
        Ok(samples)
    }

    /// Collective: `warmup` replays of `graph`, then `iters` timed replays on every rank at
    /// once, between CUDA events on the all-reduce's stream; per replay, the slowest rank's
    /// time divided by `k` (the all-reduces in the graph), nanoseconds. Returns with the
    /// stream drained.
    fn time_replays<C: Communicator, M: DevicePeerMemory>(
        comm: &C,
        ar: &mut CudaAllReduce<M>,
        graph: &DeviceGraph,
        plan: Plan<'_>,
    ) -> Result<Vec<u64>, BenchError> {
        for _ in 0..plan.warmup {
            ar.replay_graph(graph)?;
        }
        ar.synchronize()?;
        let stream = ar.backend().stream().clone();
        // Events of the stream's own context handle (cudarc records only on those).
        let timer = Timer::new(stream.context(), plan.iters)?;
        comm.barrier()?;
        timer.record(&stream, || Ok(ar.replay_graph(graph)?))?;
        ar.synchronize()?;
        let local = timer.per_launch_ns(plan.k)?;
        slowest(comm, &local)
    }

    /// Collective teardown with every stream drained (frees and module unloads may wait for
    /// the whole device): the graphs go first, then the all-reduces close, then the buffers
    /// and the all-reduces go.
    fn teardown<C: Communicator, M: DevicePeerMemory, G, B>(
        comm: &C,
        mut ars: Vec<CudaAllReduce<M>>,
        graphs: G,
        buffers: B,
    ) -> Result<(), BenchError> {
        for ar in &mut ars {
            ar.synchronize()?;
        }
        comm.barrier()?;
        drop(graphs);
        for ar in &mut ars {
            ar.close()?;
        }
        comm.barrier()?;
        drop(buffers);
        drop(ars);
        comm.barrier()?;
        Ok(())
    }

    /// Every algorithm at one world size, on this rank: rank 0's rows (printed as soon as
    /// measured, so that a run cut short keeps what it measured), empty on the others.
    fn run_world<C: Communicator, M: DevicePeerMemory>(
        comm: &C,
        args: &GpuArgs,
        memory: M,
    ) -> Result<Vec<Row>, BenchError> {
        let (rank, world) = (comm.rank(), comm.size());
        let sizes = args.sizes();
        let max_bytes = args.sweep.max_bytes;
        let k = args.graph_launches as usize;
        let dtypes: Vec<DType> = args
            .dtypes_for(world as u32)
            .into_iter()
            .map(DTypeArg::dtype)
            .collect();
        let kind = memory.name();
        let mut rows = Vec::new();
        for (a, &alg) in args.algorithms.iter().enumerate() {
            let algorithm = algorithm_of(alg);
            let backend = CudaBackend::new(comm, &memory, options(args, world))?;
            let blocks = backend.max_blocks();
            let config = Config {
                algorithm: Some(algorithm),
                ..config(args, max_bytes, 1 + k * dtypes.len() * sizes.len())
            };
            let mut ar = CustomAllReduce::new(backend, memory.clone(), comm, config)?;
            let (input, output) = (memory.allocate(max_bytes)?, memory.allocate(max_bytes)?);
            comm.barrier()?;

            // Capture every graph first, register the captured inputs in one call.
            let mut cases = Vec::new();
            for &dtype in &dtypes {
                for &bytes in &sizes {
                    let count = bytes / dtype.size();
                    if let Err(reason) = ar.backend().supports(world, dtype, bytes, algorithm) {
                        if rank == 0 {
                            eprintln!(
                                "tpcomm-bench gpu: {world} ranks {} {} {}: no kernel ({reason}), \
                                 skipped",
                                dtype.name(),
                                format_bytes(bytes),
                                algorithm.name()
                            );
                        }
                        continue;
                    }
                    let graph = ar.capture_graph(|ar| {
                        for _ in 0..k {
                            ar.all_reduce_buffer(&input, &output, dtype, count)?;
                        }
                        Ok(())
                    })?;
                    cases.push((dtype, bytes, graph));
                }
            }
            ar.register_graph_buffers(comm)?;

            // Every graph verified and timed, before (phase 1) or after (2) the resume.
            let replay_all = |ar: &mut CudaAllReduce<M>, phase: u64, what| {
                let mut samples = Vec::with_capacity(cases.len());
                for (i, (dtype, bytes, graph)) in cases.iter().enumerate() {
                    let (dtype, count) = (*dtype, bytes / dtype.size());
                    let mut runs = [Replayed {
                        name: algorithm.name(),
                        ar: 0,
                        graph,
                        output: &output,
                        fill: write_input(&memory, &input, (dtype, rank, count)),
                    }];
                    let plan = Plan {
                        dtype,
                        count,
                        salt: ((world as u64) << 40)
                            ^ ((a as u64) << 32)
                            ^ (phase << 24)
                            ^ i as u64,
                        phase: what,
                        k,
                        iters: args.iters as usize,
                        warmup: args.warmup as usize,
                        rounds: 1,
                    };
                    let mut timed = verify_and_time(comm, &memory, &mut [ar], &mut runs, plan)?;
                    samples.push(timed.remove(0));
                }
                Ok::<_, BenchError>(samples)
            };
            let before = replay_all(&mut ar, 1, "graph replay")?;
            ar.synchronize()?;
            comm.barrier()?;
            let free_active = free_device_memory()?;
            let started = Instant::now();
            ar.prepare_for_suspend(comm)?;
            let suspend_ns = elapsed_ns(started);
            let released = ar.released_bytes();
            // Every rank's memory went back before the device is asked (one GPU for all).
            comm.barrier()?;
            let freed = free_device_memory()?.saturating_sub(free_active);
            comm.barrier()?;
            let started = Instant::now();
            ar.reinit_after_resume(comm)?;
            let resume_ns = elapsed_ns(started);
            let times = slowest(comm, &[suspend_ns, resume_ns])?;
            let (suspend_ns, resume_ns) = (times[0], times[1]);
            let after = replay_all(&mut ar, 2, "graph replay after resume")?;

            if rank == 0 {
                let first = rows.len();
                for (((dtype, bytes, _), before), after) in cases.iter().zip(before).zip(after) {
                    let table = format!("{world} ranks {} {kind}", dtype.name());
                    let variants = [algorithm.name()];
                    let spec = Spec {
                        bus: Some(Bus::AllReduce),
                        ..Spec::new(&table, bytes.to_string(), *bytes, &variants)
                            .with("ranks", world)
                            .with("type", dtype.name())
                            .with("memory", kind)
                            .with("count", bytes / dtype.size())
                            .with("blocks", blocks)
                            .with("graph_launches", k)
                    };
                    for row in spec.rows(world, args.warmup as usize, vec![before]) {
                        let after_median = Stats::of(&after).map(|s| s.median_us);
                        let ratio =
                            after_median.map(|a| a / row.stats.median_us.max(f64::MIN_POSITIVE));
                        rows.push(
                            row.with("after_median_us", after_median)
                                .with("after_over_before", ratio)
                                .with("suspend_resume_us", (suspend_ns + resume_ns) as f64 / 1e3)
                                .with("suspend_us", suspend_ns as f64 / 1e3)
                                .with("resume_us", resume_ns as f64 / 1e3)
                                .with("released_bytes", released)
                                .with("device_freed_bytes", freed)
                                .with("after_samples_ns", after.clone()),
                        );
                    }
                }
                table::print_rows(&COLUMNS, &rows[first..], &[]);
            }
            teardown(comm, vec![ar], cases, (input, output))?;
        }
        Ok(rows)
    }

    /// The device's name, compute capability and multiprocessors; the driver's versions.
    fn describe_device(ordinal: i32) -> (String, String) {
        let device = CudaContext::new(ordinal as usize)
            .and_then(|ctx| {
                let name = ctx.name()?;
                let (major, minor) = ctx.compute_capability()?;
                let sms = ctx
                    .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
                let mem = ctx.total_mem()?;
                Ok(format!(
                    "{name} (device {ordinal}, sm_{major}{minor}, {sms} SMs, {:.0} GiB)",
                    mem as f64 / (1u64 << 30) as f64
                ))
            })
            .unwrap_or_else(|e| format!("device {ordinal} (not described: {e})"));
        let api = tpcomm::ipc::backend::cuda::result::driver_version()
            .map(|v| format!("CUDA {}.{}", v / 1000, (v % 1000) / 10))
            .unwrap_or_else(|e| format!("unknown ({e})"));
        let kernel = std::fs::read_to_string("/proc/driver/nvidia/version")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_string))
            .and_then(|l| {
                l.split_whitespace()
                    .find(|w| {
                        w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.')
                    })
                    .map(str::to_string)
            });
        let driver = match kernel {
            Some(k) => format!("{api} driver API, kernel module {k}"),
            None => format!("{api} driver API"),
        };
        (device, driver)
    }

    pub(super) fn run(args: &GpuArgs) -> Result<(), BenchError> {
        let started = Instant::now();
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            // Before the driver is initialised and while this process has one thread.
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", DEVICE_MAX_CONNECTIONS);
        }
        launch::warn_if_under_mpirun();
        let info = RunInfo::local("local (ranks as threads of this process, all on one GPU)");
        // Probe the device first: a machine without one fails here with a typed error.
        drop(CudaMemory::new(args.device)?);
        let (device, driver) = describe_device(args.device);
        let sizes = args.sizes();
        let k = args.graph_launches;
        let worlds: Vec<String> = args.worlds.iter().map(u32::to_string).collect();
        let lines = [
            format!("world sizes {}", worlds.join(", ")),
            format!("GPU: {device}; {driver}"),
            format!(
                "env: CUDA_DEVICE_MAX_CONNECTIONS={}, CUDA_MODULE_LOADING={}",
                std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_default(),
                std::env::var("CUDA_MODULE_LOADING").unwrap_or_else(|_| "(unset)".into())
            ),
            format!(
                "sizes {}; K = {k} all-reduces per graph; {} timed replays after {} warm-up, \
                 before and after the resume",
                sizes
                    .iter()
                    .map(|&b| format_bytes(b))
                    .collect::<Vec<_>>()
                    .join(", "),
                args.iters,
                args.warmup
            ),
            "each row: CustomAllReduce<CudaBackend<memory>> forced to one algorithm; every rank captures \
             a CUDA graph of K all-reduces (one input buffer -> one output buffer, \
             capture_graph), registers it (register_graph_buffers) and replays it concurrently \
             with its peers"
                .into(),
            "time: per all-reduce, median over replays of the slowest rank's replay time (CUDA \
             events on its backend stream) / K; blk: blocks per launch (SMs / ranks, bounded)"
                .into(),
            "after: the same graphs after prepare_for_suspend + reinit_after_resume (s+r: its \
             time, slowest rank; freed: device memory the suspend gave back, all ranks); \
             same-process aliases do not move, so this proves the tables and flags survive, \
             not that a remap works"
                .into(),
            "mem: the peer memory of the buffers, legacy CUDA IPC or virtual memory (vmm: the \
             suspend releases the Signal, staging and temp buffers; the resume maps fresh \
             memory at the same addresses)"
                .into(),
            "busbw = algbw * 2(n-1)/n as in nccl-tests, but every rank shares one GPU's memory: \
             not a link bandwidth"
                .into(),
            "every graph verified before timing, before and after the resume (small-integer \
             inputs, output poisoned, compared bit for bit on every rank)"
                .into(),
        ];
        let json = args.json.as_deref();
        let ranks = args.worlds.iter().copied().max().unwrap_or(0) as usize;
        let mut s = Session::start(&info, "gpu", 0, ranks, json, &lines)?;
        s.note("");
        s.header(
            "custom all-reduce (CUDA graphs, ranks as threads on one GPU)",
            &COLUMNS,
        );
        let mut rows: Vec<Row> = Vec::new();
        for &memory in &args.memory {
            if memory == MemoryArg::Vmm {
                if let Err(IpcError::Unsupported { what, .. }) = CudaVmmMemory::new(args.device) {
                    s.note(&format!("vmm: skipped (the GPU does not support {what})"));
                    continue;
                }
            }
            for &world in &args.worlds {
                let results = LocalGroup::new(world as usize).run(|comm| match memory {
                    MemoryArg::Legacy => {
                        run_world(&comm, args, CudaMemory::same_process(args.device)?)
                    }
                    MemoryArg::Vmm => {
                        run_world(&comm, args, CudaVmmMemory::same_process(args.device)?)
                    }
                });
                rows.extend(launch::first_rank_output(results)?);
            }
        }
        let settings = |nccl_library: Option<String>, complete: bool| Settings {
            args,
            sizes: sizes.clone(),
            device: device.clone(),
            driver: driver.clone(),
            nccl_library,
            complete,
            cuda_device_max_connections: std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok(),
            cuda_module_loading: std::env::var("CUDA_MODULE_LOADING").ok(),
            elapsed_s: started.elapsed().as_secs_f64(),
        };
        // Written now and again after NCCL: an NCCL failure or hang cannot cost these rows.
        s.keep(rows.clone());
        s.write_json("gpu", json, &settings(None, false), &[])?;

        // The engine path; a failure is reported at the end, after NCCL and the report.
        s.note("");
        let (engine_rows, engine_failure) = match engine::run(&mut s, args) {
            Ok(found) => (found, None),
            Err(e) => {
                let text = crate::engine::error::chain(&e);
                s.note(&format!("engine path: FAILED: {text}"));
                eprintln!("tpcomm-bench gpu: engine path failed: {text}");
                (Vec::new(), Some(e))
            }
        };
        s.keep(engine_rows.clone());
        s.write_json("gpu", json, &settings(None, false), &[])?;

        s.note("");
        let (nccl_rows, nccl_library): (Vec<Row>, _) = if args.no_nccl {
            s.note("nccl: skipped (--no-nccl)");
            (Vec::new(), None)
        } else {
            #[cfg(not(feature = "nccl"))]
            let reference = {
                s.note("nccl: reference skipped (built without the `nccl` feature)");
                Ok::<_, BenchError>((Vec::new(), None))
            };
            #[cfg(feature = "nccl")]
            let reference = {
                let dtypes = distinct(rows.iter().filter_map(|r| {
                    [DType::F32, DType::F16, DType::Bf16]
                        .into_iter()
                        .find(|d| d.name() == r.text("type"))
                }));
                nccl::reference(&s, args, &dtypes, &sizes)
            };
            match reference {
                Ok(found) => found,
                Err(e) => {
                    let e = crate::engine::error::chain(&e);
                    s.note(&format!("nccl: reference FAILED: {e}"));
                    eprintln!("tpcomm-bench gpu: nccl reference failed: {e}");
                    (Vec::new(), None)
                }
            }
        };
        for r in &mut rows {
            let nccl = nccl_rows
                .iter()
                .find(|n| n.text("type") == r.text("type") && n.bytes == r.bytes);
            if let Some(n) = nccl.filter(|n| n.stats.median_us > 0.0) {
                r.peer = Some(n.variant.clone());
                r.vs_peer = Some(r.stats.median_us / n.stats.median_us);
            }
        }
        // Virtual memory against legacy IPC, row for row (same world, type, algorithm, size).
        let legacy: Vec<(String, String, String, usize, f64)> = rows
            .iter()
            .filter(|r| r.text("memory") == MemoryArg::Legacy.name())
            .map(|r| {
                let key = (r.text("ranks"), r.text("type"), r.variant.clone(), r.bytes);
                (key.0, key.1, key.2, key.3, r.stats.median_us)
            })
            .collect();
        for r in rows
            .iter_mut()
            .filter(|r| r.text("memory") == MemoryArg::Vmm.name())
        {
            let peer = legacy.iter().find(|l| {
                (&l.0, &l.1, &l.2, l.3) == (&r.text("ranks"), &r.text("type"), &r.variant, r.bytes)
            });
            if let Some(l) = peer.filter(|l| l.4 > 0.0) {
                let ratio = r.stats.median_us / l.4;
                r.info.insert("vmm_over_legacy".into(), ratio.into());
            }
        }
        summarize(&mut s, &rows);
        s.note(&format!("total {:.1} s", started.elapsed().as_secs_f64()));
        s.keep_only(
            nccl_rows
                .into_iter()
                .chain(rows)
                .chain(engine_rows)
                .collect(),
        );
        let stated = "the engine path's worlds (--engine-worlds)";
        let targets = engine::targets();
        s.finish(
            "gpu",
            json,
            &settings(nccl_library, true),
            &targets,
            (true, stated),
        )?;
        engine_failure.map_or(Ok(()), Err)
    }

    /// Closing lines: per world, type and algorithm, the after/before spread and the
    /// custom / NCCL ratio per size with its geometric mean.
    fn summarize(s: &mut Session<'_>, rows: &[Row]) {
        s.note("");
        for (table, algorithm) in distinct(rows.iter().map(|r| (&r.table, &r.variant))) {
            let group = rows
                .iter()
                .filter(|r| &r.table == table && &r.variant == algorithm);
            let spread: Vec<f64> = group
                .clone()
                .filter_map(|r| r.number("after_over_before"))
                .collect();
            let worst = spread.iter().copied().fold(0.0f64, f64::max);
            let best = spread.iter().copied().fold(f64::INFINITY, f64::min);
            s.summary(format!(
                "{table} {algorithm}: after/before resume {best:.3}..{worst:.3}"
            ));
            if let (per, Some(g)) = per_size(group.clone(), |r| r.vs_peer, 2) {
                s.summary(format!(
                    "{table} {algorithm}: time / nccl(1 rank) per size: {per}; geomean {g:.2}x"
                ));
            }
            if let (per, Some(g)) = per_size(group.clone(), |r| r.number("vmm_over_legacy"), 2) {
                s.summary(format!(
                    "{table} {algorithm}: vmm / legacy per size: {per}; geomean {g:.2}x (the \
                     kernels read the same tables: expected 1.00x)"
                ));
            }
            if let Some(r) = group.clone().next() {
                let us = |k: &str| {
                    r.number(k)
                        .map_or_else(|| "-".into(), |x| format!("{x:.0}"))
                };
                let mib = |k: &str| {
                    r.number(k).map_or_else(
                        || "-".into(),
                        |x| format!("{:.1}", x / f64::from(1u32 << 20)),
                    )
                };
                s.summary(format!(
                    "{table} {algorithm}: suspend {} us, resume {} us; released {} MiB per \
                     rank, device memory freed {} MiB",
                    us("suspend_us"),
                    us("resume_us"),
                    mib("released_bytes"),
                    mib("device_freed_bytes")
                ));
            }
        }
    }

    /// The engine-path rows: what an engine pays for handing tpcomm its own stream and
    /// tensors, against today's private-stream rows.
    ///
    /// Per world size and size, every rank captures three graphs of `K` all-reduces of one
    /// input into one output (the same kernel and algorithm in all three, chosen by size):
    /// - `private`: today's path: the backend's own stream ([`CudaBackend::new`]),
    ///   [`CudaBuffer`]s, [`CustomAllReduce::capture_graph`];
    /// - `caller`: the engine's path: the engine's stream ([`CudaBackend::with_stream`]),
    ///   cudarc views of exportable memory ([`CudaBuffer::view`]) through
    ///   [`CustomAllReduce::all_reduce_device`], the engine's own `cuStreamBeginCapture`
    ///   adopted with [`CustomAllReduce::adopt_graph`]: zero-copy, like `private`;
    /// - `caller+stage`: the same with the input in cudarc's pool memory (`CudaSlice`),
    ///   which legacy IPC cannot export: the staging copy is captured into the graph.
    ///
    /// Each graph is verified once (exact sums on every rank), then the three are timed in
    /// rounds, rotating which runs first, `iters` replays each per round (each variant on its
    /// own stream, drained before the next starts). `caller` is compared with `private` (the
    /// target: within 2%), `caller+stage` with `caller` (the staging copy's cost).
    mod engine {
        use std::sync::Arc;

        use cudarc::driver::{
            sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
        };
        use tpcomm::allreduce::{
            Algorithm, CudaBackend, CustomAllReduce, DType, DeviceGraph, Element,
        };
        use tpcomm::ipc::{BufferView, CudaMemory, PeerMemory};
        use tpcomm::Communicator;

        use super::{
            config, cuda_error, options, teardown, verify_and_time, write_input, CudaAllReduce,
            Plan, Replayed,
        };
        use crate::commands::gpu::GpuArgs;
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
            Column::new("ranks", "", 5, |r, _| r.text("ranks")),
            Column::new("type", "", 5, |r, _| r.text("type")),
            col::size(9),
            col::variant("path", 12),
            Column::new("alg", "", 6, |r, _| r.text("algorithm")),
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
            let algorithm = algorithm
                .ok_or_else(|| BenchError::Usage("--graph-launches must be at least 1".into()))?;
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
            let ctx = CudaContext::new(args.device as usize)
                .map_err(cuda_error("cuDevicePrimaryCtxRetain"))?;
            // SAFETY: every slice of this context handle (the pool input) is used on
            // `stream` only, which orders its uses.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?;
            let backend =
                CudaBackend::with_stream(comm, &memory, options(args, world), stream.clone())?;
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
                let (caller_graph, _) =
                    capture_on_stream(&mut engine, &stream, &e_view, &mut out, k)?;
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
            let row = |variant, vs| {
                crate::engine::row::row_vs("engine 2 ranks bf16", "32768", variant, vs)
            };
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
                let unstaged =
                    of(STAGED).any(|r| r.info.get("staging_in_graph") == Some(&false.into()));
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
    }

    #[cfg(feature = "nccl")]
    mod nccl {
        use cudarc::driver::{sys, CudaGraph};
        use tpcomm::allreduce::DType;
        use tpcomm::ipc::{CudaBuffer, CudaMemory, PeerMemory};
        use tpcomm::transport::{
            DeviceCommunicator, DeviceElement, LocalGroup, NcclCommunicator, ReduceOp,
        };
        use tpcomm::TransportError;

        use super::{check_bytes, cuda_error, input_bytes, poison_bytes, Timer};
        use crate::commands::gpu::GpuArgs;
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
                    let enqueued =
                        enqueue_dtype(comm, b, dtype, count, k).map_err(|e| e.to_string());
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> GpuArgs {
        parse!(Gpu, [&["gpu"], extra].concat())
    }

    #[test]
    fn defaults_are_bf16_at_2_4_8_ranks_and_f32_at_2_from_1_kib_to_8_mib() {
        let args = parse(&[]);
        assert_eq!(args.worlds, vec![2, 4, 8]);
        assert_eq!(args.dtypes_for(2), vec![DTypeArg::Bf16, DTypeArg::F32]);
        assert_eq!(args.dtypes_for(4), vec![DTypeArg::Bf16]);
        assert_eq!(
            args.sizes(),
            vec![
                1 << 10,
                4 << 10,
                16 << 10,
                64 << 10,
                256 << 10,
                1 << 20,
                4 << 20,
                8 << 20
            ]
        );
        assert_eq!(
            args.algorithms,
            vec![AlgorithmArg::OneStage, AlgorithmArg::TwoStage]
        );
        assert_eq!(args.memory, vec![MemoryArg::Legacy, MemoryArg::Vmm]);
        assert!(args.validate().is_ok());
        assert!(parse(&["--memory", "vmm"]).validate().is_ok());
    }

    #[test]
    fn bad_options_are_refused() {
        assert!(parse(&["--worlds", "3"]).validate().is_err());
        assert!(parse(&["--min-bytes", "1000"]).validate().is_err());
        assert!(parse(&["--min-bytes", "16MiB"]).validate().is_err());
        let none = parse(&["--f32-worlds", "none", "--dtypes", "f16,bf16,f16"]);
        assert_eq!(none.dtypes_for(2), vec![DTypeArg::F16, DTypeArg::Bf16]);
    }

    #[test]
    fn engine_rows_default_to_2_and_4_ranks_at_decode_and_prefill_sizes() {
        let args = parse(&[]);
        assert_eq!(args.engine_worlds(), vec![2, 4]);
        assert_eq!(args.engine_sizes, vec![32 << 10, 256 << 10, 2 << 20]);
        let none = parse(&["--engine-worlds", "none"]);
        assert!(none.engine_worlds().is_empty());
        assert!(none.validate().is_ok());
        let repeated = parse(&["--engine-worlds", "4,2,4"]);
        assert_eq!(repeated.engine_worlds(), vec![4, 2]);
        assert!(parse(&["--engine-worlds", "3"]).validate().is_err());
        assert!(parse(&["--engine-sizes", "1000"]).validate().is_err());
    }

    #[test]
    fn sizes_end_at_the_maximum_even_off_the_factor() {
        let args = parse(&["--min-bytes", "1KiB", "--max-bytes", "1KiB"]);
        assert_eq!(args.sizes(), vec![1 << 10]);
        let args = parse(&["--min-bytes", "16", "--max-bytes", "48", "--factor", "2"]);
        assert_eq!(args.sizes(), vec![16, 32, 48]);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_cuda_the_subcommand_says_how_to_build_it() {
        let err = run(&parse(&[])).unwrap_err().to_string();
        assert!(err.contains("without `cuda`"), "{err}");
    }
}
