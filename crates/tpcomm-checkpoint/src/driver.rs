//! The driver side of a process checkpoint, as a trait: the five `cuCheckpointProcess*`
//! calls on a pid, plus the one fact the coordination needs from this process (how many
//! peer allocations it has imported through legacy CUDA IPC). The coordination
//! ([`crate::checkpoint_group`]) only talks to the driver through [`CheckpointDriver`], so
//! it runs unchanged against the real driver (`CudaCheckpoint`, feature `cuda`) and against
//! [`FakeDriver`](crate::fake::FakeDriver) in tests without a GPU.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The first CUDA driver API version with the public process-checkpoint entry points
/// (`cuDriverGetVersion` = 12080: CUDA 12.8, the 570 driver series).
pub const MIN_DRIVER_API_VERSION: i32 = 12080;

/// The driver entry points the coordination calls, in the order of a checkpoint: the names
/// of their one declaration, `tpcomm_transport::cuda_driver::process_checkpoint::NAMES`.
pub const ENTRY_POINTS: [&str; 5] = tpcomm_transport::cuda_driver::process_checkpoint::NAMES;

/// A process's checkpoint state as the driver reports it (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ProcessState {
    /// `CU_PROCESS_STATE_RUNNING` (0): CUDA calls run.
    Running,
    /// `CU_PROCESS_STATE_LOCKED` (1): new CUDA calls of the process block until unlocked.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED` (2): the GPU state is in host memory, the GPU memory
    /// is released; only a restore brings it back.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED` (3): the driver gave up on the process.
    Failed,
    /// A value this build does not know ([`UNREADABLE`](Self::UNREADABLE): the driver
    /// could not be asked).
    Unknown(i32),
}

impl ProcessState {
    /// The state reported for a process whose `cuCheckpointProcessGetState` failed.
    pub const UNREADABLE: Self = Self::Unknown(-1);

    /// The state of the driver's raw value.
    pub fn from_raw(raw: i32) -> Self {
        match raw {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            other => Self::Unknown(other),
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Running => f.write_str("running"),
            Self::Locked => f.write_str("locked"),
            Self::Checkpointed => f.write_str("checkpointed"),
            Self::Failed => f.write_str("failed"),
            Self::Unknown(-1) => f.write_str("in a state that could not be read"),
            Self::Unknown(raw) => write!(f, "unknown state {raw}"),
        }
    }
}

/// A driver call that returned something other than `CUDA_SUCCESS`: the entry point, the
/// raw `CUresult` and its name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{entry_point} on pid {pid} returned {name} ({code})")]
pub struct DriverError {
    /// The entry point, e.g. `cuCheckpointProcessRestore`.
    pub entry_point: String,
    /// The pid it was called on.
    pub pid: u32,
    /// The raw `CUresult`.
    pub code: i32,
    /// `cuGetErrorName` of the code (or `CUresult <code>` when the driver has no name).
    pub name: String,
}

/// `CUDA_ERROR_INVALID_VALUE`: what the driver returns for a restore of a process that held
/// imported legacy CUDA IPC mappings when it was checkpointed (driver 580, measured).
pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
/// `CUDA_ERROR_ILLEGAL_STATE`: a call out of order (checkpoint before lock, unlock while
/// checkpointed).
pub const CUDA_ERROR_ILLEGAL_STATE: i32 = 401;

/// Why the process-checkpoint API cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("process checkpoint is unsupported: {reason}")]
pub struct Unsupported {
    /// In words: no driver library, which entry points are missing, or the versions.
    pub reason: String,
    /// `cuDriverGetVersion`, when the driver library was found.
    pub driver_api_version: Option<i32>,
    /// The kernel driver's version (`/proc/driver/nvidia/version`, e.g. `580.159.04`), when
    /// readable.
    pub kernel_driver_version: Option<String>,
}

/// What a driver that can checkpoint this process reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverInfo {
    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0).
    pub driver_api_version: i32,
    /// The kernel driver's version, when readable.
    pub kernel_driver_version: Option<String>,
}

/// Decides whether a driver with `driver_api_version` (`None`: no driver library, with the
/// loader's message in `load_error`) that lacks the entry points in `missing` supports
/// process checkpoints: every entry point of [`ENTRY_POINTS`] present and the API version at
/// least [`MIN_DRIVER_API_VERSION`]. The error names the versions and the missing symbols.
pub fn check_support(
    driver_api_version: Option<i32>,
    load_error: Option<&str>,
    missing: &[&str],
    kernel_driver_version: Option<String>,
) -> Result<DriverInfo, Unsupported> {
    let unsupported = |reason: String| Unsupported {
        reason,
        driver_api_version,
        kernel_driver_version: kernel_driver_version.clone(),
    };
    let shown = |v: i32| format!("{v} (CUDA {}.{})", v / 1000, v % 1000 / 10);
    let kernel = kernel_driver_version
        .as_deref()
        .map(|k| format!(", kernel driver {k}"))
        .unwrap_or_default();
    let Some(version) = driver_api_version else {
        return Err(unsupported(format!(
            "no usable CUDA driver: {}",
            load_error.unwrap_or("the driver library was not found")
        )));
    };
    if version < MIN_DRIVER_API_VERSION {
        return Err(unsupported(format!(
            "the CUDA driver API is {}{kernel}; process checkpoints need {} (the 570 driver \
             series) or newer",
            shown(version),
            shown(MIN_DRIVER_API_VERSION)
        )));
    }
    if !missing.is_empty() {
        return Err(unsupported(format!(
            "the CUDA driver (API {}{kernel}) lacks {missing:?}",
            shown(version)
        )));
    }
    Ok(DriverInfo {
        driver_api_version: version,
        kernel_driver_version,
    })
}

