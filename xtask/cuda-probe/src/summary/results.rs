//! Reading the recorded steps: one step's (or a chain of steps') result for one process,
//! why a step has no record, one text for every process of a scenario, and a scenario that
//! was not selected.

use super::Report;
use crate::scenarios::{Outcome, ScenarioResult, Step};

/// The outcome of one step (or a chain of steps) for one process.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Res {
    Works(String),
    Fails(String),
    Missing(String),
}

impl Res {
    pub(super) fn text(&self) -> String {
        match self {
            Res::Works(s) | Res::Fails(s) | Res::Missing(s) => s.clone(),
        }
    }
}

/// Why `process` has no record of `step` in `sc`.
pub(super) fn missing(sc: &ScenarioResult, process: &str, step: &str) -> String {
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
pub(super) fn failure_text(s: &Step) -> String {
    match (s.name.as_str(), s.code) {
        ("NOT_ATTEMPTED", _) => format!("not attempted ({})", s.detail),
        (name, Some(code)) => format!("{name} ({code}) from {}", s.call),
        (name, None) => format!("{name} in {}: {}", s.call, s.detail),
    }
}

pub(super) fn steps_of<'a>(sc: &'a ScenarioResult, process: &str, step: &str) -> Vec<&'a Step> {
    sc.steps
        .iter()
        .filter(|s| s.process == process && s.step == step)
        .collect()
}

/// One step of one process.
pub(super) fn op_result(sc: &ScenarioResult, process: &str, step: &str) -> Res {
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
pub(super) fn chain_result(sc: &ScenarioResult, process: &str, steps: &[&str]) -> Res {
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
pub(super) fn combine(sc: &ScenarioResult, mut per: impl FnMut(&str) -> String) -> String {
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

pub(super) fn scenario<'a>(report: &'a Report, name: &str) -> Option<&'a ScenarioResult> {
    report.scenarios.iter().find(|s| s.name == name)
}

pub(super) fn or_not_run(
    report: &Report,
    name: &str,
    f: impl Fn(&ScenarioResult) -> String,
) -> String {
    match scenario(report, name) {
        Some(sc) => f(sc),
        None => "not run (not selected)".into(),
    }
}
