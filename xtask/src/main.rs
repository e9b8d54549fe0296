//! `cargo xtask`: the project's automation, one module per task.
//!
//! - `cargo xtask setup`: installs the system packages the tests need (MPI, libclang).
//! - `cargo xtask test`: the full test suite (the README's test command, run by CI).
//! - `cargo xtask faults`: ranks killed at each phase under MPI (also part of `test`).
//! - `cargo xtask multihost`: the suites and host/link faults across hosts made of
//!   namespaces on this machine, Open MPI over TCP between them.
//! - `cargo xtask bench`: every host benchmark as `docs/benchmarks.md` records it (JSON,
//!   tables, charts).
//! - `cargo xtask setup-cuda` / `cargo xtask kernels`: nvcc from the pinned wheels; the
//!   all-reduce fatbin with its ptxas resource report.
//! - `cargo xtask downstream`: programs outside the workspace that use tpcomm's GPU features
//!   next to their own cudarc (configured like candle, cudarc's defaults, an older CUDA)
//!   must build with one cudarc (also part of `test`).
//! - `cargo xtask gpu-check [--bundle DIR]`: the GPU tests and `tpcomm-bench gpu`, built
//!   here into a bundle with a `run.sh` for a machine with a GPU (run at once without
//!   `--bundle`).

mod bench;
mod cuda;
mod cuda_probe;
mod downstream;
mod faults;
mod fuzz;
mod gpu_check;
mod loom;
mod multihost;
mod setup;
mod soak;
mod test;
#[cfg(test)]
mod tidy;
mod util;
mod valgrind;

use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <task> [options]

tasks:
  setup                 install the system packages the tests need (MPI, libclang)
  test [--skip-mpi] [--large]
                        fmt, clippy, unit/property/doc tests, the MPI suite under mpirun;
                        prints a closing `N passed, N failed` line. --skip-mpi is refused
                        when CI=true; --large adds the all-gather past 2 GiB over MPI
                        (2 ranks, about 9 GiB of memory).
  bench [--no-mpi] [--out DIR] [--only SUB,...]
                        run every host subcommand of tpcomm-bench (2 local threads, and 2
                        MPI ranks where it has an MPI form); keep each run's JSON and table
                        as DIR/SUB-{local2,mpi2}-DATE.{json,txt} and charts in DIR/charts
                        (DIR: target/bench; bench/results holds the runs the docs cite)
  soak [--minutes N]    the mixed soak loop (objects, all-reduces, replays, suspend/resume)
                        under mpirun -np 2 for N minutes; fails on a wrong result or a leak
  valgrind              the host backends' test suites under valgrind memcheck
  faults                fault injection under mpirun --enable-recovery: a rank SIGKILLed at
                        each phase of an object collective, an all-reduce and
                        suspend/resume (2, 3, 4 ranks); survivors must name it within the
                        timeout, exit, and leave no process, /dev/shm entry or memfd behind
  multihost [--bench] [--only suites,faults,teardown] [--faults KIND,...]
                        2 to 4 hosts made of namespaces on this machine (network, PID, UTS,
                        mount; veth to one switch; 198.18.0.0/15), Open MPI across them over
                        TCP: the multi-host suites (2 hosts x 2 ranks, 4 x 1), host and link
                        faults (a host killed, a link down, a host frozen) and the teardown
                        after Ctrl-C and SIGKILL; --bench runs tpcomm-bench transport, objects
                        and queue across 2 hosts. Needs root: skipped with the reason
                        elsewhere, failed instead when TPCOMM_REQUIRE_MULTIHOST=1
  fuzz [--seconds N] [TARGET...]
                        build the libFuzzer targets in fuzz/ and run each for N s (10)
  setup-cuda            when no nvcc is found, download the pinned CUDA 13.0 compiler wheels
                        into target/ and unpack them (no GPU needed)
  kernels               build kernels/allreduce.cu into target/kernels/allreduce.fatbin and
                        print the ptxas resource report; fails on spills or local memory
  downstream            build the programs under tests/downstream/ (tpcomm's `gpu` feature next
                        to cudarc configured like candle-core, with cudarc's defaults, with
                        CUDA 12.8): each must build and hold one cudarc (no GPU needed)
  gpu-check [--bundle DIR]
                        build the GPU test executables and `tpcomm-bench gpu` (features
                        cuda, nccl; release, debug info stripped) into DIR with a run.sh
                        that runs them all on a GPU machine (no cargo needed there):
                        `bash DIR/run.sh`; without --bundle, build into
                        target/gpu-check/bundle and run it here
  loom [--preemptions N]
                        model-check the host flag barrier and two-stage handoff with loom
                        (2 and 3 ranks, epoch wrap-around) into target/loom
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        return ExitCode::FAILURE;
    };
    let result = match task.as_str() {
        "setup" => setup::run(rest),
        "test" => test::run(rest),
        "bench" => bench::run(rest),
        "soak" => soak::run(rest),
        "valgrind" => valgrind::run(rest),
        "loom" => loom::run(rest),
        "fuzz" => fuzz::run(rest),
        "faults" => faults::run(rest),
        "multihost" => multihost::run(rest),
        "setup-cuda" => cuda::setup_cuda(rest),
        "kernels" => cuda::kernels(rest),
        "downstream" => downstream::run(rest),
        "gpu-check" => gpu_check::run(rest),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown task `{other}`\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
