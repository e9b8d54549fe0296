//! The scenarios, run by the parent: each in a fresh pair of child processes, under its own
//! deadline, every step recorded and printed as its answer arrives.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::protocol::{ChildProc, Launcher, Op, Reply, Role, Silence};

/// Bytes of each legacy (`cuMemAlloc`) allocation.
const LEGACY_BYTES: u64 = 4 << 20;
/// Bytes of each VMM allocation (rounded up to the granularity).
const VMM_BYTES: u64 = 32 << 20;
/// The lock's own timeout (`CUcheckpointLockArgs::timeoutMs`).
const LOCK_TIMEOUT_MS: u32 = 5000;

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

/// A running scenario: its processes and what it recorded.
pub(crate) struct Session<'a> {
    procs: Vec<ChildProc>,
    result: &'a mut ScenarioResult,
    deadline: Instant,
    command: Duration,
    quick: Duration,
    sequential: bool,
    print: &'a mut dyn FnMut(&Step),
}

/// The answers of one request per process (`None` where nothing was asked).
pub(crate) type Replies = [Option<Reply>; 2];

impl Session<'_> {
    fn proc(&mut self, role: Role) -> Option<&mut ChildProc> {
        self.procs.iter_mut().find(|p| p.role == role)
    }

    fn pid(&self, role: Role) -> u32 {
        self.procs
            .iter()
            .find(|p| p.role == role)
            .map_or(0, |p| p.pid)
    }

    fn roles(&self) -> Vec<Role> {
        self.procs.iter().map(|p| p.role).collect()
    }

    fn record(&mut self, step: Step) {
        (self.print)(&step);
        self.result.steps.push(step);
    }

    /// Records that `role` was not asked to do `step`, and why.
    fn not_attempted(&mut self, role: Role, step: &str, why: &str) {
        self.record(Step {
            scenario: self.result.name.clone(),
            process: role.name().into(),
            step: step.into(),
            call: "-".into(),
            code: None,
            name: "NOT_ATTEMPTED".into(),
            ok: false,
            detail: why.into(),
        });
    }

    /// A parent-side record (`process` = `parent`).
    fn parent_note(&mut self, step: &str, call: &str, code: Option<i64>, ok: bool, detail: String) {
        self.record(Step {
            scenario: self.result.name.clone(),
            process: "parent".into(),
            step: step.into(),
            call: call.into(),
            code,
            name: if ok { "OK" } else { "FAILED" }.into(),
            ok,
            detail,
        });
    }

    /// Sends `op(role)` to every role of this session (`Err(why)`: that role is not asked),
    /// all before any answer is awaited (one at a time when the session is sequential).
    fn each(
        &mut self,
        step: &str,
        op: impl Fn(Role) -> Result<Op, String>,
    ) -> Result<Replies, End> {
        let roles = self.roles();
        self.ask(step, &roles, op)
    }

    /// The same operation on every role.
    fn all(&mut self, step: &str, op: Op) -> Result<Replies, End> {
        self.each(step, |_| Ok(op.clone()))
    }

    fn ask(
        &mut self,
        step: &str,
        roles: &[Role],
        op: impl Fn(Role) -> Result<Op, String>,
    ) -> Result<Replies, End> {
        let mut replies: Replies = [None, None];
        if self.sequential {
            for &role in roles {
                let one = self.ask_now(step, &[role], &op)?;
                replies[role.index()] = one[role.index()].clone();
            }
            Ok(replies)
        } else {
            self.ask_now(step, roles, &op)
        }
    }

    fn ask_now(
        &mut self,
        step: &str,
        roles: &[Role],
        op: &impl Fn(Role) -> Result<Op, String>,
    ) -> Result<Replies, End> {
        let mut sent = Vec::new();
        for &role in roles {
            match op(role) {
                Ok(op) => {
                    let limit = if op.may_take_long() {
                        self.command
                    } else {
                        self.quick
                    };
                    let proc = self.proc(role).expect("the session's own role");
                    match proc.send(&op) {
                        Ok(id) => sent.push((role, id, Instant::now(), limit)),
                        Err(why) => {
                            return Err(End::Abort {
                                process: role.name().into(),
                                step: step.into(),
                                reason: why.to_string(),
                            })
                        }
                    }
                }
                Err(why) => self.not_attempted(role, step, &why),
            }
        }
        let mut replies: Replies = [None, None];
        let mut silent = None;
        for (role, id, at, limit) in sent {
            let deadline = (at + limit).min(self.deadline);
            let proc = self.proc(role).expect("the session's own role");
            match proc.receive(id, deadline) {
                Ok(reply) => {
                    for call in &reply.calls {
                        let step = Step {
                            scenario: self.result.name.clone(),
                            process: role.name().into(),
                            step: step.into(),
                            call: call.call.clone(),
                            code: call.code,
                            name: call.name.clone(),
                            ok: call.ok,
                            detail: call.detail.clone(),
                        };
                        self.record(step);
                    }
                    for (k, v) in &reply.values {
                        self.result
                            .values
                            .insert(format!("{}.{step}.{k}", role.name()), v.clone());
                    }
                    replies[role.index()] = Some(reply);
                }
                Err(why) => {
                    // A timeout is told as the whole wait since the request was sent.
                    let why = match why {
                        Silence::Timeout(_) => {
                            Silence::Timeout(deadline.saturating_duration_since(at))
                        }
                        other => other,
                    };
                    let this = format!("{}: {why}", role.name());
                    match &mut silent {
                        None => {
                            silent = Some(End::Abort {
                                process: role.name().into(),
                                step: step.into(),
                                reason: why.to_string(),
                            })
                        }
                        Some(End::Abort { reason, .. }) => {
                            reason.push_str(&format!(" (and process {this})"))
                        }
                        Some(End::Stop(_)) => {}
                    }
                }
            }
        }
        match silent {
            Some(end) => Err(end),
            None => Ok(replies),
        }
    }

    /// Stops the script unless every asked role's reply went as needed.
    fn require(&self, replies: &Replies, what: &str) -> Result<(), End> {
        let failed: Vec<String> = Role::BOTH
            .iter()
            .filter_map(|r| {
                let reply = replies[r.index()].as_ref()?;
                let bad = reply.calls.iter().find(|c| !c.ok)?;
                Some(format!(
                    "{} {}: {}{}",
                    r.name(),
                    bad.call,
                    bad.name,
                    bad.code.map_or(String::new(), |c| format!(" ({c})"))
                ))
            })
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(End::Stop(format!("{what} failed: {}", failed.join(", "))))
        }
    }

    /// The checkpoint sequence: lock every process, then checkpoint every process, restore
    /// every process, unlock every process (each call on the process's own pid from its own
    /// thread). A process goes on as far as its own state allows (a failed lock is not
    /// followed by a checkpoint of that process); its state is read after every call.
    /// Stops the script unless every process is running again at the end.
    fn cycle(&mut self, gpu_memory: bool) -> Result<(), End> {
        self.cycle_with(gpu_memory, false)
    }

    /// [`cycle`](Self::cycle); with `states`, every process that took a step also asks its
    /// own state after it (`STEP.state`).
    fn cycle_with(&mut self, gpu_memory: bool, states: bool) -> Result<(), End> {
        let roles = self.roles();
        let mut state = [0i32; 2];
        let phases: [(&str, i32, i32, Op); 4] = [
            (
                "ckpt.lock",
                0,
                1,
                Op::CkptLock {
                    timeout_ms: LOCK_TIMEOUT_MS,
                },
            ),
            ("ckpt.checkpoint", 1, 2, Op::CkptCheckpoint),
            ("ckpt.restore", 2, 1, Op::CkptRestore),
            ("ckpt.unlock", 1, 0, Op::CkptUnlock),
        ];
        for (label, need, after, op) in phases {
            if label == "ckpt.restore" && gpu_memory {
                self.gpu_memory("ckpt.while_checkpointed");
            }
            let current = state;
            let replies = self.ask(label, &roles, |r| {
                let s = current[r.index()];
                if s == need {
                    Ok(op.clone())
                } else {
                    Err(format!(
                        "the process is {}, not {}",
                        state_name(s),
                        state_name(need)
                    ))
                }
            })?;
            let mut took = Vec::new();
            for r in &roles {
                if let Some(reply) = &replies[r.index()] {
                    let failed = reply.calls.first().is_some_and(|c| !c.ok);
                    took.push(*r);
                    state[r.index()] = match reply.value("state").and_then(|s| s.parse().ok()) {
                        Some(s) => s,
                        None if failed => state[r.index()],
                        None => after,
                    };
                }
            }
            if states && !took.is_empty() {
                let step = format!("{label}.state");
                let replies = self.ask(&step, &took, |_| Ok(Op::State))?;
                for r in &took {
                    let seen = replies[r.index()]
                        .as_ref()
                        .and_then(|reply| reply.value("state"))
                        .and_then(|s| s.parse().ok());
                    if let Some(s) = seen {
                        state[r.index()] = s;
                    }
                }
            }
        }
        for r in &roles {
            let name = state_name(state[r.index()]).to_string();
            self.result
                .values
                .insert(format!("{}.ckpt.final_state", r.name()), name);
        }
        let left: Vec<String> = roles
            .iter()
            .filter(|r| state[r.index()] != 0)
            .map(|r| format!("{} is {}", r.name(), state_name(state[r.index()])))
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(End::Stop(format!(
                "after the checkpoint sequence {}: the steps after it are not run",
                left.join(", ")
            )))
        }
    }

    /// GPU memory as `nvidia-smi` sees it (another process: nothing of the children's
    /// driver state is touched), within 4 s.
    fn gpu_memory(&mut self, step: &str) {
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        let limit = Duration::from_secs(4).min(remaining);
        let pids: Vec<u32> = self.procs.iter().map(|p| p.pid).collect();
        let (ok, detail, values) = nvidia_smi(limit, &pids);
        for (k, v) in values {
            self.result.values.insert(format!("parent.{step}.{k}"), v);
        }
        self.parent_note(step, "nvidia-smi", None, ok, detail);
    }

    /// The children, asked to exit, then killed; statuses other than a clean exit recorded.
    fn finish(&mut self, grace: Duration) {
        let procs = std::mem::take(&mut self.procs);
        for (role, status) in ChildProc::finish_all(procs, grace) {
            if status != "exit status: 0" {
                self.result
                    .values
                    .insert(format!("{}.end", role.name()), status.clone());
                self.parent_note(
                    "end",
                    "exit",
                    None,
                    true,
                    format!("{}: {status}", role.name()),
                );
            }
        }
    }
}

