//! `ipc-probe`: a standalone probe of the CUDA driver for two processes on one GPU across
//! a process checkpoint (`cuCheckpointProcess*`), with no tpcomm logic: raw driver calls
//! (cudarc's `driver::sys`, the checkpoint entry points as `tpcomm_transport::cuda_driver`
//! declares them) and system calls (`rustix`: `pidfd_open`, `pidfd_getfd`, `fstat`).
//!
//! ```text
//! cargo run --manifest-path xtask/cuda-probe/Cargo.toml -- [--json FILE] [--only a,b] [--fake[=SPEC]] [--list]
//! ```
//!
//! The parent starts itself twice per scenario (`--child A real`, `--child B real`) and
//! drives the pair over their stdin/stdout with a line protocol (`protocol.rs`); every
//! wait is bounded, a child that dies or stops answering is reported and killed, and each
//! scenario runs in a fresh pair so that one that wrecks its processes does not spoil the
//! next. Questions it answers:
//!
//! 1. After both processes are checkpointed and restored (lock both, checkpoint both,
//!    restore both, unlock both, each on its own pid from its own thread), does
//!    `cuIpcOpenMemHandle` of freshly exported legacy handles work (a) as is, (b) after
//!    `cuInit(0)` and the primary context retained again, (c) after the primary context is
//!    reset, or released to zero and retained? And the old handles?
//! 2. Does a checkpoint pass with VMM (POSIX descriptor) sharing torn down by the importer
//!    (unmapped, released, reservation kept), with the exporter's memory live or released?
//! 3. After the restore: fresh memory at the kept reservation exported and imported at the
//!    importer's kept address; the restored allocation's contents, its old descriptor, a
//!    re-export; data checked both ways with real copies.
//! 4. What lock / checkpoint / restore / unlock do with a VMM import or a legacy mapping
//!    left in place, and the states they leave.
//! 5. The exported descriptor's kind, the nvidia majors of `/proc/devices`, a same-process
//!    import at a second address, the allocation granularity, GPU memory around the
//!    checkpoint, the driver version.
//! 6. The job-file path (`CUDA_CHECKPOINT_JOB_FILE`) where the driver is 590.44 or newer.
//!
//! Output: one line per recorded call (`scenario | process | step | call | code | name |
//! detail`), then the summary, and the same as JSON (`--json FILE`, else
//! `$OUT/ipc-probe.json` when `OUT` is set; rewritten after every scenario). Without a
//! usable GPU it prints a skip line and exits 0, or exits 1 when `TPCOMM_REQUIRE_GPU=1`.
//! Each scenario has 15 s; no scenario starts after 80 s and the last ends by 84 s.

mod child;
mod cuda;
mod facts;
mod protocol;
mod scenarios;
mod summary;

use std::path::PathBuf;
use std::time::Instant;

use protocol::Launcher;
use scenarios::{Outcome, Runner, ScenarioResult, Timing, DEVICE_CHECK, SCENARIOS};
use summary::Report;
use tpcomm_transport::cuda_driver::LIBRARY_FILES;

/// How the parent runs.
#[derive(Debug, Clone)]
struct Config {
    launcher: Launcher,
    /// The children's mode: `real`, or `fake[:SPEC]` (no GPU needed).
    mode: String,
    timing: Timing,
    require_gpu: bool,
    json: Option<PathBuf>,
    only: Option<Vec<String>>,
    /// Library names the no-device check tries (the driver loader's, [`LIBRARY_FILES`]).
    library_names: Vec<String>,
    /// The text of `/proc/driver/nvidia/version` (`None`: not readable).
    kernel_driver_text: Option<String>,
    /// The text of `/proc/devices`, or why it could not be read.
    proc_devices: Result<String, String>,
}

const USAGE: &str = "usage: ipc_probe [--json FILE] [--only SCENARIO,...] [--fake[=SPEC]] [--list]";

