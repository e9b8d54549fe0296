//! `cargo xtask bench`: runs the benchmark CLI the way `docs/benchmarks.md` records it: the
//! transport tables (local 2 and 4 ranks; MPI 2 ranks with the MPI peer, and `peer-check`
//! of that peer against a C loop), their JSON under `target/bench`, and SVG charts of them
//! under `target/bench/charts`.

use std::process::Command;

use crate::{setup, util};

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut mpi = true;
    for a in args {
        match a.as_str() {
            "--no-mpi" => mpi = false,
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    let out = util::root().join("target/bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    if mpi {
        setup::ensure_mpi_toolchain()?;
    }
    let mut build = util::cargo();
    build.args(["build", "--release", "-p", "tpcomm-bench"]);
    if mpi {
        build.args(["--features", "mpi"]);
    }
    let exe = util::build_executable(build, "tpcomm-bench")?;

    for ranks in ["2", "4"] {
        let mut local = Command::new(&exe);
        let json = out.join(format!("transport-local-{ranks}.json"));
        local
            .args(["transport", "--ranks", ranks, "--json"])
            .arg(&json);
        util::run(local)?;
    }
    if mpi {
        let mut cmd = util::mpirun(2);
        cmd.arg(&exe)
            .args(["transport", "--transport", "mpi", "--json"]);
        cmd.arg(out.join("transport-mpi-2.json"));
        util::run(cmd)?;
        let mut check = util::mpirun(2);
        check
            .arg(&exe)
            .args(["peer-check", "--transport", "mpi", "--json"]);
        check.arg(out.join("peer-check-mpi-2.json"));
        util::run(check)?;
    }
    let mut plot = Command::new(&exe);
    plot.arg("plot");
    for entry in std::fs::read_dir(&out).map_err(|e| format!("reading {}: {e}", out.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|e| e == "json") {
            plot.arg(path);
        }
    }
    plot.arg("-o").arg(out.join("charts"));
    util::run(plot)?;
    eprintln!("xtask bench: JSON written under {}", out.display());
    Ok(())
}
