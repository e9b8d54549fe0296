//! `cargo xtask gpu-check [--bundle DIR]`: the one-shot GPU check.
//!
//! Builds, on a machine without a GPU, everything the GPU check runs: the driver probe
//! (`xtask/cuda-probe`, binary `ipc-probe`, a workspace of its own; run first), the GPU test
//! executables (`tpcomm-allreduce` tests `cuda` and `engine` with `nccl`, `tpcomm-ipc` test `cuda`,
//! `tpcomm-transport` test `nccl`) and `tpcomm-bench` with `cuda,nccl`, in the `gpu-check`
//! profile (release, debug info stripped, debug assertions and overflow checks on), under
//! `target/gpu-check/`. They are copied into a bundle folder with a generated `run.sh`, so
//! that a machine with a GPU but no cargo (and no registry) runs them with one command:
//!
//! ```text
//! cargo xtask gpu-check --bundle .gpu     # here: build and write .gpu/
//! bash .gpu/run.sh                        # there, from the repository root
//! ```
//!
//! Without `--bundle`, the bundle goes to `target/gpu-check/bundle` and `run.sh` runs at once
//! (a developer machine with a GPU). `run.sh`: see [`RUN_SH`].

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cuda, cuda_probe, util};

/// The profile the bundle is built in, defined on the command line (`--config`), so that
/// the workspace's own profiles stay as they are and its artifacts are kept apart.
const PROFILE: &str = "gpu-check";
const PROFILE_CONFIG: [&str; 5] = [
    "profile.gpu-check.inherits=\"release\"",
    "profile.gpu-check.debug=false",
    "profile.gpu-check.strip=\"debuginfo\"",
    "profile.gpu-check.debug-assertions=true",
    "profile.gpu-check.overflow-checks=true",
];

/// The bundle stays small enough to copy to a GPU machine quickly (48 MiB at most).
const MAX_BUNDLE_BYTES: u64 = 48 << 20;

/// The workspace a target's package belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workspace {
    /// The root workspace (`-p PACKAGE`).
    Root,
    /// The driver probe's own (`--manifest-path xtask/cuda-probe/Cargo.toml`), built into
    /// `target/cuda-probe`.
    Probe,
}

/// One executable of the bundle.
struct Target {
    /// File name in `bin/`, and the step name `run.sh` knows it by.
    name: &'static str,
    /// Where its package is.
    workspace: Workspace,
    /// `cargo` arguments after `test --no-run` or `build`.
    cargo_args: &'static [&'static str],
    /// A test executable (run with `--test-threads=1`) rather than the bench.
    test: bool,
    /// The package folder the test runs in (cargo runs tests in their package's root).
    package_dir: &'static str,
}

