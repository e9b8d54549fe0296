//! Builds `kernels/allreduce.cu` into `$OUT_DIR/allreduce.fatbin` with the shared builder
//! (the same code `cargo xtask kernels` runs), and writes the ptxas resource table next to
//! it. Fails with the builder's message when nvcc is missing or a kernel spills.
//!
//! The sources are read from this crate's own `kernels/` (in the repository a symlink to the
//! workspace's `kernels/`, the one copy of the sources; `cargo package` follows it and
//! packs the files), so the crate also builds from its package.

use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let root = manifest
        .parent()
        .and_then(Path::parent)
        .unwrap_or(&manifest)
        .to_path_buf();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let kernels = manifest.join("kernels");
    println!("cargo::rerun-if-changed={}", kernels.display());
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");

    if let Err(e) = build(&root, &kernels, &out_dir) {
        eprintln!("error: building the CUDA kernels failed: {e}");
        std::process::exit(1);
    }
}

fn build(root: &Path, kernels: &Path, out_dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let nvcc = tpcomm_kernel_build::Nvcc::locate(root)?;
    // A different compiler (another toolkit, re-unpacked wheels) means a rebuild.
    println!("cargo::rerun-if-changed={}", nvcc.path().display());
    let version = nvcc.version()?;
    let built = tpcomm_kernel_build::build_fatbin(
        &nvcc,
        &kernels.join("allreduce.cu"),
        &out_dir.join("allreduce.fatbin"),
    )?;
    let table = tpcomm_kernel_build::format_table(&built.resources);
    std::fs::write(out_dir.join("resources.txt"), &table)?;
    println!("cargo::rustc-env=TPCOMM_NVCC_VERSION={version}");
    Ok(())
}
