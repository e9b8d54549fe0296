//! The driver probe's package, `xtask/cuda-probe` (`tpcomm-cuda-probe`, binary `ipc-probe`):
//! a workspace of its own, outside the root one, so that `cargo build --workspace` never
//! builds it. `gpu-check` builds it and runs it first; `test` checks its formatting, lints and
//! unit tests. Cargo runs on it from the workspace root, with `--manifest-path`.

use std::process::Command;

use crate::util;

/// The probe's manifest, relative to the workspace root.
pub(crate) const MANIFEST: &str = "xtask/cuda-probe/Cargo.toml";

/// Where cargo builds the probe, relative to the workspace root.
const TARGET_DIR: &str = "target/cuda-probe";

/// `cargo` from the workspace root, building into `target/cuda-probe` (a target folder chosen
/// for the root workspace does not leak into the probe's). The caller adds the subcommand
/// and `--manifest-path` [`MANIFEST`].
pub(crate) fn cargo() -> Command {
    let mut cmd = util::cargo();
    cmd.env("CARGO_TARGET_DIR", util::root().join(TARGET_DIR));
    cmd
}

/// `cargo SUBCOMMAND --manifest-path xtask/cuda-probe/Cargo.toml`, as [`cargo`].
pub(crate) fn cargo_on(subcommand: &str) -> Command {
    let mut cmd = cargo();
    cmd.args([subcommand, "--manifest-path", MANIFEST]);
    cmd
}
