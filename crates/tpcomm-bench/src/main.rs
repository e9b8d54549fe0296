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
//! tpcomm-bench queue --ranks 4                # broadcast queue: 1 writer, 3 readers
//! tpcomm-bench ipc                            # exchange / close_all / reopen_all of N mappings
//! mpirun -np 2 tpcomm-bench allreduce --transport mpi --json ar.json   # plus MPI_Allreduce
//! tpcomm-bench lifecycle                      # suspend + resume with 1, 100, 1000 graph buffers
//! tpcomm-bench gpu                            # CUDA backend on one GPU (features cuda, nccl)
//! tpcomm-bench checkpoint                     # process checkpoint, each step timed (feature cuda)
//! tpcomm-bench compare old.json new.json      # ratio per row, regressions flagged
//! tpcomm-bench plot t.json ar.json -o charts  # SVG charts of time and bandwidth
//! mpirun -np 2 tpcomm-bench peer-check --transport mpi   # the MPI peer against a C loop
//! mpirun -np 2 tpcomm-bench tune --transport mpi --out table.txt   # this machine's dispatch table
//! ```
//!
//! Every subcommand runs through one engine ([`engine`], [`engine::session::Session`]): cases
//! declared as data, one interleaved timing loop, verification agreed across ranks, one
//! table printer, one JSON writer ([`engine::report`]). Benchmarks are programs that print tables,
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

mod commands;
mod data;
mod engine;
mod peers;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::commands::{
    allreduce, checkpoint, compare, gpu, ipc, lifecycle, objects, peer_check, plot, queue,
    transport, tune,
};
use crate::engine::error::BenchError;

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
    /// Broadcast queue (tpcomm-queue): rank 0 sends one value per iteration to every other
    /// rank, bytes and scheduler steps from 64 B to 8 MiB.
    ///
    /// One table: per payload, the queue (owned and borrowed values) against
    /// `objects::broadcast` over the same transport (the ratio column: how far below a
    /// collective per step the queue is), the memcpy floor (every rank copying the bytes once:
    /// what large messages cannot beat) and, with local ranks, mpi4py's `comm.bcast` of the
    /// same Python object. The summary lines give each payload's ratios to the floor and to
    /// the peers. Local threads by default (1 writer, `--ranks` - 1 readers); `--transport
    /// mpi` under `mpirun` for readers in other processes.
    Queue(queue::QueueArgs),
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
    /// Checks the MPI peer of `transport` and `allreduce` (MPI's C API from Rust) against a C
    /// loop of the same MPI calls (built with `mpicc`), iterations interleaved.
    ///
    /// Run it under `mpirun -np 2` with `--transport mpi`. Needs the `mpi` feature.
    PeerCheck(peer_check::PeerCheckArgs),
    /// Draws SVG charts of JSON reports: time and bus bandwidth against size, log axes, one
    /// line per variant and per peer.
    Plot(plot::PlotArgs),
    /// Measures the custom all-reduce's algorithms (host backend) and the transport's
    /// all-reduce on this machine, per element type and size, and writes the dispatch table
    /// file that picks the fastest (`TPCOMM_DISPATCH_TABLE`, `Config::dispatch`).
    ///
    /// Bit-stable by default (one-stage and two-stage only); `--allow-transport` lets the
    /// table choose the transport's all-reduce. Local threads by default; `--transport mpi`
    /// under `mpirun` (the table's rows are for that many ranks).
    Tune(tune::TuneArgs),
}