const TARGETS: [Target; 8] = [
    // The standalone driver probe (two processes, legacy IPC and VMM sharing across a process
    // checkpoint), the `probe` step that runs before the test suites.
    Target {
        name: "ipc-probe",
        workspace: Workspace::Probe,
        cargo_args: &[
            "--manifest-path",
            cuda_probe::MANIFEST,
            "--bin",
            "ipc-probe",
        ],
        test: false,
        package_dir: "xtask/cuda-probe",
    },
    Target {
        name: "tpcomm-allreduce-cuda",
        workspace: Workspace::Root,
        cargo_args: &[
            "-p",
            "tpcomm-allreduce",
            "--features",
            "nccl",
            "--test",
            "cuda",
        ],
        test: true,
        package_dir: "crates/tpcomm-allreduce",
    },
    Target {
        name: "tpcomm-allreduce-engine",
        workspace: Workspace::Root,
        cargo_args: &[
            "-p",
            "tpcomm-allreduce",
            "--features",
            "nccl",
            "--test",
            "engine",
        ],
        test: true,
        package_dir: "crates/tpcomm-allreduce",
    },
    Target {
        name: "tpcomm-ipc-cuda",
        workspace: Workspace::Root,
        cargo_args: &["-p", "tpcomm-ipc", "--features", "cuda", "--test", "cuda"],
        test: true,
        package_dir: "crates/tpcomm-ipc",
    },
    Target {
        name: "tpcomm-transport-nccl",
        workspace: Workspace::Root,
        cargo_args: &[
            "-p",
            "tpcomm-transport",
            "--features",
            "nccl",
            "--test",
            "nccl",
        ],
        test: true,
        package_dir: "crates/tpcomm-transport",
    },
    Target {
        name: "tpcomm-checkpoint-cuda",
        workspace: Workspace::Root,
        cargo_args: &[
            "-p",
            "tpcomm-checkpoint",
            "--features",
            "cuda",
            "--test",
            "cuda",
        ],
        test: true,
        package_dir: "crates/tpcomm-checkpoint",
    },
    Target {
        name: "engine-step",
        workspace: Workspace::Root,
        cargo_args: &[
            "-p",
            "tpcomm-allreduce",
            "--features",
            "nccl",
            "--example",
            "engine_step",
        ],
        test: false,
        package_dir: "crates/tpcomm-allreduce",
    },
    Target {
        name: "tpcomm-bench",
        workspace: Workspace::Root,
        cargo_args: &[
            "-p",
            "tpcomm-bench",
            "--features",
            "cuda,nccl",
            "--bin",
            "tpcomm-bench",
        ],
        test: false,
        package_dir: "crates/tpcomm-bench",
    },
];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut bundle: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bundle" => {
                let dir = it.next().ok_or("--bundle needs a folder")?;
                bundle = Some(PathBuf::from(dir));
            }
            other => match other.strip_prefix("--bundle=") {
                Some(dir) => bundle = Some(PathBuf::from(dir)),
                None => return Err(format!("unknown option `{other}`")),
            },
        }
    }
    let run_here = bundle.is_none();
    let root = util::root();
    let dir = match bundle {
        Some(d) if d.is_absolute() => d,
        // Relative to where the user stands (cargo runs xtask from there).
        Some(d) => std::env::current_dir()
            .map_err(|e| format!("current directory: {e}"))?
            .join(d),
        None => root.join("target/gpu-check/bundle"),
    };

    cuda::ensure_nvcc()?;
    let mut built = Vec::new();
    for target in &TARGETS {
        built.push((target, build(target)?));
    }

    write_bundle(&dir, &built)?;
    let size = dir_size(&dir)?;
    println!(
        "xtask gpu-check: bundle {} ({:.1} MiB)",
        dir.display(),
        size as f64 / (1u64 << 20) as f64
    );
    if size > MAX_BUNDLE_BYTES {
        return Err(format!(
            "the bundle is {size} bytes, above the {MAX_BUNDLE_BYTES}-byte budget"
        ));
    }
    if run_here {
        let mut cmd = Command::new("bash");
        cmd.arg(dir.join("run.sh")).current_dir(&root);
        util::run(cmd)
    } else {
        let shown = dir.strip_prefix(&root).unwrap_or(&dir);
        println!(
            "xtask gpu-check: on the GPU machine, from the repository root: bash {}/run.sh",
            shown.display()
        );
        Ok(())
    }
}

/// Builds one target in the `gpu-check` profile; returns its executable.
fn build(target: &Target) -> Result<PathBuf, String> {
    let mut cmd = match target.workspace {
        Workspace::Root => util::cargo(),
        Workspace::Probe => cuda_probe::cargo(),
    };
    if target.test {
        cmd.args(["test", "--no-run"]);
    } else {
        cmd.arg("build");
    }
    for c in PROFILE_CONFIG {
        cmd.args(["--config", c]);
    }
    cmd.args(["--profile", PROFILE]);
    cmd.args(target.cargo_args);
    util::build_executable(cmd, target.name)
}

/// Writes `bin/`, `run.sh` and `BUNDLE.txt` into `dir`, replacing an earlier bundle's.
fn write_bundle(dir: &Path, built: &[(&Target, PathBuf)]) -> Result<(), String> {
    let err = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let bin = dir.join("bin");
    match std::fs::remove_dir_all(&bin) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(&bin, e)),
    }
    std::fs::create_dir_all(&bin).map_err(|e| err(&bin, e))?;
    for (target, exe) in built {
        let to = bin.join(target.name);
        std::fs::copy(exe, &to).map_err(|e| format!("copying {}: {e}", exe.display()))?;
    }
    let script = dir.join("run.sh");
    std::fs::write(&script, run_sh()).map_err(|e| err(&script, e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| err(&script, e))?;
    }
    let manifest = dir.join("BUNDLE.txt");
    std::fs::write(&manifest, manifest_text(built)).map_err(|e| err(&manifest, e))?;
    Ok(())
}