/// `CUprocessState` in words.
pub(crate) fn state_name(state: i32) -> &'static str {
    match state {
        0 => "running",
        1 => "locked",
        2 => "checkpointed",
        3 => "failed",
        _ => "in an unknown state",
    }
}

/// Runs a command with a time limit; its stdout, or why not.
fn bounded_output(program: &str, args: &[&str], limit: Duration) -> Result<String, String> {
    use std::io::Read;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(mut s) = child.stdout.take() {
                    let _ = s.read_to_string(&mut out);
                }
                return if status.success() {
                    Ok(out)
                } else {
                    Err(format!("{program}: {status}"))
                };
            }
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{program}: no answer within {:.1} s (killed)",
                    limit.as_secs_f64()
                ));
            }
            Err(e) => return Err(format!("{program}: {e}")),
        }
    }
}

/// The device's used memory and each of `pids`' (not listed: no GPU memory) from
/// `nvidia-smi`.
fn nvidia_smi(limit: Duration, pids: &[u32]) -> (bool, String, Vec<(String, String)>) {
    let started = Instant::now();
    let device = bounded_output(
        "nvidia-smi",
        &[
            "--query-gpu=memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ],
        limit,
    );
    let apps = bounded_output(
        "nvidia-smi",
        &[
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ],
        limit.saturating_sub(started.elapsed()),
    );
    let mut values = Vec::new();
    let mut parts = Vec::new();
    let ok = device.is_ok() && apps.is_ok();
    match device {
        Ok(text) => {
            let first = text.lines().next().unwrap_or("").trim().to_string();
            parts.push(format!("device memory.used, total (MiB): {first}"));
            values.push(("device_used_total_mib".into(), first));
        }
        Err(e) => parts.push(e),
    }
    match apps {
        Ok(text) => {
            for (i, pid) in pids.iter().enumerate() {
                let role = if i == 0 { "A" } else { "B" };
                let used = text.lines().find_map(|l| {
                    let mut f = l.split(',').map(str::trim);
                    (f.next() == Some(pid.to_string().as_str()))
                        .then(|| f.next().unwrap_or("").to_string())
                });
                let shown = used
                    .clone()
                    .map_or("not listed".to_string(), |u| format!("{u} MiB"));
                parts.push(format!("{role} (pid {pid}): {shown}"));
                values.push((
                    format!("{role}_used_mib"),
                    used.unwrap_or_else(|| "not listed".into()),
                ));
            }
        }
        Err(e) => parts.push(e),
    }
    (ok, parts.join("; "), values)
}

impl Runner {
    /// Runs one scenario in fresh processes, ending by `min(its limit, the hard end)`.
    pub(crate) fn run(&self, sc: &Scenario, print: &mut dyn FnMut(&Step)) -> ScenarioResult {
        let begun = Instant::now();
        let deadline = (begun + self.timing.scenario).min(self.started + self.timing.hard_end);
        let mut result = ScenarioResult::not_run(sc, String::new());
        result.outcome = Outcome::Completed;
        let mut env = Vec::new();
        let mut remove = vec!["CUDA_CHECKPOINT_JOB_FILE".to_string()];
        let mut job_dir = None;
        let mut notes = Vec::new();
        if sc.job_file {
            let dir = std::env::temp_dir().join(format!(
                "tpcomm-ipc-probe-{}-{}",
                std::process::id(),
                begun.duration_since(self.started).as_nanos()
            ));
            let file = dir.join("job");
            match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&file, b"")) {
                Ok(()) => {
                    notes.push(format!(
                        "CUDA_CHECKPOINT_JOB_FILE={} (a fresh empty file)",
                        file.display()
                    ));
                    env.push((
                        "CUDA_CHECKPOINT_JOB_FILE".to_string(),
                        file.display().to_string(),
                    ));
                    remove.clear();
                    job_dir = Some(dir);
                }
                Err(e) => {
                    result.outcome = Outcome::Aborted {
                        process: "parent".into(),
                        step: "job_file".into(),
                        reason: format!("cannot create the job file {}: {e}", file.display()),
                    };
                    return result;
                }
            }
        }
        // A socket pair for descriptor passing between the two children.
        let sockets = if sc.processes == 2 {
            match rustix::net::socketpair(
                rustix::net::AddressFamily::UNIX,
                rustix::net::SocketType::DGRAM,
                rustix::net::SocketFlags::CLOEXEC,
                None,
            ) {
                Ok((a, b)) => Some([a, b]),
                Err(e) => {
                    notes.push(format!(
                        "no socket pair ({e}): descriptors pass by pidfd_getfd only"
                    ));
                    None
                }
            }
        } else {
            None
        };
        let mut procs = Vec::new();
        for &role in sc.roles() {
            let hello_by = (Instant::now() + self.timing.start).min(deadline);
            let socket = sockets.as_ref().map(|s| &s[role.index()]);
            match ChildProc::spawn(
                self.launcher,
                role,
                &self.mode,
                &env,
                &remove,
                socket,
                hello_by,
            ) {
                Ok(p) => procs.push(p),
                Err(why) => {
                    result.outcome = Outcome::Aborted {
                        process: role.name().into(),
                        step: "start".into(),
                        reason: why,
                    };
                    break;
                }
            }
        }
        drop(sockets);
        let mut session = Session {
            procs,
            result: &mut result,
            deadline,
            command: self.timing.command,
            quick: self.timing.quick,
            sequential: sc.job_file,
            print,
        };
        for note in notes {
            session.parent_note("setup.job_file", "job file", None, true, note);
        }
        if session.result.outcome == Outcome::Completed {
            let ended = (sc.script)(&mut session);
            session.result.outcome = match ended {
                Ok(()) => Outcome::Completed,
                Err(End::Stop(reason)) => Outcome::Stopped { reason },
                Err(End::Abort {
                    process,
                    step,
                    reason,
                }) => {
                    let note = format!("process {process} at {step}: {reason}");
                    session.parent_note(&step, "wait", None, false, note);
                    Outcome::Aborted {
                        process,
                        step,
                        reason,
                    }
                }
            };
        }
        session.finish(self.timing.exit_grace);
        if let Some(dir) = job_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        result.seconds = begun.elapsed().as_secs_f64();
        result
    }
}

