//! The crate builds from its own package: the CUDA sources its build script compiles are
//! inside the crate directory (through the `kernels` symlink), and `cargo package` packs them.

use std::path::Path;
use std::process::Command;

#[test]
fn the_kernel_sources_are_inside_the_crate() {
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    for file in ["allreduce.cu", "allreduce.cuh"] {
        assert!(
            kernels.join(file).is_file(),
            "{} is missing: build.rs reads the kernels from the crate's own directory",
            kernels.join(file).display()
        );
    }
}

#[test]
fn cargo_package_lists_the_kernel_sources() {
    let output = Command::new(env!("CARGO"))
        .args(["package", "-p", "tpcomm-kernels", "--list", "--allow-dirty"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    let listed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "cargo package --list failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    for file in ["kernels/allreduce.cu", "kernels/allreduce.cuh", "build.rs"] {
        assert!(
            listed.lines().any(|l| l == file),
            "the package lacks {file}:\n{listed}"
        );
    }
}
