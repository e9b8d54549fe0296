//! The mpi4py peer of `objects` and `queue`: the same values as Python objects, gathered or
//! broadcast by mpi4py (`objects_peer.py`, run as its own MPI job before the bench's ranks
//! start), timed the same way; rank 0 prints one JSON line per payload.

use std::process::Command;

use serde::Deserialize;

use crate::data::payload::Payload;
use crate::engine::launch::{self, RunArgs, Transport};

/// The mpi4py peer's script, written to a temporary file and run under `mpirun`.
pub(crate) const MPI4PY_SCRIPT: &str = include_str!("objects_peer.py");

/// What the mpi4py peer measured on one payload (a JSON line of rank 0).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Mpi4pyRun {
    pub(crate) payload: String,
    pub(crate) fingerprint: String,
    pub(crate) warmup: usize,
    pub(crate) samples_ns: Vec<u64>,
}

/// The Python peer's variant name.
pub(crate) const MPI4PY: &str = "mpi4py";

/// The mpi4py peer's figures for subcommand `name` (see [`run_mpi4py`]), or why there are
/// none: skipped on request (`skip`, its `--no-mpi4py`), or under `--transport mpi`.
pub(crate) fn mpi4py_peer(
    name: &str,
    collective: &str,
    run: &RunArgs,
    payloads: &[Payload],
    skip: bool,
) -> Result<Vec<Mpi4pyRun>, String> {
    match run.transport {
        _ if skip => Err("skipped (--no-mpi4py)".to_string()),
        Transport::Local => run_mpi4py(name, collective, run, payloads),
        Transport::Mpi => Err(
            "not run under --transport mpi (it needs an mpirun job of its own): run without              it to measure mpi4py next to local ranks"
                .into(),
        ),
    }
}

/// Runs the mpi4py peer of `collective` (`allgather`, or `bcast` from rank 0) on every
/// payload as its own MPI job (`mpirun -np RANKS python3`), before the bench's ranks start,
/// for the subcommand `name`; the reason when it cannot run.
fn run_mpi4py(
    name: &str,
    collective: &str,
    run: &RunArgs,
    payloads: &[Payload],
) -> Result<Vec<Mpi4pyRun>, String> {
    let probe = Command::new("python3")
        .args(["-c", "import mpi4py"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return Err(
            "mpi4py absent (python3 -c \"import mpi4py\" fails; `cargo xtask setup` \
                    installs it)"
                .into(),
        );
    }
    let script = std::env::temp_dir().join(format!(
        "tpcomm-bench-{}-objects_peer.py",
        std::process::id()
    ));
    std::fs::write(&script, MPI4PY_SCRIPT)
        .map_err(|e| format!("cannot write {}: {e}", script.display()))?;
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.split_whitespace().take(2).eq(["Uid:", "0"]))
    });
    let mut cmd = Command::new("mpirun");
    if root {
        cmd.arg("--allow-run-as-root");
    }
    let ranks = run.ranks.unwrap_or(launch::DEFAULT_LOCAL_RANKS).to_string();
    cmd.args([
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &ranks,
        "python3",
    ])
    .arg(&script)
    .arg(collective)
    .arg(run.iter.iters.unwrap_or(0).to_string())
    .arg(run.iter.warmup.unwrap_or(5).to_string())
    .args(payloads.iter().map(Payload::to_string));
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("tpcomm-bench {name}: timing the mpi4py peer first ({ranks} MPI ranks)");
    }
    let out = cmd.output();
    let _ = std::fs::remove_file(&script);
    let out = out.map_err(|e| format!("cannot start mpirun: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "the mpi4py job failed ({}): {}",
            out.status,
            err.trim()
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).map_err(|e| format!("unreadable mpi4py line `{l}`: {e}")))
        .collect()
}
