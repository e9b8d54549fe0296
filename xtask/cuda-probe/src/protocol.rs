//! The line protocol between the parent and its two children, and the parent's side of a
//! child process: spawning, one request at a time, replies read with a deadline, a dead or
//! silent child reported (never waited on for ever), killing and reaping bounded.
//!
//! Every protocol line starts with [`PREFIX`]; the rest is one JSON value. The parent writes
//! [`Request`]s to the child's stdin; the child answers each with one [`Reply`] on stdout
//! (after a [`Hello`] when it starts). Other lines on the child's stdout (a library's own
//! output) are passed on to the parent's stderr.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Marks a protocol line.
pub(crate) const PREFIX: &str = "@@ipc-probe ";

/// Environment variable that carries a child's arguments when the child is the test
/// harness (see [`Launcher::TestHarness`]).
pub(crate) const CHILD_ARGS_VAR: &str = "TPCOMM_IPC_PROBE_CHILD";

/// Environment variable naming the descriptor of a child's end of the socket pair the parent
/// made for the scenario (descriptors passed with `SCM_RIGHTS` where `pidfd_getfd` is not
/// allowed).
pub(crate) const PEER_SOCKET_VAR: &str = "TPCOMM_IPC_PROBE_PEER_SOCKET";

/// One of the two processes of a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Role {
    A,
    B,
}

impl Role {
    pub(crate) const BOTH: [Role; 2] = [Role::A, Role::B];

    pub(crate) fn index(self) -> usize {
        match self {
            Role::A => 0,
            Role::B => 1,
        }
    }

    pub(crate) fn peer(self) -> Role {
        match self {
            Role::A => Role::B,
            Role::B => Role::A,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::A => "A",
            Role::B => "B",
        }
    }

    /// The byte that seeds this process's patterns in `round` (distinct per process and
    /// round, so that a read of the wrong memory or of stale contents shows).
    pub(crate) fn seed(self, round: u8) -> u8 {
        let base: u8 = match self {
            Role::A => 0x11,
            Role::B => 0x82,
        };
        base.wrapping_add(round.wrapping_mul(0x1d))
    }
}

