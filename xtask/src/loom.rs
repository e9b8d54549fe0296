//! `cargo xtask loom`: the loom model checks of the host flag barrier and the two-stage
//! handoff (`crates/tpcomm-allreduce/src/backend/host/flags.rs`, module `loom_tests`) and of
//! the broadcast queue's chunk flags (`crates/tpcomm-queue/src/ring.rs`, module `loom_tests`).
//!
//! Runs `cargo test -p tpcomm-allreduce -p tpcomm-queue --release --lib loom` with
//! `--cfg loom` added to `RUSTFLAGS`, into `target/loom` so the normal build is not
//! invalidated. Each model prints the interleavings it explored and its time.
//! `--preemptions N` overrides every model's preemption bound (through
//! `LOOM_MAX_PREEMPTIONS`).

use crate::util;

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut preemptions = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--preemptions" => {
                let v = it.next().ok_or("--preemptions needs a value")?;
                let n: usize = v
                    .parse()
                    .map_err(|_| format!("--preemptions: `{v}` is not a number"))?;
                preemptions = Some(n);
            }
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    let mut rustflags = std::env::var("RUSTFLAGS").unwrap_or_default();
    if !rustflags.is_empty() {
        rustflags.push(' ');
    }
    rustflags.push_str("--cfg loom");
    let mut cmd = util::cargo();
    cmd.env("RUSTFLAGS", rustflags)
        .env("CARGO_TARGET_DIR", util::root().join("target").join("loom"))
        .args([
            "test",
            "-p",
            "tpcomm-allreduce",
            "-p",
            "tpcomm-queue",
            "--release",
            "--lib",
            "loom",
            "--",
            "--nocapture",
        ]);
    if let Some(n) = preemptions {
        cmd.env("LOOM_MAX_PREEMPTIONS", n.to_string());
    }
    let started = std::time::Instant::now();
    util::run(cmd)?;
    eprintln!("xtask loom: passed in {:.1?}", started.elapsed());
    Ok(())
}
