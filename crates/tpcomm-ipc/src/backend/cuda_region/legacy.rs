//! Legacy CUDA IPC's records of device memory, process-wide: the peer allocations open in
//! this process (one driver mapping per allocation and device, counted by the mappings that
//! share it: the driver refuses to open a handle twice in one context) and the allocations
//! this process exported (so that a same-process backend opens its own handles as aliases).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::CUdeviceptr;

use crate::backend::cuda_driver::result;

/// An opened allocation: the 64 handle bytes and the opening device's ordinal.
pub(crate) type OpenKey = ([u8; result::IPC_HANDLE_BYTES], i32);

#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) base: CUdeviceptr,
    pub(crate) size: u64,
    pub(crate) refs: usize,
}

/// The allocations this process has open, with the number of [`CudaMapping`]s of each.
///
/// [`CudaMapping`]: super::CudaMapping
pub(crate) fn open_table() -> MutexGuard<'static, HashMap<OpenKey, Opened>> {
    static TABLE: OnceLock<Mutex<HashMap<OpenKey, Opened>>> = OnceLock::new();
    // Nothing panics while holding the lock.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Allocations this process exported: the 64 handle bytes -> the allocation's base, so that a
/// [`CudaMemory::same_process`](crate::CudaMemory::same_process) backend can open its own
/// handles as aliases.
///
/// Entries are never looked up by peers of other processes, only by this process's own
/// aliases, and an alias is checked against the allocation now at `base`: the driver must
/// give the same handle for it (`CudaMemory::open_alias`), which a new allocation at a
/// freed one's address does not. Entries are dropped when a [`CudaBuffer`] is freed; a
/// stale entry (memory tpcomm did not allocate, freed by its owner, or a handle from
/// before a process checkpoint) is refused that way. After a checkpoint and restore the
/// driver hands out a *different* handle for the same allocation (the old one no longer
/// opens anywhere: `CUDA_ERROR_INVALID_HANDLE`); the registry's resume exports again and
/// inserts the new handle next to the old one, both naming the same base (a restore keeps
/// every allocation at its virtual address).
///
/// [`CudaBuffer`]: super::CudaBuffer
pub(crate) fn export_table(
) -> MutexGuard<'static, HashMap<[u8; result::IPC_HANDLE_BYTES], CUdeviceptr>> {
    static TABLE: OnceLock<Mutex<HashMap<[u8; result::IPC_HANDLE_BYTES], CUdeviceptr>>> =
        OnceLock::new();
    // Nothing panics while holding the lock.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}
