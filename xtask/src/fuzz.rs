//! `cargo xtask fuzz --seconds N [TARGET...]`: builds the libFuzzer targets in `fuzz/` with
//! `cargo fuzz` and runs each for N seconds, then prints executions and findings per target.
//!
//! Only stable Rust is installed: `cargo fuzz` needs nightly flags (`-Zsanitizer=address`,
//! sanitizer coverage), which `RUSTC_BOOTSTRAP=1` unlocks on a stable compiler. The targets
//! are built once, optimized with debug assertions (so arithmetic overflow is a finding).
//! Each run reads the committed seeds in `fuzz/corpus/<target>/` and writes what it
//! discovers to `fuzz/target/corpus/<target>/` (ignored), so the committed corpus only
//! changes by hand; a crash input lands in `fuzz/target/artifacts/<target>/`.

use std::path::Path;
use std::process::{Command, Stdio};

use std::io::{BufRead, BufReader};

use crate::util;

/// Every target in `fuzz/Cargo.toml`.
const TARGETS: [&str; 4] = ["length_exchange", "round_schedule", "decode", "host_handle"];

/// libFuzzer's `-max_len` for targets whose interesting inputs are larger than its guess
/// (the largest seed, at least 4096 bytes): `decode` must reach values nested 30,000 levels
/// deep (60 KB), past which an unbounded decoder overflowed the stack.
fn max_len(target: &str) -> Option<usize> {
    match target {
        "decode" => Some(128 << 10),
        _ => None,
    }
}

/// Flags shared by the build and the runs, so that `cargo fuzz run` does not rebuild.
const BUILD_FLAGS: [&str; 2] = ["-O", "--debug-assertions"];

struct Outcome {
    target: &'static str,
    executions: Option<u64>,
    finding: Option<String>,
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut seconds: u64 = 10;
    let mut chosen: Vec<&'static str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                let v = it.next().ok_or("--seconds needs a value")?;
                seconds = v
                    .parse()
                    .map_err(|_| format!("--seconds takes a whole number, not `{v}`"))?;
            }
            name => match TARGETS.iter().find(|t| **t == name) {
                Some(t) => chosen.push(t),
                None => {
                    return Err(format!(
                        "unknown fuzz target or option `{name}` (targets: {})",
                        TARGETS.join(", ")
                    ))
                }
            },
        }
    }
    if chosen.is_empty() {
        chosen = TARGETS.to_vec();
    }
    let outcomes = run_targets(&chosen, seconds)?;
    let found = outcomes.iter().filter(|o| o.finding.is_some()).count();
    if found == 0 {
        Ok(())
    } else {
        Err(format!(
            "{found} target(s) found a failing input: replay it with \
             `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run {} <target> <input>`, \
             then keep it as a regression test",
            BUILD_FLAGS.join(" ")
        ))
    }
}

/// The smoke pass of `cargo xtask test`: every target for `seconds`; returns
/// `(target, finding)` per target (`None` when it found nothing).
pub(crate) fn smoke(seconds: u64) -> Result<Vec<(&'static str, Option<String>)>, String> {
    let outcomes = run_targets(&TARGETS, seconds)?;
    Ok(outcomes
        .into_iter()
        .map(|o| (o.target, o.finding))
        .collect())
}

