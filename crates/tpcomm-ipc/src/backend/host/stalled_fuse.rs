//! A FUSE file system for tests: one regular file, `file`, answered by a thread of the test
//! until [`StalledFuse::stall`]; from then on no request is answered, as with a server that
//! hangs, until the file system is dropped (the held requests then fail with `EIO`, so that
//! nothing the test started waits for good).
//!
//! Only the requests a lookup, an open, a stat and a close of that file make are served
//! (the kernel's FUSE protocol 7.31 layouts, `linux/fuse.h`); any other is refused with
//! `ENOSYS`. Mounting needs `CAP_SYS_ADMIN` and `/dev/fuse`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};

const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const OPEN: u32 = 14;
const RELEASE: u32 = 18;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;

/// The node ids of the root (fixed by the protocol) and of `file`.
const ROOT: u64 = 1;
const FILE: u64 = 2;
/// The size `file` says it has.
pub(super) const FILE_LEN: u64 = 4096;

/// A mounted test file system; unmounted when dropped.
pub(super) struct StalledFuse {
    dir: PathBuf,
    shared: Arc<Shared>,
    server: Option<JoinHandle<()>>,
}

struct Shared {
    stalled: AtomicBool,
    shutdown: AtomicBool,
    /// Requests held unanswered since the stall.
    held: AtomicUsize,
}

impl StalledFuse {
    /// Mounts a new one in a fresh directory, or says why it cannot.
    pub(super) fn mount() -> Result<Self, String> {
        static MOUNTS: AtomicUsize = AtomicUsize::new(0);
        let dev = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| format!("cannot open /dev/fuse: {e}"))?;
        let dir = std::env::temp_dir().join(format!(
            "tpcomm-fuse-{}-{}",
            std::process::id(),
            MOUNTS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
        let data = CString::new(format!(
            "fd={},rootmode=40000,user_id={},group_id={}",
            dev.as_raw_fd(),
            rustix::process::getuid().as_raw(),
            rustix::process::getgid().as_raw(),
        ))
        .expect("no NUL in the options");
        let flags = MountFlags::NOSUID | MountFlags::NODEV;
        if let Err(e) = rustix::mount::mount("tpcomm-test", &dir, "fuse", flags, data.as_c_str()) {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!(
                "cannot mount a FUSE file system (needs CAP_SYS_ADMIN): {e}"
            ));
        }
        let shared = Arc::new(Shared {
            stalled: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            held: AtomicUsize::new(0),
        });
        let server = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("tpcomm-test-fuse".into())
                .spawn(move || serve(&dev, &shared))
                .map_err(|e| format!("cannot spawn the server: {e}"))?
        };
        Ok(Self {
            dir,
            shared,
            server: Some(server),
        })
    }

    /// The path of the file it serves.
    pub(super) fn file(&self) -> PathBuf {
        self.dir.join("file")
    }

    /// From now on, no request is answered.
    pub(super) fn stall(&self) {
        self.shared.stalled.store(true, Ordering::SeqCst);
    }

    /// How many requests have been held unanswered since the stall.
    pub(super) fn held(&self) -> usize {
        self.shared.held.load(Ordering::SeqCst)
    }
}

