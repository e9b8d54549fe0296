//! A driver double for tests without a GPU: [`FakeDriver`] keeps a checkpoint state per pid,
//! enforces the driver's ordering the way driver 580 does (measured: a checkpoint before a
//! lock and an unlock while checkpointed are `CUDA_ERROR_ILLEGAL_STATE`; a process with
//! imported CUDA IPC mappings checkpoints fine but its restore fails with
//! `CUDA_ERROR_INVALID_VALUE` and leaves it checkpointed), injects failures, and logs every
//! call in one global order, so that tests check the ordering rules across ranks.
//!
//! Clones share their state: give each rank thread a clone.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::driver::{
    CheckpointDriver, DriverError, DriverInfo, ProcessState, Unsupported, CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_VALUE,
};

/// An injected lock failure code (`CUDA_ERROR_TIMEOUT`, 909) after which the fake leaves the
/// process locked: a lock that failed late.
pub const LOCK_TIMEOUT_KEEPS_LOCK: i32 = 909;

/// A driver call of the fake's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
}

impl Call {
    fn entry_point(self) -> &'static str {
        match self {
            Call::Lock => "cuCheckpointProcessLock",
            Call::Checkpoint => "cuCheckpointProcessCheckpoint",
            Call::Restore => "cuCheckpointProcessRestore",
            Call::Unlock => "cuCheckpointProcessUnlock",
        }
    }
}

/// One logged call: what, on which pid, and the `CUresult` it returned (0: success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// The call.
    pub call: Call,
    /// The pid.
    pub pid: u32,
    /// The returned code.
    pub code: i32,
}

#[derive(Debug, Default)]
struct Inner {
    states: HashMap<u32, ProcessState>,
    imported: HashMap<u32, usize>,
    faults: HashMap<(Call, u32), VecDeque<i32>>,
    log: Vec<Event>,
    lock_timeouts: Vec<Duration>,
    unsupported: Option<Unsupported>,
}

/// The fake driver (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct FakeDriver {
    inner: Arc<Mutex<Inner>>,
}

impl FakeDriver {
    /// A supported driver; every process running, nothing imported.
    pub fn new() -> Self {
        Self::default()
    }

    /// A driver whose [`support`](CheckpointDriver::support) fails with `why` (an absent or
    /// too old driver: build it with [`check_support`](crate::check_support)).
    pub fn unsupported(why: Unsupported) -> Self {
        let fake = Self::new();
        fake.with(|i| i.unsupported = Some(why));
        fake
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Makes process `pid` hold `count` imported CUDA IPC allocations.
    pub fn set_imported(&self, pid: u32, count: usize) {
        self.with(|i| i.imported.insert(pid, count));
    }

    /// Makes the next `call` on `pid` fail with `code` (queued: several faults fail
    /// successive calls). A failed call changes no state, except a lock failing with
    /// [`LOCK_TIMEOUT_KEEPS_LOCK`], which leaves the process locked (a lock that failed late).
    pub fn fail_next(&self, call: Call, pid: u32, code: i32) {
        self.with(|i| i.faults.entry((call, pid)).or_default().push_back(code));
    }

    /// Every call so far, in the order they happened (across threads).
    pub fn log(&self) -> Vec<Event> {
        self.with(|i| i.log.clone())
    }

    /// The lock timeouts passed, in order.
    pub fn lock_timeouts(&self) -> Vec<Duration> {
        self.with(|i| i.lock_timeouts.clone())
    }

    /// The state of `pid` (running when never touched).
    pub fn state_of(&self, pid: u32) -> ProcessState {
        self.with(|i| i.states.get(&pid).copied().unwrap_or(ProcessState::Running))
    }

    fn call(&self, call: Call, pid: u32) -> Result<(), DriverError> {
        self.with(|i| {
            let state = i.states.get(&pid).copied().unwrap_or(ProcessState::Running);
            let injected = i.faults.get_mut(&(call, pid)).and_then(VecDeque::pop_front);
            let (code, next) = match (injected, call, state) {
                (Some(LOCK_TIMEOUT_KEEPS_LOCK), Call::Lock, ProcessState::Running) => {
                    (LOCK_TIMEOUT_KEEPS_LOCK, ProcessState::Locked)
                }
                (Some(code), _, _) => (code, state),
                (None, Call::Lock, ProcessState::Running) => (0, ProcessState::Locked),
                (None, Call::Checkpoint, ProcessState::Locked) => (0, ProcessState::Checkpointed),
                (None, Call::Restore, ProcessState::Checkpointed)
                    if i.imported.get(&pid).copied().unwrap_or(0) > 0 =>
                {
                    (CUDA_ERROR_INVALID_VALUE, state)
                }
                (None, Call::Restore, ProcessState::Checkpointed) => (0, ProcessState::Locked),
                (None, Call::Unlock, ProcessState::Locked) => (0, ProcessState::Running),
                (None, _, _) => (CUDA_ERROR_ILLEGAL_STATE, state),
            };
            i.states.insert(pid, next);
            i.log.push(Event { call, pid, code });
            if code == 0 {
                Ok(())
            } else {
                Err(DriverError {
                    entry_point: call.entry_point().into(),
                    pid,
                    code,
                    name: match code {
                        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE".into(),
                        CUDA_ERROR_ILLEGAL_STATE => "CUDA_ERROR_ILLEGAL_STATE".into(),
                        other => format!("CUresult {other}"),
                    },
                })
            }
        })
    }
}

impl CheckpointDriver for FakeDriver {
    fn support(&self) -> Result<DriverInfo, Unsupported> {
        match self.with(|i| i.unsupported.clone()) {
            Some(why) => Err(why),
            None => Ok(DriverInfo {
                driver_api_version: 13000,
                kernel_driver_version: Some("fake".into()),
            }),
        }
    }

    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), DriverError> {
        self.with(|i| i.lock_timeouts.push(timeout));
        self.call(Call::Lock, pid)
    }

    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        self.call(Call::Checkpoint, pid)
    }

    fn restore(&self, pid: u32) -> Result<(), DriverError> {
        self.call(Call::Restore, pid)
    }

    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        self.call(Call::Unlock, pid)
    }

    fn state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        Ok(self.state_of(pid))
    }

    fn imported_ipc_mappings(&self, pid: u32) -> Option<usize> {
        Some(self.with(|i| i.imported.get(&pid).copied().unwrap_or(0)))
    }
}
