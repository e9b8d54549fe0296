//! A child process: says hello, then answers the parent's requests one by one until it is
//! told to exit or its stdin closes.
//!
//! Modes (`--child ROLE MODE`): `real` (the CUDA driver, [`crate::cuda`]); `fake[:SPEC]`
//! (a stand-in driver with the checkpoint state machine, for the orchestration tests and
//! `--fake`; SPEC is `[A.|B.]OP=CODE|hang|exit,...`: that operation fails with CODE, never
//! answers, or ends the process); `hang` (never says hello); `exit` (ends at once with
//! status 3); `mute` (says hello, never answers); `peer-socket` (says hello, then sends a
//! byte over the socket the parent passed).

use std::collections::BTreeMap;
use std::io::BufRead;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use crate::facts::{hex, unhex};
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::protocol::{emit, parse_request, Call, Hello, Op, Reply, Role, PEER_SOCKET_VAR};

/// What answers the requests.
trait Backend {
    fn run(&mut self, op: &Op) -> Reply;
}

impl Backend for crate::cuda::Cuda {
    fn run(&mut self, op: &Op) -> Reply {
        crate::cuda::Cuda::run(self, op)
    }
}

/// The child's entry point; its exit status.
pub(crate) fn main(args: &[String]) -> i32 {
    let (Some(role), mode) = (args.first(), args.get(1).map_or("real", String::as_str)) else {
        eprintln!("ipc-probe: --child needs a role (A or B) and a mode");
        return 2;
    };
    let role = match role.as_str() {
        "A" => Role::A,
        "B" => Role::B,
        other => {
            eprintln!("ipc-probe: unknown role `{other}`");
            return 2;
        }
    };
    match mode {
        "real" => serve(&mut crate::cuda::Cuda::with_peer_socket(peer_socket())),
        "hang" => {
            std::thread::sleep(Duration::from_secs(600));
            0
        }
        "exit" => 3,
        // Says hello, then one byte over the socket the parent passed (or exits with 4).
        "peer-socket" => {
            let Some(sock) = peer_socket() else { return 4 };
            if emit(&Hello {
                hello: std::process::id(),
            })
            .is_err()
            {
                return 1;
            }
            match rustix::net::send(&sock, b"x", rustix::net::SendFlags::empty()) {
                Ok(_) => {
                    for line in std::io::stdin().lock().lines() {
                        if line.is_err() {
                            break;
                        }
                    }
                    0
                }
                Err(_) => 5,
            }
        }
        "mute" => {
            if emit(&Hello {
                hello: std::process::id(),
            })
            .is_err()
            {
                return 1;
            }
            for line in std::io::stdin().lock().lines() {
                if line.is_err() {
                    break;
                }
            }
            0
        }
        fake if fake == "fake" || fake.starts_with("fake:") => {
            let spec = fake.strip_prefix("fake:").unwrap_or("");
            match Fake::new(role, spec) {
                Ok(mut f) => serve(&mut f),
                Err(e) => {
                    eprintln!("ipc-probe: {e}");
                    2
                }
            }
        }
        other => {
            eprintln!("ipc-probe: unknown child mode `{other}`");
            2
        }
    }
}

/// The socket end the parent passed (its descriptor number in [`PEER_SOCKET_VAR`]), when it
/// is a socket.
fn peer_socket() -> Option<OwnedFd> {
    let raw: RawFd = std::env::var(PEER_SOCKET_VAR).ok()?.parse().ok()?;
    // SAFETY: only checks whether the number is an open descriptor of this process.
    let fd = unsafe { BorrowedFd::borrow_raw(raw) };
    let st = rustix::fs::fstat(fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return None;
    }
    // SAFETY: the parent made this socket end for this process alone (inherited at spawn,
    // close-on-exec everywhere else); nothing else in this process owns the descriptor.
    Some(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn serve(backend: &mut dyn Backend) -> i32 {
    if emit(&Hello {
        hello: std::process::id(),
    })
    .is_err()
    {
        return 1;
    }
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { return 1 };
        let request = match parse_request(&line) {
            None => continue,
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                eprintln!("ipc-probe: child: unreadable request: {e}");
                return 2;
            }
        };
        let mut reply = std::panic::catch_unwind(AssertUnwindSafe(|| backend.run(&request.op)))
            .unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into());
                Reply {
                    calls: vec![Call::note(request.op.name(), false, "PANIC", what)],
                    ..Reply::default()
                }
            });
        reply.id = request.id;
        if emit(&reply).is_err() {
            return 1;
        }
        if request.op == Op::Exit {
            return 0;
        }
    }
    0
}

