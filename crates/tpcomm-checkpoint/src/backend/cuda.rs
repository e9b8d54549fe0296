//! [`CudaCheckpoint`]: the process-checkpoint entry points of the CUDA driver, resolved at
//! run time in the driver library that tpcomm's probe loaded, through their one declaration
//! (`tpcomm_transport::cuda_driver::process_checkpoint`, with `init` for the driver's version
//! and `cuInit`, `error_strings` for the names of result codes), never linked: a machine
//! without a driver, or with one older than the 570 series (CUDA 12.8), gets [`Unsupported`]
//! with the versions, never a panic.
//!
//! The entry points are called from the rank's own thread: on driver 580 a process's calls
//! on its own pid work from any of its threads, one with its context current included
//! (measured).

use std::ffi::{c_int, c_uint};
use std::time::Duration;

use tpcomm_transport::cuda_driver::process_checkpoint::{self, ArgsFn, LockArgs, ReservedArgs};
use tpcomm_transport::cuda_driver::{error_strings, init, missing_symbols, CuResult, ResolveError};

use crate::driver::{
    check_support, CheckpointDriver, DriverError, DriverInfo, ProcessState, Unsupported,
    ENTRY_POINTS,
};

/// What a loaded driver gives: the five entry points, and `cuGetErrorName` when the driver
/// has it.
#[derive(Clone, Copy)]
struct Entries {
    calls: &'static process_checkpoint::Entries,
    error_strings: Option<&'static error_strings::Available>,
}

/// The real driver (see the module docs). Cheap to copy between rank threads.
#[derive(Clone)]
pub struct CudaCheckpoint {
    loaded: Result<(Entries, DriverInfo), Unsupported>,
}

impl std::fmt::Debug for CudaCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCheckpoint")
            .field("loaded", &self.loaded.as_ref().map(|(_, info)| info))
            .finish()
    }
}

/// The kernel driver's version from `/proc/driver/nvidia/version` ("... Kernel Module  580.159.04 ...").
fn kernel_driver_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| w.split('.').count() >= 2 && w.split('.').all(|p| p.parse::<u32>().is_ok()))
        .map(str::to_string)
}

impl CudaCheckpoint {
    /// Loads the entry points (once per call; cheap after the first, the library stays
    /// loaded). Never fails: an unusable driver is reported by
    /// [`support`](CheckpointDriver::support) and by every call, so every rank still joins
    /// the coordination's check and the refusal is agreed.
    pub fn load() -> Self {
        Self {
            loaded: Self::try_load(),
        }
    }

    fn try_load() -> Result<(Entries, DriverInfo), Unsupported> {
        let kernel = kernel_driver_version();
        let missing = match missing_symbols(&ENTRY_POINTS) {
            Ok(missing) => missing,
            Err(e) => return Err(check_support(None, Some(&e), &[], kernel).unwrap_err()),
        };
        // Each on its own: a driver with `cuDriverGetVersion` but without `cuInit` is told
        // apart (its version is reported).
        let start = init::available().ok();
        let version = start
            .and_then(init::Available::driver_version)
            .and_then(Result::ok);
        let load_error = version
            .is_none()
            .then_some("cuDriverGetVersion failed or is missing");
        let info = check_support(version, load_error, &missing, kernel)?;
        match start.and_then(init::Available::init) {
            Some(Ok(())) => {}
            other => {
                return Err(Unsupported {
                    reason: format!(
                        "cuInit failed ({}): no usable GPU",
                        other
                            .and_then(Result::err)
                            .map_or("missing".into(), |c| format!("CUresult {c}"))
                    ),
                    driver_api_version: Some(info.driver_api_version),
                    kernel_driver_version: info.kernel_driver_version,
                })
            }
        }
        // Every entry point was found above (check_support passed); each is read with its
        // cuda.h signature.
        let calls = process_checkpoint::entries().map_err(|e| load_failure(&info, e))?;
        let entries = Entries {
            calls,
            error_strings: error_strings::available().ok(),
        };
        Ok((entries, info))
    }

    fn entries(&self, entry_point: &str, pid: u32) -> Result<Entries, DriverError> {
        match &self.loaded {
            Ok((entries, _)) => Ok(*entries),
            // Unreachable through the coordination (its check refuses first); a direct
            // caller gets CUDA_ERROR_NOT_SUPPORTED.
            Err(_) => Err(DriverError {
                entry_point: entry_point.into(),
                pid,
                code: 801,
                name: "CUDA_ERROR_NOT_SUPPORTED (process checkpoint unsupported here)".into(),
            }),
        }
    }

