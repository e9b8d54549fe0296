//! A failed open of a peer's handle told apart from an exporter that has exited
//! ([`IpcError::OwnerGone`]). The peer allocations open in this process are recorded in
//! `backend/cuda_region/legacy.rs`.

use crate::error::IpcError;

/// Turns a failed open into [`IpcError::OwnerGone`] when the exporting process is gone.
pub(super) fn owner_gone_or(e: IpcError, pid: u32) -> IpcError {
    let gone = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH));
    if gone {
        IpcError::OwnerGone { pid }
    } else {
        e
    }
}