// ---- the scripts --------------------------------------------------------------------

fn value_of(replies: &Replies, role: Role, key: &str) -> Result<String, String> {
    replies[role.index()]
        .as_ref()
        .and_then(|r| r.value(key))
        .map(str::to_string)
        .ok_or_else(|| format!("process {} reported no {key}", role.name()))
}

fn device_check(s: &mut Session<'_>) -> Result<(), End> {
    let r = s.all("device.init", Op::Init)?;
    s.require(&r, "the device check")?;
    Ok(())
}

fn init(s: &mut Session<'_>) -> Result<(), End> {
    let r = s.all("setup.init", Op::Init)?;
    s.require(&r, "init")?;
    s.all("setup.mem_info", Op::MemInfo)?;
    Ok(())
}

/// Init, a legacy allocation each, exported, opened by the peer (its contents checked),
/// closed. The handles.
fn legacy_setup(s: &mut Session<'_>, close: bool) -> Result<Replies, End> {
    init(s)?;
    let r = s.each("setup.legacy_alloc", |r| {
        Ok(Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: r.seed(0),
        })
    })?;
    s.require(&r, "the legacy allocation")?;
    let handles = s.all("setup.legacy_export", Op::LegacyExport)?;
    let opened = s.each("setup.legacy_open", |r| {
        Ok(Op::LegacyOpen {
            handle: value_of(&handles, r.peer(), "handle")?,
            seed: r.peer().seed(0),
        })
    })?;
    if close {
        s.all("setup.legacy_close", Op::LegacyClose)?;
    }
    s.require(&opened, "opening the peer's handle before the checkpoint")?;
    s.all("setup.mem_info_before", Op::MemInfo)?;
    Ok(handles)
}

