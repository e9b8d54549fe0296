//! Process checkpoint (`cuCheckpointProcess*`, CUDA 12.8, the 570 driver series): lock a
//! process's CUDA calls, move its GPU state to host memory and back, unlock, and read its
//! state; what `tpcomm-checkpoint`'s CUDA driver calls.
//!
//! The argument structs are 64 bytes each in CUDA 12.8 to 13.x (`CUcheckpointLockArgs`:
//! `timeoutMs`, a reserved `u32`, seven reserved `u64`; the others reserved words, which
//! must be zero; `CUcheckpointRestoreArgs` of 13.0 adds an optional GPU remapping table,
//! left empty). Zeroed blocks work on driver 580 (measured).

use std::ffi::{c_int, c_uint};

use super::resolve::entry_points;
use super::CuResult;

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LockArgs {
    /// `timeoutMs`: how long the lock waits for running CUDA calls; 0 means no timeout.
    pub timeout_ms: c_uint,
    /// Reserved: zero.
    pub reserved0: c_uint,
    /// Reserved: zero.
    pub reserved1: [u64; 7],
}

impl LockArgs {
    /// A lock that waits at most `timeout_ms` milliseconds (0: without a bound), the
    /// reserved words zero.
    pub fn new(timeout_ms: c_uint) -> Self {
        Self {
            timeout_ms,
            reserved0: 0,
            reserved1: [0; 7],
        }
    }
}

/// `CUcheckpointCheckpointArgs`, `CUcheckpointRestoreArgs` (no GPU remapping),
/// `CUcheckpointUnlockArgs`: reserved, zero.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ReservedArgs {
    /// Reserved: zero.
    pub reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<ReservedArgs>() == 64);

/// `cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)`.
pub type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResult;
/// `cuCheckpointProcessCheckpoint`, `cuCheckpointProcessRestore`,
/// `cuCheckpointProcessUnlock`: `(int pid, <its args> *args)`.
pub type ArgsFn = unsafe extern "C" fn(c_int, *mut ReservedArgs) -> CuResult;
/// `cuCheckpointProcessGetState(int pid, CUprocessState *state)` (an int-sized enum).
pub type StateFn = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;

// In the order of a checkpoint.
entry_points! {
    purpose: "process checkpoint",
    since: "CUDA 12.8",
    lock: LockFn = "cuCheckpointProcessLock",
    checkpoint: ArgsFn = "cuCheckpointProcessCheckpoint",
    restore: ArgsFn = "cuCheckpointProcessRestore",
    unlock: ArgsFn = "cuCheckpointProcessUnlock",
    state: StateFn = "cuCheckpointProcessGetState",
}
