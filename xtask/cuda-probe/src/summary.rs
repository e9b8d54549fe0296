//! The report and its summary: questions 1-6 answered in words from the recorded steps (a
//! pure function of the report, so that its wording is tested with made-up results).

use serde::Serialize;

use crate::facts::{bytes, DeviceMajor};
use crate::scenarios::{Outcome, ScenarioResult, Step};

/// Everything the probe found; written as `ipc-probe.json`.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Report {
    pub(crate) probe: String,
    /// `running` (a partial report), `ran`, `skipped` (no GPU) or `failed`.
    pub(crate) status: String,
    pub(crate) reason: Option<String>,
    pub(crate) seconds: f64,
    /// The first line of `/proc/driver/nvidia/version`.
    pub(crate) kernel_driver: Option<String>,
    pub(crate) kernel_driver_version: Option<String>,
    pub(crate) nvidia_majors: Vec<DeviceMajor>,
    /// Why `/proc/devices` could not be read.
    pub(crate) proc_devices_error: Option<String>,
    pub(crate) device: Option<ScenarioResult>,
    pub(crate) scenarios: Vec<ScenarioResult>,
    pub(crate) answers: Vec<Answer>,
}

/// One answer of the summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Answer {
    /// The question's number (1-6).
    pub(crate) id: String,
    pub(crate) question: String,
    pub(crate) answer: String,
}

/// The outcome of one step (or a chain of steps) for one process.
#[derive(Debug, Clone, PartialEq)]
enum Res {
    Works(String),
    Fails(String),
    Missing(String),
}

impl Res {
    fn text(&self) -> String {
        match self {
            Res::Works(s) | Res::Fails(s) | Res::Missing(s) => s.clone(),
        }
    }
}

/// Why `process` has no record of `step` in `sc`.
fn missing(sc: &ScenarioResult, process: &str, step: &str) -> String {
    match &sc.outcome {
        Outcome::NotRun { reason } => format!("not run ({reason})"),
        Outcome::Aborted {
            process: p,
            step: s,
            reason,
        } if p == process && s == step => format!("no answer from process {p}: {reason}"),
        Outcome::Aborted {
            process: p,
            step: s,
            reason,
        } => format!("not reached (process {p} at {s}: {reason})"),
        Outcome::Stopped { reason } => format!("not reached ({reason})"),
        Outcome::Completed => "not recorded".into(),
    }
}

/// "CUDA_ERROR_NOT_PERMITTED (800) from cuIpcOpenMemHandle".
fn failure_text(s: &Step) -> String {
    match (s.name.as_str(), s.code) {
        ("NOT_ATTEMPTED", _) => format!("not attempted ({})", s.detail),
        (name, Some(code)) => format!("{name} ({code}) from {}", s.call),
        (name, None) => format!("{name} in {}: {}", s.call, s.detail),
    }
}

fn steps_of<'a>(sc: &'a ScenarioResult, process: &str, step: &str) -> Vec<&'a Step> {
    sc.steps
        .iter()
        .filter(|s| s.process == process && s.step == step)
        .collect()
}

/// One step of one process.
fn op_result(sc: &ScenarioResult, process: &str, step: &str) -> Res {
    let steps = steps_of(sc, process, step);
    if steps.is_empty() {
        return Res::Missing(missing(sc, process, step));
    }
    if let Some(bad) = steps.iter().find(|s| !s.ok) {
        return Res::Fails(failure_text(bad));
    }
    let checked = steps.iter().any(|s| s.call == "verify");
    Res::Works(if checked {
        "works (CUDA_SUCCESS, the data read back as written)".into()
    } else {
        "works (CUDA_SUCCESS)".into()
    })
}

