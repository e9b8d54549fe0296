//! `cargo xtask test`: the full suite, as CI runs it.
//!
//! Steps: set up MPI when missing, set up nvcc when missing and build the CUDA kernels
//! (`cuda.rs`), `cargo fmt --check`, clippy with warnings denied (every
//! feature), `cargo doc` with rustdoc warnings denied (every feature), every unit/property/integration/doc test (every feature),
//! the same formatting check, lints and unit tests for the driver probe (`xtask/cuda-probe`, a
//! workspace of its own: `cuda_probe.rs`), then the MPI
//! conformance programs under `mpirun -np 2` and `-np 4`, and once more with `-np 3` and a
//! timeout on the communicator (the nonblocking, deadline-polled path), `mpi-single-copy-off`
//! under `-np 2` and `-np 4` (Open MPI only), the bench's MPI subcommands on a few small
//! sizes (every path verified, the MPI peer's included), the fault suite
//! (`faults.rs`: ranks SIGKILLed at each phase), and a fuzz smoke pass (`fuzz.rs`, every
//! target for a few seconds), and the downstream builds (`downstream.rs`: tpcomm's GPU
//! features next to cudarc configured as engines configure it). The closing line, `total: N
//! passed, N failed`, covers the cargo tests (the probe's included), the MPI cases, the bench runs, the fault cases,
//! the fuzz targets and the downstream programs together.

use std::process::Command;

use crate::{cuda, cuda_probe, downstream, faults, fuzz, setup, util};

/// Rank counts the MPI suite runs with (4 is oversubscribed on a 2-core machine).
const MPI_RANKS: [usize; 2] = [2, 4];
/// Rank count of the extra conformance run with a timeout on the MPI communicator (every
/// collective then runs nonblocking, polled against the deadline).
const MPI_TIMED_RANKS: usize = 3;
/// The timeout of that run: far above any collective of the suite, so it never fires.
const MPI_TIMED_TIMEOUT_MS: u32 = 120_000;
/// Seconds per target of the fuzz smoke pass.
const FUZZ_SMOKE_SECS: u64 = 10;
/// Upper bound on one mpirun, so a hang fails instead of eating CI's time.
const MPI_TIMEOUT_SECS: u32 = 600;

#[derive(Debug, Default)]
struct Tally {
    passed: u64,
    failed: u64,
    ignored: u64,
    /// Tests that returned early because the machine lacks what they need (a GPU, NCCL, FUSE):
    /// reported by libtest as passed, moved here from `passed`.
    skipped: Vec<String>,
    problems: Vec<String>,
}

