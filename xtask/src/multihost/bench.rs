//! `cargo xtask multihost --bench`: `tpcomm-bench transport` (blocking, and timed:
//! `--mpi-timeout-ms`), `objects` and `queue` with one MPI rank on each of 2 hosts, so that
//! every byte crosses the veth link over TCP. Each table carries its peer measured in the
//! same run (the plain MPI call for the transport and the objects, `objects::broadcast` for
//! the queue, whose reader is on the other host and so reads the transport). The JSON
//! reports and tables go to `target/multihost/bench`. The link is veth in one kernel: its
//! latency and bandwidth are those of the kernel's TCP stack, not of a network.

use std::process::Command;

use super::cluster::Cluster;
use crate::util;

/// The runs: a name for their files, the subcommand and its options (the transport up to
/// 4 MiB by factors of 4, once on the blocking path and once with every collective bounded,
/// the timed path the queue's remote readers take; the mpi4py peers launch jobs of their
/// own, which cannot cross these hosts).
const RUNS: [(&str, &str, &[&str]); 4] = [
    (
        "transport",
        "transport",
        &["--max-bytes", "4MiB", "--factor", "4"],
    ),
    (
        "transport-timed",
        "transport",
        &[
            "--max-bytes",
            "4MiB",
            "--factor",
            "4",
            "--mpi-timeout-ms",
            "60000",
        ],
    ),
    ("objects", "objects", &["--no-mpi4py"]),
    ("queue", "queue", &["--no-mpi4py"]),
];

pub(super) fn run() -> Result<(), String> {
    let mut build = util::cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "tpcomm-bench",
        "--features",
        "mpi",
    ]);
    let exe = util::build_executable(build, "tpcomm-bench")?;
    let out = util::root().join("target/multihost/bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let cluster = Cluster::create(2)?;
    let mut failed = Vec::new();
    for (name, sub, options) in RUNS {
        let mpirun = cluster.mpirun(2, 1)?;
        let mut cmd = Command::new("timeout");
        cmd.args(["--kill-after=10", "1800"]);
        cmd.arg(mpirun.get_program()).args(mpirun.get_args());
        let json = out.join(format!("{name}-2hosts.json"));
        cmd.arg(&exe)
            .args([sub, "--transport", "mpi"])
            .args(options)
            .arg("--json")
            .arg(&json);
        cmd.current_dir(util::root());
        let mut table = format!(
            "# cargo xtask multihost --bench: 2 hosts x 1 rank over TCP on veth; load average {}\n",
            util::load_average()
        );
        let ok = util::run_lines(cmd, |line| {
            table.push_str(line);
            table.push('\n');
        })?;
        let txt = out.join(format!("{name}-2hosts.txt"));
        std::fs::write(&txt, table).map_err(|e| format!("{}: {e}", txt.display()))?;
        if !ok {
            failed.push(name);
        }
    }
    let tag = cluster.tag().to_owned();
    cluster
        .teardown()
        .map_err(|e| format!("tearing down {tag}: {e}"))?;
    eprintln!(
        "multihost --bench: tables and reports under {}",
        out.display()
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("the runs of {failed:?} failed"))
    }
}