/// A chain of steps of one process: the first that did not work, else "works".
fn chain_result(sc: &ScenarioResult, process: &str, steps: &[&str]) -> Res {
    let mut checked = false;
    for step in steps {
        match op_result(sc, process, step) {
            Res::Works(text) => checked |= text.contains("data"),
            Res::Fails(text) if steps.len() > 1 => return Res::Fails(format!("{text} at {step}")),
            Res::Missing(text) if steps.len() > 1 => {
                return Res::Missing(format!("{text} at {step}"))
            }
            other => return other,
        }
    }
    Res::Works(if checked {
        "works (every call CUDA_SUCCESS, the data read back as written)".into()
    } else {
        "works (every call CUDA_SUCCESS)".into()
    })
}

/// One text for every process of the scenario: "X (both processes)" or "A: X; B: Y".
fn combine(sc: &ScenarioResult, mut per: impl FnMut(&str) -> String) -> String {
    let texts: Vec<(String, String)> = sc.processes.iter().map(|p| (p.clone(), per(p))).collect();
    match texts.as_slice() {
        [] => "no processes".into(),
        [(_, one)] => one.clone(),
        [(_, first), rest @ ..] if rest.iter().all(|(_, t)| t == first) => {
            format!("{first} (both processes)")
        }
        many => many
            .iter()
            .map(|(p, t)| format!("{p}: {t}"))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

fn scenario<'a>(report: &'a Report, name: &str) -> Option<&'a ScenarioResult> {
    report.scenarios.iter().find(|s| s.name == name)
}

fn or_not_run(report: &Report, name: &str, f: impl Fn(&ScenarioResult) -> String) -> String {
    match scenario(report, name) {
        Some(sc) => f(sc),
        None => "not run (not selected)".into(),
    }
}

const PHASES: [(&str, &str); 4] = [
    ("ckpt.lock", "lock"),
    ("ckpt.checkpoint", "checkpoint"),
    ("ckpt.restore", "restore"),
    ("ckpt.unlock", "unlock"),
];

/// The checkpoint sequence in words: every phase's result per process and the states left.
fn cycle_text(sc: &ScenarioResult) -> String {
    if !sc.steps.iter().any(|s| s.step.starts_with("ckpt.")) {
        return missing(sc, "A", "ckpt.lock");
    }
    let mut all_ok = true;
    let mut phases = Vec::new();
    for (step, label) in PHASES {
        let text = combine(sc, |p| {
            let steps = steps_of(sc, p, step);
            match steps
                .iter()
                .find(|s| s.call != "cuCheckpointProcessGetState")
            {
                Some(s) if s.ok => "CUDA_SUCCESS".to_string(),
                Some(s) if s.name == "NOT_ATTEMPTED" => {
                    all_ok = false;
                    format!("not attempted ({})", s.detail)
                }
                Some(s) => {
                    all_ok = false;
                    match s.code {
                        Some(c) => format!("{} ({c})", s.name),
                        None => format!("{}: {}", s.name, s.detail),
                    }
                }
                None => {
                    all_ok = false;
                    missing(sc, p, step)
                }
            }
        });
        phases.push(format!("{label}: {text}"));
    }
    let states = combine(sc, |p| {
        sc.value(p, "ckpt", "final_state")
            .unwrap_or("state unknown")
            .to_string()
    });
    if all_ok && sc.processes.len() > 1 {
        format!(
            "lock, checkpoint, restore and unlock: CUDA_SUCCESS on both processes; left {states}"
        )
    } else if all_ok {
        format!("lock, checkpoint, restore and unlock: CUDA_SUCCESS; left {states}")
    } else {
        format!("{}; left {states}", phases.join("; "))
    }
}

fn used(sc: &ScenarioResult, step: &str) -> String {
    sc.value("A", step, "used")
        .and_then(|u| u.parse::<u64>().ok())
        .map_or("unknown".into(), bytes)
}