/// Installs cargo-fuzz when missing, builds the targets, runs each of `chosen` for
/// `seconds` and prints the table of executions and findings.
fn run_targets(chosen: &[&'static str], seconds: u64) -> Result<Vec<Outcome>, String> {
    ensure_cargo_fuzz()?;
    let fuzz_dir = util::root().join("fuzz");

    let mut build = fuzz_command(&fuzz_dir);
    build.arg("build").args(BUILD_FLAGS);
    util::run(build)?;

    let outcomes: Vec<Outcome> = chosen
        .iter()
        .map(|t| run_target(&fuzz_dir, t, seconds))
        .collect::<Result<_, _>>()?;

    println!("\nfuzz: {seconds} s per target");
    println!("{:<18} {:>14}  findings", "target", "executions");
    for o in &outcomes {
        let execs = o.executions.map_or("?".to_string(), |n| n.to_string());
        let finding = o.finding.as_deref().unwrap_or("none");
        println!("{:<18} {:>14}  {finding}", o.target, execs);
    }
    Ok(outcomes)
}

/// `cargo fuzz` in `fuzz/`, with nightly features unlocked on the stable compiler.
fn fuzz_command(fuzz_dir: &Path) -> Command {
    let mut cmd = util::cargo();
    cmd.arg("fuzz").current_dir(fuzz_dir);
    cmd.env("RUSTC_BOOTSTRAP", "1");
    cmd
}

/// Runs one target for `seconds`, echoing libFuzzer's summary lines.
fn run_target(fuzz_dir: &Path, target: &'static str, seconds: u64) -> Result<Outcome, String> {
    let scratch = fuzz_dir.join("target").join("corpus").join(target);
    let seeds = fuzz_dir.join("corpus").join(target);
    let artifacts = fuzz_dir.join("target").join("artifacts").join(target);
    for dir in [&scratch, &artifacts] {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let mut cmd = fuzz_command(fuzz_dir);
    cmd.arg("run")
        .args(BUILD_FLAGS)
        .arg(target)
        .arg(&scratch)
        .arg(&seeds)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .args(max_len(target).map(|n| format!("-max_len={n}")))
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()));
    eprintln!("$ {}", util::show(&cmd));
    // libFuzzer reports on stderr.
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{}`: {e}", util::show(&cmd)))?;
    let stderr = child.stderr.take().ok_or("child has no stderr")?;
    let mut executions = None;
    let mut finding = None;
    let mut tail: Vec<String> = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.map_err(|e| format!("reading the output of {target}: {e}"))?;
        if let Some(n) = line.strip_prefix("stat::number_of_executed_units:") {
            executions = n.trim().parse().ok();
        }
        if let Some(rest) = line.split("Test unit written to ").nth(1) {
            finding = Some(rest.trim().to_string());
        }
        let summary = line.starts_with("stat::")
            || line.contains("ERROR")
            || line.contains("SUMMARY")
            || line.contains("panicked at")
            || line.contains("Test unit written")
            || line.starts_with("Done ");
        if summary {
            eprintln!("  {target}: {line}");
        }
        tail.push(line);
        if tail.len() > 40 {
            tail.remove(0);
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for {target}: {e}"))?;
    if !status.success() && finding.is_none() {
        for l in &tail {
            eprintln!("  {target}| {l}");
        }
        finding = Some(format!("exited with {status}, no input written"));
    }
    Ok(Outcome {
        target,
        executions,
        finding,
    })
}

/// Makes sure `cargo fuzz` and a C++ compiler (libFuzzer is C++) are present: installed
/// automatically as root, else the commands are printed and the task fails.
fn ensure_cargo_fuzz() -> Result<(), String> {
    let has_cargo_fuzz = util::cargo()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let has_cxx = util::on_path("c++") || util::on_path("g++") || util::on_path("clang++");
    if has_cargo_fuzz && has_cxx {
        return Ok(());
    }
    let mut commands = Vec::new();
    if !has_cxx {
        commands.push("sudo sh -c 'apt-get update && apt-get install -y g++'".to_string());
    }
    if !has_cargo_fuzz {
        commands.push("cargo install cargo-fuzz --locked".to_string());
    }
    if !util::is_root() {
        return Err(format!(
            "missing {}; install with:\n    {}\nthen run the task again",
            [
                (!has_cxx).then_some("a C++ compiler"),
                (!has_cargo_fuzz).then_some("cargo-fuzz")
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" and "),
            commands.join("\n    ")
        ));
    }
    if !has_cxx {
        let mut update = Command::new("apt-get");
        update.arg("update");
        util::run(update)?;
        let mut install = Command::new("apt-get");
        install.args(["install", "-y", "g++"]);
        install.env("DEBIAN_FRONTEND", "noninteractive");
        util::run(install)?;
    }
    if !has_cargo_fuzz {
        let mut install = util::cargo();
        install.args(["install", "cargo-fuzz", "--locked"]);
        util::run(install)?;
    }
    Ok(())
}
