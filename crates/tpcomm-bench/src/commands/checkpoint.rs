//! `tpcomm-bench checkpoint`: a process checkpoint through the CUDA driver
//! (`tpcomm_checkpoint::checkpoint_group`), each step timed: prepare (`prepare_for_suspend`),
//! lock, checkpoint, restore, unlock, reinit (`reinit_after_resume`), the first graph replay
//! after it, and the GPU memory the checkpoint released (read in the pause by `nvidia-smi`,
//! another process).
//!
//! Ranks are threads of this process on one GPU (`CudaVmmMemory::same_process` by default,
//! `--memory legacy` for `CudaMemory::same_process`): one process, so one driver rank makes
//! the four driver calls while the others wait in the agreement. On virtual memory the
//! suspend also releases the all-reduce's Signal, staging and temp buffers.
//! Each rank captures one CUDA graph of `--graph-len` all-reduces of `--bytes` (f32) and
//! holds `--ballast-mib` of device memory, so that the checkpoint has something to move.
//! Every repeat replays the graph before and after and checks the outputs are bit-identical.
//!
//! The checkpoint is one call, so the harness does not time it iteration by iteration: each
//! repeat is one sample of every step (the slowest rank's own part), and [`rows`] turns the
//! samples into the harness's rows (one per step, the first replay compared with the replay
//! before), printed and written like every other subcommand's.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use tpcomm_checkpoint::Step;

use crate::engine::error::BenchError;
use crate::engine::launch::{self, RunInfo};
use crate::engine::row::{link_peers, Row};
use crate::engine::session::Session;
use crate::engine::sweep::format_bytes;
use crate::engine::table::{col, Column};
use crate::engine::timing::Spec;

/// Options of `tpcomm-bench checkpoint`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct CheckpointArgs {
    /// Ranks (threads of this process on GPU 0).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=8))]
    pub(crate) ranks: u32,
    /// Bytes of each captured all-reduce (f32; a multiple of 16).
    #[arg(long, default_value_t = 1 << 20)]
    pub(crate) bytes: usize,
    /// All-reduces captured in each rank's graph.
    #[arg(long, default_value_t = 4)]
    pub(crate) graph_len: usize,
    /// Device memory each rank allocates on top (MiB).
    #[arg(long, default_value_t = 512)]
    pub(crate) ballast_mib: usize,
    /// Checkpoints timed.
    #[arg(long, default_value_t = 3)]
    pub(crate) repeat: u32,
    /// Peer memory of the all-reduce and its graph buffers (the ballast is plain
    /// `cuMemAlloc` memory either way).
    #[arg(long, value_enum, default_value = "vmm", value_name = "KIND")]
    pub(crate) memory: crate::engine::options::MemoryArg,
    /// Also write every figure (and every repeat's time) to this JSON file (schema in
    /// docs/benchmarks.md).
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

/// The table of the steps.
const TABLE: &str = "checkpoint";
/// The timed steps, in running order: the replay before the checkpoint, the sequence's
/// steps (`tpcomm_checkpoint::Step::name`), the first replay after it.
pub(crate) const STEPS: [&str; 8] = [
    "replay_before",
    "prepare",
    "lock",
    "checkpoint",
    "restore",
    "unlock",
    "reinit",
    "first_replay",
];

/// The steps of the checkpoint sequence that are timed, [`STEPS`] `1..7`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SEQUENCE: [Step; 6] = [
    Step::Prepare,
    Step::Lock,
    Step::Checkpoint,
    Step::Restore,
    Step::Unlock,
    Step::Reinit,
];

/// What every rank measured: per step of [`STEPS`], one time per repeat (nanoseconds, the
/// slowest rank's own part; `None` where no rank timed the step), and rank 0's GPU memory
/// figures per repeat (MiB).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Measured {
    pub(crate) steps: Vec<Vec<Option<u64>>>,
    pub(crate) memory: Vec<Memory>,
}

/// The GPU memory of one repeat, MiB: what the checkpoint released on the device, and this
/// process's use before and during it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Memory {
    pub(crate) released_mib: f64,
    pub(crate) process_mib_before: f64,
    pub(crate) process_mib_during: f64,
}

