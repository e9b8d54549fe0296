//! The checkpoint sequence across a scenario's processes: lock every process, then
//! checkpoint, restore and unlock every process, each as far as its own state allows, and the
//! GPU memory `nvidia-smi` sees while they are checkpointed.

use std::time::{Duration, Instant};

use super::nvidia_smi::nvidia_smi;
use super::session::Session;
use super::End;
use crate::protocol::Op;

/// The lock's own timeout (`CUcheckpointLockArgs::timeoutMs`).
const LOCK_TIMEOUT_MS: u32 = 5000;

impl Session<'_> {
    /// The checkpoint sequence: lock every process, then checkpoint every process, restore
    /// every process, unlock every process (each call on the process's own pid from its own
    /// thread). A process goes on as far as its own state allows (a failed lock is not
    /// followed by a checkpoint of that process); its state is read after every call.
    /// Stops the script unless every process is running again at the end.
    pub(super) fn cycle(&mut self, gpu_memory: bool) -> Result<(), End> {
        self.cycle_with(gpu_memory, false)
    }

    /// [`cycle`](Self::cycle); with `states`, every process that took a step also asks its
    /// own state after it (`STEP.state`).
    pub(super) fn cycle_with(&mut self, gpu_memory: bool, states: bool) -> Result<(), End> {
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