impl Config {
    fn from_args(args: &[String]) -> Result<Option<Self>, String> {
        let mut cfg = Config {
            launcher: Launcher::SelfExe,
            mode: "real".into(),
            timing: Timing::GPU,
            require_gpu: std::env::var("TPCOMM_REQUIRE_GPU").is_ok_and(|v| v == "1"),
            json: std::env::var_os("OUT")
                .filter(|o| !o.is_empty())
                .map(|o| PathBuf::from(o).join("ipc-probe.json")),
            only: None,
            library_names: LIBRARY_FILES.iter().map(|name| name.to_string()).collect(),
            kernel_driver_text: std::fs::read_to_string("/proc/driver/nvidia/version").ok(),
            proc_devices: std::fs::read_to_string("/proc/devices")
                .map_err(|e| format!("/proc/devices: {e}")),
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--json" => cfg.json = Some(it.next().ok_or("--json needs a file")?.into()),
                "--only" => {
                    let list = it.next().ok_or("--only needs scenario names")?;
                    let names: Vec<String> = list.split(',').map(str::to_string).collect();
                    for n in &names {
                        if !SCENARIOS.iter().any(|s| s.name == n) {
                            return Err(format!("unknown scenario `{n}` (--list names them)"));
                        }
                    }
                    cfg.only = Some(names);
                }
                "--fake" => cfg.mode = "fake".into(),
                "--list" => {
                    for s in &SCENARIOS {
                        println!("{:<18} {}", s.name, s.about);
                    }
                    return Ok(None);
                }
                "--help" | "-h" => {
                    println!("{USAGE}");
                    return Ok(None);
                }
                other => match other.strip_prefix("--fake=") {
                    Some(spec) => cfg.mode = format!("fake:{spec}"),
                    None => return Err(format!("unknown option `{other}`\n{USAGE}")),
                },
            }
        }
        Ok(Some(cfg))
    }

    fn fake(&self) -> bool {
        self.mode.starts_with("fake")
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        std::process::exit(child::main(&args[1..]));
    }
    match Config::from_args(&args) {
        Ok(Some(cfg)) => std::process::exit(run(&cfg, &mut |line| println!("{line}"))),
        Ok(None) => {}
        Err(e) => {
            eprintln!("ipc-probe: {e}");
            std::process::exit(2);
        }
    }
}

/// The driver library the children will load, or why there is none.
fn find_library(names: &[String]) -> Result<String, String> {
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: loading the CUDA driver library runs its initialisers, which have no
        // preconditions. The parent makes no driver call.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                // Kept loaded: unloading a driver library is not always safe.
                std::mem::forget(lib);
                return Ok(name.clone());
            }
            Err(e) => errors.push(format!("{name}: {}", facts::error_chain(&e))),
        }
    }
    Err(format!("no CUDA driver library: {}", errors.join("; ")))
}