fn main() -> ExitCode {
    init_tracing();
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tpcomm-bench: error: {}", engine::error::chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Runs one subcommand.
fn run(command: Command) -> Result<(), BenchError> {
    match command {
        Command::Transport(args) => engine::launch::run(&args),
        Command::Objects(args) => objects::run(&args),
        Command::Queue(args) => queue::run(&args),
        Command::Ipc(args) => engine::launch::run(&args),
        Command::AllReduce(args) => engine::launch::run(&args),
        Command::Lifecycle(args) => engine::launch::run(&args),
        Command::Gpu(args) => gpu::run(&args),
        Command::Checkpoint(args) => checkpoint::run(&args),
        Command::Compare(args) => compare::run(&args),
        Command::PeerCheck(args) => peer_check::run(&args),
        Command::Plot(args) => plot::run(&args),
        Command::Tune(args) => engine::launch::run(&args),
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
    use crate::commands::lifecycle::STEPS;
    use crate::data::collective::TransportOp;
    use crate::engine::launch::Transport;
    use crate::engine::row::Row;

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

    /// Every subcommand that runs without a GPU or mpirun (`allreduce` also with
    /// `--rewrite`), end to end on 3 local ranks (2 iterations after 1 warm-up): the
    /// variants of its first case in order, one of their facts, a summary line, every row
    /// timed and compared with its peer where it has one, and the JSON report read back.
    #[test]
    fn every_local_subcommand_verifies_and_times_on_three_ranks_and_writes_its_report() {
        let dir = std::env::temp_dir().join(format!("tpcomm-bench-{}-runs", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let transitions = [
            STEPS.as_slice(),
            &["suspend+resume", "floor suspend+resume"],
        ]
        .concat();
        let allreduce_rows = [
            "1stage",
            "2stage",
            "auto",
            "replay",
            "memcpy",
            "floor copy+sum",
            "floor sum",
        ];
        let table = dir.join("tuned.txt");
        let table = table.to_str().unwrap();
        // The arguments, the variants of the first case, one of their facts, a summary line.
        type Run<'a> = (&'a [&'a str], &'a [&'a str], (&'a str, &'a str), &'a str);
        let runs: [Run<'_>; 7] = [
            (
                &["transport", "--max-bytes", "64"],
                &["tpcomm"],
                ("type", "uint8"),
                "all_gather: avg busbw",
            ),
            (
                &[
                    "objects",
                    "--payloads",
                    "blob:300,records:10",
                    "--no-mpi4py",
                ],
                &["tpcomm owned", "tpcomm borrowed", "tpcomm into", "floor"],
                ("values_per_rank", "1"),
                "",
            ),
            (
                &["ipc", "--regions", "4", "--buffer-bytes", "100"],
                &[
                    "exchange",
                    "close_all",
                    "reopen_all",
                    "close_all+reopen_all",
                ],
                ("mappings", "8"),
                "",
            ),
            (
                &[
                    "allreduce",
                    "--dtypes",
                    "f32,bf16",
                    "--max-bytes",
                    "256KiB",
                    "--factor",
                    "4",
                ],
                &allreduce_rows,
                ("algorithm", "1stage"),
                "bf16: 2stage/1stage time per size",
            ),
            (
                &["allreduce", "--rewrite", "--max-bytes", "4KiB"],
                &allreduce_rows,
                ("algorithm", "1stage"),
                "",
            ),
            (
                &[
                    "lifecycle",
                    "--graph-buffers",
                    "3",
                    "--latency-bytes",
                    "1KiB",
                ],
                &transitions,
                // Signal, staging, temp and 3 graph buffers of each of 2 peers.
                ("mappings", "12"),
                "first replay after a resume / steady-state replay: N=3 ",
            ),
            (
                &[
                    "tune",
                    "--dtypes",
                    "f32",
                    "--max-bytes",
                    "4KiB",
                    "--out",
                    table,
                ],
                &[
                    "staged 1stage",
                    "staged 2stage",
                    "registered 1stage",
                    "registered 2stage",
                    "transport",
                ],
                ("type", "f32"),
                "dispatch table for 3 ranks written to",
            ),
        ];
        for (argv, variants, (key, value), summary) in runs {
            let json = dir.join(format!("{}.json", argv[0]));
            let common = ["--ranks", "3", "--iters", "2", "--warmup", "1", "--json"];
            let argv = [argv, &common, &[json.to_str().unwrap()]].concat();
            let command = Cli::try_parse_from([&["tpcomm-bench"], argv.as_slice()].concat());
            super::run(command.unwrap().command).unwrap();
            let report = crate::engine::report::read(&json).unwrap();
            let first = &report.rows[0];
            let case: Vec<&Row> = report
                .rows
                .iter()
                .filter(|r| r.table == first.table && r.case == first.case)
                .collect();
            let names: Vec<&str> = case.iter().map(|r| r.variant.as_str()).collect();
            assert_eq!(names, variants, "{argv:?}");
            assert!(case.iter().all(|r| r.iters == 2), "{argv:?}");
            assert_eq!(first.text(key), value, "{argv:?}");
            let summarized = report.summary.iter().any(|l| l.starts_with(summary));
            assert!(summary.is_empty() || summarized, "{argv:?}");
            for r in &report.rows {
                assert!(r.stats.median_us > 0.0, "{r:?}");
                assert_eq!(r.peer.is_some(), r.vs_peer.is_some(), "{r:?}");
            }
        }
        // The tuned table reads back, for 3 ranks.
        let tuned = tpcomm::allreduce::dispatch::DispatchTable::load(table).unwrap();
        assert!(tuned.keys().all(|k| k.ranks == 3), "{tuned}");
        assert_eq!(
            tuned.keys().count(),
            2,
            "staged and registered f32: {tuned}"
        );
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
