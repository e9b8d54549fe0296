//! A running scenario's session with its children: requests sent to every process before
//! any answer is awaited (one at a time when the scenario is sequential), every answer
//! recorded and printed as it arrives, a silent or dead child turned into the scenario's
//! end, and the children finished.

use std::time::{Duration, Instant};

use super::{End, ScenarioResult, Step};
use crate::protocol::{ChildProc, Op, Reply, Role, Silence};

/// A running scenario: its processes and what it recorded.
pub(crate) struct Session<'a> {
    pub(super) procs: Vec<ChildProc>,
    pub(super) result: &'a mut ScenarioResult,
    pub(super) deadline: Instant,
    pub(super) command: Duration,
    pub(super) quick: Duration,
    pub(super) sequential: bool,
    pub(super) print: &'a mut dyn FnMut(&Step),
}

/// The answers of one request per process (`None` where nothing was asked).
pub(crate) type Replies = [Option<Reply>; 2];

impl Session<'_> {
    fn proc(&mut self, role: Role) -> Option<&mut ChildProc> {
        self.procs.iter_mut().find(|p| p.role == role)
    }

    pub(super) fn pid(&self, role: Role) -> u32 {
        self.procs
            .iter()
            .find(|p| p.role == role)
            .map_or(0, |p| p.pid)
    }

    pub(super) fn roles(&self) -> Vec<Role> {
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
    pub(super) fn parent_note(
        &mut self,
        step: &str,
        call: &str,
        code: Option<i64>,
        ok: bool,
        detail: String,
    ) {
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
    pub(super) fn each(
        &mut self,
        step: &str,
        op: impl Fn(Role) -> Result<Op, String>,
    ) -> Result<Replies, End> {
        let roles = self.roles();
        self.ask(step, &roles, op)
    }

    /// The same operation on every role.
    pub(super) fn all(&mut self, step: &str, op: Op) -> Result<Replies, End> {
        self.each(step, |_| Ok(op.clone()))
    }

    pub(super) fn ask(
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
    pub(super) fn require(&self, replies: &Replies, what: &str) -> Result<(), End> {
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

    /// The children, asked to exit, then killed; statuses other than a clean exit recorded.
    pub(super) fn finish(&mut self, grace: Duration) {
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
