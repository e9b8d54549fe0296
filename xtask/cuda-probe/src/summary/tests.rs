use super::*;
use crate::scenarios::Step;
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
            reason:
                "after the checkpoint sequence A is checkpointed: the steps after it are not run"
                    .into(),
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
