//! `cargo xtask downstream`: builds the programs under `tests/downstream/`, each a crate
//! outside the workspace that depends on tpcomm's `gpu` feature next to its own cudarc,
//! configured the way engines configure it (like candle-core 0.11: linked dynamically, CUDA
//! version from nvcc; cudarc's defaults; an explicit older CUDA version). Each one must
//! build and hold a single cudarc in its dependency graph (`cargo tree -i cudarc`). Part of
//! `cargo xtask test`, where each program counts as one test. Each program has a
//! `Cargo.lock` (updated in place when tpcomm's own dependencies change).
//!
//! The builds need nvcc on `PATH` (cudarc's `cuda-version-from-build-system` runs `nvcc
//! --version`, and tpcomm-kernels compiles the kernels): the one `ensure_nvcc` finds (the
//! pinned wheels of `cargo xtask setup-cuda` when nothing else) is put first on `PATH`. They
//! share `target/downstream` so that what does not depend on the cudarc configuration (the
//! kernels among them) is built once. Nothing is linked against libcuda or run: no GPU is
//! needed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::{cuda, util};

/// Where the programs live, relative to the workspace root.
const DIR: &str = "tests/downstream";

/// One program's outcome: its name, and `None` when it built with one cudarc, else what
/// went wrong.
pub(crate) type Outcome = (String, Option<String>);

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if let Some(a) = args.first() {
        return Err(format!("downstream takes no arguments (got `{a}`)"));
    }
    let failed = check_all()?
        .iter()
        .filter(|(_, finding)| finding.is_some())
        .count();
    if failed > 0 {
        return Err(format!("{failed} downstream program(s) failed"));
    }
    Ok(())
}

/// Builds and checks every program; prints one `downstream NAME ... ok|FAILED` line each.
pub(crate) fn check_all() -> Result<Vec<Outcome>, String> {
    let nvcc = cuda::ensure_nvcc()?;
    let nvcc_dir = nvcc
        .path()
        .parent()
        .ok_or("nvcc has no parent folder")?
        .to_path_buf();
    let programs = programs()?;
    let mut outcomes = Vec::new();
    for dir in programs {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let started = Instant::now();
        let finding = check(&dir, &nvcc_dir).err();
        match &finding {
            None => println!(
                "downstream {name} ... ok ({:.0} s)",
                started.elapsed().as_secs_f64()
            ),
            Some(f) => println!("downstream {name} ... FAILED: {f}"),
        }
        outcomes.push((name, finding));
    }
    Ok(outcomes)
}

/// The program folders, sorted; an error when there is none.
fn programs() -> Result<Vec<PathBuf>, String> {
    let dir = util::root().join(DIR);
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if path.join("Cargo.toml").is_file() {
            found.push(path);
        }
    }
    if found.is_empty() {
        return Err(format!("no program under {}", dir.display()));
    }
    found.sort();
    Ok(found)
}

/// A cargo command on the program in `dir`, with nvcc first on `PATH`.
fn cargo_in(dir: &Path, nvcc_dir: &Path) -> Result<Command, String> {
    let mut cmd = util::cargo();
    cmd.current_dir(dir);
    let mut paths = vec![nvcc_dir.to_path_buf()];
    if let Some(old) = std::env::var_os("PATH") {
        paths.extend(std::env::split_paths(&old));
    }
    let joined = std::env::join_paths(paths).map_err(|e| format!("PATH: {e}"))?;
    cmd.env("PATH", joined);
    // The program is a workspace of its own: a target folder chosen for the workspace must
    // not leak into it (`--target-dir` says where it builds).
    cmd.env_remove("CARGO_TARGET_DIR");
    Ok(cmd)
}

fn check(dir: &Path, nvcc_dir: &Path) -> Result<(), String> {
    let mut build = cargo_in(dir, nvcc_dir)?;
    build
        .args(["build", "--target-dir"])
        .arg(util::root().join("target/downstream"));
    util::run(build)?;

    // `cargo tree -i cudarc` refuses to pick when the graph holds several cudarcs, and
    // prints the one it holds otherwise.
    let mut tree = cargo_in(dir, nvcc_dir)?;
    tree.args(["tree", "-i", "cudarc", "--depth", "0", "-e", "normal,build"]);
    eprintln!("$ {}", util::show(&tree));
    let out = tree
        .output()
        .map_err(|e| format!("cannot start `{}`: {e}", util::show(&tree)))?;
    let listed = String::from_utf8_lossy(&out.stdout);
    let held: Vec<&str> = listed
        .lines()
        .filter(|l| l.starts_with("cudarc v"))
        .collect();
    if !out.status.success() || held.len() != 1 {
        return Err(format!(
            "the dependency graph must hold exactly one cudarc; `{}` said: {} {}",
            util::show(&tree),
            listed.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    eprintln!("one cudarc: {}", held[0]);
    Ok(())
}
