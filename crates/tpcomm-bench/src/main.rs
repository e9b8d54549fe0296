//! `tpcomm-bench`: nccl-tests-style tables for tpcomm's collectives.
//!
//! One subcommand per layer of tpcomm; each prints one table per operation (size, count,
//! time, algorithm bandwidth, bus bandwidth), compares each tpcomm path with a peer measured
//! in the same run, and can write every figure as JSON (`--json`); `compare` diffs two
//! reports and `plot` draws them.
//!
//! ```text
//! tpcomm-bench transport                      # 2 ranks as threads of this process
//! tpcomm-bench transport --ranks 4 --json t.json
//! mpirun -np 2 tpcomm-bench transport --transport mpi   # MPI ranks, plus the plain MPI call
//! tpcomm-bench objects                        # object all-gather vs the hand-written floor
//! tpcomm-bench ipc                            # exchange / close_all / reopen_all of N mappings
//! mpirun -np 2 tpcomm-bench allreduce --transport mpi --json ar.json   # plus MPI_Allreduce
//! tpcomm-bench lifecycle                      # suspend + resume with 1, 100, 1000 graph buffers
//! tpcomm-bench gpu                            # CUDA backend on one GPU (features cuda, nccl)
//! tpcomm-bench checkpoint                     # process checkpoint, each step timed (feature cuda)
//! tpcomm-bench compare old.json new.json      # ratio per row, regressions flagged
//! tpcomm-bench plot t.json ar.json -o charts  # SVG charts of time and bandwidth
//! mpirun -np 2 tpcomm-bench peer-check --transport mpi   # the MPI peer against a C loop
//! ```
//!
//! Every subcommand runs through one harness ([`harness`], [`launch::Session`]): cases
//! declared as data, one interleaved timing loop, verification agreed across ranks, one
//! table printer, one JSON writer ([`report`]). Benchmarks are programs that print tables,
//! never timed assertions inside tests: the figures depend on the machine.
//!
//! Logging goes to stderr through `tracing`, off unless `RUST_LOG` asks for it.

/// `tpcomm-bench ARGV...` parsed into the options of subcommand `$variant` (tests).
#[cfg(test)]
macro_rules! parse {
    ($variant:ident, $argv:expr) => {{
        let given = $argv;
        let argv = std::iter::once("tpcomm-bench").chain(given.iter().copied());
        match <crate::Cli as clap::Parser>::try_parse_from(argv)
            .unwrap()
            .command
        {
            crate::Command::$variant(args) => args,
            other => panic!("not {}: {other:?}", stringify!($variant)),
        }
    }};
}

mod allreduce;
mod charts;
mod checkpoint;
mod compare;
mod error;
mod gpu;
mod harness;
mod ipc;
mod launch;
mod lifecycle;
mod mpi_peer;
mod objects;
mod peer_check;
mod report;
mod sweep;
mod table;
mod transport;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::BenchError;

