//! `tpcomm-bench peer-check`: checks the MPI peer the other subcommands measure in their
//! runs (the plain MPI call through rsmpi, [`crate::mpi_peer`]) against the same calls in a
//! standalone C program, `src/peer_loop.c`, built here with `mpicc` next to this executable.
//!
//! Both sides time the same way (barrier, one call, slowest rank, median) at the same sizes
//! and iteration counts, in separate MPI jobs started by `--launcher`, alternated for
//! `--rounds` rounds; the median over rounds of each side is compared. A peer within
//! `--tolerance` of the C loop measures MPI, not the Rust binding around it.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

use crate::error::BenchError;
use crate::harness::Row;
use crate::report;
use crate::sweep::parse_bytes;
use crate::table::{self, col, Column};

/// The C source, written next to the executable and compiled there.
const SOURCE: &str = include_str!("peer_loop.c");

/// Options of `tpcomm-bench peer-check`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PeerCheckArgs {
    /// The command that starts the MPI jobs, split at spaces (for example
    /// `mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2`).
    #[arg(long, default_value = "mpirun -np 2", value_name = "CMD")]
    pub(crate) launcher: String,
    /// Smallest size (a multiple of 16: the all-reduce moves 16-byte packs).
    #[arg(long, default_value = "64", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) min_bytes: usize,
    /// Largest size.
    #[arg(long, default_value = "1MiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) max_bytes: usize,
    /// Each size is the previous one times this factor.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(2..))]
    pub(crate) factor: u32,
    /// Timed iterations per size, on both sides.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) iters: u32,
    /// Jobs of each side, alternated.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) rounds: u32,
    /// The largest difference from the C loop still counted as the same, in percent.
    #[arg(long, default_value_t = 5.0, value_name = "PCT")]
    pub(crate) tolerance: f64,
}

/// The three calls checked: the C loop's name, the bench subcommand and table that measure
/// the same call, and the peer's variant name there.
const CALLS: [(&str, &str, &str, &str); 3] = [
    ("allgather", "transport", "all_gather", "rsmpi"),
    ("allgatherv", "transport", "all_gather_varcount", "rsmpi"),
    ("allreduce", "allreduce", "f32", "MPI_Allreduce"),
];
const WARMUP: &str = "5";