    fn check(&self, entry_point: &str, pid: u32, code: CuResult) -> Result<(), DriverError> {
        if code == 0 {
            return Ok(());
        }
        let name = self
            .loaded
            .as_ref()
            .ok()
            .and_then(|(e, _)| e.error_strings)
            .and_then(|s| s.name(code))
            .unwrap_or_else(|| format!("CUresult {code}"));
        Err(DriverError {
            entry_point: entry_point.into(),
            pid,
            code,
            name,
        })
    }

    fn raw_pid(pid: u32, entry_point: &str) -> Result<c_int, DriverError> {
        c_int::try_from(pid).map_err(|_| DriverError {
            entry_point: entry_point.into(),
            pid,
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE (pid out of range)".into(),
        })
    }

    fn with_reserved(
        &self,
        entry_point: &'static str,
        pid: u32,
        pick: fn(&process_checkpoint::Entries) -> ArgsFn,
    ) -> Result<(), DriverError> {
        let f = pick(self.entries(entry_point, pid)?.calls);
        let raw = Self::raw_pid(pid, entry_point)?;
        let mut args = ReservedArgs::default();
        // SAFETY: a 64-byte zeroed argument block as the driver expects, valid for the call.
        let code = unsafe { f(raw, &mut args) };
        self.check(entry_point, pid, code)
    }
}

/// An entry point found but not readable: the loader's message (`ResolveError::Symbol`).
fn load_failure(info: &DriverInfo, e: ResolveError) -> Unsupported {
    let message = match e {
        ResolveError::Symbol { message, .. } => message,
        other => other.to_string(),
    };
    Unsupported {
        reason: format!("a process-checkpoint entry point could not be loaded: {message}"),
        driver_api_version: Some(info.driver_api_version),
        kernel_driver_version: info.kernel_driver_version.clone(),
    }
}

impl CheckpointDriver for CudaCheckpoint {
    fn support(&self) -> Result<DriverInfo, Unsupported> {
        self.loaded
            .as_ref()
            .map(|(_, i)| i.clone())
            .map_err(Clone::clone)
    }

    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), DriverError> {
        const CALL: &str = "cuCheckpointProcessLock";
        let f = self.entries(CALL, pid)?.calls.lock;
        let raw = Self::raw_pid(pid, CALL)?;
        // 0 would mean "no timeout": at least 1 ms, at most u32::MAX.
        let ms = timeout.as_millis().clamp(1, u128::from(u32::MAX)) as c_uint;
        let mut args = LockArgs::new(ms);
        // SAFETY: a 64-byte argument block as the driver expects, valid for the call.
        let code = unsafe { f(raw, &mut args) };
        self.check(CALL, pid, code)
    }

    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        self.with_reserved("cuCheckpointProcessCheckpoint", pid, |e| e.checkpoint)
    }

    fn restore(&self, pid: u32) -> Result<(), DriverError> {
        self.with_reserved("cuCheckpointProcessRestore", pid, |e| e.restore)
    }

    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        self.with_reserved("cuCheckpointProcessUnlock", pid, |e| e.unlock)
    }

    fn state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        const CALL: &str = "cuCheckpointProcessGetState";
        let f = self.entries(CALL, pid)?.calls.state;
        let raw = Self::raw_pid(pid, CALL)?;
        let mut state: c_int = -1;
        // SAFETY: out-pointer to a local `CUprocessState` (an int-sized enum).
        let code = unsafe { f(raw, &mut state) };
        self.check(CALL, pid, code)?;
        Ok(ProcessState::from_raw(state))
    }

    fn imported_ipc_mappings(&self, pid: u32) -> Option<usize> {
        (pid == std::process::id()).then(tpcomm_ipc::cuda_imported_allocations)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a driver (CI) the load reports why, with no panic; with one it
    /// names a supported driver or why not.
    #[test]
    fn loading_reports_instead_of_panicking() {
        let driver = CudaCheckpoint::load();
        match driver.support() {
            Ok(info) => assert!(info.driver_api_version >= 12080),
            Err(why) => {
                assert!(!why.reason.is_empty());
                let e = driver.lock(std::process::id(), Duration::from_secs(1));
                assert_eq!(e.unwrap_err().code, 801);
            }
        }
    }
}
