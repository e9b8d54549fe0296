//! The scenarios, run by the parent: each in a fresh pair of child processes, under its own
//! deadline, every step recorded and printed as its answer arrives.
//!
//! Here: what a scenario is and records, the list of scenarios and the run's timing. The
//! session that asks the children (`session.rs`), the checkpoint sequence across them
//! (`cycle.rs`), `nvidia-smi` (`nvidia_smi.rs`), one scenario's run in fresh processes
//! (`runner.rs`) and the scenarios' scripts (`scripts.rs`) have files of their own.

mod cycle;
mod nvidia_smi;
mod runner;
mod scripts;
mod session;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::protocol::{Launcher, Role};
use scripts::{
    device_check, job_file, legacy_as_is, legacy_left_open, legacy_reinit, legacy_release,
    legacy_reset, state_query, vmm_left_mapped, vmm_live, vmm_released, vmm_self,
};
use session::Session;

pub(crate) use cycle::state_name;

/// One recorded call, as printed and written to the JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Step {
    pub(crate) scenario: String,
    /// `A`, `B` or `parent`.
    pub(crate) process: String,
    pub(crate) step: String,
    pub(crate) call: String,
    pub(crate) code: Option<i64>,
    pub(crate) name: String,
    pub(crate) ok: bool,
    pub(crate) detail: String,
}

impl Step {
    /// The printed line: `scenario | process | step | call | code | name | detail`.
    pub(crate) fn line(&self) -> String {
        format!(
            "{} | {} | {} | {} | {} | {} | {}",
            self.scenario,
            self.process,
            self.step,
            self.call,
            self.code.map_or("-".to_string(), |c| c.to_string()),
            self.name,
            self.detail
        )
    }
}

/// How a scenario ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub(crate) enum Outcome {
    /// Every step was run.
    Completed,
    /// The script stopped: what follows needs a state it did not get (a failed init, a
    /// process left locked or checkpointed).
    Stopped { reason: String },
    /// A process did not answer in time, died, or could not be started.
    Aborted {
        process: String,
        step: String,
        reason: String,
    },
    /// Not started.
    NotRun { reason: String },
}

/// What one scenario recorded.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ScenarioResult {
    pub(crate) name: String,
    pub(crate) about: String,
    pub(crate) processes: Vec<String>,
    pub(crate) outcome: Outcome,
    pub(crate) seconds: f64,
    pub(crate) steps: Vec<Step>,
    /// The values the children reported, keyed `PROCESS.STEP.KEY`.
    pub(crate) values: BTreeMap<String, String>,
}

impl ScenarioResult {
    pub(crate) fn not_run(sc: &Scenario, reason: String) -> Self {
        Self {
            name: sc.name.into(),
            about: sc.about.into(),
            processes: sc.roles().iter().map(|r| r.name().to_string()).collect(),
            outcome: Outcome::NotRun { reason },
            seconds: 0.0,
            steps: Vec::new(),
            values: BTreeMap::new(),
        }
    }

    pub(crate) fn value(&self, process: &str, step: &str, key: &str) -> Option<&str> {
        self.values
            .get(&format!("{process}.{step}.{key}"))
            .map(String::as_str)
    }
}

/// Why a script ended early.
#[derive(Debug)]
pub(crate) enum End {
    Stop(String),
    Abort {
        process: String,
        step: String,
        reason: String,
    },
}

type Script = fn(&mut Session<'_>) -> Result<(), End>;

/// One scenario.
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) about: &'static str,
    /// 1 or 2 processes.
    pub(crate) processes: usize,
    /// The children get `CUDA_CHECKPOINT_JOB_FILE` (a fresh empty file) and the checkpoint
    /// steps run one process at a time.
    pub(crate) job_file: bool,
    script: Script,
}

impl std::fmt::Debug for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

impl Scenario {
    pub(crate) fn roles(&self) -> &'static [Role] {
        if self.processes == 1 {
            &[Role::A]
        } else {
            &Role::BOTH
        }
    }
}

/// The device check that runs before any scenario: one process, `Init`.
pub(crate) const DEVICE_CHECK: Scenario = Scenario {
    name: "device",
    about: "one process: cuInit, the driver version, device 0 and its primary context",
    processes: 1,
    job_file: false,
    script: device_check,
};