/// Fresh handles exported after the restore, opened by the peer (contents `round`), closed.
fn fresh_legacy(s: &mut Session<'_>, round: u8) -> Result<(), End> {
    let fresh = s.all("after.fresh_export", Op::LegacyExport)?;
    s.each("after.fresh_open", |r| {
        Ok(Op::LegacyOpen {
            handle: value_of(&fresh, r.peer(), "handle")?,
            seed: r.peer().seed(round),
        })
    })?;
    s.all("after.fresh_close", Op::LegacyClose)?;
    Ok(())
}

fn legacy_as_is(s: &mut Session<'_>) -> Result<(), End> {
    let old = legacy_setup(s, true)?;
    s.cycle(true)?;
    s.all("after.mem_info", Op::MemInfo)?;
    fresh_legacy(s, 0)?;
    old_legacy(s, &old)
}

fn legacy_reinit(s: &mut Session<'_>) -> Result<(), End> {
    let old = legacy_setup(s, true)?;
    s.cycle(false)?;
    s.all("after.reinit", Op::ReInit)?;
    fresh_legacy(s, 0)?;
    old_legacy(s, &old)
}

/// The handles exported before the checkpoint, opened by the peer, closed.
fn old_legacy(s: &mut Session<'_>, old: &Replies) -> Result<(), End> {
    s.each("after.old_open", |r| {
        Ok(Op::LegacyOpen {
            handle: value_of(old, r.peer(), "handle")?,
            seed: r.peer().seed(0),
        })
    })?;
    s.all("after.old_close", Op::LegacyClose)?;
    Ok(())
}

