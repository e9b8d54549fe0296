//! How `gpu` checks and times captured graphs: each rank's input written and the output
//! poisoned, one replay checked bit for bit against the exact sum on every rank, then timed
//! replays between CUDA events on each rank's stream, rounds rotating the order; and the
//! teardown, every stream drained first.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};
use tpcomm::allreduce::{
    Config, CudaBackend, CudaOptions, CustomAllReduce, DType, DeviceGraph, Element,
};
use tpcomm::ipc::{CudaBuffer, CudaMemory, DevicePeerMemory, PeerMemory};
use tpcomm::Communicator;

use super::GpuArgs;
use crate::data::elements::{check, expected, input, with_element};
use crate::engine::error::BenchError;
use crate::engine::timing::{slowest, Order};
use crate::engine::verify::agree;

pub(super) type CudaAllReduce<M = CudaMemory> = CustomAllReduce<CudaBackend<M>>;

pub(super) fn cuda_error(call: &'static str) -> impl FnOnce(DriverError) -> BenchError {
    move |e| BenchError::Cuda {
        call,
        detail: e.to_string(),
    }
}

/// Free device memory now (`cuMemGetInfo`).
pub(super) fn free_device_memory() -> Result<usize, BenchError> {
    cudarc::driver::result::mem_get_info()
        .map(|(free, _)| free)
        .map_err(cuda_error("cuMemGetInfo_v2"))
}

/// Timing events around each of `n` launches on one stream.
pub(super) struct Timer {
    events: Vec<CudaEvent>,
}

impl Timer {
    pub(super) fn new(ctx: &Arc<CudaContext>, launches: usize) -> Result<Self, BenchError> {
        let events = (0..=launches)
            .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(cuda_error("cuEventCreate"))?;
        Ok(Self { events })
    }

    /// Records an event before the first launch and after each of `launch`'s calls (as
    /// many as there are events after the first).
    pub(super) fn record(
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
    pub(super) fn per_launch_ns(&self, per: usize) -> Result<Vec<u64>, BenchError> {
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
pub(super) fn input_bytes(dtype: DType, rank: usize, count: usize, salt: u64) -> Vec<u8> {
    with_element!(dtype, T => bytemuck::cast_slice(&input::<T>(rank, count, salt)).to_vec())
}

/// `count` NaNs of `dtype`.
pub(super) fn poison_bytes(dtype: DType, count: usize) -> Vec<u8> {
    with_element!(dtype, T => {
        bytemuck::cast_slice(&vec![T::from_f32(f32::NAN); count]).to_vec()
    })
}

/// What is wrong with `raw` (elements of `dtype`) against `want`, if anything.
pub(super) fn check_bytes(dtype: DType, raw: &[u8], want: &[f32]) -> Option<String> {
    with_element!(dtype, T => {
        let mut got =
            vec![<T as bytemuck::Zeroable>::zeroed(); raw.len() / std::mem::size_of::<T>()];
        bytemuck::cast_slice_mut::<T, u8>(&mut got).copy_from_slice(raw);
        check(&got, want)
    })
}

/// The launch options of `world` ranks sharing the device.
pub(super) fn options(args: &GpuArgs, world: usize) -> CudaOptions {
    CudaOptions {
        max_blocks: args.max_blocks.unwrap_or(CudaOptions::default().max_blocks),
        ranks_per_device: world,
        ..CudaOptions::default()
    }
}

/// The all-reduce's configuration: `slots` RankData slots at least (every captured call
/// takes its own, plus slot 0).
pub(super) fn config(args: &GpuArgs, max_bytes: usize, slots: usize) -> Config {
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
pub(super) struct Replayed<'a> {
    /// The variant's name (the row's, and in a verification failure).
    pub(super) name: &'a str,
    /// Which of the all-reduces replays it.
    pub(super) ar: usize,
    pub(super) graph: &'a DeviceGraph,
    /// Where it writes the sum.
    pub(super) output: &'a CudaBuffer,
    /// Writes this rank's input for a salt.
    pub(super) fill: Box<dyn FnMut(u64) -> Result<(), BenchError> + 'a>,
}

/// The `fill` of a graph that reads `buffer`: this rank's input of `count` `dtype`s.
pub(super) fn write_input<'a, M: PeerMemory>(
    memory: &'a M,
    buffer: &'a CudaBuffer,
    (dtype, rank, count): (DType, usize, usize),
) -> Box<dyn FnMut(u64) -> Result<(), BenchError> + 'a> {
    Box::new(move |salt| Ok(memory.write(buffer, 0, &input_bytes(dtype, rank, count, salt))?))
}

/// How the graphs of a case are checked and timed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan<'a> {
    pub(super) dtype: DType,
    pub(super) count: usize,
    pub(super) salt: u64,
    /// Said in a verification failure after the variant's name.
    pub(super) phase: &'a str,
    /// All-reduces per graph.
    pub(super) k: usize,
    pub(super) iters: usize,
    pub(super) warmup: usize,
    /// Timing rounds, each running every graph `iters` times, rotating which runs first.
    pub(super) rounds: usize,
}

/// Collective: every graph of `runs` verified once (this rank's input written for its
/// salt, the output poisoned, one replay, the output compared bit for bit with the exact
/// sum on every rank, agreed across ranks), then timed in `plan.rounds` rounds
/// ([`time_replays`]). Per graph, every replay's slowest-rank time per all-reduce.
pub(super) fn verify_and_time<C: Communicator, M: DevicePeerMemory>(
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
pub(super) fn time_replays<C: Communicator, M: DevicePeerMemory>(
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
pub(super) fn teardown<C: Communicator, M: DevicePeerMemory, G, B>(
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
