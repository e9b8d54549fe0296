//! `tpcomm-bench checkpoint`: a process checkpoint through the CUDA driver
//! (`tpcomm_checkpoint::checkpoint_group`), each step timed: prepare (`prepare_for_suspend`),
//! lock, checkpoint, restore, unlock, reinit (`reinit_after_resume`), the first graph replay
//! after it, and the GPU memory the checkpoint released (read in the pause by `nvidia-smi`,
//! another process).
//!
//! Ranks are threads of this process on one GPU (`CudaMemory::same_process`): one process,
//! so one driver rank makes the four driver calls while the others wait in the agreement.
//! Each rank captures one CUDA graph of `--graph-len` all-reduces of `--bytes` (f32) and
//! holds `--ballast-mib` of device memory, so that the checkpoint has something to move.
//! Every repeat replays the graph before and after and checks the outputs are bit-identical.
//! One table row and one JSON row per repeat and step.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use crate::error::BenchError;

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
    /// Writes every row as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
struct Row {
    repeat: u32,
    /// `prepare`, `lock`, `checkpoint`, `restore`, `unlock`, `reinit`, `first_replay`,
    /// `replay_before`, `released_mib`, `process_mib_before`, `process_mib_during`.
    what: String,
    /// Milliseconds (slowest rank's local part), or MiB for the memory rows.
    value: f64,
}

pub(crate) fn run(args: &CheckpointArgs) -> Result<(), BenchError> {
    if args.bytes == 0 || !args.bytes.is_multiple_of(16) || args.graph_len == 0 {
        return Err(BenchError::Usage(
            "--bytes must be a positive multiple of 16 and --graph-len positive".into(),
        ));
    }
    let rows = imp::run(args)?;
    println!("{:>6}  {:<18} {:>12}", "repeat", "what", "value");
    for r in &rows {
        let unit = if r.what.ends_with("_mib") {
            "MiB"
        } else {
            "ms"
        };
        println!("{:>6}  {:<18} {:>9.3} {unit}", r.repeat, r.what, r.value);
    }
    if let Some(path) = &args.json {
        #[derive(Serialize)]
        struct Report<'a> {
            args: &'a CheckpointArgs,
            rows: &'a [Row],
        }
        let text = serde_json::to_string_pretty(&Report { args, rows: &rows })
            .map_err(|e| BenchError::Usage(format!("cannot encode the report: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| BenchError::Usage(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::{CheckpointArgs, Row};
    use crate::error::BenchError;

    pub(super) fn run(_: &CheckpointArgs) -> Result<Vec<Row>, BenchError> {
        Err(BenchError::Usage(
            "this tpcomm-bench was built without `cuda`: rebuild with \
             `cargo build --release -p tpcomm-bench --features cuda,nccl`, or run \
             `cargo xtask gpu-check`"
                .into(),
        ))
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::time::{Duration, Instant};

    use tpcomm::allreduce::{Config, CudaBackend, CudaOptions, CustomAllReduce, DType};
    use tpcomm::ipc::{CudaBuffer, CudaMemory, PeerMemory};
    use tpcomm::transport::{LocalCommunicator, LocalGroup};
    use tpcomm::Communicator;
    use tpcomm_checkpoint::{
        checkpoint_group, CheckpointDriver, CheckpointOptions, CudaCheckpoint, GpuMemory, Step,
        Suspendable,
    };

    use super::{CheckpointArgs, Row};
    use crate::error::BenchError;

    fn failed(call: &'static str) -> impl Fn(String) -> BenchError {
        move |detail| BenchError::Cuda { call, detail }
    }

    fn mib(bytes: u64) -> f64 {
        bytes as f64 / (1u64 << 20) as f64
    }

    /// One rank: the all-reduce, its graph, the ballast; `repeat` checkpoints. Returns the
    /// rows this rank measured (every rank's step times, rank 0's memory figures).
    fn rank(comm: LocalCommunicator, args: &CheckpointArgs) -> Result<Vec<Row>, BenchError> {
        let memory = CudaMemory::same_process(0)?;
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
        let _ballast = memory.allocate(args.ballast_mib.max(1) << 20)?;
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
            |ar: &mut CustomAllReduce<CudaBackend>| -> Result<(Vec<u8>, Duration), BenchError> {
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
        let mut rows = Vec::new();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for repeat in 0..args.repeat {
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
            .map_err(|e| failed("checkpoint_group")(crate::error::chain(&e)))?;
            let (after, first_replay) = replay(&mut ar)?;
            if after != before {
                return Err(BenchError::WrongData {
                    what: "the graph replayed after the checkpoint".into(),
                    rank: comm.rank(),
                    detail: "the output differs from the replay before it".into(),
                    bad_ranks: vec![comm.rank()],
                });
            }
            let mut push = |what: &str, value: f64| {
                rows.push(Row {
                    repeat,
                    what: what.into(),
                    value,
                })
            };
            push("replay_before", ms(replay_before));
            for step in [
                Step::Prepare,
                Step::Lock,
                Step::Checkpoint,
                Step::Restore,
                Step::Unlock,
                Step::Reinit,
            ] {
                if let Some(t) = report.timing(step) {
                    push(step.name(), ms(t.local));
                }
            }
            push("first_replay", ms(first_replay));
            if let (Some(Ok(b)), Some(Ok(d))) = (&memory_before, &during) {
                let pid = std::process::id();
                push(
                    "released_mib",
                    mib(b.device_used.saturating_sub(d.device_used)),
                );
                push("process_mib_before", mib(b.of_process(pid)));
                push("process_mib_during", mib(d.of_process(pid)));
            } else if comm.rank() == 0 {
                eprintln!(
                    "tpcomm-bench checkpoint: no GPU memory figures: {memory_before:?} / {during:?}"
                );
            }
        }
        ar.close_with(&comm)?;
        Ok(rows)
    }

    pub(super) fn run(args: &CheckpointArgs) -> Result<Vec<Row>, BenchError> {
        let results = LocalGroup::new(args.ranks as usize)
            .timeout(Duration::from_secs(120))
            .run(|comm| rank(comm, args));
        // Per repeat and step: the slowest rank; memory rows come from rank 0 only.
        let mut merged: Vec<Row> = Vec::new();
        for result in results {
            for row in result?? {
                match merged
                    .iter_mut()
                    .find(|m| m.repeat == row.repeat && m.what == row.what)
                {
                    Some(m) => m.value = m.value.max(row.value),
                    None => merged.push(row),
                }
            }
        }
        Ok(merged)
    }
}
