//! The peer allocations this process has open through legacy CUDA IPC: one driver mapping per
//! allocation and device, counted by the mappings that share it (the driver refuses to open
//! a handle twice in one context).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::CUdeviceptr;

use crate::backend::cuda_driver::result;
use crate::error::IpcError;

/// An opened allocation: the 64 handle bytes and the opening device's ordinal.
pub(crate) type OpenKey = ([u8; result::IPC_HANDLE_BYTES], i32);

#[derive(Debug)]
pub(super) struct Opened {
    pub(super) base: CUdeviceptr,
    pub(super) size: u64,
    pub(super) refs: usize,
}

/// The allocations this process has open, with the number of [`CudaMapping`]s of each.
///
/// [`CudaMapping`]: super::CudaMapping
pub(super) fn open_table() -> MutexGuard<'static, HashMap<OpenKey, Opened>> {
    static TABLE: OnceLock<Mutex<HashMap<OpenKey, Opened>>> = OnceLock::new();
    // Nothing panics while holding the lock.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The number of peer allocations this process has open through legacy CUDA IPC
/// (`cuIpcOpenMemHandle`) right now, over every [`CudaMemory`] and device: each counts once
/// however many [`CudaMapping`]s share it; plus the virtual-memory imports of every
/// `CudaVmmMemory` mapped now (a detached one is not: it holds only its address range).
/// Same-process aliases ([`CudaMemory::same_process`]) open nothing in the driver and are not
/// counted.
///
/// A process checkpoint (`cuCheckpointProcessCheckpoint`) must not run while this is above
/// zero: on driver 580 the checkpoint of an importer succeeds but its restore fails
/// (`CUDA_ERROR_INVALID_VALUE`) and leaves the process checkpointed for good, so
/// `tpcomm-checkpoint` refuses before locking. The count is taken under the table's lock;
/// another thread may open or close a mapping right after it is read.
///
/// [`CudaMemory`]: super::CudaMemory
/// [`CudaMapping`]: super::CudaMapping
/// [`CudaMemory::same_process`]: super::CudaMemory::same_process
pub fn imported_allocations() -> usize {
    open_table().len() + crate::backend::cuda_vmm::imported_now()
}

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
