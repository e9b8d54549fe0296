//! `cargo xtask faults`: fault injection under MPI. For each phase of an object collective,
//! an all-reduce, suspend/resume and the broadcast queue (its writer, one of its readers), and
//! for 2, 3 and 4 ranks, one rank SIGKILLs itself at
//! that phase (`mpi-faults`, under `mpirun --enable-recovery`) and the survivors must:
//!
//! 1. each report an error naming the dead rank (first), within the timeout plus a margin;
//! 2. each exit (the whole mpirun ends before a hard limit);
//! 3. leave nothing behind: no process of the job, no new entry in `/dev/shm`, no process
//!    holding a `tpcomm-peer` memfd that did not hold one before.
//!
//! Open MPI 4.1 reports success (`mpirun` exits 0) under `--enable-recovery` even when a rank
//! was killed, so the verdict comes from the ranks' lines, never from mpirun's status.
//! Also run by `cargo xtask test`; each case counts as one test.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{setup, util};

/// The phases `mpi-faults` knows, in the order the cases run.
const PHASES: [&str; 8] = [
    "object-lengths",
    "object-payload",
    "allreduce-launch",
    "suspend",
    "resume",
    "resume-stable",
    "queue-writer",
    "queue-reader",
];
/// Rank counts (3 and 4 are oversubscribed on a 2-core machine).
const RANKS: [usize; 3] = [2, 3, 4];
/// The timeout every wait of the survivors is bounded by.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How much later than the timeout a survivor may report (scheduling on a loaded machine).
const REPORT_MARGIN: Duration = Duration::from_secs(5);
/// Hard limit on one mpirun (start-up, the warm-up round, the timeout, exit).
const JOB_LIMIT_SECS: u64 = 60;

/// The fault suite's counts.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if let Some(other) = args.first() {
        return Err(format!("unknown option `{other}`"));
    }
    setup::ensure_mpi_toolchain()?;
    let outcome = suite()?;
    println!(
        "\nfaults: {} passed, {} failed",
        outcome.passed, outcome.failed
    );
    if outcome.failed == 0 {
        Ok(())
    } else {
        Err("a fault case failed".into())
    }
}

/// Builds `mpi-faults` and runs every case; prints `fault ... ok` / `fault ... FAILED` lines.
pub(crate) fn suite() -> Result<Outcome, String> {
    if !open_mpi() {
        return Err("the fault suite needs Open MPI's mpirun (--enable-recovery)".into());
    }
    let exe = util::mpi_program("mpi-faults", false)?;
    let mut outcome = Outcome::default();
    for np in RANKS {
        for (i, phase) in PHASES.iter().enumerate() {
            // Vary the victim: every rank, rank 0 included, dies in some case.
            let victim = (i + np) % np;
            let name = format!("{phase} np={np} victim={victim}");
            match run_case(&exe, np, phase, victim) {
                Ok(()) => {
                    println!("fault {name} ... ok");
                    outcome.passed += 1;
                }
                Err(why) => {
                    println!("fault {name} ... FAILED: {why}");
                    outcome.failed += 1;
                }
            }
        }
    }
    Ok(outcome)
}

/// Whether `mpirun` is Open MPI's.
pub(crate) fn open_mpi() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .output()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned()
                + &String::from_utf8_lossy(&o.stderr);
            text.contains("Open MPI") || text.contains("OpenRTE")
        })
        .unwrap_or(false)
}

/// One case: runs the job and checks the survivors' lines, the time bound and leftovers.
fn run_case(exe: &Path, np: usize, phase: &str, victim: usize) -> Result<(), String> {
    let shm_before = dev_shm();
    let memfd_before = memfd_holders();
    let mpirun = util::mpirun(np);
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=5", &JOB_LIMIT_SECS.to_string()]);
    cmd.arg(mpirun.get_program()).args(mpirun.get_args());
    cmd.arg("--enable-recovery").arg(exe).args([
        phase.to_string(),
        victim.to_string(),
        TIMEOUT.as_millis().to_string(),
    ]);
    cmd.current_dir(util::root());
    let started = Instant::now();
    let out = cmd
        .output()
        .map_err(|e| format!("cannot start `{}`: {e}", util::show(&cmd)))?;
    let wall = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let verdict = judge(&stdout, np, phase, victim, out.status.code(), wall)
        .and_then(|()| leftovers(exe, &shm_before, &memfd_before));
    if verdict.is_err() {
        eprintln!("--- mpi-faults {phase} np={np} victim={victim} stdout:\n{stdout}");
        let noise = |l: &&str| !l.contains("PMIX ERROR: BAD-PARAM");
        let stderr: Vec<&str> = stderr.lines().filter(noise).collect();
        eprintln!("--- stderr:\n{}", stderr.join("\n"));
    }
    verdict
}