fn legacy_reset(s: &mut Session<'_>) -> Result<(), End> {
    legacy_setup(s, true)?;
    s.cycle(false)?;
    s.all("after.reset", Op::CtxReset)?;
    s.each("after.legacy_alloc", |r| {
        Ok(Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: r.seed(2),
        })
    })?;
    fresh_legacy(s, 2)
}

fn legacy_release(s: &mut Session<'_>) -> Result<(), End> {
    legacy_setup(s, true)?;
    s.cycle(false)?;
    s.all("after.release", Op::CtxReleaseRetain)?;
    s.each("after.legacy_alloc", |r| {
        Ok(Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: r.seed(2),
        })
    })?;
    fresh_legacy(s, 2)
}

fn legacy_left_open(s: &mut Session<'_>) -> Result<(), End> {
    legacy_setup(s, false)?;
    s.cycle(false)?;
    s.each("after.read_peer", |r| {
        Ok(Op::LegacyReadPeer {
            seed: r.peer().seed(0),
        })
    })?;
    Ok(())
}

/// `pidfd_getfd` + import of the peer's descriptor `fd_from[peer]` (the pattern `seed(peer)`
/// expected).
fn import_peer(
    s: &mut Session<'_>,
    step: &str,
    fds: &Replies,
    sizes: &Replies,
    seed: impl Fn(Role) -> u8,
) -> Result<Replies, End> {
    let pids = [s.pid(Role::A), s.pid(Role::B)];
    // Each exporter first offers its descriptor over the socket pair (the importer takes that
    // copy where pidfd_getfd is not allowed).
    s.each(&format!("{step}.offer"), |r| {
        let fd = value_of(fds, r, "fd")?
            .parse()
            .map_err(|_| "a descriptor that is not a number".to_string())?;
        Ok(Op::VmmOffer { fd })
    })?;
    s.each(step, |r| {
        let peer = r.peer();
        let fd = value_of(fds, peer, "fd")?
            .parse()
            .map_err(|_| "a descriptor that is not a number".to_string())?;
        let size = value_of(sizes, peer, "size")?
            .parse()
            .map_err(|_| "a size that is not a number".to_string())?;
        Ok(Op::VmmImport {
            pid: pids[peer.index()],
            fd,
            size,
            seed: seed(r),
        })
    })
}