impl Tally {
    /// Reads cargo's `test result: ok. 12 passed; 0 failed; 1 ignored; ...` lines.
    fn cargo_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            let (Some(num), Some(label)) = (words.iter().rev().nth(1), words.last()) else {
                continue;
            };
            let Ok(n) = num.parse::<u64>() else { continue };
            match *label {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                _ => {}
            }
        }
    }

    /// Moves the tests listed in a skip log (one `name<TAB>reason` line each) from passed to
    /// skipped.
    fn skips_from(&mut self, log: &str) {
        for line in log.lines().filter(|l| !l.trim().is_empty()) {
            self.skipped.push(line.replace('\t', ": "));
            self.passed = self.passed.saturating_sub(1);
        }
    }
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut skip_mpi = false;
    let mut large = false;
    for a in args {
        match a.as_str() {
            "--skip-mpi" => skip_mpi = true,
            "--large" => large = true,
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    let ci = std::env::var("CI")
        .map(|v| v == "true" || v == "1")
        .unwrap_or(false);
    if skip_mpi && ci {
        return Err("--skip-mpi is refused when CI=true: the MPI suite must run in CI".into());
    }
    if skip_mpi && large {
        return Err("--large runs over MPI and cannot be combined with --skip-mpi".into());
    }
    setup::ensure_mpi_toolchain()?;
    // The CUDA kernels build on every run, CI included (nvcc from the pinned wheels).
    cuda::ensure_nvcc()?;
    cuda::kernels(&[])?;

    let mut fmt = util::cargo();
    fmt.args(["fmt", "--all", "--check"]);
    util::run(fmt)?;
    let mut probe_fmt = cuda_probe::cargo_on("fmt");
    probe_fmt.args(["--all", "--check"]);
    util::run(probe_fmt)?;

    let mut clippy = util::cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ]);
    util::run(clippy)?;
    let mut probe_clippy = cuda_probe::cargo_on("clippy");
    probe_clippy.args(["--all-targets", "--", "-D", "warnings"]);
    util::run(probe_clippy)?;

    // The API docs of every crate with every feature, broken links and other rustdoc
    // warnings denied.
    let mut doc = util::cargo();
    doc.args(["doc", "--workspace", "--all-features", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");
    util::run(doc)?;

    let mut tally = Tally::default();
    let mut tests = util::cargo();
    tests.args(["test", "--workspace", "--all-features", "--no-fail-fast"]);
    // GPU tests that find no GPU append a line here (tpcomm_transport::testing).
    let skip_log = util::root().join("target/test-skips.log");
    if skip_log.exists() {
        std::fs::remove_file(&skip_log).map_err(|e| format!("{}: {e}", skip_log.display()))?;
    }
    tests.env("TPCOMM_SKIP_LOG", &skip_log);
    let ok = util::run_lines(tests, |line| tally.cargo_line(line))?;
    tally.skips_from(&std::fs::read_to_string(&skip_log).unwrap_or_default());
    if !ok {
        tally
            .problems
            .push("cargo test exited with a failure".into());
    }
    // The driver probe's unit tests (its fake driver, its child processes), counted in the
    // tally like the workspace's.
    let mut probe_tests = cuda_probe::cargo_on("test");
    probe_tests.arg("--no-fail-fast");
    if !util::run_lines(probe_tests, |line| tally.cargo_line(line))? {
        tally
            .problems
            .push("cargo test of the driver probe exited with a failure".into());
    }

    if skip_mpi {
        eprintln!("xtask test: MPI suite SKIPPED (--skip-mpi); these cases are not counted");
    } else {
        run_mpi_suite(&mut tally)?;
        run_bench_smoke(&mut tally)?;
        run_fault_suite(&mut tally)?;
        if large {
            run_large(&mut tally)?;
        }
    }
    run_fuzz_smoke(&mut tally)?;
    run_downstream(&mut tally)?;

    println!();
    if tally.ignored > 0 {
        println!("({} tests ignored)", tally.ignored);
    }
    if !tally.skipped.is_empty() {
        println!(
            "({} tests skipped, not counted as passed; `cargo xtask gpu-check` runs the GPU ones on a GPU):",
            tally.skipped.len()
        );
        for s in &tally.skipped {
            // The reasons repeat the loader's whole search list: the first line of each is
            // enough here (the full text is in target/test-skips.log).
            let short: String = s.chars().take(150).collect();
            let cut = if short.len() < s.len() { " ..." } else { "" };
            println!("  skipped: {short}{cut}");
        }
    }
    for p in &tally.problems {
        println!("problem: {p}");
    }
    println!("total: {} passed, {} failed", tally.passed, tally.failed);
    if tally.failed > 0 || !tally.problems.is_empty() || tally.passed == 0 {
        return Err("the test suite failed".into());
    }
    Ok(())
}

fn run_mpi_suite(tally: &mut Tally) -> Result<(), String> {
    let exe = util::mpi_program("mpi-conformance", false)?;
    for np in MPI_RANKS {
        run_mpi_program(tally, np, &exe, None)?;
    }
    run_mpi_program(tally, MPI_TIMED_RANKS, &exe, Some(MPI_TIMED_TIMEOUT_MS))?;
    // The blocking path's protection against a peer sending more than agreed: Open MPI
    // with its shared-memory single-copy mechanism turned off before MPI_Init.
    if faults::open_mpi() {
        let exe = util::mpi_program("mpi-single-copy-off", false)?;
        for np in MPI_RANKS {
            run_mpi_program(tally, np, &exe, None)?;
        }
    } else {
        eprintln!("xtask test: mpi-single-copy-off SKIPPED (it needs Open MPI)");
    }
    Ok(())
}

/// The bench's MPI subcommands on 2 ranks, a few small sizes and iterations each: every
/// path, the MPI peer (MPI's C API called from Rust) and the C loop included, is verified
/// on fresh data before it is timed, and a wrong result exits with a failure. Each run
/// counts as one test; the figures are not judged.
const BENCH_SMOKE: [&[&str]; 4] = [
    &["transport", "--max-bytes", "4KiB", "--factor", "8"],
    &["peer-check", "--max-bytes", "4KiB", "--factor", "8"],
    &["allreduce", "--max-bytes", "64KiB", "--factor", "8"],
    &["queue", "--payloads", "blob:64,blob:300000,step:10"],
];

/// Runs [`BENCH_SMOKE`] under `mpirun -np 2` (the bench built as the cargo tests built it).
fn run_bench_smoke(tally: &mut Tally) -> Result<(), String> {
    let mut build = util::cargo();
    build.args(["build", "-p", "tpcomm-bench", "--all-features"]);
    let exe = util::build_executable(build, "tpcomm-bench")?;
    for args in BENCH_SMOKE {
        let mut cmd = bounded_mpirun(2, &exe);
        cmd.args(args.iter())
            .args(["--transport", "mpi", "--iters", "3", "--warmup", "1"]);
        let label = format!("mpirun -np 2 tpcomm-bench {}", args.join(" "));
        if util::run_lines(cmd, |_| {})? {
            println!("bench {label} ... ok");
            tally.passed += 1;
        } else {
            println!("bench {label} ... FAILED");
            tally.failed += 1;
        }
    }
    Ok(())
}

/// `cargo xtask faults`: each case counts as one test.
fn run_fault_suite(tally: &mut Tally) -> Result<(), String> {
    let started = std::time::Instant::now();
    let outcome = faults::suite()?;
    eprintln!(
        "xtask test: fault suite took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    tally.passed += outcome.passed;
    tally.failed += outcome.failed;
    if outcome.passed + outcome.failed == 0 {
        tally.problems.push("the fault suite ran no case".into());
    }
    Ok(())
}

/// A short `cargo xtask fuzz` pass: each target counts as one test (a finding fails it).
fn run_fuzz_smoke(tally: &mut Tally) -> Result<(), String> {
    let started = std::time::Instant::now();
    let outcomes = fuzz::smoke(FUZZ_SMOKE_SECS)?;
    eprintln!(
        "xtask test: fuzz smoke pass ({FUZZ_SMOKE_SECS} s per target) took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    for (target, finding) in outcomes {
        match finding {
            None => {
                println!("fuzz {target} ({FUZZ_SMOKE_SECS} s) ... ok");
                tally.passed += 1;
            }
            Some(f) => {
                println!("fuzz {target} ({FUZZ_SMOKE_SECS} s) ... FAILED: {f}");
                tally.failed += 1;
            }
        }
    }
    Ok(())
}

/// `cargo xtask downstream`: each program counts as one test.
fn run_downstream(tally: &mut Tally) -> Result<(), String> {
    let started = std::time::Instant::now();
    for (_, finding) in downstream::check_all()? {
        match finding {
            None => tally.passed += 1,
            Some(_) => tally.failed += 1,
        }
    }
    eprintln!(
        "xtask test: downstream builds took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The opt-in all-gather past 2 GiB (`--large`): 2 ranks, release build.
fn run_large(tally: &mut Tally) -> Result<(), String> {
    let exe = util::mpi_program("mpi-large-gather", true)?;
    run_mpi_program(tally, 2, &exe, None)
}

/// Runs `exe` under `mpirun -np np` (bounded by a timeout) and counts its `case ...` lines.
/// With `timeout_ms`, the program's MPI communicator bounds every collective by it
/// (`TPCOMM_MPI_TIMEOUT_MS`, read by `mpi_program`).
fn run_mpi_program(
    tally: &mut Tally,
    np: usize,
    exe: &std::path::Path,
    timeout_ms: Option<u32>,
) -> Result<(), String> {
    let name = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut cmd = bounded_mpirun(np, exe);
    if let Some(ms) = timeout_ms {
        cmd.env("TPCOMM_MPI_TIMEOUT_MS", ms.to_string());
    }
    let label = match timeout_ms {
        Some(ms) => format!("{name} (timeout {ms} ms)"),
        None => name,
    };
    let name = label;
    let (ok, passed, failed) = util::run_cases(cmd)?;
    tally.passed += passed;
    tally.failed += failed;
    if !ok {
        tally
            .problems
            .push(format!("mpirun -np {np} {name} exited with a failure"));
    }
    if passed + failed == 0 {
        tally
            .problems
            .push(format!("mpirun -np {np} {name} reported no case"));
    }
    Ok(())
}

/// `exe` under `mpirun -np np`, from the workspace root, killed after [`MPI_TIMEOUT_SECS`].
fn bounded_mpirun(np: usize, exe: &std::path::Path) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &MPI_TIMEOUT_SECS.to_string()]);
    let mpirun = util::mpirun(np);
    cmd.arg(mpirun.get_program())
        .args(mpirun.get_args())
        .arg(exe);
    cmd.current_dir(util::root());
    cmd
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn cargo_result_lines_are_summed() {
        let mut t = Tally::default();
        t.cargo_line("test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s");
        t.cargo_line(
            "test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out",
        );
        t.cargo_line("test something ... ok");
        assert_eq!((t.passed, t.failed, t.ignored), (15, 2, 1));
        t.skips_from("gpu_test\tno CUDA device\nother\tno NCCL\n");
        assert_eq!(t.passed, 13);
        assert_eq!(t.skipped, ["gpu_test: no CUDA device", "other: no NCCL"]);
    }
}