/// Checks the ranks' lines.
fn judge(
    stdout: &str,
    np: usize,
    phase: &str,
    victim: usize,
    status: Option<i32>,
    wall: Duration,
) -> Result<(), String> {
    if matches!(status, Some(124) | Some(137) | None) {
        return Err(format!(
            "the job did not end within {JOB_LIMIT_SECS} s (status {status:?})"
        ));
    }
    let lines: Vec<&str> = stdout.lines().collect();
    let died = format!("victim {victim}: SIGKILL at {phase}");
    if !lines.iter().any(|l| *l == died) {
        return Err(format!(
            "rank {victim} never reached the fault (`{died}` missing)"
        ));
    }
    for rank in (0..np).filter(|&r| r != victim) {
        let prefix = format!("survivor {rank}: ");
        let Some(line) = lines.iter().find(|l| l.starts_with(&prefix)) else {
            return Err(format!("rank {rank} reported nothing"));
        };
        let expected = format!("{prefix}{phase} failed after ");
        let Some(rest) = line.strip_prefix(&expected) else {
            return Err(format!("rank {rank}: {line}"));
        };
        if !rest.contains(&format!(" s naming rank {victim}: ")) {
            return Err(format!("rank {rank} does not name rank {victim}: {line}"));
        }
        let secs: f64 = rest
            .split(' ')
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("rank {rank}: no duration in `{line}`"))?;
        if secs > (TIMEOUT + REPORT_MARGIN).as_secs_f64() {
            return Err(format!(
                "rank {rank} reported after {secs} s, past the {TIMEOUT:?} timeout plus \
                 {REPORT_MARGIN:?}"
            ));
        }
        if lines
            .iter()
            .any(|l| l.starts_with(&prefix) && l.contains("FAILED"))
        {
            return Err(format!("rank {rank} failed a later check"));
        }
        let exited = format!("rank {rank}: exiting without MPI_Finalize");
        if !lines.contains(&exited.as_str()) {
            return Err(format!("rank {rank} did not reach its exit"));
        }
    }
    if lines.iter().any(|l| l.contains("FAILED")) {
        return Err("a rank reported a failure".into());
    }
    eprintln!(
        "  {phase} np={np}: job ended in {:.1} s",
        wall.as_secs_f64()
    );
    Ok(())
}

/// Fails when the job left a process, a `/dev/shm` entry or a memfd holder behind.
fn leftovers(
    exe: &Path,
    shm_before: &BTreeSet<String>,
    memfd_before: &BTreeSet<u32>,
) -> Result<(), String> {
    // mpirun has returned; its children may take a moment to be reaped.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut alive = job_processes(exe);
    while !alive.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        alive = job_processes(exe);
    }
    if !alive.is_empty() {
        return Err(format!("processes of the job still run: {alive:?}"));
    }
    // An entry that a live process still maps belongs to a job running beside this one (a
    // developer's benchmark under mpirun, say): this job's processes are all gone.
    let mapped = shm_mapped_by_live_processes();
    let new_shm: Vec<String> = dev_shm()
        .difference(shm_before)
        .filter(|name| !mapped.contains(*name))
        .cloned()
        .collect();
    if !new_shm.is_empty() {
        return Err(format!("left in /dev/shm: {new_shm:?}"));
    }
    // A holder that is gone a moment later was another program's short-lived process (a
    // developer's test binary, say): this job's processes are all gone, and whatever they
    // left holding a segment would still hold it.
    let mut new_holders: Vec<u32> = memfd_holders().difference(memfd_before).copied().collect();
    if !new_holders.is_empty() {
        std::thread::sleep(Duration::from_secs(1));
        let still = memfd_holders();
        new_holders.retain(|pid| still.contains(pid));
    }
    if !new_holders.is_empty() {
        return Err(format!(
            "processes {new_holders:?} hold a tpcomm-peer memfd after the job"
        ));
    }
    Ok(())
}

/// Entries of `/dev/shm`.
fn dev_shm() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Names of the `/dev/shm` entries that some live process maps (from `/proc/*/maps`).
fn shm_mapped_by_live_processes() -> BTreeSet<String> {
    pids()
        .into_iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/maps")).ok())
        .flat_map(|maps| {
            maps.lines()
                .filter_map(|l| l.split_once("/dev/shm/").map(|(_, name)| name.to_string()))
                .map(|name| name.trim_end_matches(" (deleted)").to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Process ids in /proc.
fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Processes running `exe`.
fn job_processes(exe: &Path) -> Vec<u32> {
    pids()
        .into_iter()
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p.as_path() == exe)
        })
        .collect()
}

/// Processes with an open descriptor on a `tpcomm-peer` memfd.
fn memfd_holders() -> BTreeSet<u32> {
    pids()
        .into_iter()
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|d| {
                d.filter_map(|e| e.ok()).any(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|t| t.to_string_lossy().contains("memfd:tpcomm-peer"))
                })
            })
        })
        .collect()
}