/// Init, a VMM allocation each, exported, imported by the peer and checked, written by the
/// peer through its mapping and checked by the owner, the import unmapped and released;
/// with `release_own` the owner's memory too. The create replies (sizes) and the export
/// replies (descriptors).
fn vmm_setup(
    s: &mut Session<'_>,
    unmap: bool,
    release_own: bool,
) -> Result<(Replies, Replies), End> {
    init(s)?;
    let created = s.each("setup.vmm_create", |r| {
        Ok(Op::VmmCreate {
            bytes: VMM_BYTES,
            seed: r.seed(0),
        })
    })?;
    s.require(&created, "the VMM allocation")?;
    let exported = s.all("setup.vmm_export", Op::VmmExport)?;
    let imported = import_peer(s, "setup.vmm_import", &exported, &created, |r| {
        r.peer().seed(0)
    })?;
    s.require(
        &imported,
        "importing the peer's allocation before the checkpoint",
    )?;
    s.each("setup.vmm_write_peer", |r| {
        Ok(Op::VmmWritePeer { seed: r.seed(1) })
    })?;
    s.each("setup.vmm_read_own", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(1),
        })
    })?;
    if unmap {
        s.all("setup.vmm_unmap_import", Op::VmmUnmapImport)?;
    }
    if release_own {
        s.all("setup.vmm_release_own", Op::VmmReleaseOwn)?;
    }
    s.all("setup.mem_info_before", Op::MemInfo)?;
    Ok((created, exported))
}

