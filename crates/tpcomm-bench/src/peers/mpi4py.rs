//! The mpi4py peer of `objects` and `queue`: the same values as Python objects, gathered or
//! broadcast by mpi4py (`objects_peer.py`, run as its own MPI job before the bench's ranks
//! start), timed the same way; rank 0 prints one JSON line per payload.

use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::data::payload::Payload;
use crate::engine::error::BenchError;
use crate::engine::launch::{self, RunArgs, Transport};
use crate::engine::row::Row;
use crate::engine::targets::Judge;

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

impl Mpi4pyRun {
    /// Refuses figures of other values than the bench's: `ours` is the fingerprint of the
    /// bench's values of `payload` ([`fingerprint`](crate::data::payload::fingerprint)),
    /// `differ` what the error says differs (`values differ`, `value differs`).
    pub(crate) fn check(
        &self,
        payload: Payload,
        differ: &str,
        ours: &str,
    ) -> Result<(), BenchError> {
        if self.fingerprint == ours {
            return Ok(());
        }
        Err(BenchError::Usage(format!(
            "the mpi4py peer's {payload} {differ} from the bench's (fingerprint {} vs {ours})",
            self.fingerprint
        )))
    }

    /// The peer's row of `payload` in `table`, `bytes` per rank (`None` without samples).
    pub(crate) fn row(&self, table: &str, payload: Payload, bytes: usize) -> Option<Row> {
        let (case, samples) = (payload.to_string(), self.samples_ns.clone());
        Row::new(table, &case, MPI4PY, bytes, self.warmup, samples)
    }
}

/// The Python peer's variant name.
pub(crate) const MPI4PY: &str = "mpi4py";

/// The mpi4py peer's runs for one subcommand, measured before its ranks start, or why
/// there are none.
#[derive(Debug)]
pub(crate) struct Mpi4py(Result<Vec<Mpi4pyRun>, String>);

impl Mpi4py {
    /// The peer's figures for subcommand `name` (see [`run_mpi4py`]), or why there are
    /// none: skipped on request (`skip`, its `--no-mpi4py`), or under `--transport mpi`.
    pub(crate) fn measure(
        name: &str,
        collective: &str,
        run: &RunArgs,
        payloads: &[Payload],
        skip: bool,
    ) -> Self {
        Self(match run.transport {
            _ if skip => Err("skipped (--no-mpi4py)".to_string()),
            Transport::Local => run_mpi4py(name, collective, run, payloads),
            Transport::Mpi => Err(
                "not run under --transport mpi (it needs an mpirun job of its own): run without \
             it to measure mpi4py next to local ranks"
                    .into(),
            ),
        })
    }

    /// The peer's run of `payload`, if it ran.
    pub(crate) fn of(&self, payload: Payload) -> Option<&Mpi4pyRun> {
        let runs = self.0.as_ref().ok()?;
        runs.iter().find(|r| r.payload == payload.to_string())
    }

    /// The preamble's line on the peer: `ran`, what it timed, or why it did not run.
    pub(crate) fn describe(&self, ran: &str) -> String {
        match &self.0 {
            Ok(_) => ran.into(),
            Err(why) => format!("mpi4py: {why}"),
        }
    }
}

/// A subcommand's options with the mpi4py peer's figures, measured before its ranks start:
/// what `objects` and `queue` run as their [`Bench`](crate::engine::launch::Bench).
#[derive(Serialize)]
pub(crate) struct WithMpi4py<'a, A> {
    /// The options (the JSON report's settings).
    #[serde(flatten)]
    pub(crate) args: &'a A,
    /// The mpi4py peer's runs, or why there are none.
    #[serde(skip)]
    pub(crate) mpi4py: Mpi4py,
}

/// The judge of "every row whose variant starts with `prefix` faster than mpi4py on its
/// payload": met when no such row takes as long as the mpi4py row of its case or longer;
/// the detail names those that do. `None` without an mpi4py row.
pub(crate) fn faster_on_every_payload(prefix: &'static str) -> Judge {
    Box::new(move |rows: &[Row]| {
        let judged = rows.iter().any(|r| r.is(MPI4PY));
        let slower: Vec<String> = rows
            .iter()
            .filter(|r| r.variant.starts_with(prefix))
            .filter_map(|r| {
                let py = rows.iter().find(|p| p.is(MPI4PY) && p.case == r.case)?;
                Some((r, py.stats.median_us / r.stats.median_us))
            })
            .filter(|(_, x)| *x <= 1.0)
            .map(|(r, x)| format!("{} {} {x:.2}x", r.case, r.variant))
            .collect();
        judged.then(|| {
            let detail = if slower.is_empty() {
                format!("every {prefix} row faster (mpi4py time / {prefix} time above 1)")
            } else {
                format!("not faster: {}", slower.join(", "))
            };
            (slower.is_empty(), detail)
        })
    })
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