/// Every scenario, the most decisive first (the probe may run out of time).
pub(crate) const SCENARIOS: [Scenario; 11] = [
    Scenario {
        name: "legacy-as-is",
        about: "1a: legacy IPC cross-opened and closed, both checkpointed and restored; fresh and old handles opened as is",
        processes: 2,
        job_file: false,
        script: legacy_as_is,
    },
    Scenario {
        name: "legacy-reinit",
        about: "1b: as 1a, then cuInit(0) and the primary context retained and made current again before the fresh and old handles",
        processes: 2,
        job_file: false,
        script: legacy_reinit,
    },
    Scenario {
        name: "vmm-released",
        about: "2 and 3: VMM (POSIX fd) cross-imported, the imports unmapped and the exporters' memory released before the checkpoint (reservations kept); after the restore fresh memory at the kept addresses, exported, imported at the importer's kept address, data both ways",
        processes: 2,
        job_file: false,
        script: vmm_released,
    },
    Scenario {
        name: "vmm-live",
        about: "2 and 3: as vmm-released but the exporters keep their allocations and exported descriptors through the checkpoint; after the restore the restored memory's contents, the old descriptors, a re-export, then fresh memory at the kept addresses",
        processes: 2,
        job_file: false,
        script: vmm_live,
    },
    Scenario {
        name: "legacy-reset",
        about: "1c: as 1a, then cuDevicePrimaryCtxReset, the context retained again, a new cuMemAlloc allocation exported and opened",
        processes: 2,
        job_file: false,
        script: legacy_reset,
    },
    Scenario {
        name: "legacy-release",
        about: "1c: as 1a, then the primary context released to zero and retained again, a new allocation exported and opened",
        processes: 2,
        job_file: false,
        script: legacy_release,
    },
    Scenario {
        name: "vmm-left-mapped",
        about: "4: VMM imports left mapped through lock, checkpoint, restore, unlock",
        processes: 2,
        job_file: false,
        script: vmm_left_mapped,
    },
    Scenario {
        name: "legacy-left-open",
        about: "4: legacy IPC mappings left open through lock, checkpoint, restore, unlock",
        processes: 2,
        job_file: false,
        script: legacy_left_open,
    },
    Scenario {
        name: "vmm-self",
        about: "5: one process imports its own exported descriptor and maps it at a second address",
        processes: 1,
        job_file: false,
        script: vmm_self,
    },
    Scenario {
        name: "state-query",
        about: "5: one process asks its own cuCheckpointProcessGetState while running, locked, checkpointed, restored and unlocked",
        processes: 1,
        job_file: false,
        script: state_query,
    },
    Scenario {
        name: "job-file",
        about: "6: as 1a with CUDA_CHECKPOINT_JOB_FILE set to a fresh file for both processes, the checkpoint steps one process at a time",
        processes: 2,
        job_file: true,
        script: job_file,
    },
];

/// Timing of the run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// Each scenario's own limit.
    pub(crate) scenario: Duration,
    /// The limit of a request that may take long: init, the primary-context calls, the
    /// checkpoint calls.
    pub(crate) command: Duration,
    /// The limit of every other request (allocations, exports, imports, copies).
    pub(crate) quick: Duration,
    /// Waiting for a child's hello.
    pub(crate) start: Duration,
    /// No scenario starts after this much of the run.
    pub(crate) stop_starting: Duration,
    /// Every scenario ends by this much of the run.
    pub(crate) hard_end: Duration,
    /// How long an exiting child is waited for before it is killed.
    pub(crate) exit_grace: Duration,
}

impl Timing {
    /// The GPU run: 15 s per scenario, no start after 80 s, everything over by 84 s (the
    /// ending children and the summary fit in the 90 s that `run.sh` gives).
    pub(crate) const GPU: Self = Self {
        scenario: Duration::from_secs(15),
        command: Duration::from_secs(10),
        quick: Duration::from_secs(5),
        start: Duration::from_secs(10),
        stop_starting: Duration::from_secs(80),
        hard_end: Duration::from_secs(84),
        exit_grace: Duration::from_secs(1),
    };
}

/// What the runner needs to start children.
#[derive(Debug, Clone)]
pub(crate) struct Runner {
    pub(crate) launcher: Launcher,
    /// The children's mode (`real`, `fake:...`, `hang`, ...).
    pub(crate) mode: String,
    pub(crate) timing: Timing,
    /// When the run started.
    pub(crate) started: Instant,
}