/// What the parent asks a child to do. Each operation records every call it makes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Op {
    /// `cuInit(0)`, the driver version, device 0, its primary context retained and made
    /// current, the checkpoint entry points resolved, `PR_SET_PTRACER` (so that a sibling
    /// may `pidfd_getfd` from this process).
    Init,
    /// `cuMemGetInfo`.
    MemInfo,
    /// `cuMemAlloc` of `bytes`, the pattern of `seed` written into it.
    LegacyAlloc { bytes: u64, seed: u8 },
    /// `cuIpcGetMemHandle` of the legacy allocation: value `handle` (hex).
    LegacyExport,
    /// `cuIpcOpenMemHandle` of a peer's handle, then a read checked against `seed`.
    LegacyOpen { handle: String, seed: u8 },
    /// A read through the open peer mapping, checked against `seed`.
    LegacyReadPeer { seed: u8 },
    /// `cuIpcCloseMemHandle` of the open peer mapping (nothing when none is open).
    LegacyClose,
    /// `cuInit(0)` again, the primary context retained again and made current.
    ReInit,
    /// `cuDevicePrimaryCtxReset`, then the primary context retained and made current (every
    /// allocation of the old context is gone).
    CtxReset,
    /// `cuDevicePrimaryCtxRelease` once per retain of this process (down to zero), then
    /// retained and made current again.
    CtxReleaseRetain,
    /// Granularity, `cuMemCreate` (pinned device memory, POSIX descriptor handles) of `bytes`
    /// rounded up, `cuMemAddressReserve` (kept for the process's life), `cuMemMap`,
    /// `cuMemSetAccess`, the pattern of `seed` written.
    VmmCreate { bytes: u64, seed: u8 },
    /// Fresh physical memory (`cuMemCreate`) mapped at the kept reservation, the pattern of
    /// `seed` written.
    VmmFresh { seed: u8 },
    /// `cuMemExportToShareableHandle` of the own allocation: value `fd`, and the descriptor's
    /// kind (`readlink`, `fstat`).
    VmmExport,
    /// The own exported descriptor `fd` sent to the peer over the socket pair (`SCM_RIGHTS`).
    VmmOffer { fd: i32 },
    /// `pidfd_open(pid)`, `pidfd_getfd(fd)` (and the copy the peer offered over the socket,
    /// which serves when `pidfd_getfd` is not allowed), `cuMemImportFromShareableHandle`, mapped into the
    /// import reservation (`size` bytes, reserved on first use and kept), access set, read
    /// checked against `seed`.
    VmmImport {
        pid: u32,
        fd: i32,
        size: u64,
        seed: u8,
    },
    /// A read through the import mapping, checked against `seed`.
    VmmReadPeer { seed: u8 },
    /// The pattern of `seed` written through the import mapping.
    VmmWritePeer { seed: u8 },
    /// A read of the own allocation, checked against `seed`.
    VmmReadOwn { seed: u8 },
    /// `cuMemUnmap` and `cuMemRelease` of the import, the fetched descriptor closed; the
    /// reservation is kept.
    VmmUnmapImport,
    /// `cuMemUnmap` and `cuMemRelease` of the own allocation, the exported descriptor
    /// closed; the reservation is kept.
    VmmReleaseOwn,
    /// The own exported descriptor imported in this process
    /// (`cuMemImportFromShareableHandle`), mapped at a second reservation; the own pattern
    /// (`seed`) read through it, then a write (`write_seed`) through it read back through
    /// the first; the second mapping is released again.
    VmmSelfImport { seed: u8, write_seed: u8 },
    /// `cuCheckpointProcessLock` of this process (its own pid); on failure its state.
    CkptLock { timeout_ms: u32 },
    /// `cuCheckpointProcessCheckpoint`; on failure the state.
    CkptCheckpoint,
    /// `cuCheckpointProcessRestore`; on failure the state.
    CkptRestore,
    /// `cuCheckpointProcessUnlock`; on failure the state.
    CkptUnlock,
    /// `cuCheckpointProcessGetState`.
    State,
    /// The child exits.
    Exit,
}

impl Op {
    /// Whether the operation may take long (init and context creation, the checkpoint
    /// calls): it gets the longer of the two request limits.
    pub(crate) fn may_take_long(&self) -> bool {
        matches!(
            self,
            Op::Init
                | Op::ReInit
                | Op::CtxReset
                | Op::CtxReleaseRetain
                | Op::CkptLock { .. }
                | Op::CkptCheckpoint
                | Op::CkptRestore
                | Op::CkptUnlock
        )
    }

    /// The operation's name, as serialized.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::Init => "init",
            Op::MemInfo => "mem_info",
            Op::LegacyAlloc { .. } => "legacy_alloc",
            Op::LegacyExport => "legacy_export",
            Op::LegacyOpen { .. } => "legacy_open",
            Op::LegacyReadPeer { .. } => "legacy_read_peer",
            Op::LegacyClose => "legacy_close",
            Op::ReInit => "re_init",
            Op::CtxReset => "ctx_reset",
            Op::CtxReleaseRetain => "ctx_release_retain",
            Op::VmmCreate { .. } => "vmm_create",
            Op::VmmFresh { .. } => "vmm_fresh",
            Op::VmmExport => "vmm_export",
            Op::VmmOffer { .. } => "vmm_offer",
            Op::VmmImport { .. } => "vmm_import",
            Op::VmmReadPeer { .. } => "vmm_read_peer",
            Op::VmmWritePeer { .. } => "vmm_write_peer",
            Op::VmmReadOwn { .. } => "vmm_read_own",
            Op::VmmUnmapImport => "vmm_unmap_import",
            Op::VmmReleaseOwn => "vmm_release_own",
            Op::VmmSelfImport { .. } => "vmm_self_import",
            Op::CkptLock { .. } => "ckpt_lock",
            Op::CkptCheckpoint => "ckpt_checkpoint",
            Op::CkptRestore => "ckpt_restore",
            Op::CkptUnlock => "ckpt_unlock",
            Op::State => "state",
            Op::Exit => "exit",
        }
    }
}