/// What a fake operation does instead of succeeding.
#[derive(Debug, Clone, PartialEq)]
enum Twist {
    Fail(i64),
    Hang,
    Exit,
}

/// The stand-in driver: every operation succeeds with plausible values unless the spec
/// says otherwise; the checkpoint calls follow the driver's state machine (a call in the
/// wrong state is `CUDA_ERROR_ILLEGAL_STATE`), so a parent that orders them wrongly fails.
struct Fake {
    twists: BTreeMap<String, Twist>,
    state: i32,
    exports: u32,
    imports: u32,
    inited: bool,
}

fn fake_name(code: i64) -> String {
    match code {
        0 => "CUDA_SUCCESS".into(),
        1 => "CUDA_ERROR_INVALID_VALUE".into(),
        100 => "CUDA_ERROR_NO_DEVICE".into(),
        400 => "CUDA_ERROR_INVALID_HANDLE".into(),
        401 => "CUDA_ERROR_ILLEGAL_STATE".into(),
        800 => "CUDA_ERROR_NOT_PERMITTED".into(),
        801 => "CUDA_ERROR_NOT_SUPPORTED".into(),
        other => format!("CUresult {other}"),
    }
}

impl Fake {
    fn new(role: Role, spec: &str) -> Result<Self, String> {
        let mut twists = BTreeMap::new();
        for item in spec.split(',').filter(|s| !s.is_empty()) {
            let (op, what) = item
                .split_once('=')
                .ok_or_else(|| format!("fake spec `{item}`: expected OP=CODE|hang|exit"))?;
            let op = match op.split_once('.') {
                Some((r, op)) if r == role.name() => op,
                Some(_) => continue,
                None => op,
            };
            let twist = match what {
                "hang" => Twist::Hang,
                "exit" => Twist::Exit,
                code => Twist::Fail(
                    code.parse()
                        .map_err(|_| format!("fake spec `{item}`: bad code"))?,
                ),
            };
            twists.insert(op.to_string(), twist);
        }
        Ok(Self {
            twists,
            state: 0,
            exports: 0,
            imports: 0,
            inited: false,
        })
    }

    fn call(&self, call: &str, code: i64, detail: &str) -> Call {
        Call {
            call: call.into(),
            code: Some(code),
            name: fake_name(code),
            ok: code == 0,
            detail: detail.into(),
        }
    }
}

