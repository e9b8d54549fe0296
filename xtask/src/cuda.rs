//! `cargo xtask setup-cuda` and `cargo xtask kernels`.
//!
//! - `setup-cuda`: when no nvcc is found (`$NVCC`, `$CUDA_HOME`, `PATH`, the unpacked
//!   wheels), downloads the pinned CUDA 13.0 compiler wheels with pip into
//!   `target/cuda-wheels` and unpacks them into `target/cuda` with python3's zipfile
//!   (keeping execute bits; no `unzip` needed). Idempotent: a second run finds nvcc and
//!   does nothing. No GPU needed.
//! - `kernels`: builds `kernels/allreduce.cu` into `target/kernels/allreduce.fatbin` with
//!   the same builder the `tpcomm-kernels` build script uses, prints the ptxas resource
//!   table (registers per kernel per architecture), the entry points per architecture and
//!   the build time; fails on any register spill or local-memory use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use tpcomm_kernel_build::fatbin::Fatbin;
use tpcomm_kernel_build::{build_fatbin, format_table, Nvcc, WHEELS_DIR};

use crate::util;

/// The pinned compiler wheels (see shared/TOOLCHAIN.md): nvcc, its front end headers,
/// NVVM, the runtime headers and CCCL. About 100 MB download, 270 MB unpacked.
pub(crate) const CUDA_WHEELS: [&str; 5] = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
];

/// Where pip puts the wheels, relative to the workspace root.
const WHEELS_DOWNLOAD_DIR: &str = "target/cuda-wheels";

/// Unpacks every wheel of `argv[1]` into `argv[2]`, restoring the Unix permission bits that
/// zipfile drops (nvcc, ptxas, cicc must stay executable).
const UNPACK_PY: &str = r#"
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
wheels = sorted(f for f in os.listdir(src) if f.endswith(".whl"))
if not wheels:
    sys.exit("no wheels in " + src)
for name in wheels:
    with zipfile.ZipFile(os.path.join(src, name)) as z:
        for info in z.infolist():
            path = z.extract(info, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)
    print("unpacked", name)
"#;

pub(crate) fn setup_cuda(args: &[String]) -> Result<(), String> {
    if let Some(a) = args.first() {
        return Err(format!("setup-cuda takes no arguments (got `{a}`)"));
    }
    ensure_nvcc().map(|_| ())
}

fn describe(nvcc: &Nvcc) -> Result<String, String> {
    let version = nvcc.version().map_err(|e| e.to_string())?;
    Ok(format!(
        "{} (found via {}): {version}",
        nvcc.path().display(),
        nvcc.origin()
    ))
}

fn python() -> &'static str {
    if util::on_path("python3") {
        "python3"
    } else {
        "python"
    }
}

/// Finds nvcc, downloading and unpacking the pinned wheels first when there is none.
pub(crate) fn ensure_nvcc() -> Result<Nvcc, String> {
    let root = util::root();
    if let Ok(nvcc) = Nvcc::locate(&root) {
        println!("nvcc: {}", describe(&nvcc)?);
        return Ok(nvcc);
    }
    let started = Instant::now();
    let wheels = root.join(WHEELS_DOWNLOAD_DIR);
    let unpacked = root.join(WHEELS_DIR);
    let partial = root.join(format!("{WHEELS_DIR}.partial"));
    for dir in [&wheels, &partial] {
        remove_dir_if_present(dir)?;
    }
    std::fs::create_dir_all(&wheels).map_err(|e| format!("{}: {e}", wheels.display()))?;

    let mut download = Command::new(python());
    download
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(&wheels)
        .args(CUDA_WHEELS);
    util::run(download).map_err(|e| {
        format!("{e}\n(the CUDA compiler wheels come from the Python package registry)")
    })?;

    // Unpack next to the final folder and rename, so an interrupted run never leaves a
    // half-unpacked toolkit that `locate` would accept.
    let script = root.join("target/cuda-unpack.py");
    std::fs::write(&script, UNPACK_PY).map_err(|e| format!("{}: {e}", script.display()))?;
    let mut unpack = Command::new(python());
    unpack.arg(&script).arg(&wheels).arg(&partial);
    util::run(unpack)?;
    remove_dir_if_present(&unpacked)?;
    std::fs::rename(&partial, &unpacked).map_err(|e| {
        format!(
            "renaming {} to {}: {e}",
            partial.display(),
            unpacked.display()
        )
    })?;

    let nvcc = Nvcc::locate(&root).map_err(|e| e.to_string())?;
    println!(
        "nvcc: {} (downloaded and unpacked in {:.1} s)",
        describe(&nvcc)?,
        started.elapsed().as_secs_f64()
    );
    Ok(nvcc)
}

fn remove_dir_if_present(dir: &Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("removing {}: {e}", dir.display())),
    }
}

/// The fatbin `cargo xtask kernels` writes.
pub(crate) fn fatbin_path() -> PathBuf {
    util::root().join("target/kernels/allreduce.fatbin")
}

pub(crate) fn kernels(args: &[String]) -> Result<(), String> {
    if let Some(a) = args.first() {
        return Err(format!("kernels takes no arguments (got `{a}`)"));
    }
    let root = util::root();
    let nvcc = Nvcc::locate(&root).map_err(|e| e.to_string())?;
    println!("nvcc: {}", describe(&nvcc)?);
    let source = root.join("kernels/allreduce.cu");
    let output = fatbin_path();
    let built = build_fatbin(&nvcc, &source, &output).map_err(|e| e.to_string())?;
    println!("\nptxas resource report (registers per thread; launch bound 512 threads):");
    print!("{}", format_table(&built.resources));

    let bytes = std::fs::read(&output).map_err(|e| format!("{}: {e}", output.display()))?;
    let fatbin = Fatbin::parse(&bytes).map_err(|e| format!("{}: {e}", output.display()))?;
    println!();
    for entry in fatbin.entries() {
        let names = entry
            .entry_points()
            .map_err(|e| format!("{}: {e}", output.display()))?;
        println!(
            "{:<11} {:>8} bytes, {} entry points",
            entry.target_name(),
            entry.payload.len(),
            names.len()
        );
    }
    println!(
        "\nbuilt {} ({} bytes) in {:.1} s",
        output.strip_prefix(&root).unwrap_or(&output).display(),
        bytes.len(),
        built.elapsed.as_secs_f64()
    );
    Ok(())
}
