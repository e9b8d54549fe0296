//! The findings in words: the checkpoint sequence (every phase per process and the states
//! left), GPU memory around it, the exported descriptor's kind, the nvidia device majors,
//! the allocation granularity, the driver versions, and where an import was mapped.

use super::results::{combine, missing, or_not_run, scenario, steps_of};
use super::Report;
use crate::facts::bytes;
use crate::scenarios::ScenarioResult;

const PHASES: [(&str, &str); 4] = [
    ("ckpt.lock", "lock"),
    ("ckpt.checkpoint", "checkpoint"),
    ("ckpt.restore", "restore"),
    ("ckpt.unlock", "unlock"),
];

/// The checkpoint sequence in words: every phase's result per process and the states left.
pub(super) fn cycle_text(sc: &ScenarioResult) -> String {
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
pub(super) fn memory_text(sc: &ScenarioResult) -> String {
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
pub(super) fn fd_text(report: &Report) -> String {
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

pub(super) fn majors_text(report: &Report) -> String {
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

pub(super) fn granularity_text(report: &Report) -> String {
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

pub(super) fn driver_text(report: &Report) -> String {
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

pub(super) fn address_note<'a>(sc: &'a ScenarioResult, step: &str) -> impl Fn(&str) -> String + 'a {
    let step = step.to_string();
    move |p: &str| match sc.value(p, &step, "same_address") {
        Some("yes") => ", mapped at the importer's kept address".into(),
        _ => String::new(),
    }
}