const COLUMNS: [Column; 6] = [
    col::variant("step", 14),
    Column::new("repeats", "", 7, |r, _| r.iters.to_string()),
    Column::new("median", "(ms)", 10, |r, _| ms(r.stats.median_us)),
    Column::new("min", "(ms)", 10, |r, _| ms(r.stats.min_us)),
    Column::new("max", "(ms)", 10, |r, _| ms(r.stats.max_us)),
    Column::new("ratio", "vs before", 10, |r, _| col::ratio(r.vs_peer)),
];

fn ms(us: f64) -> String {
    format!("{:.3}", us / 1e3)
}

/// The rows of `measured` over `ranks` ranks: one per step that some rank timed (its
/// repeats as samples), the first replay compared with the replay before the checkpoint,
/// the case being the all-reduce size; the memory figures as facts of the `checkpoint` row.
pub(crate) fn rows(args: &CheckpointArgs, measured: &Measured) -> Vec<Row> {
    let samples = measured
        .steps
        .iter()
        .map(|repeats| repeats.iter().flatten().copied().collect())
        .collect();
    let spec = Spec::new(TABLE, args.bytes.to_string(), args.bytes, &STEPS)
        .with("ranks", args.ranks)
        .with("graph_len", args.graph_len)
        .with("ballast_mib", args.ballast_mib)
        .with("memory", args.memory.name());
    let mut rows = spec.rows(args.ranks as usize, 0, samples);
    link_peers(&mut rows, |r| {
        r.is("first_replay").then(|| "replay_before".into())
    });
    if !measured.memory.is_empty() {
        let per = |f: fn(&Memory) -> f64| measured.memory.iter().map(f).collect::<Vec<_>>();
        if let Some(row) = rows.iter_mut().find(|r| r.is("checkpoint")) {
            row.info.extend([
                ("released_mib".into(), per(|m| m.released_mib).into()),
                (
                    "process_mib_before".into(),
                    per(|m| m.process_mib_before).into(),
                ),
                (
                    "process_mib_during".into(),
                    per(|m| m.process_mib_during).into(),
                ),
            ]);
        }
    }
    rows
}

/// The summary line of the memory figures, one entry per repeat.
fn memory_line(memory: &[Memory]) -> Option<String> {
    let per: Vec<String> = memory
        .iter()
        .map(|m| {
            format!(
                "{:.0} MiB (process {:.0} -> {:.0} MiB)",
                m.released_mib, m.process_mib_before, m.process_mib_during
            )
        })
        .collect();
    (!per.is_empty()).then(|| format!("GPU memory released by the checkpoint: {}", per.join(", ")))
}