impl Backend for Fake {
    fn run(&mut self, op: &Op) -> Reply {
        let mut reply = Reply::default();
        let name = op.name();
        let twist = self.twists.get(name).cloned();
        match twist {
            Some(Twist::Hang) => std::thread::sleep(Duration::from_secs(600)),
            Some(Twist::Exit) => std::process::exit(9),
            _ => {}
        }
        if !self.inited && !matches!(op, Op::Init | Op::Exit) {
            reply.calls.push(Call::note(
                name,
                false,
                "NOT_INITIALIZED",
                "no successful init",
            ));
            return reply;
        }
        let forced = match twist {
            Some(Twist::Fail(code)) => Some(code),
            _ => None,
        };
        let mut v = |k: &str, val: String| {
            reply.values.insert(k.into(), val);
        };
        // The state machine of the checkpoint calls: (needed state, state after).
        let ckpt = match op {
            Op::CkptLock { .. } => Some(("cuCheckpointProcessLock", 0, 1)),
            Op::CkptCheckpoint => Some(("cuCheckpointProcessCheckpoint", 1, 2)),
            Op::CkptRestore => Some(("cuCheckpointProcessRestore", 2, 1)),
            Op::CkptUnlock => Some(("cuCheckpointProcessUnlock", 1, 0)),
            _ => None,
        };
        let mut calls = Vec::new();
        if let Some((call, need, after)) = ckpt {
            let code = match forced {
                Some(code) => code,
                None if self.state != need => 401,
                None => 0,
            };
            if code == 0 {
                self.state = after;
            }
            calls.push(self.call(call, code, "fake"));
            if code != 0 {
                calls.push(Call {
                    ok: true,
                    ..self.call(
                        "cuCheckpointProcessGetState",
                        0,
                        &format!("state {}", self.state),
                    )
                });
                v("state", self.state.to_string());
            }
        } else {
            let (call, detail) = match op {
                Op::Init => ("cuInit", "fake"),
                Op::MemInfo => ("cuMemGetInfo", "fake"),
                Op::LegacyAlloc { .. } => ("cuMemAlloc", "fake"),
                Op::LegacyExport => ("cuIpcGetMemHandle", "fake"),
                Op::LegacyOpen { .. } => ("cuIpcOpenMemHandle", "fake"),
                Op::LegacyReadPeer { .. } => ("cuMemcpyDtoH", "fake"),
                Op::LegacyClose => ("cuIpcCloseMemHandle", "fake"),
                Op::ReInit => ("cuDevicePrimaryCtxRetain", "fake"),
                Op::CtxReset => ("cuDevicePrimaryCtxReset", "fake"),
                Op::CtxReleaseRetain => ("cuDevicePrimaryCtxRelease", "fake"),
                Op::VmmCreate { .. } | Op::VmmFresh { .. } => ("cuMemCreate", "fake"),
                Op::VmmExport => ("cuMemExportToShareableHandle", "fake"),
                Op::VmmOffer { .. } => ("sendmsg(SCM_RIGHTS)", "fake"),
                Op::VmmImport { .. } | Op::VmmSelfImport { .. } => {
                    ("cuMemImportFromShareableHandle", "fake")
                }
                Op::VmmReadPeer { .. } | Op::VmmReadOwn { .. } => ("cuMemcpyDtoH", "fake"),
                Op::VmmWritePeer { .. } => ("cuMemcpyHtoD", "fake"),
                Op::VmmUnmapImport | Op::VmmReleaseOwn => ("cuMemUnmap", "fake"),
                Op::State => ("cuCheckpointProcessGetState", "fake"),
                _ => ("-", "fake"),
            };
            // Arguments the parent passes on from the peer must look right.
            let bad = match op {
                Op::LegacyOpen { handle, .. } if unhex(handle, 64).is_none() => {
                    Some("the handle is not 64 bytes of hex")
                }
                Op::VmmImport { pid, fd, size, .. } if *pid == 0 || *fd < 0 || *size == 0 => {
                    Some("pid, fd or size missing")
                }
                _ if self.state != 0 && !matches!(op, Op::State | Op::Exit) => {
                    Some("a CUDA call while locked or checkpointed would block")
                }
                _ => None,
            };
            let code = match (forced, bad) {
                (Some(code), _) => code,
                (None, Some(_)) => 1,
                (None, None) => 0,
            };
            let state_detail = format!(
                "{} ({})",
                crate::scenarios::state_name(self.state),
                self.state
            );
            let detail = match op {
                Op::State => state_detail.as_str(),
                _ => detail,
            };
            calls.push(self.call(call, code, bad.unwrap_or(detail)));
            if code == 0 {
                match op {
                    Op::Init => {
                        self.inited = true;
                        v("driver_version", "13000".into());
                        v("device_count", "1".into());
                        v("device", "fake device".into());
                    }
                    Op::MemInfo => {
                        v("free", (100u64 << 30).to_string());
                        v("total", (140u64 << 30).to_string());
                        v("used", (40u64 << 30).to_string());
                    }
                    Op::LegacyExport => {
                        self.exports += 1;
                        let mut h = [0u8; 64];
                        h[..4].copy_from_slice(&std::process::id().to_le_bytes());
                        h[4..8].copy_from_slice(&self.exports.to_le_bytes());
                        v("handle", hex(&h));
                    }
                    Op::VmmCreate { .. } | Op::VmmFresh { .. } => {
                        v("granularity_minimum", (2u64 << 20).to_string());
                        v("granularity_recommended", (2u64 << 20).to_string());
                        v("va", "0x7f0000000000".into());
                        v("size", (32u64 << 20).to_string());
                    }
                    Op::VmmExport => {
                        self.exports += 1;
                        v("fd", (10 + self.exports).to_string());
                        v("fd_link", "/dev/nvidiactl".into());
                        v("fd_type", "character device".into());
                        v("fd_rdev", "195:255".into());
                        v("fd_dev", "0:5".into());
                        v("fd_ino", "1234".into());
                    }
                    Op::VmmImport { .. } => {
                        self.imports += 1;
                        v("va", "0x7f1000000000".into());
                        if self.imports > 1 {
                            v("same_address", "yes".into());
                        }
                    }
                    Op::VmmSelfImport { .. } => v("same_handle", "false".into()),
                    Op::State => v("state", self.state.to_string()),
                    _ => {}
                }
                if matches!(
                    op,
                    Op::LegacyOpen { .. }
                        | Op::LegacyReadPeer { .. }
                        | Op::VmmImport { .. }
                        | Op::VmmReadPeer { .. }
                        | Op::VmmReadOwn { .. }
                        | Op::VmmSelfImport { .. }
                ) {
                    calls.push(Call::check("verify", true, "fake bytes match"));
                }
            }
        }
        reply.calls = calls;
        reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fake_follows_the_checkpoint_state_machine() {
        let mut f = Fake::new(Role::A, "").unwrap();
        assert!(f.run(&Op::Init).ok());
        assert_eq!(f.run(&Op::CkptCheckpoint).calls[0].code, Some(401));
        assert!(f.run(&Op::CkptLock { timeout_ms: 1 }).ok());
        let r = f.run(&Op::MemInfo);
        assert!(!r.ok(), "a CUDA call while locked is refused");
        assert!(f.run(&Op::CkptCheckpoint).ok());
        assert_eq!(f.run(&Op::CkptCheckpoint).calls[0].code, Some(401));
        assert!(f.run(&Op::CkptRestore).ok());
        assert!(f.run(&Op::CkptUnlock).ok());
        assert_eq!(f.run(&Op::State).value("state"), Some("0"));
        let r = f.run(&Op::CkptUnlock);
        assert_eq!(r.calls[0].code, Some(401));
        assert_eq!(r.value("state"), Some("0"), "a failure reports the state");
    }

    #[test]
    fn the_fake_spec_picks_the_role_and_the_twist() {
        let f = Fake::new(Role::B, "B.ckpt_restore=1,A.legacy_open=800,mem_info=hang").unwrap();
        assert_eq!(f.twists.get("ckpt_restore"), Some(&Twist::Fail(1)));
        assert_eq!(f.twists.get("legacy_open"), None);
        assert_eq!(f.twists.get("mem_info"), Some(&Twist::Hang));
        assert!(Fake::new(Role::A, "nonsense").is_err());
        assert!(Fake::new(Role::A, "x=y").is_err());
        let mut f = Fake::new(Role::A, "legacy_open=800").unwrap();
        f.run(&Op::Init);
        let r = f.run(&Op::LegacyOpen {
            handle: hex(&[0; 64]),
            seed: 1,
        });
        assert_eq!(r.calls[0].code, Some(800));
        assert_eq!(r.calls[0].name, "CUDA_ERROR_NOT_PERMITTED");
    }
}
