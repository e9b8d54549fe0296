//! Small process helpers shared by the tasks.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The workspace root (the parent of this crate's folder).
pub(crate) fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// `cargo` as invoked by the user (respects `$CARGO`).
pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// Renders a command for logs.
pub(crate) fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` with inherited output; fails unless it exits 0.
pub(crate) fn run(mut cmd: Command) -> Result<(), String> {
    eprintln!("$ {}", show(&cmd));
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start `{}`: {e}", show(&cmd)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed ({status})", show(&cmd)))
    }
}

/// Runs `cmd`, echoing its stdout line by line and handing each line to `on_line`
/// (stderr is inherited). Returns whether it exited 0.
pub(crate) fn run_lines(mut cmd: Command, mut on_line: impl FnMut(&str)) -> Result<bool, String> {
    eprintln!("$ {}", show(&cmd));
    cmd.stdout(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{}`: {e}", show(&cmd)))?;
    let stdout = child.stdout.take().ok_or("child has no stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(|e| format!("reading output of `{}`: {e}", show(&cmd)))?;
        println!("{line}");
        on_line(&line);
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for `{}`: {e}", show(&cmd)))?;
    Ok(status.success())
}

/// Runs a conformance program (echoing its lines, see [`run_lines`]) that prints one
/// `case NAME ... ok` or `case NAME ... FAILED: why` line per case: whether it exited 0, and
/// how many cases passed and failed.
pub(crate) fn run_cases(cmd: Command) -> Result<(bool, u64, u64), String> {
    let (mut passed, mut failed) = (0u64, 0u64);
    let ok = run_lines(cmd, |line| {
        if line.starts_with("case ") {
            if line.ends_with(" ... ok") {
                passed += 1;
            } else {
                failed += 1;
            }
        }
    })?;
    Ok((ok, passed, failed))
}

/// Whether `program` is found on PATH.
pub(crate) fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false)
}

/// Whether this process runs as root.
pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Builds the MPI program `bin` of `tpcomm-conformance` (`tests/src/bin/`) with the `mpi`
/// feature and returns its path.
pub(crate) fn mpi_program(bin: &str, release: bool) -> Result<PathBuf, String> {
    let mut build = cargo();
    build.arg("build");
    if release {
        build.arg("--release");
    }
    build.args([
        "-p",
        "tpcomm-conformance",
        "--features",
        "mpi",
        "--bin",
        bin,
    ]);
    build_executable(build, bin)
}

/// Runs `cmd` (a `cargo build` or `cargo test --no-run` of one executable) and returns the
/// path of the executable cargo reports, wherever the target directory is
/// (`CARGO_TARGET_DIR`, `build.target-dir`). Diagnostics go to stderr.
pub(crate) fn build_executable(mut cmd: Command, what: &str) -> Result<PathBuf, String> {
    cmd.arg("--message-format=json-render-diagnostics");
    eprintln!("$ {}", show(&cmd));
    let output = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start `{}`: {e}", show(&cmd)))?;
    if !output.status.success() {
        return Err(format!("building {what} failed ({})", output.status));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let exes: Vec<String> = stdout
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
        .filter_map(|l| json_string_field(l, "executable"))
        .collect();
    match exes.as_slice() {
        [one] => Ok(PathBuf::from(one)),
        [] => Err(format!("building {what}: cargo reported no executable")),
        many => Err(format!(
            "building {what}: cargo reported several executables: {many:?}"
        )),
    }
}

/// The string value of `"field":"..."` in one line of cargo's JSON messages (`None` when the
/// field is absent or `null`). Handles the escapes JSON strings may carry.
fn json_string_field(line: &str, field: &str) -> Option<String> {
    let key = format!("\"{field}\":\"");
    let start = line.find(&key)? + key.len();
    let mut out = String::new();
    let mut chars = line[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'u' => {
                    let hex: String = chars.by_ref().take(4).collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`), or "unknown", for the first
/// line of a recorded run.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The `mpirun` command line for `np` ranks (Open MPI needs flags to run as root and to
/// place more ranks than cores).
pub(crate) fn mpirun(np: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    let version = Command::new("mpirun")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        })
        .unwrap_or_default();
    if version.contains("Open MPI") || version.contains("OpenRTE") {
        if is_root() {
            cmd.arg("--allow-run-as-root");
        }
        cmd.args(["--oversubscribe", "--bind-to", "none"]);
    }
    cmd.arg("-np").arg(np.to_string());
    cmd.current_dir(root());
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executables_are_read_from_cargo_messages() {
        let line = r#"{"reason":"compiler-artifact","target":{"name":"cuda"},"executable":"/w/target/gpu-check/deps/cuda-0123","fresh":true}"#;
        assert_eq!(
            json_string_field(line, "executable").as_deref(),
            Some("/w/target/gpu-check/deps/cuda-0123")
        );
        let null = r#"{"reason":"compiler-artifact","executable":null}"#;
        assert_eq!(json_string_field(null, "executable"), None);
        let escaped = r#"{"executable":"/a \"b\"\\c\u0041"}"#;
        assert_eq!(
            json_string_field(escaped, "executable").as_deref(),
            Some("/a \"b\"\\cA")
        );
    }
}