pub(crate) fn run(args: &CheckpointArgs) -> Result<(), BenchError> {
    if args.bytes == 0 || !args.bytes.is_multiple_of(16) || args.graph_len == 0 {
        return Err(BenchError::Usage(
            "--bytes must be a positive multiple of 16 and --graph-len positive".into(),
        ));
    }
    if !cfg!(feature = "cuda") {
        return imp::run(args).map(drop);
    }
    launch::warn_if_under_mpirun();
    let info = RunInfo::local("local (ranks as threads of this process, all on one GPU)");
    let json = args.json.as_deref();
    let lines = [
        format!(
            "each rank: a CUDA graph of {} f32 all-reduces of {} on {} peer memory, {} MiB of \
             ballast; {} checkpoints (checkpoint_group), the graph replayed and checked bit for \
             bit before and after each",
            args.graph_len,
            format_bytes(args.bytes),
            args.memory.name(),
            args.ballast_mib,
            args.repeat
        ),
        "time: per step, the slowest rank's own part (the driver calls run on one rank); \
         median, min and max over the repeats; ratio: first replay / replay before"
            .into(),
    ];
    let ranks = args.ranks as usize;
    let mut s = Session::start(&info, "checkpoint", 0, ranks, json, &lines)?;
    let measured = imp::run(args)?;
    s.header("process checkpoint through the CUDA driver", &COLUMNS);
    s.rows(&COLUMNS, rows(args, &measured), |_| true);
    if let Some(line) = memory_line(&measured.memory) {
        s.summary(line);
    } else {
        s.summary("no GPU memory figures (nvidia-smi gave none)".into());
    }
    s.finish("checkpoint", json, args, &[], (true, "any run"))
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::{CheckpointArgs, Measured};
    use crate::engine::error::BenchError;

    pub(super) fn run(_: &CheckpointArgs) -> Result<Measured, BenchError> {
        Err(BenchError::WithoutCuda)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::time::{Duration, Instant};

    use tpcomm::allreduce::{Config, CudaBackend, CudaOptions, CustomAllReduce, DType};
    use tpcomm::ipc::{CudaBuffer, CudaMemory, CudaVmmMemory, DevicePeerMemory, PeerMemory};

    use crate::engine::options::MemoryArg;
    use tpcomm::transport::{LocalCommunicator, LocalGroup};
    use tpcomm::Communicator;
    use tpcomm_checkpoint::{
        checkpoint_group, CheckpointDriver, CheckpointOptions, CudaCheckpoint, GpuMemory,
        Suspendable,
    };

    use super::{CheckpointArgs, Measured, Memory, SEQUENCE, STEPS};
    use crate::engine::error::BenchError;
    use crate::engine::launch;
    use crate::engine::timing::slowest;
    use crate::engine::verify::agree;

    fn failed(call: &'static str) -> impl Fn(String) -> BenchError {
        move |detail| BenchError::Cuda { call, detail }
    }

    fn mib(bytes: u64) -> f64 {
        bytes as f64 / (1u64 << 20) as f64
    }

    fn ns(d: Duration) -> u64 {
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
    }

    /// One rank: the all-reduce, its graph, the ballast; `repeat` checkpoints (collective).
    /// Every rank returns the steps' slowest-rank times; rank 0 adds its memory figures.
    fn rank<M: DevicePeerMemory>(
        comm: LocalCommunicator,
        args: &CheckpointArgs,
        memory: M,
    ) -> Result<Measured, BenchError> {
        let options = CudaOptions {
            ranks_per_device: comm.size(),
            ..CudaOptions::default()
        };
        let backend = CudaBackend::new(&comm, &memory, options)?;
        let config = Config {
            max_bytes: args.bytes.max(Config::default().max_bytes),
            ..Config::default()
        };
        let mut ar = CustomAllReduce::new(backend, memory.clone(), &comm, config)?;
        let count = args.bytes / 4;
        let bufs: Vec<CudaBuffer> = (0..=args.graph_len)
            .map(|_| memory.allocate(args.bytes))
            .collect::<Result<_, _>>()?;
        let _ballast = CudaMemory::same_process(0)?.allocate(args.ballast_mib.max(1) << 20)?;
        let graph = ar.capture_graph(|ar| {
            for w in bufs.windows(2) {
                ar.all_reduce_buffer(&w[0], &w[1], DType::F32, count)?;
            }
            Ok(())
        })?;
        ar.register_graph_buffers(&comm)?;
        let input: Vec<f32> = (0..count)
            .map(|i| ((i * 7 + comm.rank() * 13) % 97) as f32 * 0.25)
            .collect();
        memory.write(&bufs[0], 0, bytemuck::cast_slice(&input))?;
        let last = bufs.last().expect("graph_len >= 1");
        let replay =
            |ar: &mut CustomAllReduce<CudaBackend<M>>| -> Result<(Vec<u8>, Duration), BenchError> {
                for b in &bufs[1..] {
                    memory.write(b, 0, &vec![0xff; args.bytes])?;
                }
                comm.barrier()?;
                let t = Instant::now();
                ar.replay_graph(&graph)?;
                ar.synchronize()?;
                let took = t.elapsed();
                comm.barrier()?;
                let mut out = vec![0u8; args.bytes];
                memory.read(last, 0, &mut out)?;
                Ok((out, took))
            };
        let driver = CudaCheckpoint::load();
        driver
            .support()
            .map_err(|e| failed("cuCheckpointProcess*")(e.to_string()))?;
        // Per step and repeat: this rank's time plus one, 0 where it did not time the step
        // (so that the largest over the ranks is the slowest rank's, or 0 for nobody's).
        let mut local = vec![vec![0u64; args.repeat as usize]; STEPS.len()];
        let mut measured = Measured::default();
        for repeat in 0..args.repeat as usize {
            let (before, replay_before) = replay(&mut ar)?;
            let memory_before = (comm.rank() == 0).then(GpuMemory::probe);
            let mut during = None;
            let report = {
                let objects: &mut [&mut dyn Suspendable<LocalCommunicator>] = &mut [&mut ar];
                checkpoint_group(
                    &comm,
                    &driver,
                    objects,
                    &CheckpointOptions::default(),
                    |p| {
                        if p.rank == 0 {
                            during = Some(GpuMemory::probe());
                        }
                        Ok(())
                    },
                )
            }
            .map_err(|e| failed("checkpoint_group")(crate::engine::error::chain(&e)))?;
            let (after, first_replay) = replay(&mut ar)?;
            let differs = (after != before)
                .then(|| "the output differs from the replay before it".to_string());
            agree(&comm, differs, || {
                "the graph replayed after the checkpoint".into()
            })?;
            let times = std::iter::once(Some(replay_before))
                .chain(SEQUENCE.map(|step| report.timing(step).map(|t| t.local)))
                .chain([Some(first_replay)]);
            for (step, took) in local.iter_mut().zip(times) {
                step[repeat] = took.map_or(0, |d| ns(d).saturating_add(1));
            }
            if let (Some(Ok(b)), Some(Ok(d))) = (&memory_before, &during) {
                let pid = std::process::id();
                measured.memory.push(Memory {
                    released_mib: mib(b.device_used.saturating_sub(d.device_used)),
                    process_mib_before: mib(b.of_process(pid)),
                    process_mib_during: mib(d.of_process(pid)),
                });
            } else if comm.rank() == 0 {
                eprintln!(
                    "tpcomm-bench checkpoint: no GPU memory figures: {memory_before:?} / {during:?}"
                );
            }
        }
        ar.close_with(&comm)?;
        for step in &local {
            let worst = slowest(&comm, step)?;
            measured
                .steps
                .push(worst.iter().map(|&t| t.checked_sub(1)).collect());
        }
        Ok(measured)
    }

    pub(super) fn run(args: &CheckpointArgs) -> Result<Measured, BenchError> {
        let results = LocalGroup::new(args.ranks as usize)
            .timeout(Duration::from_secs(120))
            .run(|comm| match args.memory {
                MemoryArg::Legacy => rank(comm, args, CudaMemory::same_process(0)?),
                MemoryArg::Vmm => rank(comm, args, CudaVmmMemory::same_process(0)?),
            });
        launch::first_rank_output(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timed_steps_are_the_sequences_between_the_two_replays() {
        let names: Vec<&str> = SEQUENCE.iter().map(|s| s.name()).collect();
        assert_eq!(names, STEPS[1..7]);
    }

    #[test]
    fn a_row_per_timed_step_with_the_first_replay_against_the_one_before() {
        let mut steps = vec![vec![Some(2_000_000), Some(4_000_000)]; STEPS.len()];
        steps[2] = vec![None, None]; // `lock`: timed by no rank
        steps[7] = vec![Some(3_000_000), Some(3_000_000)];
        let memory = [measured_memory(), measured_memory()].concat();
        let args = parse!(Checkpoint, ["checkpoint", "--repeat", "2"]);
        let rows = rows(&args, &Measured { steps, memory });
        let names: Vec<&str> = rows.iter().map(|r| r.variant.as_str()).collect();
        assert_eq!(
            names,
            [
                "replay_before",
                "prepare",
                "checkpoint",
                "restore",
                "unlock",
                "reinit",
                "first_replay"
            ]
        );
        assert!(rows.iter().all(|r| r.iters == 2 && r.case == "1048576"));
        assert_eq!(rows[0].stats.median_us, 3000.0, "2 and 4 ms");
        let first = rows.last().unwrap();
        assert_eq!(first.peer.as_deref(), Some("replay_before"));
        assert_eq!(first.vs_peer, Some(1.0));
        assert_eq!(
            rows[2].info["released_mib"],
            serde_json::json!([1024.0, 1024.0])
        );
        assert_eq!(
            memory_line(&measured_memory()).unwrap(),
            "GPU memory released by the checkpoint: 1024 MiB (process 1100 -> 76 MiB)"
        );
        assert!(memory_line(&[]).is_none());
    }

    fn measured_memory() -> Vec<Memory> {
        vec![Memory {
            released_mib: 1024.0,
            process_mib_before: 1100.0,
            process_mib_during: 76.0,
        }]
    }
}