impl Drop for StalledFuse {
    fn drop(&mut self) {
        // Answers what is held (EIO) and whatever comes while the mount goes away.
        self.shared.stalled.store(false, Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let _ = rustix::mount::unmount(&self.dir, UnmountFlags::DETACH);
        self.shared.shutdown.store(true, Ordering::SeqCst);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The server loop: polls so that it sees a stall lifted or a shutdown within 50 ms.
fn serve(dev: &OwnedFd, shared: &Shared) {
    let mut buf = vec![0u8; 1 << 17];
    let mut held: Vec<u64> = Vec::new();
    let tick = Timespec {
        tv_sec: 0,
        tv_nsec: 50_000_000,
    };
    while !shared.shutdown.load(Ordering::SeqCst) {
        if !shared.stalled.load(Ordering::SeqCst) {
            for unique in held.drain(..) {
                reply(dev, unique, -(Errno::IO.raw_os_error()), &[]);
            }
        }
        let mut fds = [PollFd::new(dev, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&tick)) {
            Ok(0) | Err(Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        let n = match rustix::io::read(dev, &mut buf) {
            Ok(n) => n,
            // An interrupted request, or none after all.
            Err(Errno::INTR | Errno::AGAIN | Errno::NOENT) => continue,
            // The mount is gone (ENODEV) or the connection aborted.
            Err(_) => return,
        };
        let Some(request) = buf.get(..n).and_then(Request::parse) else {
            return;
        };
        if matches!(request.opcode, FORGET | BATCH_FORGET | INTERRUPT) {
            continue;
        }
        if shared.stalled.load(Ordering::SeqCst) {
            held.push(request.unique);
            shared.held.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        answer(dev, &request);
    }
}

struct Request<'a> {
    opcode: u32,
    unique: u64,
    nodeid: u64,
    body: &'a [u8],
}

impl<'a> Request<'a> {
    /// `fuse_in_header`: len u32, opcode u32, unique u64, nodeid u64, uid, gid, pid u32,
    /// total_extlen u16, padding u16 (40 bytes); the body follows.
    fn parse(bytes: &'a [u8]) -> Option<Self> {
        let u32_at = |at: usize| Some(u32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
        let u64_at = |at: usize| Some(u64::from_ne_bytes(bytes.get(at..at + 8)?.try_into().ok()?));
        Some(Self {
            opcode: u32_at(4)?,
            unique: u64_at(8)?,
            nodeid: u64_at(16)?,
            body: bytes.get(40..)?,
        })
    }
}

fn answer(dev: &OwnedFd, r: &Request<'_>) {
    let ok = |body: &[u8]| reply(dev, r.unique, 0, body);
    match r.opcode {
        INIT => {
            // fuse_init_out (64 bytes): major, minor, max_readahead, flags u32;
            // max_background, congestion_threshold u16; max_write, time_gran u32; the rest 0.
            let mut out = Vec::with_capacity(64);
            for v in [7u32, 31, 0, 0] {
                out.extend_from_slice(&v.to_ne_bytes());
            }
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&4096u32.to_ne_bytes());
            out.extend_from_slice(&1u32.to_ne_bytes());
            out.resize(64, 0);
            ok(&out);
        }
        LOOKUP if r.nodeid == ROOT && r.body.starts_with(b"file\0") => {
            // fuse_entry_out: nodeid, generation, entry_valid, attr_valid u64, two u32 nsec,
            // then fuse_attr. Nothing is cached: every stat asks the server.
            let mut out = Vec::with_capacity(128);
            for v in [FILE, 1, 0, 0] {
                out.extend_from_slice(&v.to_ne_bytes());
            }
            out.extend_from_slice(&[0; 8]);
            out.extend_from_slice(&attr(FILE));
            ok(&out);
        }
        GETATTR if [ROOT, FILE].contains(&r.nodeid) => {
            // fuse_attr_out: attr_valid u64, attr_valid_nsec u32, dummy u32, fuse_attr.
            let mut out = vec![0; 16];
            out.extend_from_slice(&attr(r.nodeid));
            ok(&out);
        }
        // fuse_open_out: fh u64, open_flags u32, backing_id i32.
        OPEN if r.nodeid == FILE => ok(&[0; 16]),
        FLUSH | RELEASE => ok(&[]),
        LOOKUP => reply(dev, r.unique, -(Errno::NOENT.raw_os_error()), &[]),
        _ => reply(dev, r.unique, -(Errno::NOSYS.raw_os_error()), &[]),
    }
}

/// `fuse_attr` (88 bytes) of the root directory or of `file`.
fn attr(node: u64) -> [u8; 88] {
    let (mode, size, nlink) = if node == ROOT {
        (0o040_755u32, 0u64, 2u32)
    } else {
        (0o100_600, FILE_LEN, 1)
    };
    let mut a = [0u8; 88];
    a[0..8].copy_from_slice(&node.to_ne_bytes());
    a[8..16].copy_from_slice(&size.to_ne_bytes());
    // blocks, atime, mtime, ctime (u64), three nsec (u32): zero; then mode, nlink, uid, gid.
    a[60..64].copy_from_slice(&mode.to_ne_bytes());
    a[64..68].copy_from_slice(&nlink.to_ne_bytes());
    a[68..72].copy_from_slice(&rustix::process::getuid().as_raw().to_ne_bytes());
    a[72..76].copy_from_slice(&rustix::process::getgid().as_raw().to_ne_bytes());
    // rdev, blksize, flags.
    a[80..84].copy_from_slice(&4096u32.to_ne_bytes());
    a
}

/// `fuse_out_header` (len u32, error i32, unique u64) and the body, in one write.
fn reply(dev: &OwnedFd, unique: u64, error: i32, body: &[u8]) {
    let len = u32::try_from(16 + body.len()).expect("small replies");
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&error.to_ne_bytes());
    out.extend_from_slice(&unique.to_ne_bytes());
    out.extend_from_slice(body);
    // A request interrupted meanwhile is answered with ENOENT; nothing to do about it.
    let _ = rustix::io::write(dev, &out);
}
