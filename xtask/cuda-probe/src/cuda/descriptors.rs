//! How an exported descriptor reaches the peer process and what it is: fetched with
//! `pidfd_open` + `pidfd_getfd`, or passed over the parent's socket pair (`SCM_RIGHTS`) when
//! that does not serve; described by `readlink` and `fstat`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

use super::calls::Calls;
use super::Cuda;

/// What a descriptor is: `readlink /proc/self/fd/N` and `fstat`.
pub(super) fn fd_facts(
    fd: impl AsFd,
    values: &mut std::collections::BTreeMap<String, String>,
) -> String {
    let raw = fd.as_fd().as_raw_fd();
    let link = std::fs::read_link(format!("/proc/self/fd/{raw}"))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|e| format!("(readlink failed: {e})"));
    values.insert("fd_link".into(), link.clone());
    match rustix::fs::fstat(fd) {
        Ok(st) => {
            let kind = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
                rustix::fs::FileType::CharacterDevice => "character device",
                rustix::fs::FileType::BlockDevice => "block device",
                rustix::fs::FileType::RegularFile => "regular file",
                rustix::fs::FileType::Directory => "directory",
                rustix::fs::FileType::Fifo => "fifo",
                rustix::fs::FileType::Socket => "socket",
                rustix::fs::FileType::Symlink => "symlink",
                rustix::fs::FileType::Unknown => "unknown type",
            };
            let rdev = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
            let dev = (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
            values.insert("fd_type".into(), kind.into());
            values.insert("fd_mode".into(), format!("{:o}", st.st_mode));
            values.insert("fd_rdev".into(), format!("{}:{}", rdev.0, rdev.1));
            values.insert("fd_dev".into(), format!("{}:{}", dev.0, dev.1));
            values.insert("fd_ino".into(), st.st_ino.to_string());
            format!(
                "fd {raw} -> {link}: {kind} (st_mode {:o}), st_rdev {}:{}, st_dev {}:{}, st_ino {}",
                st.st_mode, rdev.0, rdev.1, dev.0, dev.1, st.st_ino
            )
        }
        Err(e) => format!("fd {raw} -> {link}: fstat failed: {e}"),
    }
}

/// `pidfd_open(pid)` + `pidfd_getfd(fd)`: the peer's descriptor, or `None` (recorded, not a
/// failure of the import: the socket copy may serve).
pub(super) fn fetch_by_pidfd(c: &mut Calls<'_>, pid: u32, fd: i32) -> Option<OwnedFd> {
    let Some(pid_) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        c.note("pidfd_open", false, "BAD_PID", format!("pid {pid}"));
        return None;
    };
    let pidfd = rustix::process::pidfd_open(pid_, PidfdFlags::empty());
    c.sys("pidfd_open", &pidfd, format!("pid {pid}"));
    let fetched = match pidfd {
        Ok(pidfd) => {
            let fetched =
                rustix::process::pidfd_getfd(&pidfd, fd as RawFd, PidfdGetfdFlags::empty());
            c.sys("pidfd_getfd", &fetched, format!("fd {fd} of pid {pid}"));
            fetched.ok()
        }
        Err(_) => None,
    };
    if let Some(last) = c.calls.last_mut() {
        last.ok = true;
    }
    fetched
}

impl Cuda {
    /// Sends the own exported descriptor `fd` to the peer over the socket the parent gave
    /// (`SCM_RIGHTS`).
    pub(super) fn vmm_offer(&mut self, c: &mut Calls<'_>, fd: i32) {
        let Some(sock) = &self.peer_socket else {
            c.note("sendmsg", false, "NO_SOCKET", "no socket to the peer");
            return;
        };
        let Some(own) = self.own.fds.iter().find(|f| f.as_raw_fd() == fd) else {
            c.note(
                "sendmsg",
                false,
                "NOT_EXPORTED",
                format!("fd {fd} is not an exported descriptor of this process"),
            );
            return;
        };
        let fds = [own.as_fd()];
        let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            c.note(
                "sendmsg",
                false,
                "NO_SPACE",
                "the control buffer is too small",
            );
            return;
        }
        let sent = rustix::net::sendmsg(
            sock,
            &[std::io::IoSlice::new(&[1u8])],
            &mut control,
            SendFlags::empty(),
        );
        c.sys(
            "sendmsg(SCM_RIGHTS)",
            &sent,
            format!("fd {fd} to the peer over the socket"),
        );
    }

    /// The descriptor the peer offered, received within 2 s. `pidfd_served`: a failure here
    /// does not fail the import.
    pub(super) fn receive_offered(
        &mut self,
        c: &mut Calls<'_>,
        pidfd_served: bool,
    ) -> Option<OwnedFd> {
        let Some(sock) = &self.peer_socket else {
            c.note(
                "recvmsg",
                pidfd_served,
                "NO_SOCKET",
                "no socket to the peer",
            );
            return None;
        };
        let timeout = rustix::net::sockopt::set_socket_timeout(
            sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(std::time::Duration::from_secs(2)),
        );
        if !c.sys("setsockopt(SO_RCVTIMEO)", &timeout, "2 s") {
            return None;
        }
        let mut byte = [0u8; 1];
        let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            sock,
            &mut [std::io::IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let ok = c.sys("recvmsg(SCM_RIGHTS)", &got, "the peer's offered descriptor");
        if !ok {
            if let Some(last) = c.calls.last_mut() {
                last.ok = pidfd_served;
            }
            return None;
        }
        let mut received = None;
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for fd in fds {
                    received.get_or_insert(fd);
                }
            }
        }
        if received.is_none() {
            c.note(
                "recvmsg(SCM_RIGHTS)",
                pidfd_served,
                "NO_RIGHTS",
                "a message without a descriptor",
            );
        }
        received
    }
}