fn write_json(path: &Option<PathBuf>, report: &Report) -> Result<(), String> {
    let Some(path) = path else { return Ok(()) };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

/// No usable GPU: a skip line and 0, or 1 when a GPU is required.
fn no_device(cfg: &Config, report: &mut Report, why: String, emit: &mut dyn FnMut(&str)) -> i32 {
    let code = if cfg.require_gpu {
        emit(&format!(
            "ipc-probe: FAILED: no usable GPU and TPCOMM_REQUIRE_GPU=1: {why}"
        ));
        report.status = "failed".into();
        1
    } else {
        emit(&format!(
            "ipc-probe: SKIPPED (no usable GPU; TPCOMM_REQUIRE_GPU=1 makes this a failure): {why}"
        ));
        report.status = "skipped".into();
        0
    };
    report.reason = Some(why);
    if let Err(e) = write_json(&cfg.json, report) {
        emit(&format!("ipc-probe: cannot write the JSON report: {e}"));
        return 1;
    }
    code
}

/// The parent: every selected scenario, the summary, the JSON. Its exit status.
fn run(cfg: &Config, emit: &mut dyn FnMut(&str)) -> i32 {
    let started = Instant::now();
    let mut report = Report {
        probe: "tpcomm ipc-probe".into(),
        status: "running".into(),
        kernel_driver: cfg
            .kernel_driver_text
            .as_deref()
            .and_then(|t| t.lines().next())
            .map(|l| l.trim().to_string()),
        kernel_driver_version: cfg
            .kernel_driver_text
            .as_deref()
            .and_then(facts::kernel_driver_version),
        ..Report::default()
    };
    match &cfg.proc_devices {
        Ok(text) => report.nvidia_majors = facts::nvidia_majors(text),
        Err(e) => report.proc_devices_error = Some(e.clone()),
    }
    if !cfg.fake() {
        if let Err(why) = find_library(&cfg.library_names) {
            return no_device(cfg, &mut report, why, emit);
        }
    }
    let runner = Runner {
        launcher: cfg.launcher,
        mode: cfg.mode.clone(),
        timing: cfg.timing,
        started,
    };
    emit(&format!(
        "ipc-probe: {}; kernel driver {}; columns: scenario | process | step | call | code | name | detail",
        if cfg.fake() { "fake driver" } else { "CUDA driver" },
        report.kernel_driver_version.as_deref().unwrap_or("unknown"),
    ));
    let device = runner.run(&DEVICE_CHECK, &mut |s| emit(&s.line()));
    let usable = device.outcome == Outcome::Completed;
    let why = match &device.outcome {
        Outcome::Completed => String::new(),
        Outcome::Stopped { reason } => reason.clone(),
        Outcome::Aborted {
            process,
            step,
            reason,
        } => format!("the device check's process {process} at {step}: {reason}"),
        Outcome::NotRun { reason } => reason.clone(),
    };
    report.device = Some(device);
    if !usable {
        return no_device(cfg, &mut report, why, emit);
    }
    let job_file = match report.kernel_driver_version.as_deref() {
        None => Err("not tried: the kernel driver's version could not be read (/proc/driver/nvidia/version)".to_string()),
        Some(v) => match facts::has_job_file_path(v) {
            Some(true) => Ok(()),
            Some(false) => Err(format!(
                "not tried: the kernel driver {v} is older than {}.{}, the first with the job-file path",
                facts::JOB_FILE_DRIVER.0,
                facts::JOB_FILE_DRIVER.1
            )),
            None => Err(format!("not tried: the kernel driver version `{v}` does not parse")),
        },
    };
    for sc in &SCENARIOS {
        if let Some(only) = &cfg.only {
            if !only.iter().any(|n| n == sc.name) {
                continue;
            }
        }
        let elapsed = started.elapsed();
        let result = if elapsed >= cfg.timing.stop_starting {
            ScenarioResult::not_run(
                sc,
                format!(
                    "the probe stops starting scenarios at {} s",
                    cfg.timing.stop_starting.as_secs()
                ),
            )
        } else if let (true, Err(why)) = (sc.job_file, &job_file) {
            ScenarioResult::not_run(sc, why.clone())
        } else {
            emit(&format!("== {}: {}", sc.name, sc.about));
            runner.run(sc, &mut |s| emit(&s.line()))
        };
        let status = match &result.outcome {
            Outcome::Completed => "completed".to_string(),
            Outcome::Stopped { reason } => format!("stopped: {reason}"),
            Outcome::Aborted {
                process,
                step,
                reason,
            } => format!("ABORTED: process {process} at {step}: {reason}"),
            Outcome::NotRun { reason } => format!("not run: {reason}"),
        };
        emit(&format!(
            "== {}: {status} ({:.1} s)",
            sc.name, result.seconds
        ));
        report.scenarios.push(result);
        report.seconds = started.elapsed().as_secs_f64();
        report.answers = summary::answers(&report);
        if let Err(e) = write_json(&cfg.json, &report) {
            emit(&format!("ipc-probe: cannot write the JSON report: {e}"));
        }
    }
    report.status = "ran".into();
    report.seconds = started.elapsed().as_secs_f64();
    report.answers = summary::answers(&report);
    emit(&format!("== ipc-probe summary ({:.1} s):", report.seconds));
    for line in summary::table(&report.answers).lines() {
        emit(line);
    }
    match write_json(&cfg.json, &report) {
        Ok(()) => {
            if let Some(p) = &cfg.json {
                emit(&format!("ipc-probe: JSON written to {}", p.display()));
            }
            0
        }
        Err(e) => {
            emit(&format!("ipc-probe: cannot write the JSON report: {e}"));
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The child side when a test starts this test executable as a child (see
    /// `Launcher::TestHarness`): runs the child with the arguments of the environment and
    /// exits with its status.
    #[test]
    #[ignore = "run as a child process by the orchestration tests"]
    fn child_process() {
        if let Ok(args) = std::env::var(protocol::CHILD_ARGS_VAR) {
            let args: Vec<String> = args.split(' ').map(str::to_string).collect();
            std::process::exit(child::main(&args));
        }
    }

    fn test_config(mode: &str) -> Config {
        Config {
            launcher: Launcher::TestHarness,
            mode: mode.into(),
            timing: Timing {
                scenario: Duration::from_secs(20),
                command: Duration::from_secs(2),
                quick: Duration::from_secs(2),
                start: Duration::from_secs(10),
                stop_starting: Duration::from_secs(120),
                hard_end: Duration::from_secs(150),
                exit_grace: Duration::from_secs(1),
            },
            require_gpu: false,
            json: None,
            only: None,
            library_names: vec!["libtpcomm-no-such-cuda-driver.so.1".into()],
            kernel_driver_text: None,
            proc_devices: Ok(String::new()),
        }
    }

    fn temp_json(name: &str) -> PathBuf {
        std::env::temp_dir()
            .join(format!(
                "tpcomm-ipc-probe-test-{}-{name}",
                std::process::id()
            ))
            .join("ipc-probe.json")
    }

    fn run_collect(cfg: &Config) -> (i32, Vec<String>) {
        let mut lines = Vec::new();
        let code = run(cfg, &mut |l| lines.push(l.to_string()));
        (code, lines)
    }

    #[test]
    fn without_a_driver_the_probe_skips_or_fails_when_a_gpu_is_required() {
        let mut cfg = test_config("real");
        cfg.json = Some(temp_json("nodevice"));
        let (code, lines) = run_collect(&cfg);
        assert_eq!(code, 0, "{lines:?}");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("ipc-probe: SKIPPED (no usable GPU"),
            "{lines:?}"
        );
        assert!(
            lines[0].contains("libtpcomm-no-such-cuda-driver.so.1"),
            "{lines:?}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(cfg.json.as_ref().unwrap()).unwrap())
                .unwrap();
        assert_eq!(json["status"], "skipped");
        assert!(json["reason"]
            .as_str()
            .unwrap()
            .contains("no CUDA driver library"));

        cfg.require_gpu = true;
        let (code, lines) = run_collect(&cfg);
        assert_eq!(code, 1, "{lines:?}");
        assert!(lines[0].starts_with("ipc-probe: FAILED: no usable GPU and TPCOMM_REQUIRE_GPU=1"));
        std::fs::remove_dir_all(cfg.json.unwrap().parent().unwrap()).ok();
    }

    /// A device check whose init fails (no device) is the no-device path too.
    #[test]
    fn a_device_check_that_finds_no_device_skips() {
        let mut cfg = test_config("fake:init=100");
        cfg.require_gpu = false;
        let (code, lines) = run_collect(&cfg);
        assert_eq!(code, 0, "{lines:?}");
        let last = lines.last().unwrap();
        assert!(last.contains("SKIPPED"), "{lines:?}");
        assert!(last.contains("CUDA_ERROR_NO_DEVICE (100)"), "{lines:?}");
        cfg.require_gpu = true;
        assert_eq!(run_collect(&cfg).0, 1);
    }

    /// Every scenario runs to its end against the stand-in driver (so the scripts pass
    /// every value they need and order the checkpoint calls as the driver's state machine
    /// wants), the summary answers every question, and the JSON holds it all.
    #[test]
    fn every_scenario_runs_against_the_fake_driver() {
        let mut cfg = test_config("fake");
        cfg.kernel_driver_text = Some(
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  595.10.01  Release Build\n"
                .into(),
        );
        cfg.proc_devices = Ok("Character devices:\n195 nvidia-frontend\n".into());
        cfg.json = Some(temp_json("fake"));
        let (code, lines) = run_collect(&cfg);
        assert_eq!(code, 0, "{lines:#?}");
        for sc in &SCENARIOS {
            assert!(
                lines
                    .iter()
                    .any(|l| *l == format!("== {}: completed", sc.name)
                        || l.starts_with(&format!("== {}: completed (", sc.name))),
                "{} did not complete: {lines:#?}",
                sc.name
            );
        }
        let text = lines.join("\n");
        assert!(!text.contains("NOT_ATTEMPTED"), "{text}");
        assert!(!text.contains("not reached"), "{text}");
        assert!(text.contains(
            "fresh legacy handle after restore, as is: works (every call CUDA_SUCCESS, the data read back as written) (both processes)"
        ), "{text}");
        assert!(
            text.contains("major 195 is nvidia-frontend in /proc/devices"),
            "{text}"
        );
        assert!(text.contains("job-file path (CUDA_CHECKPOINT_JOB_FILE): lock, checkpoint, restore and unlock: CUDA_SUCCESS on both processes; left running (both processes)"), "{text}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(cfg.json.as_ref().unwrap()).unwrap())
                .unwrap();
        assert_eq!(json["status"], "ran");
        assert_eq!(json["scenarios"].as_array().unwrap().len(), SCENARIOS.len());
        assert!(json["answers"].as_array().unwrap().len() >= 20);
        std::fs::remove_dir_all(cfg.json.unwrap().parent().unwrap()).ok();
    }

    fn one_scenario(mode: &str, name: &str, command: Duration) -> (ScenarioResult, Duration) {
        let mut cfg = test_config(mode);
        cfg.timing.command = command;
        cfg.timing.quick = command;
        let runner = Runner {
            launcher: cfg.launcher,
            mode: cfg.mode.clone(),
            timing: cfg.timing,
            started: Instant::now(),
        };
        let sc = SCENARIOS.iter().find(|s| s.name == name).unwrap();
        let t = Instant::now();
        let r = runner.run(sc, &mut |_| {});
        (r, t.elapsed())
    }

    #[test]
    fn a_child_that_never_starts_or_exits_at_once_is_reported_within_its_timeout() {
        let mut cfg = test_config("hang");
        cfg.timing.start = Duration::from_millis(1500);
        let runner = Runner {
            launcher: cfg.launcher,
            mode: "hang".into(),
            timing: cfg.timing,
            started: Instant::now(),
        };
        let t = Instant::now();
        let r = runner.run(&SCENARIOS[0], &mut |_| {});
        assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
        match &r.outcome {
            Outcome::Aborted {
                process,
                step,
                reason,
            } => {
                assert_eq!((process.as_str(), step.as_str()), ("A", "start"));
                assert!(
                    reason.contains("did not start: no answer within"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }

        let runner = Runner {
            mode: "exit".into(),
            ..runner
        };
        let t = Instant::now();
        let r = runner.run(&SCENARIOS[0], &mut |_| {});
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        match &r.outcome {
            Outcome::Aborted {
                process, reason, ..
            } => {
                assert_eq!(process, "A");
                assert!(reason.contains("exit status: 3"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_child_that_stops_answering_mid_scenario_is_killed_and_reported() {
        // B never answers its checkpoint call: the scenario ends after the command's
        // timeout, naming B and the step; both children are gone.
        let (r, took) = one_scenario(
            "fake:B.ckpt_checkpoint=hang",
            "legacy-as-is",
            Duration::from_secs(1),
        );
        assert!(took < Duration::from_secs(8), "{took:?}");
        assert_eq!(
            r.outcome,
            Outcome::Aborted {
                process: "B".into(),
                step: "ckpt.checkpoint".into(),
                reason: "no answer within 1.0 s".into(),
            }
        );
        // A answered the same step.
        assert!(r
            .steps
            .iter()
            .any(|s| s.process == "A" && s.step == "ckpt.checkpoint" && s.ok));
        assert!(
            r.values
                .get("B.end")
                .is_some_and(|s| s.starts_with("killed")),
            "{:?}",
            r.values
        );

        // A mute child (hello, then silence) times out at its first request.
        let (r, took) = one_scenario("mute", "vmm-self", Duration::from_millis(500));
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(
            matches!(&r.outcome, Outcome::Aborted { step, .. } if step == "setup.init"),
            "{:?}",
            r.outcome
        );
    }

    #[test]
    fn a_child_that_dies_mid_scenario_is_reported_with_its_status() {
        let (r, took) = one_scenario(
            "fake:A.legacy_export=exit",
            "legacy-reinit",
            Duration::from_secs(5),
        );
        assert!(took < Duration::from_secs(5), "{took:?}");
        match &r.outcome {
            Outcome::Aborted {
                process,
                step,
                reason,
            } => {
                assert_eq!(
                    (process.as_str(), step.as_str()),
                    ("A", "setup.legacy_export")
                );
                assert!(reason.contains("exit status: 9"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_failed_restore_stops_the_scenario_with_the_states_left() {
        let (r, _) = one_scenario(
            "fake:B.ckpt_restore=1",
            "legacy-left-open",
            Duration::from_secs(5),
        );
        assert_eq!(
            r.outcome,
            Outcome::Stopped {
                reason: "after the checkpoint sequence B is checkpointed: the steps after it are not run".into()
            }
        );
        let unlock_b: Vec<_> = r
            .steps
            .iter()
            .filter(|s| s.process == "B" && s.step == "ckpt.unlock")
            .collect();
        assert_eq!(unlock_b.len(), 1);
        assert_eq!(unlock_b[0].name, "NOT_ATTEMPTED");
        let report = Report {
            scenarios: vec![r],
            ..Report::default()
        };
        let a = summary::answers(&report);
        let left = &a
            .iter()
            .find(|a| a.question == "legacy IPC mapping left open")
            .unwrap()
            .answer;
        assert!(
            left.contains("restore: A: CUDA_SUCCESS; B: CUDA_ERROR_INVALID_VALUE (1)"),
            "{left}"
        );
        assert!(left.ends_with("left A: running; B: checkpointed"), "{left}");
    }

    /// Children that hang at every checkpoint: each scenario ends at its request limit, no
    /// scenario starts after the cut-off, and the whole run ends soon after the hard end (the
    /// GPU timing scaled down: 15 s / 10 s / 80 s / 84 s become 2 s / 1 s / 3 s / 4 s).
    #[test]
    fn the_run_ends_in_bounded_time_whatever_the_children_do() {
        let mut cfg = test_config("fake:ckpt_checkpoint=hang");
        cfg.timing = Timing {
            scenario: Duration::from_secs(2),
            command: Duration::from_secs(1),
            quick: Duration::from_secs(1),
            start: Duration::from_secs(2),
            stop_starting: Duration::from_secs(3),
            hard_end: Duration::from_secs(4),
            exit_grace: Duration::from_millis(200),
        };
        let t = Instant::now();
        let (code, lines) = run_collect(&cfg);
        let took = t.elapsed();
        assert_eq!(code, 0, "{lines:#?}");
        assert!(took < Duration::from_secs(8), "{took:?}");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("== legacy-as-is: ABORTED: process A at ckpt.checkpoint: no answer within 1.0 s (and process B: no answer within")),
            "{lines:#?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains(": not run: the probe stops starting scenarios at 3 s")),
            "{lines:#?}"
        );
    }

    #[test]
    fn scenarios_stop_starting_past_the_cut_off() {
        let mut cfg = test_config("fake");
        cfg.timing.stop_starting = Duration::ZERO;
        let (code, lines) = run_collect(&cfg);
        assert_eq!(code, 0);
        assert!(
            lines.iter().any(|l| l.starts_with(
                "== legacy-as-is: not run: the probe stops starting scenarios at 0 s"
            )),
            "{lines:#?}"
        );
        assert!(lines.iter().any(|l| l.contains("fresh legacy handle after restore, as is: not run (the probe stops starting scenarios at 0 s)")), "{lines:#?}");
    }

    /// The socket end reaches the child it is meant for (inherited, its number in the
    /// environment), and the parent's copy is close-on-exec again after the spawn.
    #[test]
    fn a_child_inherits_its_socket_end() {
        let (mine, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::DGRAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let child = protocol::ChildProc::spawn(
            Launcher::TestHarness,
            protocol::Role::A,
            "peer-socket",
            &[],
            &[],
            Some(&theirs),
            deadline,
        )
        .expect("the child starts");
        let flags = rustix::io::fcntl_getfd(&theirs).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        drop(theirs);
        rustix::net::sockopt::set_socket_timeout(
            &mine,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_secs(5)),
        )
        .unwrap();
        let mut byte = [0u8; 1];
        let got = rustix::net::recv(&mine, &mut byte, rustix::net::RecvFlags::empty());
        assert_eq!(got.map(|(n, _)| n), Ok(1));
        assert_eq!(&byte, b"x");
        let ended = protocol::ChildProc::finish_all(vec![child], Duration::from_secs(2));
        assert_eq!(ended.len(), 1);
    }

    #[test]
    fn options_parse() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cfg = Config::from_args(&args(&[
            "--json",
            "/tmp/x.json",
            "--only",
            "vmm-self,job-file",
            "--fake=B.init=1",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(cfg.json, Some(PathBuf::from("/tmp/x.json")));
        assert_eq!(
            cfg.only,
            Some(vec!["vmm-self".to_string(), "job-file".to_string()])
        );
        assert_eq!(cfg.mode, "fake:B.init=1");
        assert!(Config::from_args(&args(&["--only", "nope"])).is_err());
        assert!(Config::from_args(&args(&["--bogus"])).is_err());
    }
}