/// One request: an operation under the parent's step label.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Request {
    pub(crate) id: u64,
    pub(crate) op: Op,
}

/// The first line a child prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) hello: u32,
}

/// One call a child made: a CUDA driver call (`code` its `CUresult`, `name` from
/// `cuGetErrorName`), a system call (`code` the errno), or a check (`code` none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Call {
    pub(crate) call: String,
    pub(crate) code: Option<i64>,
    pub(crate) name: String,
    /// Whether the operation could go on after this call.
    pub(crate) ok: bool,
    pub(crate) detail: String,
}

impl Call {
    pub(crate) fn check(what: &str, ok: bool, detail: impl Into<String>) -> Self {
        Self {
            call: what.into(),
            code: None,
            name: if ok { "OK" } else { "MISMATCH" }.into(),
            ok,
            detail: detail.into(),
        }
    }

    pub(crate) fn note(what: &str, ok: bool, name: &str, detail: impl Into<String>) -> Self {
        Self {
            call: what.into(),
            code: None,
            name: name.into(),
            ok,
            detail: detail.into(),
        }
    }
}

/// A child's answer to one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Reply {
    pub(crate) id: u64,
    pub(crate) calls: Vec<Call>,
    /// Results the parent passes on (a handle, a descriptor number, a state).
    pub(crate) values: BTreeMap<String, String>,
}

impl Reply {
    /// Every call went as needed.
    #[cfg(test)]
    pub(crate) fn ok(&self) -> bool {
        self.calls.iter().all(|c| c.ok)
    }

    pub(crate) fn value(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }
}

/// Why a child gave no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Silence {
    /// No answer before the deadline.
    Timeout(Duration),
    /// The child's stdout closed (it exited or was killed); its status when known.
    Died(String),
    /// A protocol line that does not parse, or an answer to another request.
    Garbled(String),
}

impl std::fmt::Display for Silence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Silence::Timeout(d) => write!(f, "no answer within {:.1} s", d.as_secs_f64()),
            Silence::Died(status) => write!(f, "the process ended ({status})"),
            Silence::Garbled(what) => write!(f, "unreadable answer: {what}"),
        }
    }
}

/// How a child process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Launcher {
    /// This executable with `--child ROLE MODE`.
    SelfExe,
    /// This test executable, running its ignored test `tests::child_process`, which reads
    /// the arguments from [`CHILD_ARGS_VAR`].
    #[cfg_attr(not(test), allow(dead_code))]
    TestHarness,
}

impl Launcher {
    fn command(self, role: Role, mode: &str) -> std::io::Result<Command> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        match self {
            Launcher::SelfExe => {
                cmd.args(["--child", role.name(), mode]);
            }
            Launcher::TestHarness => {
                cmd.args([
                    "--exact",
                    "tests::child_process",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ARGS_VAR, format!("{} {mode}", role.name()));
            }
        }
        Ok(cmd)
    }
}

enum Line {
    Protocol(String),
    End,
}

/// The parent's handle on one child process.
pub(crate) struct ChildProc {
    pub(crate) role: Role,
    pub(crate) pid: u32,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<Line>,
    next_id: u64,
    /// The child ended or broke the protocol: every later request fails at once with this.
    gone: Option<Silence>,
}

impl std::fmt::Debug for ChildProc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildProc")
            .field("role", &self.role)
            .field("pid", &self.pid)
            .finish()
    }
}