/// Fresh memory at the kept reservation, exported, imported at the importer's kept
/// reservation, then data both ways. `round` seeds the owner's pattern, `round + 1` the
/// peer's write.
fn vmm_fresh(s: &mut Session<'_>, round: u8) -> Result<(), End> {
    let fresh = s.each("after.vmm_fresh", |r| {
        Ok(Op::VmmFresh {
            seed: r.seed(round),
        })
    })?;
    let exported = s.all("after.fresh_export", Op::VmmExport)?;
    import_peer(s, "after.fresh_import", &exported, &fresh, |r| {
        r.peer().seed(round)
    })?;
    s.each("after.fresh_write_peer", |r| {
        Ok(Op::VmmWritePeer {
            seed: r.seed(round + 1),
        })
    })?;
    s.each("after.fresh_read_own", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(round + 1),
        })
    })?;
    Ok(())
}

fn vmm_released(s: &mut Session<'_>) -> Result<(), End> {
    vmm_setup(s, true, true)?;
    s.cycle(true)?;
    s.all("after.mem_info", Op::MemInfo)?;
    vmm_fresh(s, 2)
}

fn vmm_live(s: &mut Session<'_>) -> Result<(), End> {
    let (created, exported) = vmm_setup(s, true, false)?;
    s.cycle(true)?;
    s.all("after.mem_info", Op::MemInfo)?;
    // The owner's memory holds what the peer wrote before the checkpoint.
    s.each("after.restored_contents", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(1),
        })
    })?;
    // The descriptors exported before the checkpoint, still open in the exporters; the
    // peer's memory holds this process's write.
    import_peer(s, "after.old_fd_import", &exported, &created, |r| r.seed(1))?;
    s.all("after.old_fd_unmap", Op::VmmUnmapImport)?;
    let again = s.all("after.reexport", Op::VmmExport)?;
    import_peer(s, "after.reexport_import", &again, &created, |r| r.seed(1))?;
    s.each("after.reexport_write_peer", |r| {
        Ok(Op::VmmWritePeer { seed: r.seed(5) })
    })?;
    s.each("after.reexport_read_own", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(5),
        })
    })?;
    s.all("after.reexport_unmap", Op::VmmUnmapImport)?;
    s.all("after.release_restored", Op::VmmReleaseOwn)?;
    vmm_fresh(s, 2)
}

fn vmm_left_mapped(s: &mut Session<'_>) -> Result<(), End> {
    vmm_setup(s, false, false)?;
    s.cycle(false)?;
    s.each("after.read_peer", |r| {
        Ok(Op::VmmReadPeer { seed: r.seed(1) })
    })?;
    Ok(())
}

fn vmm_self(s: &mut Session<'_>) -> Result<(), End> {
    init(s)?;
    let r = s.each("self.vmm_create", |r| {
        Ok(Op::VmmCreate {
            bytes: VMM_BYTES,
            seed: r.seed(0),
        })
    })?;
    s.require(&r, "the VMM allocation")?;
    let r = s.all("self.vmm_export", Op::VmmExport)?;
    s.require(&r, "the export")?;
    s.each("self.vmm_self_import", |r| {
        Ok(Op::VmmSelfImport {
            seed: r.seed(0),
            write_seed: r.seed(4),
        })
    })?;
    Ok(())
}

fn state_query(s: &mut Session<'_>) -> Result<(), End> {
    init(s)?;
    s.all(
        "setup.legacy_alloc",
        Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: Role::A.seed(0),
        },
    )?;
    s.all("setup.state", Op::State)?;
    s.cycle_with(false, true)
}

fn job_file(s: &mut Session<'_>) -> Result<(), End> {
    legacy_setup(s, true)?;
    s.cycle(false)?;
    fresh_legacy(s, 0)
}