/// GPU memory before the lock, while checkpointed (nvidia-smi) and after the unlock.
fn memory_text(sc: &ScenarioResult) -> String {
    if sc.value("A", "setup.mem_info_before", "used").is_none() {
        return missing(sc, "A", "setup.mem_info_before");
    }
    let smi = |k: &str| {
        sc.value("parent", "ckpt.while_checkpointed", k)
            .map(str::to_string)
    };
    let during = match smi("device_used_total_mib") {
        Some(device) => {
            let procs: Vec<String> = sc
                .processes
                .iter()
                .map(|p| {
                    let u = smi(&format!("{p}_used_mib")).unwrap_or_else(|| "unknown".into());
                    match u.parse::<u64>() {
                        Ok(n) => format!("{p} {n} MiB"),
                        Err(_) => format!("{p} {u}"),
                    }
                })
                .collect();
            format!(
                "nvidia-smi while checkpointed: device used/total {device} MiB, {}",
                procs.join(", ")
            )
        }
        None => "nvidia-smi while checkpointed: not read".into(),
    };
    format!(
        "device memory used (cuMemGetInfo): after init {}, before the lock {}, after the unlock {}; {during}",
        used(sc, "setup.mem_info"),
        used(sc, "setup.mem_info_before"),
        used(sc, "after.mem_info"),
    )
}

/// The exported descriptor's kind, from the first VMM export recorded.
fn fd_text(report: &Report) -> String {
    let found = [
        ("vmm-released", "setup.vmm_export"),
        ("vmm-live", "setup.vmm_export"),
        ("vmm-left-mapped", "setup.vmm_export"),
        ("vmm-self", "self.vmm_export"),
    ]
    .iter()
    .find_map(|(name, step)| {
        let sc = scenario(report, name)?;
        sc.value("A", step, "fd_type").map(|_| (sc, *step))
    });
    let Some((sc, step)) = found else {
        return or_not_run(report, "vmm-released", |sc| {
            missing(sc, "A", "setup.vmm_export")
        });
    };
    let v = |k: &str| sc.value("A", step, k).unwrap_or("?").to_string();
    let kind = v("fd_type");
    let rdev = v("fd_rdev");
    let mut text = format!(
        "{kind} (st_mode {}), readlink {}, st_rdev {rdev}, st_dev {}, st_ino {}",
        v("fd_mode"),
        v("fd_link"),
        v("fd_dev"),
        v("fd_ino")
    );
    if kind == "character device" {
        let major = rdev.split(':').next().and_then(|m| m.parse::<u32>().ok());
        let named = major.and_then(|m| {
            report
                .nvidia_majors
                .iter()
                .find(|d| d.major == m && d.kind == "character")
        });
        match (major, named) {
            (Some(m), Some(d)) => {
                text.push_str(&format!("; major {m} is {} in /proc/devices", d.name))
            }
            (Some(m), None) => text.push_str(&format!(
                "; major {m} is not an nvidia* character major of /proc/devices"
            )),
            _ => {}
        }
    }
    text
}

fn majors_text(report: &Report) -> String {
    if let Some(e) = &report.proc_devices_error {
        return format!("/proc/devices not read: {e}");
    }
    if report.nvidia_majors.is_empty() {
        return "none".into();
    }
    report
        .nvidia_majors
        .iter()
        .map(|d| format!("{} {} ({})", d.major, d.name, d.kind))
        .collect::<Vec<_>>()
        .join(", ")
}

fn granularity_text(report: &Report) -> String {
    let found = [
        ("vmm-released", "setup.vmm_create"),
        ("vmm-live", "setup.vmm_create"),
        ("vmm-self", "self.vmm_create"),
    ]
    .iter()
    .find_map(|(name, step)| {
        let sc = scenario(report, name)?;
        let min = sc.value("A", step, "granularity_minimum")?.parse().ok()?;
        let rec = sc
            .value("A", step, "granularity_recommended")?
            .parse()
            .ok()?;
        Some((min, rec))
    });
    match found {
        Some((min, rec)) => format!(
            "minimum {}, recommended {} (pinned device memory, POSIX descriptor handles)",
            bytes(min),
            bytes(rec)
        ),
        None => or_not_run(report, "vmm-released", |sc| {
            missing(sc, "A", "setup.vmm_create")
        }),
    }
}