/// What the bundle holds and where it came from.
fn manifest_text(built: &[(&Target, PathBuf)]) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(util::root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    };
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]);
    let mut s = format!(
        "tpcomm GPU check bundle, written by `cargo xtask gpu-check`\n\
         commit: {}{}\n\
         built: unix time {}\n\
         profile: {PROFILE} ({})\n\n",
        git(&["rev-parse", "HEAD"]),
        if dirty.is_empty() || dirty == "unknown" {
            ""
        } else {
            " (plus uncommitted changes)"
        },
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        PROFILE_CONFIG.join(", "),
    );
    for (target, _) in built {
        let verb = if target.test {
            "test --no-run"
        } else {
            "build"
        };
        s.push_str(&format!(
            "bin/{}: cargo {verb} {}\n",
            target.name,
            target.cargo_args.join(" ")
        ));
    }
    s.push_str(
        "\nrun: bash run.sh [probe|allreduce|engine|ipc|nccl|checkpoint|example|bench|checkpoint-bench ...] (from the repository root)\n",
    );
    s
}

/// Bytes of every file under `dir`.
fn dir_size(dir: &Path) -> Result<u64, String> {
    let mut total = 0;
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        let meta = entry
            .metadata()
            .map_err(|e| format!("{}: {e}", entry.path().display()))?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// The script, with the test steps filled in from [`TARGETS`].
fn run_sh() -> String {
    let mut steps = String::new();
    for t in TARGETS.iter().filter(|t| t.test) {
        let (step, secs) = match t.name {
            "tpcomm-allreduce-cuda" => ("allreduce", 100),
            "tpcomm-allreduce-engine" => ("engine", 60),
            "tpcomm-ipc-cuda" => ("ipc", 45),
            "tpcomm-checkpoint-cuda" => ("checkpoint", 60),
            _ => ("nccl", 45),
        };
        steps.push_str(&format!(
            "run_test {step} {secs} {} {}\n",
            t.name, t.package_dir
        ));
    }
    RUN_SH.replace("@TEST_STEPS@", &steps)
}

/// `run.sh`: environment, device report, the driver probe (`ipc-probe`, 90 s, JSON into
/// `$OUT` when set), each GPU test executable with `--test-threads=1`
/// under a timeout, then `tpcomm-bench gpu` (JSON into `$OUT` when set); everything teed to
/// `$OUT/gpu-check.log` when `$OUT` is set; a summary; exit status 1 when any step failed.
/// The whole script ends within 290 s (each step's timeout is cut to what is left).
const RUN_SH: &str = r#"#!/usr/bin/env bash
# The tpcomm GPU check, generated by `cargo xtask gpu-check` (see BUNDLE.txt).
#   bash run.sh [probe|allreduce|engine|ipc|nccl|checkpoint|example|bench|checkpoint-bench ...]     (all steps when none are named)
# Environment it honours: OUT (a folder for the log and the bench JSON), TPCOMM_NCCL_LIBRARY
# (the full path of libnccl.so.2), TPCOMM_CUBLAS_LIBRARY (the full path of libcublas.so.13 or
# .so.12, for the engine example), TPCOMM_PYTHON (a python whose nvidia-* wheels hold them),
# TPCOMM_BENCH_ARGS (extra options of `tpcomm-bench gpu`).
set -u
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="$BUNDLE/bin"
REPO="$(cd "$BUNDLE/.." && pwd)"
START=$SECONDS
DEADLINE=$((START + 290))

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    LOG="$OUT/gpu-check.log"
    exec > >(tee -a "$LOG") 2>&1
    TEE_PID=$!
    RESULTS="$OUT"
else
    RESULTS="$BUNDLE"
fi

WANT=" ${*:-probe allreduce engine ipc nccl checkpoint example bench checkpoint-bench} "
wanted() { case "$WANT" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

export TPCOMM_REQUIRE_GPU=1
export CUDA_MODULE_LOADING=EAGER
# Every rank's stream its own hardware queue: ranks that are threads on one GPU spin-wait
# on each other, and two of them behind one queue would wait for ever.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export RUST_BACKTRACE=1
export TPCOMM_SKIP_LOG="$RESULTS/gpu-check-skips.log"
rm -f "$TPCOMM_SKIP_LOG"

echo "== tpcomm gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
sed -n '1,3p' "$BUNDLE/BUNDLE.txt" 2>/dev/null
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_mode --format=csv
    nvidia-smi topo -m 2>/dev/null | head -n 12
else
    echo "nvidia-smi: not found"
fi
[ -r /proc/driver/nvidia/version ] && head -n 1 /proc/driver/nvidia/version

# wheel_lib PATTERN: the lib folder of an nvidia-* python wheel holding a file named PATTERN
# (nvidia/<package>/lib/PATTERN: nvidia/nccl/lib, nvidia/cublas/lib, nvidia/cu13/lib, ...), the
# highest version when several match; asks TPCOMM_PYTHON, python3, python, then a torch venv
# under /opt/torch. Prints nothing when none holds it.
wheel_lib() {
    local py dir
    for py in ${TPCOMM_PYTHON:-} python3 python /opt/torch/.venv/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        dir="$("$py" - "$1" <<'PY' 2>/dev/null
import glob, importlib.util, os, re, sys
pattern = sys.argv[1]
roots = []
try:
    spec = importlib.util.find_spec("nvidia")
    if spec:
        roots += list(spec.submodule_search_locations or [])
except Exception:
    pass
roots += [os.path.join(p, "nvidia") for p in sys.path if p]
hits = []
for root in roots:
    hits += glob.glob(os.path.join(root, "*", "lib", pattern))
if hits:
    version = lambda h: [int(n) for n in re.findall(r"\d+", os.path.basename(h))]
    print(os.path.dirname(max(hits, key=version)))
PY
)"
        if [ -n "$dir" ]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

# libnccl: TPCOMM_NCCL_LIBRARY if set, else the nvidia-nccl-cu* wheel of python, else the
# loader path. Its folder goes first on LD_LIBRARY_PATH either way.
NCCL_DIR=""
if [ -n "${TPCOMM_NCCL_LIBRARY:-}" ]; then
    NCCL_DIR="$(dirname "$TPCOMM_NCCL_LIBRARY")"
    echo "libnccl: TPCOMM_NCCL_LIBRARY=$TPCOMM_NCCL_LIBRARY"
else
    NCCL_DIR="$(wheel_lib libnccl.so.2)"
    if [ -n "$NCCL_DIR" ]; then
        echo "libnccl: $NCCL_DIR/libnccl.so.2 (python wheel)"
    else
        echo "libnccl: no python wheel found; relying on the loader path"
    fi
fi
if [ -n "$NCCL_DIR" ]; then
    export LD_LIBRARY_PATH="$NCCL_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# libcublas (the engine example's GEMMs, loaded by cudarc, which asks for libcublas.so, then
# libcublas.so.13, then libcublas.so.12): the folder of TPCOMM_CUBLAS_LIBRARY if set, else of
# the nvidia-cublas wheel of python (libcublasLt of the same release sits next to it), else
# the loader path. Its folder goes first on the example steps' LD_LIBRARY_PATH only.
CUBLAS_DIR=""
if [ -n "${TPCOMM_CUBLAS_LIBRARY:-}" ]; then
    CUBLAS_DIR="$(dirname "$TPCOMM_CUBLAS_LIBRARY")"
    echo "libcublas: TPCOMM_CUBLAS_LIBRARY=$TPCOMM_CUBLAS_LIBRARY"
else
    CUBLAS_DIR="$(wheel_lib 'libcublas.so.*')"
    if [ -n "$CUBLAS_DIR" ]; then
        echo "libcublas: $CUBLAS_DIR (python wheel):" $(cd "$CUBLAS_DIR" && ls libcublas.so* libcublasLt.so* 2>/dev/null)
    else
        echo "libcublas: no python wheel found; relying on the loader path"
    fi
fi
EXAMPLE_LD_LIBRARY_PATH="${CUBLAS_DIR:+$CUBLAS_DIR${LD_LIBRARY_PATH:+:}}${LD_LIBRARY_PATH:-}"
echo "env: TPCOMM_REQUIRE_GPU=1 CUDA_MODULE_LOADING=$CUDA_MODULE_LOADING CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

SUMMARY=""
FAILED=0
# step NAME SECONDS DIR CMD...: runs CMD in DIR under a timeout cut to what is left.
step() {
    local name="$1" secs="$2" dir="$3"
    shift 3
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo "== $name: SKIPPED (out of time: ${left}s left of the 290 s budget)"
        SUMMARY="$SUMMARY
  $name: SKIPPED (out of time)"
        FAILED=1
        return
    fi
    [ "$secs" -gt "$left" ] && secs=$left
    echo
    echo "== $name (timeout ${secs}s): $*"
    local t0=$SECONDS
    (cd "$dir" && timeout -k 5 "$secs" "$@")
    local rc=$?
    local took=$((SECONDS - t0))
    local status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMEOUT after ${took}s (rc $rc)"
        FAILED=1
    elif [ "$rc" -ne 0 ]; then
        status="FAILED (rc $rc)"
        FAILED=1
    fi
    echo "== $name: $status (${took}s)"
    SUMMARY="$SUMMARY
  $name: $status (${took}s)"
}

# run_test STEP SECONDS EXECUTABLE PACKAGE_DIR: one test executable, in its package's folder
# when the repository is there (as cargo runs it).
run_test() {
    local name="$1" secs="$2" exe="$3" pkg="$4"
    wanted "$name" || return 0
    local dir="$REPO/$pkg"
    [ -d "$dir" ] || dir="$BUNDLE"
    step "$name" "$secs" "$dir" "$BIN/$exe" --test-threads=1 --nocapture
}

if wanted probe; then
    # The standalone driver probe (xtask/cuda-probe): two processes
    # on the GPU, legacy CUDA IPC and VMM (POSIX fd) sharing across a process checkpoint, every
    # CUresult recorded; a summary of its answers, and $RESULTS/ipc-probe.json. It ends within
    # 90 s whatever the driver does (each scenario has 15 s, a hung child is killed).
    step probe 90 "$BUNDLE" "$BIN/ipc-probe" --json "$RESULTS/ipc-probe.json"
fi
@TEST_STEPS@
if wanted example; then
    # The engine example (crates/tpcomm-allreduce/examples/engine_step.rs): an MLP block with
    # cuBLAS and the all-reduce in one graph; at 2 ranks with the partial sums in exportable
    # memory (zero-copy), at 4 in cudarc's pool memory (staging copy captured).
    step example 60 "$BUNDLE" env LD_LIBRARY_PATH="$EXAMPLE_LD_LIBRARY_PATH" "$BIN/engine-step" 2
    step example4 60 "$BUNDLE" env LD_LIBRARY_PATH="$EXAMPLE_LD_LIBRARY_PATH" "$BIN/engine-step" 4 --pool
fi
if wanted bench; then
    # shellcheck disable=SC2086
    step bench 120 "$BUNDLE" "$BIN/tpcomm-bench" gpu --json "$RESULTS/gpu-bench.json" ${TPCOMM_BENCH_ARGS:-}
fi
if wanted checkpoint-bench; then
    # Process checkpoint (ranks as threads of one process), each step timed (crates/tpcomm-bench/src/checkpoint.rs).
    step checkpoint-bench 60 "$BUNDLE" "$BIN/tpcomm-bench" checkpoint --json "$RESULTS/gpu-checkpoint.json"
fi

if [ -s "$TPCOMM_SKIP_LOG" ]; then
    echo
    echo "== skipped tests:"
    cat "$TPCOMM_SKIP_LOG"
fi
echo
echo "== summary ($((SECONDS - START))s):$SUMMARY"
RC=0
if [ "$FAILED" -ne 0 ]; then
    echo "== gpu-check: FAILED"
    RC=1
else
    echo "== gpu-check: all steps passed"
fi
# Let tee write the last lines of the log before returning.
if [ -n "${TEE_PID:-}" ]; then
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
fi
exit "$RC"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_runs_every_test_step_and_the_bench() {
        let s = run_sh();
        assert!(!s.contains("@TEST_STEPS@"));
        // The probe is a default step and runs before every test suite, within 90 s.
        assert!(s.contains("${*:-probe allreduce "));
        let probe = s
            .find("step probe 90 \"$BUNDLE\" \"$BIN/ipc-probe\" --json \"$RESULTS/ipc-probe.json\"")
            .expect("the probe step");
        let first_test = s.find("\nrun_test ").expect("a test step");
        assert!(probe < first_test);
        // The probe is built first, from its own workspace.
        let probe = &TARGETS[0];
        assert_eq!(probe.name, "ipc-probe");
        assert!(!probe.test);
        assert_eq!(probe.workspace, Workspace::Probe);
        assert_eq!(
            probe.cargo_args,
            [
                "--manifest-path",
                "xtask/cuda-probe/Cargo.toml",
                "--bin",
                "ipc-probe"
            ]
        );
        assert!(TARGETS[1..].iter().all(|t| t.workspace == Workspace::Root));
        for step in ["allreduce", "engine", "ipc", "nccl", "checkpoint"] {
            assert!(s.contains(&format!("run_test {step} ")), "{step}");
        }
        assert!(s.contains("tpcomm-bench\" gpu --json"));
        assert!(s.contains("tpcomm-bench\" checkpoint --json"));
        assert!(s.contains("engine-step\" 2"));
        assert!(s.contains("engine-step\" 4 --pool"));
        // The example finds cuBLAS the way the tests find NCCL.
        assert!(s.contains("wheel_lib libnccl.so.2"));
        assert!(s.contains("wheel_lib 'libcublas.so.*'"));
        assert!(s.contains("LD_LIBRARY_PATH=\"$EXAMPLE_LD_LIBRARY_PATH\""));
        assert!(s.contains("--test-threads=1"));
    }
}
