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
//! captured into the graph (`caller+stage`, its cost against `caller`); see `engine_path`.
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

#[cfg(feature = "cuda")]
mod custom;
#[cfg(feature = "cuda")]
mod engine_path;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "cuda")]
mod replay;
#[cfg(feature = "cuda")]
mod run;

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
    run::run(args)
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
