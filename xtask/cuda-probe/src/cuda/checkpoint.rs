//! The process checkpoint of this process, on its own pid: lock (with its timeout),
//! checkpoint, restore, unlock, and the state query, through the entry points
//! `entry_points.rs` resolves.

use std::ffi::c_int;

use tpcomm_transport::cuda_driver::process_checkpoint::{LockArgs, ReservedArgs};

use super::calls::Calls;
use super::Cuda;

impl Cuda {
    pub(super) fn state(
        &self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) -> bool {
        let Some(f) = self.checkpoint.map(|e| e.state) else {
            return c.note(
                "cuCheckpointProcessGetState",
                false,
                "MISSING",
                "entry point not found",
            );
        };
        let pid = std::process::id() as c_int;
        let mut state: c_int = -1;
        // SAFETY: out-pointer to a local `CUprocessState` (int-sized).
        let code = unsafe { f(pid, &mut state) };
        let label = match state {
            0 => "running",
            1 => "locked",
            2 => "checkpointed",
            3 => "failed",
            _ => "unknown",
        };
        let ok = c.raw(
            "cuCheckpointProcessGetState",
            code,
            format!("{label} ({state})"),
        );
        if ok {
            values.insert("state".into(), state.to_string());
        }
        // A state that cannot be read does not stop the sequence.
        if let Some(last) = c.calls.last_mut() {
            last.ok = true;
        }
        ok
    }

    pub(super) fn ckpt(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        step: Step,
    ) {
        let Some(e) = self.checkpoint else {
            c.note(step.name(), false, "MISSING", "entry point not found");
            return;
        };
        let pid = std::process::id() as c_int;
        let started = std::time::Instant::now();
        let code = match step {
            Step::Lock(timeout_ms) => {
                let mut args = LockArgs::new(timeout_ms.max(1));
                // SAFETY: a 64-byte argument block valid for the call, on this process's pid.
                unsafe { (e.lock)(pid, &mut args) }
            }
            other => {
                let f = match other {
                    Step::Checkpoint => e.checkpoint,
                    Step::Restore => e.restore,
                    _ => e.unlock,
                };
                let mut args = ReservedArgs::default();
                // SAFETY: a zeroed 64-byte argument block valid for the call, on this
                // process's pid.
                unsafe { f(pid, &mut args) }
            }
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let detail = match step {
            Step::Lock(t) => format!("own pid {pid}, timeout {t} ms, {ms:.1} ms"),
            _ => format!("own pid {pid}, {ms:.1} ms"),
        };
        // On failure the state says what the call left; on success it is known (and a
        // state query from a locked process is probed on its own, `state-query`).
        if !c.raw(step.name(), code, detail) {
            self.state(c, values);
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Step {
    Lock(u32),
    Checkpoint,
    Restore,
    Unlock,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::Lock(_) => "cuCheckpointProcessLock",
            Step::Checkpoint => "cuCheckpointProcessCheckpoint",
            Step::Restore => "cuCheckpointProcessRestore",
            Step::Unlock => "cuCheckpointProcessUnlock",
        }
    }
}