fn driver_text(report: &Report) -> String {
    let api = report
        .device
        .as_ref()
        .and_then(|d| d.value("A", "device.init", "driver_version"))
        .and_then(|v| v.parse::<i32>().ok())
        .map_or("cuDriverGetVersion not read".into(), |v| {
            format!(
                "cuDriverGetVersion {v} (CUDA {}.{})",
                v / 1000,
                (v % 1000) / 10
            )
        });
    let kernel = report
        .kernel_driver
        .clone()
        .unwrap_or_else(|| "/proc/driver/nvidia/version not readable".into());
    format!("{api}; {kernel}")
}

fn address_note<'a>(sc: &'a ScenarioResult, step: &str) -> impl Fn(&str) -> String + 'a {
    let step = step.to_string();
    move |p: &str| match sc.value(p, &step, "same_address") {
        Some("yes") => ", mapped at the importer's kept address".into(),
        _ => String::new(),
    }
}

/// The summary: every question's answer, in order.
pub(crate) fn answers(report: &Report) -> Vec<Answer> {
    let mut out = Vec::new();
    let mut add = |id: &str, question: &str, answer: String| {
        out.push(Answer {
            id: id.into(),
            question: question.into(),
            answer,
        })
    };
    let chain = |name: &str, steps: &'static [&'static str]| {
        or_not_run(report, name, |sc| {
            combine(sc, |p| chain_result(sc, p, steps).text())
        })
    };
    let op = |name: &str, step: &'static str| {
        or_not_run(report, name, |sc| {
            combine(sc, |p| op_result(sc, p, step).text())
        })
    };
    let cycle = |name: &str| or_not_run(report, name, cycle_text);

    add(
        "1",
        "checkpoint and restore of two processes that cross-opened and closed legacy IPC",
        cycle("legacy-as-is"),
    );
    add(
        "1a",
        "fresh legacy handle after restore, as is",
        chain("legacy-as-is", &["after.fresh_export", "after.fresh_open"]),
    );
    add(
        "1a",
        "old (pre-checkpoint) legacy handle after restore",
        op("legacy-as-is", "after.old_open"),
    );
    add(
        "1b",
        "fresh legacy handle after restore, cuInit(0) and primary context retained again",
        chain(
            "legacy-reinit",
            &["after.reinit", "after.fresh_export", "after.fresh_open"],
        ),
    );
    add(
        "1b",
        "old (pre-checkpoint) legacy handle after restore, cuInit(0) and primary context retained again",
        op("legacy-reinit", "after.old_open"),
    );
    add(
        "1c",
        "cuDevicePrimaryCtxReset after restore, then retain",
        op("legacy-reset", "after.reset"),
    );
    add(
        "1c",
        "fresh legacy handle of a new allocation after the primary context reset",
        chain(
            "legacy-reset",
            &[
                "after.legacy_alloc",
                "after.fresh_export",
                "after.fresh_open",
            ],
        ),
    );
    add(
        "1c",
        "primary context released to zero and retained again after restore",
        op("legacy-release", "after.release"),
    );
    add(
        "1c",
        "fresh legacy handle of a new allocation after release to zero and retain",
        chain(
            "legacy-release",
            &[
                "after.legacy_alloc",
                "after.fresh_export",
                "after.fresh_open",
            ],
        ),
    );
    add(
        "2",
        "checkpoint, VMM import unmapped and released, exporter's memory released (reservations kept)",
        cycle("vmm-released"),
    );
    add(
        "2",
        "checkpoint, VMM import unmapped and released, exporter's allocation and descriptor kept live",
        cycle("vmm-live"),
    );
    add(
        "2",
        "GPU memory, exporter released",
        or_not_run(report, "vmm-released", memory_text),
    );
    add(
        "2",
        "GPU memory, exporter kept live",
        or_not_run(report, "vmm-live", memory_text),
    );
    add(
        "2",
        "GPU memory, legacy allocations (1a)",
        or_not_run(report, "legacy-as-is", memory_text),
    );
    const FRESH: &[&str] = &[
        "after.vmm_fresh",
        "after.fresh_export",
        "after.fresh_import",
        "after.fresh_write_peer",
        "after.fresh_read_own",
    ];
    add(
        "3",
        "fresh memory at the exporter's kept reservation, exported, imported at the importer's kept address, data both ways (exporter released before the checkpoint)",
        or_not_run(report, "vmm-released", |sc| {
            let note = address_note(sc, "after.fresh_import");
            combine(sc, |p| match chain_result(sc, p, FRESH) {
                Res::Works(t) => format!("{t}{}", note(p)),
                other => other.text(),
            })
        }),
    );
    add(
        "3",
        "natively restored allocation: its contents after restore",
        op("vmm-live", "after.restored_contents"),
    );
    add(
        "3",
        "natively restored allocation through the descriptor exported before the checkpoint",
        op("vmm-live", "after.old_fd_import"),
    );
    add(
        "3",
        "natively restored allocation exported again, imported and mapped, data both ways",
        chain(
            "vmm-live",
            &[
                "after.reexport",
                "after.reexport_import",
                "after.reexport_write_peer",
                "after.reexport_read_own",
            ],
        ),
    );
    add(
        "3",
        "fresh memory at the kept address after releasing the restored allocation (exporter kept live)",
        or_not_run(report, "vmm-live", |sc| {
            let note = address_note(sc, "after.fresh_import");
            combine(sc, |p| match chain_result(sc, p, FRESH) {
                Res::Works(t) => format!("{t}{}", note(p)),
                other => other.text(),
            })
        }),
    );
    let left = |name: &str| {
        or_not_run(report, name, |sc| {
            let mut text = cycle_text(sc);
            if sc.steps.iter().any(|s| s.step == "after.read_peer") {
                let read = combine(sc, |p| op_result(sc, p, "after.read_peer").text());
                text.push_str(&format!("; the mapping read after: {read}"));
            }
            text
        })
    };
    add("4", "VMM import left mapped", left("vmm-left-mapped"));
    add(
        "4",
        "legacy IPC mapping left open",
        left("legacy-left-open"),
    );
    add("5", "exported descriptor's kind", fd_text(report));
    add("5", "nvidia majors in /proc/devices", majors_text(report));
    add(
        "5",
        "same-process import of its own descriptor, mapped at a second address",
        or_not_run(report, "vmm-self", |sc| {
            combine(sc, |p| {
                let r = chain_result(sc, p, &["self.vmm_self_import"]);
                match (r, sc.value(p, "self.vmm_self_import", "same_handle")) {
                    (Res::Works(t), Some("true")) => {
                        format!("{t}; the import returned the own handle value")
                    }
                    (Res::Works(t), Some(_)) => {
                        format!("{t}; the import returned a new handle value")
                    }
                    (other, _) => other.text(),
                }
            })
        }),
    );
    add(
        "5",
        "cuCheckpointProcessGetState from the process itself: running, after lock, checkpoint, restore, unlock",
        or_not_run(report, "state-query", |sc| {
            ["setup.state", "ckpt.lock.state", "ckpt.checkpoint.state", "ckpt.restore.state", "ckpt.unlock.state"]
                .iter()
                .map(|step| {
                    let steps = steps_of(sc, "A", step);
                    match steps.first() {
                        Some(s) if s.code == Some(0) => s.detail.clone(),
                        Some(s) => failure_text(s),
                        None => missing(sc, "A", step),
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        }),
    );
    add("5", "allocation granularity", granularity_text(report));
    add("5", "driver version", driver_text(report));
    add(
        "6",
        "job-file path (CUDA_CHECKPOINT_JOB_FILE)",
        or_not_run(report, "job-file", |sc| match &sc.outcome {
            Outcome::NotRun { reason } => reason.clone(),
            _ => format!(
                "{}; fresh legacy handle after restore: {}",
                cycle_text(sc),
                combine(sc, |p| {
                    chain_result(sc, p, &["after.fresh_export", "after.fresh_open"]).text()
                })
            ),
        }),
    );
    out
}

/// The summary as printed.
pub(crate) fn table(answers: &[Answer]) -> String {
    let mut s = String::new();
    for a in answers {
        s.push_str(&format!("  {:<3} {}: {}\n", a.id, a.question, a.answer));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn step(sc: &str, p: &str, step: &str, call: &str, code: Option<i64>, name: &str) -> Step {
        Step {
            scenario: sc.into(),
            process: p.into(),
            step: step.into(),
            call: call.into(),
            code,
            name: name.into(),
            ok: code == Some(0) || name == "OK",
            detail: String::new(),
        }
    }

    fn result(name: &str, outcome: Outcome, steps: Vec<Step>) -> ScenarioResult {
        ScenarioResult {
            name: name.into(),
            about: String::new(),
            processes: vec!["A".into(), "B".into()],
            outcome,
            seconds: 1.0,
            steps,
            values: BTreeMap::new(),
        }
    }

    fn ok_cycle(sc: &str) -> Vec<Step> {
        let mut v = Vec::new();
        for p in ["A", "B"] {
            for (label, call) in [
                ("ckpt.lock", "cuCheckpointProcessLock"),
                ("ckpt.checkpoint", "cuCheckpointProcessCheckpoint"),
                ("ckpt.restore", "cuCheckpointProcessRestore"),
                ("ckpt.unlock", "cuCheckpointProcessUnlock"),
            ] {
                v.push(step(sc, p, label, call, Some(0), "CUDA_SUCCESS"));
                v.push(step(
                    sc,
                    p,
                    label,
                    "cuCheckpointProcessGetState",
                    Some(0),
                    "CUDA_SUCCESS",
                ));
            }
        }
        v
    }

    fn answer<'a>(answers: &'a [Answer], question: &str) -> &'a str {
        &answers
            .iter()
            .find(|a| a.question == question)
            .unwrap_or_else(|| panic!("no question {question}"))
            .answer
    }

    #[test]
    fn a_refused_fresh_handle_is_named_with_its_code_on_both_processes() {
        let mut steps = ok_cycle("legacy-reinit");
        for p in ["A", "B"] {
            steps.push(step(
                "legacy-reinit",
                p,
                "after.reinit",
                "cuInit",
                Some(0),
                "CUDA_SUCCESS",
            ));
            steps.push(step(
                "legacy-reinit",
                p,
                "after.fresh_export",
                "cuIpcGetMemHandle",
                Some(0),
                "CUDA_SUCCESS",
            ));
            steps.push(step(
                "legacy-reinit",
                p,
                "after.fresh_open",
                "cuIpcOpenMemHandle",
                Some(800),
                "CUDA_ERROR_NOT_PERMITTED",
            ));
        }
        let report = Report {
            scenarios: vec![result("legacy-reinit", Outcome::Completed, steps)],
            ..Report::default()
        };
        let a = answers(&report);
        assert_eq!(
            answer(&a, "fresh legacy handle after restore, cuInit(0) and primary context retained again"),
            "CUDA_ERROR_NOT_PERMITTED (800) from cuIpcOpenMemHandle at after.fresh_open (both processes)"
        );
        assert_eq!(
            answer(&a, "fresh legacy handle after restore, as is"),
            "not run (not selected)"
        );
    }

    #[test]
    fn working_steps_say_the_data_was_checked_and_differing_processes_are_told_apart() {
        let sc = "vmm-released";
        let mut steps = ok_cycle(sc);
        for p in ["A", "B"] {
            for label in [
                "after.vmm_fresh",
                "after.fresh_export",
                "after.fresh_import",
                "after.fresh_write_peer",
                "after.fresh_read_own",
            ] {
                steps.push(step(sc, p, label, "cuSomething", Some(0), "CUDA_SUCCESS"));
            }
            steps.push(step(sc, p, "after.fresh_import", "verify", None, "OK"));
        }
        let mut r = result(sc, Outcome::Completed, steps);
        r.values
            .insert("A.after.fresh_import.same_address".into(), "yes".into());
        r.values
            .insert("B.after.fresh_import.same_address".into(), "yes".into());
        let report = Report {
            scenarios: vec![r.clone()],
            ..Report::default()
        };
        let q = "fresh memory at the exporter's kept reservation, exported, imported at the importer's kept address, data both ways (exporter released before the checkpoint)";
        assert_eq!(
            answer(&answers(&report), q),
            "works (every call CUDA_SUCCESS, the data read back as written), mapped at the importer's kept address (both processes)"
        );
        assert_eq!(
            answer(&answers(&report), "checkpoint, VMM import unmapped and released, exporter's memory released (reservations kept)"),
            "lock, checkpoint, restore and unlock: CUDA_SUCCESS on both processes; left state unknown (both processes)"
        );
        // B's import fails: the processes differ.
        for s in r.steps.iter_mut() {
            if s.process == "B" && s.step == "after.fresh_import" && s.call == "cuSomething" {
                s.code = Some(1);
                s.name = "CUDA_ERROR_INVALID_VALUE".into();
                s.ok = false;
                s.call = "cuMemImportFromShareableHandle".into();
            }
        }
        let report = Report {
            scenarios: vec![r],
            ..Report::default()
        };
        assert_eq!(
            answer(&answers(&report), q),
            "A: works (every call CUDA_SUCCESS, the data read back as written), mapped at the importer's kept address; B: CUDA_ERROR_INVALID_VALUE (1) from cuMemImportFromShareableHandle at after.fresh_import"
        );
    }

    #[test]
    fn a_failed_restore_is_named_with_the_states_left_and_later_steps_not_reached() {
        let sc = "legacy-left-open";
        let mut steps = Vec::new();
        for p in ["A", "B"] {
            steps.push(step(
                sc,
                p,
                "ckpt.lock",
                "cuCheckpointProcessLock",
                Some(0),
                "CUDA_SUCCESS",
            ));
            steps.push(step(
                sc,
                p,
                "ckpt.checkpoint",
                "cuCheckpointProcessCheckpoint",
                Some(0),
                "CUDA_SUCCESS",
            ));
        }
        steps.push(step(
            sc,
            "A",
            "ckpt.restore",
            "cuCheckpointProcessRestore",
            Some(1),
            "CUDA_ERROR_INVALID_VALUE",
        ));
        steps.push(step(
            sc,
            "A",
            "ckpt.restore",
            "cuCheckpointProcessGetState",
            Some(0),
            "CUDA_SUCCESS",
        ));
        steps.push(step(
            sc,
            "B",
            "ckpt.restore",
            "cuCheckpointProcessRestore",
            Some(0),
            "CUDA_SUCCESS",
        ));
        let mut na = step(sc, "A", "ckpt.unlock", "-", None, "NOT_ATTEMPTED");
        na.detail = "the process is checkpointed, not locked".into();
        steps.push(na);
        steps.push(step(
            sc,
            "B",
            "ckpt.unlock",
            "cuCheckpointProcessUnlock",
            Some(0),
            "CUDA_SUCCESS",
        ));
        let mut r = result(
            sc,
            Outcome::Stopped {
                reason: "after the checkpoint sequence A is checkpointed: the steps after it are not run".into(),
            },
            steps,
        );
        r.values
            .insert("A.ckpt.final_state".into(), "checkpointed".into());
        r.values
            .insert("B.ckpt.final_state".into(), "running".into());
        let report = Report {
            scenarios: vec![r],
            ..Report::default()
        };
        assert_eq!(
            answer(&answers(&report), "legacy IPC mapping left open"),
            "lock: CUDA_SUCCESS (both processes); checkpoint: CUDA_SUCCESS (both processes); \
             restore: A: CUDA_ERROR_INVALID_VALUE (1); B: CUDA_SUCCESS; \
             unlock: A: not attempted (the process is checkpointed, not locked); B: CUDA_SUCCESS; \
             left A: checkpointed; B: running"
        );
    }

    #[test]
    fn scenarios_not_run_or_cut_short_say_why() {
        let not_run = result(
            "vmm-live",
            Outcome::NotRun {
                reason: "the probe stopped starting scenarios at 80 s".into(),
            },
            vec![],
        );
        let aborted = result(
            "legacy-as-is",
            Outcome::Aborted {
                process: "B".into(),
                step: "ckpt.checkpoint".into(),
                reason: "no answer within 10.0 s".into(),
            },
            vec![step(
                "legacy-as-is",
                "A",
                "ckpt.lock",
                "cuCheckpointProcessLock",
                Some(0),
                "CUDA_SUCCESS",
            )],
        );
        let job = result(
            "job-file",
            Outcome::NotRun {
                reason: "not tried: the kernel driver 580.95.05 is older than 590.44".into(),
            },
            vec![],
        );
        let report = Report {
            scenarios: vec![not_run, aborted, job],
            ..Report::default()
        };
        let a = answers(&report);
        assert_eq!(
            answer(
                &a,
                "natively restored allocation: its contents after restore"
            ),
            "not run (the probe stopped starting scenarios at 80 s) (both processes)"
        );
        assert_eq!(
            answer(&a, "fresh legacy handle after restore, as is"),
            "not reached (process B at ckpt.checkpoint: no answer within 10.0 s) at after.fresh_export (both processes)"
        );
        let cycle = answer(
            &a,
            "checkpoint and restore of two processes that cross-opened and closed legacy IPC",
        );
        assert!(
            cycle.contains("checkpoint: A: not reached (process B at ckpt.checkpoint: no answer within 10.0 s); B: no answer from process B: no answer within 10.0 s"),
            "{cycle}"
        );
        assert_eq!(
            answer(&a, "job-file path (CUDA_CHECKPOINT_JOB_FILE)"),
            "not tried: the kernel driver 580.95.05 is older than 590.44"
        );
    }

    #[test]
    fn system_facts_are_worded_with_the_matching_major() {
        let mut r = result("vmm-released", Outcome::Completed, vec![]);
        for (k, v) in [
            ("fd_type", "character device"),
            ("fd_mode", "20666"),
            ("fd_link", "/dev/nvidiactl"),
            ("fd_rdev", "195:255"),
            ("fd_dev", "0:5"),
            ("fd_ino", "77"),
        ] {
            r.values.insert(format!("A.setup.vmm_export.{k}"), v.into());
        }
        r.values.insert(
            "A.setup.vmm_create.granularity_minimum".into(),
            (2u64 << 20).to_string(),
        );
        r.values.insert(
            "A.setup.vmm_create.granularity_recommended".into(),
            (2u64 << 20).to_string(),
        );
        let mut device = result("device", Outcome::Completed, vec![]);
        device
            .values
            .insert("A.device.init.driver_version".into(), "13000".into());
        let report = Report {
            kernel_driver: Some("NVRM version: ... 580.95.05 ...".into()),
            nvidia_majors: vec![DeviceMajor {
                kind: "character".into(),
                major: 195,
                name: "nvidia-frontend".into(),
            }],
            device: Some(device),
            scenarios: vec![r],
            ..Report::default()
        };
        let a = answers(&report);
        assert_eq!(
            answer(&a, "exported descriptor's kind"),
            "character device (st_mode 20666), readlink /dev/nvidiactl, st_rdev 195:255, st_dev 0:5, st_ino 77; major 195 is nvidia-frontend in /proc/devices"
        );
        assert_eq!(
            answer(&a, "nvidia majors in /proc/devices"),
            "195 nvidia-frontend (character)"
        );
        assert_eq!(
            answer(&a, "allocation granularity"),
            "minimum 2 MiB, recommended 2 MiB (pinned device memory, POSIX descriptor handles)"
        );
        assert_eq!(
            answer(&a, "driver version"),
            "cuDriverGetVersion 13000 (CUDA 13.0); NVRM version: ... 580.95.05 ..."
        );
        assert!(table(&a).lines().count() == a.len());
    }
}