impl ChildProc {
    /// Starts the child (`env` set, `remove` unset in its environment) and waits for its
    /// hello until `deadline`.
    pub(crate) fn spawn(
        launcher: Launcher,
        role: Role,
        mode: &str,
        env: &[(String, String)],
        remove: &[String],
        socket: Option<&OwnedFd>,
        deadline: Instant,
    ) -> Result<Self, String> {
        let mut cmd = launcher
            .command(role, mode)
            .map_err(|e| format!("this executable's path: {e}"))?;
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for k in remove {
            cmd.env_remove(k);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        // The socket end is inherited by this child only: close-on-exec is cleared for the
        // spawn and set again (the parent spawns one child at a time).
        if let Some(sock) = socket {
            cmd.env(PEER_SOCKET_VAR, sock.as_raw_fd().to_string());
            rustix::io::fcntl_setfd(sock, rustix::io::FdFlags::empty())
                .map_err(|e| format!("the socket for process {}: {e}", role.name()))?;
        }
        let spawned = cmd.spawn();
        if let Some(sock) = socket {
            let _ = rustix::io::fcntl_setfd(sock, rustix::io::FdFlags::CLOEXEC);
        }
        let mut child =
            spawned.map_err(|e| format!("cannot start process {}: {e}", role.name()))?;
        let pid = child.id();
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::Builder::new()
                .name(format!("ipc-probe-{}", role.name()))
                .spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        match line.find(PREFIX) {
                            // The test harness may print "test ... " before it on the line.
                            Some(at) => {
                                let msg = line[at + PREFIX.len()..].to_string();
                                if tx.send(Line::Protocol(msg)).is_err() {
                                    return;
                                }
                            }
                            None => eprintln!("ipc-probe: process {} said: {line}", role.name()),
                        }
                    }
                    let _ = tx.send(Line::End);
                })
                .map_err(|e| format!("cannot start a reader thread: {e}"))?;
        }
        let mut proc = Self {
            role,
            pid,
            child,
            stdin,
            lines,
            next_id: 1,
            gone: None,
        };
        match proc.read_line(deadline) {
            Ok(line) => match serde_json::from_str::<Hello>(&line) {
                Ok(h) if h.hello == pid => Ok(proc),
                _ => {
                    proc.kill();
                    Err(format!(
                        "process {} started with an unexpected first line: {line}",
                        role.name()
                    ))
                }
            },
            Err(why) => {
                proc.kill();
                Err(format!("process {} did not start: {why}", role.name()))
            }
        }
    }

    /// Sends one request (no answer awaited); its id.
    pub(crate) fn send(&mut self, op: &Op) -> Result<u64, Silence> {
        if let Some(gone) = &self.gone {
            return Err(gone.clone());
        }
        let id = self.next_id;
        self.next_id += 1;
        let line = serde_json::to_string(&Request { id, op: op.clone() })
            .map_err(|e| Silence::Garbled(e.to_string()))?;
        let written = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(format!("{PREFIX}{line}\n").as_bytes())
                .and_then(|()| stdin.flush()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        if let Err(e) = written {
            let status = self.status_within(Duration::from_millis(500));
            let why = Silence::Died(format!("{status}; writing to it failed: {e}"));
            self.gone = Some(why.clone());
            return Err(why);
        }
        Ok(id)
    }

    /// Waits for the answer to request `id` until `deadline`.
    pub(crate) fn receive(&mut self, id: u64, deadline: Instant) -> Result<Reply, Silence> {
        if let Some(gone) = &self.gone {
            return Err(gone.clone());
        }
        let line = self.read_line(deadline)?;
        match serde_json::from_str::<Reply>(&line) {
            Ok(reply) if reply.id == id => Ok(reply),
            Ok(reply) => {
                let why = Silence::Garbled(format!("answer {} to request {id}", reply.id));
                self.gone = Some(why.clone());
                Err(why)
            }
            Err(e) => {
                let why = Silence::Garbled(format!("{e}: {line}"));
                self.gone = Some(why.clone());
                Err(why)
            }
        }
    }

    fn read_line(&mut self, deadline: Instant) -> Result<String, Silence> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(wait) {
            Ok(Line::Protocol(line)) => Ok(line),
            Ok(Line::End) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let why = Silence::Died(self.status_within(Duration::from_secs(1)));
                self.gone = Some(why.clone());
                Err(why)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Silence::Timeout(wait)),
        }
    }

    /// The child's exit status, waited for at most `limit`.
    fn status_within(&mut self, limit: Duration) -> String {
        let until = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.to_string(),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                Ok(None) => return "still running".into(),
                Err(e) => return format!("status unknown: {e}"),
            }
        }
    }

    /// Asks every child to exit, waits up to `grace` for all of them together, then kills
    /// the ones left (reaped within 2 s together). How each ended, in order.
    pub(crate) fn finish_all(mut procs: Vec<ChildProc>, grace: Duration) -> Vec<(Role, String)> {
        for p in &mut procs {
            if p.gone.is_none() && p.send(&Op::Exit).is_ok() {
                p.stdin = None;
            }
        }
        let until = Instant::now() + grace;
        let mut ended: Vec<Option<String>> = vec![None; procs.len()];
        loop {
            for (p, e) in procs.iter_mut().zip(&mut ended) {
                if e.is_none() {
                    if let Ok(Some(status)) = p.child.try_wait() {
                        *e = Some(status.to_string());
                    }
                }
            }
            if ended.iter().all(Option::is_some) || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for (p, e) in procs.iter_mut().zip(&ended) {
            if e.is_none() {
                p.stdin = None;
                if let Err(e) = p.child.kill() {
                    eprintln!("ipc-probe: killing process {}: {e}", p.role.name());
                }
            }
        }
        let until = Instant::now() + Duration::from_secs(2);
        let mut out = Vec::new();
        for (p, e) in procs.iter_mut().zip(ended) {
            let status = match e {
                Some(status) => status,
                None => {
                    let left = until.saturating_duration_since(Instant::now());
                    match p.status_within(left) {
                        s if s == "still running" => "killed, but not reaped within 2 s".into(),
                        s => format!("killed ({s})"),
                    }
                }
            };
            out.push((p.role, status));
        }
        out
    }

    /// SIGKILL, then reaped within 2 s (a process stuck in the kernel is left behind and
    /// said so).
    pub(crate) fn kill(&mut self) -> String {
        self.stdin = None;
        if let Ok(Some(status)) = self.child.try_wait() {
            return status.to_string();
        }
        if let Err(e) = self.child.kill() {
            return format!("kill failed: {e}");
        }
        match self.status_within(Duration::from_secs(2)) {
            s if s == "still running" => "killed, but not reaped within 2 s".into(),
            s => format!("killed ({s})"),
        }
    }
}

