//! `cargo xtask setup`: the system packages the MPI backend needs.
//!
//! rsmpi's build needs `mpicc` on PATH and libclang (bindgen). As root the packages are
//! installed with apt-get; otherwise the exact command is printed and the task fails.

use std::path::Path;
use std::process::Command;

use crate::util;

/// The Debian packages for the MPI backend (see shared/TOOLCHAIN.md).
pub(crate) const MPI_PACKAGES: [&str; 3] = ["libopenmpi-dev", "openmpi-bin", "libclang-dev"];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if let Some(a) = args.first() {
        return Err(format!("setup takes no arguments (got `{a}`)"));
    }
    ensure_mpi_toolchain()?;
    ensure_mpi4py();
    Ok(())
}

/// Best effort: installs mpi4py from PyPI (built against the MPI just ensured) for the
/// Python peer of `tpcomm-bench objects`; without it the bench says mpi4py is absent.
fn ensure_mpi4py() {
    let have = |args: &[&str]| {
        Command::new("python3")
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if have(&["-c", "import mpi4py"]) || !have(&["-m", "pip", "--version"]) {
        return;
    }
    eprintln!(
        "xtask: installing mpi4py (python3 -m pip install mpi4py) for the bench's Python peer"
    );
    if !have(&["-m", "pip", "install", "--quiet", "mpi4py"]) {
        eprintln!(
            "xtask: warning: mpi4py did not install; `tpcomm-bench objects` will run without it"
        );
    }
}

fn libclang_present() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    let dirs = [
        "/usr/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
    ];
    let mut candidates: Vec<std::path::PathBuf> =
        dirs.iter().map(|d| Path::new(d).to_path_buf()).collect();
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("llvm-") {
                candidates.push(e.path().join("lib"));
            }
        }
    }
    candidates.iter().any(|dir| {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("libclang"))
            })
            .unwrap_or(false)
    })
}

fn missing() -> Vec<&'static str> {
    let mut m = Vec::new();
    if !util::on_path("mpicc") {
        m.push("mpicc");
    }
    if !util::on_path("mpirun") {
        m.push("mpirun");
    }
    if !libclang_present() {
        m.push("libclang");
    }
    m
}

/// Makes sure `mpicc`, `mpirun` and libclang are present, installing them as root.
pub(crate) fn ensure_mpi_toolchain() -> Result<(), String> {
    let missing = missing();
    if missing.is_empty() {
        return Ok(());
    }
    let command = format!(
        "apt-get update && apt-get install -y {}",
        MPI_PACKAGES.join(" ")
    );
    if !util::is_root() {
        return Err(format!(
            "missing {}; install them with:\n    sudo sh -c '{command}'\nthen run the task again",
            missing.join(", ")
        ));
    }
    eprintln!(
        "xtask: missing {}; installing: {command}",
        missing.join(", ")
    );
    let mut update = Command::new("apt-get");
    update.arg("update");
    util::run(update)?;
    let mut install = Command::new("apt-get");
    install.args(["install", "-y"]).args(MPI_PACKAGES);
    install.env("DEBIAN_FRONTEND", "noninteractive");
    util::run(install)?;
    let still = self::missing();
    if still.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "still missing after the install: {}",
            still.join(", ")
        ))
    }
}