/// Runs `argv` (after the launcher); its stdout.
fn job(launcher: &[&str], argv: &[String]) -> Result<String, BenchError> {
    let mut cmd = Command::new(launcher[0]);
    cmd.args(&launcher[1..]).args(argv);
    let out = cmd
        .output()
        .map_err(|e| BenchError::Usage(format!("cannot start `{}`: {e}", launcher[0])))?;
    if !out.status.success() {
        return Err(BenchError::Usage(format!(
            "`{} {}` failed ({}): {}",
            launcher.join(" "),
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Compiles the C loop into `dir`; its path.
fn build(dir: &Path) -> Result<PathBuf, BenchError> {
    let write = |path: &Path, source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| write(dir, e))?;
    let (src, exe) = (dir.join("peer_loop.c"), dir.join("peer_loop"));
    std::fs::write(&src, SOURCE).map_err(|e| write(&src, e))?;
    let status = Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .map_err(|e| BenchError::Usage(format!("mpicc not found ({e}): install Open MPI")))?;
    if !status.success() {
        return Err(BenchError::Usage(format!("mpicc failed ({status})")));
    }
    Ok(exe)
}

/// Runs the subcommand.
pub(crate) fn run(args: &PeerCheckArgs) -> Result<(), BenchError> {
    let launcher: Vec<&str> = args.launcher.split_whitespace().collect();
    if launcher.is_empty() || !args.min_bytes.is_multiple_of(16) || args.min_bytes > args.max_bytes
    {
        return Err(BenchError::Usage(
            "--launcher must name a command; --min-bytes a multiple of 16, at most --max-bytes"
                .into(),
        ));
    }
    let exe = std::env::current_exe().map_err(|e| BenchError::Usage(e.to_string()))?;
    let dir = exe.parent().unwrap_or(Path::new(".")).join("peer-check");
    let c_loop = build(&dir)?;
    let mut sizes = vec![args.min_bytes];
    while let Some(next) = sizes
        .last()
        .and_then(|s| s.checked_mul(args.factor as usize))
    {
        if next > args.max_bytes {
            break;
        }
        sizes.push(next);
    }
    let size_args: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let bench = |subcommand: &str, extra: &[&str], json: &Path| -> Vec<String> {
        let mut v: Vec<String> = [
            exe.to_string_lossy().as_ref(),
            subcommand,
            "--transport",
            "mpi",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        for (flag, value) in [
            ("--min-bytes", args.min_bytes.to_string()),
            ("--max-bytes", args.max_bytes.to_string()),
            ("--factor", args.factor.to_string()),
            ("--iters", args.iters.to_string()),
            ("--warmup", WARMUP.to_string()),
            ("--json", json.display().to_string()),
        ] {
            v.extend([flag.to_string(), value]);
        }
        v
    };
    // (call, bytes) -> medians of the in-run peer and of the C loop, one per round.
    let mut peer: Vec<(usize, usize, f64)> = Vec::new();
    let mut c: Vec<(usize, usize, f64)> = Vec::new();
    for round in 0..args.rounds {
        eprintln!(
            "tpcomm-bench peer-check: round {} of {}",
            round + 1,
            args.rounds
        );
        for (k, (name, ..)) in CALLS.iter().enumerate() {
            let mut argv = vec![c_loop.display().to_string(), name.to_string()];
            argv.extend([args.iters.to_string(), WARMUP.to_string()]);
            argv.extend(size_args.iter().cloned());
            for line in job(&launcher, &argv)?.lines() {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if let [_, bytes, us] = fields[..] {
                    if let (Ok(b), Ok(us)) = (bytes.parse(), us.parse()) {
                        c.push((k, b, us));
                    }
                }
            }
        }
        let json = dir.join("peer.json");
        for (subcommand, extra) in [
            (
                "transport",
                &["--ops", "all_gather,all_gather_varcount"][..],
            ),
            ("allreduce", &["--paths", "auto"][..]),
        ] {
            job(&launcher, &bench(subcommand, extra, &json))?;
            for r in report::read(&json)?.rows {
                let call = CALLS
                    .iter()
                    .position(|c| c.1 == subcommand && c.2 == r.table && c.3 == r.variant);
                if let Some(k) = call {
                    peer.push((k, r.bytes, r.stats.median_us));
                }
            }
        }
    }
    let median_of = |v: &[(usize, usize, f64)], k: usize, b: usize| {
        let mut xs: Vec<f64> = v
            .iter()
            .filter(|x| (x.0, x.1) == (k, b))
            .map(|x| x.2)
            .collect();
        xs.sort_by(f64::total_cmp);
        match xs.len() {
            0 => None,
            n if n % 2 == 1 => Some(xs[n / 2]),
            n => Some((xs[n / 2 - 1] + xs[n / 2]) / 2.0),
        }
    };
    // A row per call and size: the peer's median as the row, the C loop's as its peer.
    let mut rows = Vec::new();
    for (k, call) in CALLS.iter().enumerate() {
        for &b in &sizes {
            let (Some(p), Some(cl)) = (median_of(&peer, k, b), median_of(&c, k, b)) else {
                continue;
            };
            let ns = |us: f64| vec![(us * 1e3).round() as u64];
            let mut row = Row::new(call.0, &b.to_string(), call.3, b, 5, ns(p))
                .ok_or_else(|| BenchError::Usage("no samples".into()))?;
            row.vs_peer = Some(p / cl);
            rows.push(row.with("c_loop_us", cl));
        }
    }
    const COLUMNS: [Column; 5] = [
        Column::new("call", "(MPI_)", 11, |r, _| r.table.clone()),
        col::size(10),
        Column::new("in-run", "peer (us)", 12, |r, _| {
            format!("{:.3}", r.stats.median_us)
        }),
        Column::new("C loop", "(us)", 12, |r, _| col::f3(r.number("c_loop_us"))),
        col::vs_peer("ratio", "peer/C", 8),
    ];
    let mut lines = vec![format!(
        "# peer-check: the in-run MPI peer (rsmpi, warm buffers) against {}, {} iterations, \
         median of {} rounds; launcher `{}`",
        c_loop.display(),
        args.iters,
        args.rounds,
        args.launcher
    )];
    lines.extend(table::header("median time per call", &COLUMNS));
    lines.extend(rows.iter().map(|r| table::row_line(&COLUMNS, r, None)));
    let tol = args.tolerance / 100.0;
    let outside: Vec<&Row> = rows
        .iter()
        .filter(|r| r.vs_peer.is_some_and(|x| (x - 1.0).abs() > tol))
        .collect();
    lines.push(format!(
        "# {} of {} rows within {}% of the C loop{}",
        rows.len() - outside.len(),
        rows.len(),
        args.tolerance,
        if outside.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = outside
                .iter()
                .map(|r| format!("{} {} B", r.table, r.bytes))
                .collect();
            format!(
                " (outside: {}; rerun on a quiet machine before reading much into it)",
                list.join(", ")
            )
        }
    ));
    table::print(&lines);
    Ok(())
}
