//! `cargo xtask soak --minutes N`: the mixed soak loop under `mpirun -np 2`.
//!
//! Builds `mpi-soak` (release) and runs it for N minutes (default 1): object collectives
//! of random sizes, all-reduces of random sizes and dtypes, captured-plan replays, bursts of
//! broadcast-queue messages (millions of them in a minute) and a suspend/resume of the
//! all-reduce and the queue every 300 operations, every result checked. Each rank prints its
//! operations per second and its descriptors, mappings and resident memory at the start and
//! the end; the task fails if a result was wrong or descriptors or mappings grew.

use std::process::Command;

use crate::{setup, util};

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut minutes = 1.0f64;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--minutes" => {
                let v = it.next().ok_or("--minutes needs a value")?;
                minutes = v
                    .parse()
                    .map_err(|_| format!("--minutes: `{v}` is not a number"))?;
                if minutes.is_nan() || minutes <= 0.0 {
                    return Err("--minutes must be positive".into());
                }
            }
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    setup::ensure_mpi_toolchain()?;
    let exe = util::mpi_program("mpi-soak", true)?;
    let limit = (minutes * 60.0) as u64 + 300;
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &limit.to_string()]);
    let mpirun = util::mpirun(2);
    cmd.arg(mpirun.get_program()).args(mpirun.get_args());
    cmd.arg(&exe);
    cmd.env("TPCOMM_SOAK_SECONDS", (minutes * 60.0).to_string());
    cmd.current_dir(util::root());
    util::run(cmd)
}
