//! `cargo xtask bench`: runs every host subcommand of the benchmark CLI the way
//! `docs/benchmarks.md` records it (2 ranks as local threads, and 2 MPI ranks under `mpirun`
//! where the subcommand has an MPI form), keeps each run's JSON report and printed table as
//! `<subcommand>-<local2|mpi2>-<YYYY-MM-DD>.{json,txt}`, and draws SVG charts of them into
//! `charts/`. The output folder is `target/bench` unless `--out` names another
//! (`bench/results` holds the runs the documentation cites).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{setup, util};

/// The subcommands run, in order, and whether each has a local (threads) form.
const SUBCOMMANDS: [(&str, bool); 7] = [
    ("peer-check", false),
    ("transport", true),
    ("objects", true),
    ("ipc", true),
    ("allreduce", true),
    ("lifecycle", true),
    ("queue", true),
];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut mpi = true;
    let mut out = util::root().join("target/bench");
    let mut only: Option<Vec<String>> = None;
    let mut args = args.iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--no-mpi" => mpi = false,
            "--out" => {
                let dir = args.next().ok_or("`--out` needs a folder")?;
                out = util::root().join(dir);
            }
            "--only" => {
                let list = args.next().ok_or("`--only` needs subcommands")?;
                let names: Vec<String> = list.split(',').map(str::to_owned).collect();
                if let Some(bad) = names
                    .iter()
                    .find(|n| !SUBCOMMANDS.iter().any(|(s, _)| s == n))
                {
                    return Err(format!("unknown subcommand `{bad}` in `--only`"));
                }
                only = Some(names);
            }
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    if mpi {
        setup::ensure_mpi_toolchain()?;
    }
    let mut build = util::cargo();
    build.args(["build", "--release", "-p", "tpcomm-bench"]);
    if mpi {
        build.args(["--features", "mpi"]);
    }
    // Paths inside the workspace are given relative to it (the commands run there), so
    // that the recorded tables and reports name no folder of this machine.
    let root = util::root();
    let exe = util::build_executable(build, "tpcomm-bench")?;
    let exe = relative(&exe, &root);
    let out_arg = relative(&out, &root);
    let date = utc_date(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| e.to_string())?
            .as_secs(),
    );

    let mut reports = Vec::new();
    for (sub, local) in SUBCOMMANDS {
        if only.as_ref().is_some_and(|o| !o.iter().any(|n| n == sub)) {
            continue;
        }
        if local {
            let stem = format!("{sub}-local2-{date}");
            let mut cmd = Command::new(&exe);
            cmd.current_dir(&root).args([sub, "--ranks", "2"]);
            reports.push(record(cmd, &out, &out_arg, &stem)?);
        }
        if mpi {
            let stem = format!("{sub}-mpi2-{date}");
            let mut cmd = util::mpirun(2);
            cmd.arg(&exe).args([sub, "--transport", "mpi"]);
            reports.push(record(cmd, &out, &out_arg, &stem)?);
        } else if !local {
            eprintln!("xtask bench: {sub} needs MPI; skipped under --no-mpi");
        }
    }
    if reports.is_empty() {
        return Err("nothing to run".into());
    }
    let mut plot = Command::new(&exe);
    plot.current_dir(&root)
        .arg("plot")
        .args(&reports)
        .arg("-o")
        .arg(out_arg.join("charts"));
    util::run(plot)?;
    eprintln!(
        "xtask bench: reports, tables and charts written under {}",
        out.display()
    );
    Ok(())
}

/// `path` relative to `root` when it lies inside it (then `./`-prefixed for an executable
/// to be found without `PATH`), otherwise as given.
fn relative(path: &Path, root: &Path) -> PathBuf {
    match path.strip_prefix(root) {
        Ok(inner) => Path::new(".").join(inner),
        Err(_) => path.to_path_buf(),
    }
}

/// Runs one benchmark (in the workspace root) with `--json OUT/STEM.json`, echoing its
/// table and keeping it in `OUT/STEM.txt`; returns the JSON's path as given to it. `out` is
/// the folder, `out_arg` the same folder as the command names it.
fn record(mut cmd: Command, out: &Path, out_arg: &Path, stem: &str) -> Result<PathBuf, String> {
    let json = out_arg.join(format!("{stem}.json"));
    let txt = out.join(format!("{stem}.txt"));
    cmd.arg("--json").arg(&json);
    let shown = util::show(&cmd);
    let mut table = format!(
        "# recorded by cargo xtask bench: commit {}, load average {} at the start\n",
        commit(),
        util::load_average()
    );
    let ok = util::run_lines(cmd, |line| {
        table.push_str(line);
        table.push('\n');
    })?;
    if !ok {
        return Err(format!("`{shown}` failed"));
    }
    std::fs::write(&txt, table).map_err(|e| format!("writing {}: {e}", txt.display()))?;
    Ok(json)
}

/// The checked-out commit (`git rev-parse --short HEAD`), with `+ changes` when tracked
/// files differ from it; `unknown` outside a git checkout.
fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(util::root())
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(head) => match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(changes) if changes.is_empty() => head,
            _ => format!("{head} + changes"),
        },
        None => "unknown".into(),
    }
}

/// `YYYY-MM-DD` (UTC) of `secs` seconds since the Unix epoch (the proleptic Gregorian
/// calendar's civil date of the day count).
fn utc_date(secs: u64) -> String {
    let days = (secs / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::utc_date;

    #[test]
    fn dates_are_the_utc_calendar_day_of_the_timestamp() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
        assert_eq!(utc_date(1_798_761_599), "2026-12-31");
        assert_eq!(utc_date(1_798_761_600), "2027-01-01");
    }
}