impl Drop for ChildProc {
    /// Never waits: a child still there is sent SIGKILL and left to the system.
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            let _ = self.child.kill();
        }
    }
}

/// Writes one protocol line on stdout (the child's side).
pub(crate) fn emit<T: Serialize>(value: &T) -> std::io::Result<()> {
    let line = serde_json::to_string(value).map_err(std::io::Error::other)?;
    let mut out = std::io::stdout().lock();
    out.write_all(format!("{PREFIX}{line}\n").as_bytes())?;
    out.flush()
}

/// The request in one line of the child's stdin, if it is a protocol line.
pub(crate) fn parse_request(line: &str) -> Option<Result<Request, String>> {
    let at = line.find(PREFIX)?;
    Some(serde_json::from_str(&line[at + PREFIX.len()..]).map_err(|e| e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_through_a_line() {
        let op = Op::VmmImport {
            pid: 42,
            fd: 7,
            size: 2 << 20,
            seed: 3,
        };
        let line = format!(
            "{PREFIX}{}",
            serde_json::to_string(&Request {
                id: 9,
                op: op.clone()
            })
            .unwrap()
        );
        let got = parse_request(&line).unwrap().unwrap();
        assert_eq!(got, Request { id: 9, op });
        assert!(parse_request("running 1 test").is_none());
        assert!(parse_request(&format!("{PREFIX}{{\"id\":1}}"))
            .unwrap()
            .is_err());
    }

    #[test]
    fn seeds_differ_per_process_and_round() {
        let mut seen = std::collections::HashSet::new();
        for role in Role::BOTH {
            for round in 0..8 {
                assert!(seen.insert(role.seed(round)));
            }
        }
    }
}
