//! The custom rows of `gpu`: per world size and forced algorithm, every rank captures one
//! CUDA graph per element type and size, registers them, and every graph is checked and
//! timed before and after a suspend/resume (its time and the memory it gave back recorded).

use std::time::Instant;

use tpcomm::allreduce::{Algorithm, Backend, Config, CudaBackend, CustomAllReduce, DType};
use tpcomm::ipc::DevicePeerMemory;
use tpcomm::Communicator;

use super::replay::{
    config, free_device_memory, options, teardown, verify_and_time, write_input, CudaAllReduce,
    Plan, Replayed,
};
use super::{AlgorithmArg, GpuArgs};
use crate::engine::error::BenchError;
use crate::engine::options::DTypeArg;
use crate::engine::row::{Bus, Row, Stats};
use crate::engine::sweep::format_bytes;
use crate::engine::table::{self, col, Column};
use crate::engine::timing::{elapsed_ns, slowest, Spec};

fn algorithm_of(a: AlgorithmArg) -> Algorithm {
    match a {
        AlgorithmArg::OneStage => Algorithm::OneStage,
        AlgorithmArg::TwoStage => Algorithm::TwoStage,
    }
}

/// Two decimals of a number fact.
fn f2(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

pub(super) const COLUMNS: [Column; 14] = [
    Column::fact("ranks", "", 5, "ranks"),
    Column::fact("type", "", 5, "type"),
    Column::fact("mem", "", 6, "memory"),
    col::size(9),
    col::variant("alg", 6),
    Column::fact("blk", "", 4, "blocks"),
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

/// Every algorithm at one world size, on this rank: rank 0's rows (printed as soon as
/// measured, so that a run cut short keeps what it measured), empty on the others.
pub(super) fn run_world<C: Communicator, M: DevicePeerMemory>(
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
                    salt: ((world as u64) << 40) ^ ((a as u64) << 32) ^ (phase << 24) ^ i as u64,
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
