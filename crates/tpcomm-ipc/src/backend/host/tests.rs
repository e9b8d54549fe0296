//! The `/proc` fallback, which `open` takes only where `pidfd_getfd` is not allowed.

use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use rustix::fs::{MemfdFlags, Mode, OFlags};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

use super::proc_fallback::open_via_proc;
use super::segment_checks::check_segment;
use super::stalled_fuse::{self, StalledFuse};
use super::*;
use crate::error::SegmentProblem;

/// Held while a test of this module starts a process, and by a FUSE test throughout: a
/// process started while a FUSE file is open here would inherit that descriptor until
/// its `exec` closes it, and that close waits on the server once it stalls.
static FORKS: Mutex<()> = Mutex::new(());

/// A `sleep` holding `fd` as its descriptor 0, and a handle naming all `len` bytes of it.
fn hold(fd: OwnedFd, len: u64) -> (Child, HostHandle) {
    let _forks = lock(&FORKS);
    spawn_holder(fd, len)
}

/// [`hold`], for a caller that holds [`FORKS`].
fn spawn_holder(fd: OwnedFd, len: u64) -> (Child, HostHandle) {
    let stat = rustix::fs::fstat(&fd).unwrap();
    let child = Command::new("sleep")
        .arg("600")
        .stdin(Stdio::from(fd))
        .spawn()
        .unwrap();
    let h = HostHandle {
        pid: child.id(),
        fd: 0,
        dev: stat.st_dev,
        inode: stat.st_ino,
        segment_len: len,
        offset: 0,
        len,
    };
    (child, h)
}

fn reap(mut child: Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A FUSE file system serving one file, or `None` after recording why the test skips.
fn fuse() -> Option<StalledFuse> {
    StalledFuse::mount()
        .map_err(|why| tpcomm_transport::testing::skip(&why))
        .ok()
}

/// A `sleep` holding the file system's file open, and a handle naming it; from then on
/// the file system answers nothing. The caller holds [`FORKS`].
///
/// The file is opened without `O_CLOEXEC`: the child keeps its inherited copy, where
/// closing it in `exec` (which `spawn` does not wait for) would wait on the stalled server
/// with the child's exec lock held, and so block `pidfd_getfd` on the child.
fn hold_stalled(fs: &StalledFuse) -> (Child, HostHandle) {
    let file =
        rustix::fs::open(fs.file(), OFlags::RDWR, Mode::empty()).expect("the FUSE file opens");
    let held = spawn_holder(file, stalled_fuse::FILE_LEN);
    fs.stall();
    held
}

/// `result` (of `within_10s`) is the refusal of a file that is no memfd, in time.
fn assert_refused_at_once(what: &str, result: Option<Result<()>>) {
    match result {
        Some(Err(IpcError::NotASegment {
            problem: SegmentProblem::NotMemfd,
            ..
        })) => {}
        None => panic!("{what} waited on a file system that never answers for 10 s"),
        Some(other) => panic!("{what}: expected NotASegment(NotMemfd), got {other:?}"),
    }
}

/// What `f` returns, or `None` when it has not returned after 10 s (it goes on on its
/// own thread).
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10)).ok()
}

#[test]
fn a_handle_naming_a_file_whose_server_never_answers_is_refused_without_waiting() {
    let _forks = lock(&FORKS);
    let Some(fs) = fuse() else { return };
    let (child, h) = hold_stalled(&fs);
    // Whether `open` fetches the descriptor (`pidfd_getfd`, allowed to this process) or
    // takes the `/proc` fallback, which refuses by the link and fetches nothing.
    let fetches = rustix::process::pidfd_open(Pid::from_child(&child), PidfdFlags::empty())
        .and_then(|pidfd| rustix::process::pidfd_getfd(&pidfd, 1, PidfdGetfdFlags::empty()))
        .is_ok();
    let result = within_10s(move || HostMemory::new().open(&h).map(|_| ()));
    // The refused descriptor's close reached the server (on a thread of its own, whose
    // wait `open` gave up after `CLOSE_WAIT`): closing it on the caller's thread would
    // have waited there.
    let held = fs.held();
    // Unmounting answers what is held, and lets the child's own close end.
    drop(fs);
    reap(child);
    assert_refused_at_once("open", result);
    if fetches {
        assert!(held >= 1, "the refused descriptor was never closed");
    } else {
        eprintln!("pidfd_getfd is not allowed here: the /proc fallback served (nothing fetched)");
    }
}

#[test]
fn the_proc_fallback_refuses_a_file_whose_server_never_answers_without_waiting() {
    let _forks = lock(&FORKS);
    let Some(fs) = fuse() else { return };
    let (child, h) = hold_stalled(&fs);
    let result = within_10s(move || open_via_proc(&h).map(|_| ()));
    drop(fs);
    reap(child);
    assert_refused_at_once("the /proc fallback", result);
}

#[test]
fn the_proc_fallback_reopens_a_segment_of_another_process() {
    let fd = rustix::fs::memfd_create(SEGMENT_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SEGMENT_SEALS).unwrap();
    let (child, h) = hold(fd, 4096);
    let reopened = open_via_proc(&h);
    reap(child);
    check_segment(&reopened.unwrap(), &h).unwrap();
}

#[test]
fn a_handle_naming_another_processs_private_segment_is_foreign() {
    let private = HostMemory::new().allocate_private(4096).unwrap();
    let (child, h) = hold(
        private.segment.as_ref().unwrap().fd.try_clone().unwrap(),
        4096,
    );
    let reopened = open_via_proc(&h);
    reap(child);
    match check_segment(&reopened.unwrap(), &h) {
        Err(IpcError::NotASegment {
            problem: SegmentProblem::ForeignName { .. },
            ..
        }) => {}
        other => panic!("expected NotASegment(ForeignName), got {other:?}"),
    }
}

#[test]
fn the_proc_fallback_never_opens_an_ordinary_file_of_another_process() {
    let path = std::env::temp_dir().join(format!("tpcomm-proc-fallback-{}", std::process::id()));
    std::fs::write(&path, [7u8; 4096]).unwrap();
    let file = rustix::fs::open(&path, OFlags::RDWR, Mode::empty()).unwrap();
    let (child, h) = hold(file, 4096);
    let result = open_via_proc(&h);
    reap(child);
    std::fs::remove_file(&path).unwrap();
    match result {
        Err(IpcError::NotASegment {
            problem: SegmentProblem::NotMemfd,
            ..
        }) => {}
        other => panic!("expected NotASegment(NotMemfd), got {other:?}"),
    }
}

#[test]
fn the_proc_fallback_checks_the_inode_before_reopening() {
    let fd = rustix::fs::memfd_create(SEGMENT_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    let (child, mut h) = hold(fd, 4096);
    h.inode ^= 1;
    let result = open_via_proc(&h);
    reap(child);
    assert!(
        matches!(result, Err(IpcError::StaleHandle(_))),
        "{result:?}"
    );
}

#[test]
fn the_proc_fallback_names_an_exited_owner_not_yet_reaped() {
    let fd = rustix::fs::memfd_create(SEGMENT_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    let (mut child, h) = hold(fd, 4096);
    child.kill().unwrap();
    // Until it has exited, leaving a zombie (NOWAIT): its descriptors are gone.
    rustix::process::waitid(
        rustix::process::WaitId::Pid(Pid::from_child(&child)),
        rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT,
    )
    .unwrap();
    let result = open_via_proc(&h);
    child.wait().unwrap();
    match result {
        Err(IpcError::OwnerGone { pid }) => assert_eq!(pid, h.pid),
        other => panic!("expected OwnerGone, got {other:?}"),
    }
}