/// The driver calls of a process checkpoint on one pid. Implementations must be callable
/// from any thread. Every method returns the driver's error unchanged (no retry); the
/// coordination decides what to do next.
pub trait CheckpointDriver: Send + Sync {
    /// Whether this process can use the API at all (library, entry points, versions).
    fn support(&self) -> Result<DriverInfo, Unsupported>;

    /// `cuCheckpointProcessLock`: blocks new CUDA calls of `pid` and waits for running ones,
    /// for at most `timeout` (never unbounded).
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), DriverError>;

    /// `cuCheckpointProcessCheckpoint`: moves `pid`'s GPU state to host memory and releases
    /// its GPU memory. Needs [`ProcessState::Locked`].
    fn checkpoint(&self, pid: u32) -> Result<(), DriverError>;

    /// `cuCheckpointProcessRestore`: brings the GPU state back at the same virtual
    /// addresses. Needs [`ProcessState::Checkpointed`]; leaves the process locked.
    fn restore(&self, pid: u32) -> Result<(), DriverError>;

    /// `cuCheckpointProcessUnlock`: lets CUDA calls run again. Needs
    /// [`ProcessState::Locked`].
    fn unlock(&self, pid: u32) -> Result<(), DriverError>;

    /// `cuCheckpointProcessGetState`.
    fn state(&self, pid: u32) -> Result<ProcessState, DriverError>;

    /// How many peer allocations *this* process has open through legacy CUDA IPC. A
    /// process with any cannot be restored after a checkpoint (measured on driver 580: the
    /// restore fails and leaves it checkpointed), so the coordination refuses to lock it.
    ///
    /// `pid` is the process the coordination is about to lock. `None`: the driver cannot
    /// tell (the real driver counts only the caller's own process's mappings; for any other
    /// pid it cannot know), and the coordination refuses to lock a process it cannot
    /// vouch for ([`Reason::ImportsUnknown`](crate::Reason::ImportsUnknown)). A fake driver
    /// models several processes.
    fn imported_ipc_mappings(&self, pid: u32) -> Option<usize>;
}

impl<D: CheckpointDriver + ?Sized> CheckpointDriver for &D {
    fn support(&self) -> Result<DriverInfo, Unsupported> {
        (**self).support()
    }
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), DriverError> {
        (**self).lock(pid, timeout)
    }
    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        (**self).checkpoint(pid)
    }
    fn restore(&self, pid: u32) -> Result<(), DriverError> {
        (**self).restore(pid)
    }
    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        (**self).unlock(pid)
    }
    fn state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        (**self).state(pid)
    }
    fn imported_ipc_mappings(&self, pid: u32) -> Option<usize> {
        (**self).imported_ipc_mappings(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_driver_is_unsupported_with_the_loaders_message() {
        let e = check_support(None, Some("libcuda.so.1: not found"), &[], None).unwrap_err();
        assert!(e.reason.contains("libcuda.so.1: not found"), "{e}");
        assert_eq!(e.driver_api_version, None);
    }

    #[test]
    fn a_driver_older_than_570_is_unsupported_naming_both_versions() {
        let e = check_support(Some(12040), None, &[], Some("550.54.15".into())).unwrap_err();
        assert!(e.reason.contains("12040 (CUDA 12.4)"), "{e}");
        assert!(e.reason.contains("12080 (CUDA 12.8)"), "{e}");
        assert!(e.reason.contains("550.54.15"), "{e}");
        assert_eq!(e.driver_api_version, Some(12040));
    }

    #[test]
    fn a_new_driver_missing_an_entry_point_is_unsupported_naming_it() {
        let e =
            check_support(Some(13000), None, &["cuCheckpointProcessRestore"], None).unwrap_err();
        assert!(e.reason.contains("cuCheckpointProcessRestore"), "{e}");
    }

    #[test]
    fn a_complete_570_or_newer_driver_is_supported() {
        let info = check_support(Some(13000), None, &[], Some("580.159.04".into())).unwrap();
        assert_eq!(info.driver_api_version, 13000);
        assert!(check_support(Some(12080), None, &[], None).is_ok());
    }

    #[test]
    fn raw_states_map_to_the_drivers_enum() {
        let states: Vec<_> = (0..5).map(ProcessState::from_raw).collect();
        assert_eq!(
            states,
            [
                ProcessState::Running,
                ProcessState::Locked,
                ProcessState::Checkpointed,
                ProcessState::Failed,
                ProcessState::Unknown(4)
            ]
        );
    }
}
