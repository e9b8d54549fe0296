//! The report and its summary: questions 1-6 answered in words from the recorded steps (a
//! pure function of the report, so that its wording is tested with made-up results).
//!
//! Here: the report, the questions and their answers. Reading the recorded steps
//! (`results.rs`) and putting the findings in words (`findings.rs`) have files of their own.

mod findings;
mod results;

use serde::Serialize;

use crate::facts::DeviceMajor;
use crate::scenarios::{Outcome, ScenarioResult};
use findings::{
    address_note, cycle_text, driver_text, fd_text, granularity_text, majors_text, memory_text,
};
use results::{chain_result, combine, failure_text, missing, op_result, or_not_run, steps_of, Res};

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
mod tests;
