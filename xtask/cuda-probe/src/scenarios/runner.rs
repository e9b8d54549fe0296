//! One scenario's run: a fresh pair of child processes (a socket pair between them for
//! descriptor passing, a fresh job file where the scenario wants one), its script under its
//! own deadline, the outcome, and the children ended.

use std::time::Instant;

use super::session::Session;
use super::{End, Outcome, Runner, Scenario, ScenarioResult, Step};
use crate::protocol::ChildProc;

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
