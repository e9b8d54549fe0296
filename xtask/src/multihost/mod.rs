//! `cargo xtask multihost`: tpcomm across several hosts of this machine. The hosts are
//! namespaces ([`cluster`]): each its own network, PID, UTS and mount namespace, linked by
//! veth to one switch, Open MPI launched across them over TCP (shared memory inside a host)
//! by `mpirun` with a host file and a launch agent that enters a host's namespaces instead
//! of ssh.
//!
//! - the suites (`mpi-multihost suites`): 2 hosts × 2 ranks, and 4 hosts × 1 rank with every
//!   collective bounded by a timeout (the roll call's path);
//! - the host and link faults ([`faults`]), each on hosts of its own;
//! - `--bench`: `tpcomm-bench transport`, `objects` and `queue` across 2 hosts ([`bench`](mod@bench));
//! - a check of the teardown on Ctrl-C and SIGKILL ([`hold`]): a child run holding hosts is
//!   interrupted, and nothing of its hosts may be left.
//!
//! Where namespaces cannot be made (not root, a sandbox that refuses), the run is skipped
//! with the reason; `TPCOMM_REQUIRE_MULTIHOST=1` makes that a failure.

mod bench;
mod cluster;
mod faults;
mod hold;

use std::time::Instant;

use crate::{setup, util};

/// The 2 × 2 and 4 × 1 layouts of the suites, with the timeout (ms) each runs under.
const SUITE_LAYOUTS: [(usize, usize, Option<u32>); 2] = [(2, 2, None), (4, 1, Some(60_000))];
/// Upper bound on one suite's mpirun.
const SUITE_LIMIT_SECS: u32 = 900;

/// What `cargo xtask multihost` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Suites,
    Faults,
    Teardown,
}

const USAGE: &str = "cargo xtask multihost [--bench] [--only suites,faults,teardown] \
                     [--faults KIND,...]";

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut parts = vec![Part::Suites, Part::Faults, Part::Teardown];
    let mut bench = false;
    let mut kinds: Option<Vec<String>> = None;
    let mut args = args.iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => bench = true,
            "--only" => {
                let list = args.next().ok_or("`--only` needs parts")?;
                parts = list
                    .split(',')
                    .map(|p| match p {
                        "suites" => Ok(Part::Suites),
                        "faults" => Ok(Part::Faults),
                        "teardown" => Ok(Part::Teardown),
                        other => Err(format!("unknown part `{other}` ({USAGE})")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--faults" => {
                let list = args.next().ok_or("`--faults` needs kinds")?;
                kinds = Some(list.split(',').map(str::to_owned).collect());
            }
            // The child of the teardown check (see `hold`).
            "--hold" => return hold::hold(),
            other => return Err(format!("unknown option `{other}` ({USAGE})")),
        }
    }
    if let Err(cluster::Refused(why)) = cluster::probe() {
        let why = format!("no hosts can be made here: {why}");
        if std::env::var("TPCOMM_REQUIRE_MULTIHOST").is_ok_and(|v| v == "1") {
            return Err(format!("TPCOMM_REQUIRE_MULTIHOST=1 but {why}"));
        }
        println!("multihost: SKIPPED: {why}");
        return Ok(());
    }
    setup::ensure_mpi_toolchain()?;
    if bench {
        return bench::run();
    }
    let exe = util::mpi_program("mpi-multihost", false)?;
    let (mut passed, mut failed) = (0u64, 0u64);
    let tally = |ok: bool, passed: &mut u64, failed: &mut u64| {
        if ok {
            *passed += 1;
        } else {
            *failed += 1;
        }
    };
    if parts.contains(&Part::Teardown) {
        for (signal, ok) in hold::check()? {
            println!(
                "multihost teardown after {signal} ... {}",
                ok.as_ref()
                    .map_or_else(|e| format!("FAILED: {e}"), |()| "ok".into())
            );
            tally(ok.is_ok(), &mut passed, &mut failed);
        }
    }
    if parts.contains(&Part::Suites) {
        for (hosts, slots, timeout) in SUITE_LAYOUTS {
            let (p, f) = suite(&exe, hosts, slots, timeout)?;
            passed += p;
            failed += f;
        }
    }
    if parts.contains(&Part::Faults) {
        for case in faults::CASES {
            if kinds
                .as_ref()
                .is_some_and(|k| !k.iter().any(|k| k == case.kind))
            {
                continue;
            }
            let verdict = faults::run_case(&exe, case);
            match &verdict {
                Ok(figure) => println!("multihost fault {} ... ok: {figure}", case.kind),
                Err(e) => println!("multihost fault {} ... FAILED: {e}", case.kind),
            }
            tally(verdict.is_ok(), &mut passed, &mut failed);
        }
    }
    println!("\nmultihost: {passed} passed, {failed} failed");
    if failed == 0 {
        Ok(())
    } else {
        Err("a multihost case failed".into())
    }
}

/// One run of the suites on `hosts × slots` ranks; the counts of its `case` lines (a job that
/// fails without a failed case counts as one failure).
fn suite(
    exe: &std::path::Path,
    hosts: usize,
    slots: usize,
    timeout_ms: Option<u32>,
) -> Result<(u64, u64), String> {
    let cluster = cluster::Cluster::create(hosts)?;
    let mpirun = cluster.mpirun(hosts, slots)?;
    let mut cmd = std::process::Command::new("timeout");
    cmd.args(["--kill-after=10", &SUITE_LIMIT_SECS.to_string()]);
    cmd.arg(mpirun.get_program()).args(mpirun.get_args());
    if let Some(ms) = timeout_ms {
        // Forwarded to the ranks on every host (`-x`).
        cmd.env("TPCOMM_MPI_TIMEOUT_MS", ms.to_string());
        cmd.args(["-x", "TPCOMM_MPI_TIMEOUT_MS"]);
    }
    if std::env::var_os("TPCOMM_MULTIHOST_ONLY").is_some() {
        cmd.args(["-x", "TPCOMM_MULTIHOST_ONLY"]);
    }
    cmd.arg(exe).args(["suites", &hosts.to_string()]);
    cmd.current_dir(util::root());
    let label = match timeout_ms {
        Some(ms) => format!("{hosts} hosts x {slots} ranks, timeout {ms} ms"),
        None => format!("{hosts} hosts x {slots} ranks"),
    };
    println!("multihost suites on {label}");
    let started = Instant::now();
    let (ok, passed, mut failed) = util::run_cases(cmd)?;
    if !ok && failed == 0 {
        failed += 1;
        println!("multihost suites on {label}: the job failed");
    }
    println!(
        "multihost suites on {label}: {passed} passed, {failed} failed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let tag = cluster.tag().to_owned();
    cluster
        .teardown()
        .map_err(|e| format!("tearing down {tag}: {e}"))?;
    Ok((passed, failed))
}