/// nccl-tests-style benchmarks of tpcomm's collectives.
#[derive(Debug, Parser)]
#[command(name = "tpcomm-bench", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One subcommand per tpcomm layer, and two that read reports.
#[derive(Debug, Subcommand)]
enum Command {
    /// Transport collectives (all-gather, gathers, broadcast, all-to-all) over host bytes.
    ///
    /// Ranks are threads of one process by default; under `mpirun` with `--transport mpi`
    /// they are MPI ranks, and every operation is also timed as the plain MPI call.
    Transport(transport::TransportArgs),
    /// Object all-gather (tpcomm-objects) of blobs and records: tpcomm owned, tpcomm
    /// borrowed, and the hand-written floor (postcard + lengths + one varcount).
    ///
    /// Local threads by default; `--transport mpi` under `mpirun`.
    Objects(objects::ObjectsArgs),
    /// Peer memory (tpcomm-ipc, host backend): exchange and open N mappings, close_all,
    /// reopen_all.
    ///
    /// Local threads by default; `--transport mpi` under `mpirun`.
    Ipc(ipc::IpcArgs),
    /// Custom all-reduce (tpcomm-allreduce, host backend): one-stage, two-stage, the
    /// dispatcher's choice and a replayed captured plan, 1 KiB to 8 MiB.
    ///
    /// Local threads by default (at most 8); `--transport mpi` under `mpirun`, where
    /// MPI_Allreduce of the same data is timed too.
    #[command(name = "allreduce")]
    AllReduce(allreduce::AllReduceArgs),
    /// Custom all-reduce lifecycle: prepare_for_suspend + reinit_after_resume with 1, 100,
    /// 1000 graph buffers registered, and all-reduce latency before vs after a resume.
    ///
    /// Local threads by default (at most 8); `--transport mpi` under `mpirun`.
    Lifecycle(lifecycle::LifecycleArgs),
    /// Custom all-reduce, CUDA backend, on one GPU (ranks as threads): CUDA graphs of K
    /// all-reduces replayed per world size (2, 4, 8), algorithm, type and size, before and
    /// after a suspend/resume, every graph verified; NCCL on one rank as the reference.
    ///
    /// Needs the `cuda` feature (and `nccl` for the reference row) and a GPU.
    Gpu(gpu::GpuArgs),
    /// Process checkpoint through the CUDA driver (ranks as threads on one GPU): prepare,
    /// lock, checkpoint, restore, unlock, reinit and the first graph replay timed, with the
    /// GPU memory the checkpoint released.
    ///
    /// Needs the `cuda` feature, a GPU and a 570+ driver.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Compares two JSON reports row by row: new median / old median, regressions flagged.
    ///
    /// Exits with status 1 when a row is slower than the threshold allows.
    Compare(compare::CompareArgs),
    /// Checks the MPI peer of `transport` and `allreduce` (rsmpi in the run) against a C
    /// loop of the same MPI calls (built with `mpicc`), iterations interleaved.
    ///
    /// Run it under `mpirun -np 2` with `--transport mpi`. Needs the `mpi` feature.
    PeerCheck(peer_check::PeerCheckArgs),
    /// Draws SVG charts of JSON reports: time and bus bandwidth against size, log axes, one
    /// line per variant and per peer.
    Plot(charts::PlotArgs),
}

fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let result: Result<(), BenchError> = match cli.command {
        Command::Transport(args) => launch::run(&args),
        Command::Objects(args) => objects::run(&args),
        Command::Ipc(args) => launch::run(&args),
        Command::AllReduce(args) => launch::run(&args),
        Command::Lifecycle(args) => launch::run(&args),
        Command::Gpu(args) => gpu::run(&args),
        Command::Checkpoint(args) => checkpoint::run(&args),
        Command::Compare(args) => compare::run(&args),
        Command::PeerCheck(args) => peer_check::run(&args),
        Command::Plot(args) => charts::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tpcomm-bench: error: {}", error::chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (off when unset or invalid).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser, ValueEnum};

    use super::Cli;
    use crate::launch::Transport;
    use crate::transport::TransportOp;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_texts_name_no_internal_issue() {
        let mut cli = Cli::command();
        let mut texts = vec![cli.render_long_help().to_string()];
        for sub in cli.get_subcommands_mut() {
            texts.push(sub.render_long_help().to_string());
        }
        for text in texts {
            assert!(!text.to_lowercase().contains("issue"), "{text}");
        }
    }

    #[test]
    fn transport_defaults_measure_every_op_from_8_bytes_to_64_mib_locally() {
        let args = parse!(Transport, ["transport"]);
        assert_eq!(args.ops, TransportOp::value_variants());
        assert_eq!(
            (args.run.transport, args.run.ranks),
            (Transport::Local, None)
        );
        let sweep = &args.sweep;
        assert_eq!(
            (sweep.min_bytes, sweep.max_bytes, sweep.factor),
            (8, 64 << 20, 2)
        );
        assert_eq!((args.run.iter.iters, args.run.iter.warmup), (None, None));
    }

    #[test]
    fn transport_options_parse() {
        let args = parse!(
            Transport,
            [
                "transport",
                "--ranks",
                "4",
                "--ops",
                "broadcast,all_gather",
                "--max-bytes",
                "1KiB"
            ]
        );
        assert_eq!(args.run.ranks, Some(4));
        assert_eq!(
            args.ops,
            vec![TransportOp::Broadcast, TransportOp::AllGather]
        );
        assert_eq!(args.sweep.max_bytes, 1024);
    }

    #[test]
    fn options_out_of_range_are_refused_by_the_parser() {
        for argv in [
            &["transport", "--ops", "reduce"][..],
            &["transport", "--ranks", "0"],
            &["transport", "--factor", "1"],
            &["allreduce", "--dtypes", "f64"],
            &["gpu", "--worlds", "9"],
            &["gpu", "--f32-worlds", "1"],
        ] {
            let argv = std::iter::once("tpcomm-bench").chain(argv.iter().copied());
            assert!(Cli::try_parse_from(argv).is_err());
        }
    }
}
