//! [`CudaCheckpoint`]: the process-checkpoint entry points of the CUDA driver, resolved at
//! run time in the driver library that tpcomm's probe loaded
//! (`tpcomm_transport::backend::cuda_driver::library`), never linked: a machine without a
//! driver, or with one older than the 570 series (CUDA 12.8), gets [`Unsupported`] with the
//! versions, never a panic.
//!
//! The argument structs are 64 bytes each in CUDA 12.8 to 13.x (`CUcheckpointLockArgs`:
//! `timeoutMs`, a reserved `u32`, seven reserved `u64`; the others reserved words, which
//! must be zero; `CUcheckpointRestoreArgs` of 13.0 adds an optional GPU remapping table,
//! left empty). Zeroed blocks work on driver 580 (measured).
//!
//! The entry points are called from the rank's own thread: on driver 580 a process's calls
//! on its own pid work from any of its threads, one with its context current included
//! (measured).

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::time::Duration;

use crate::driver::{
    check_support, CheckpointDriver, DriverError, DriverInfo, ProcessState, Unsupported,
    ENTRY_POINTS,
};

type CuResult = c_int;

/// `CUcheckpointLockArgs`.
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`, `CUcheckpointRestoreArgs` (no GPU remapping),
/// `CUcheckpointUnlockArgs`: reserved, zero.
#[repr(C)]
struct ReservedArgs {
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<ReservedArgs>() == 64);

type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResult;
type ArgsFn = unsafe extern "C" fn(c_int, *mut ReservedArgs) -> CuResult;
type StateFn = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;
type VersionFn = unsafe extern "C" fn(*mut c_int) -> CuResult;
type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
type ErrorNameFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

#[derive(Clone, Copy)]
struct Entries {
    lock: LockFn,
    checkpoint: ArgsFn,
    restore: ArgsFn,
    unlock: ArgsFn,
    state: StateFn,
    error_name: Option<ErrorNameFn>,
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
        let lib = match tpcomm_transport::backend::cuda_driver::library() {
            Ok(lib) => lib,
            Err(e) => return Err(check_support(None, Some(&e), &[], kernel).unwrap_err()),
        };
        // SAFETY: the symbols are looked up with the C signatures of cuda.h (CUDA 12.8+);
        // they are only called through these types below.
        let sym = |name: &str| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.ok();
        let missing: Vec<&str> = ENTRY_POINTS
            .iter()
            .copied()
            .filter(|n| sym(n).is_none())
            .collect();
        // SAFETY: `cuDriverGetVersion(int*)` and `cuInit(unsigned)` as cuda.h declares them.
        let version_fn = unsafe { lib.get::<VersionFn>(b"cuDriverGetVersion") }.ok();
        let mut version: c_int = 0;
        let version = match version_fn {
            // SAFETY: out-pointer to a local; the call needs no initialised driver.
            Some(f) if unsafe { f(&mut version) } == 0 => Some(version),
            _ => None,
        };
        let load_error = version
            .is_none()
            .then_some("cuDriverGetVersion failed or is missing");
        let info = check_support(version, load_error, &missing, kernel)?;
        // SAFETY: as above.
        let init = unsafe { lib.get::<InitFn>(b"cuInit") }.ok();
        // SAFETY: cuInit(0) is idempotent and thread-safe.
        match init.map(|f| unsafe { f(0) }) {
            Some(0) => {}
            other => {
                return Err(Unsupported {
                    reason: format!(
                        "cuInit failed ({}): no usable GPU",
                        other.map_or("missing".into(), |c| format!("CUresult {c}"))
                    ),
                    driver_api_version: Some(info.driver_api_version),
                    kernel_driver_version: info.kernel_driver_version,
                })
            }
        }
        // SAFETY: every entry point was found above (check_support passed); each is read
        // with its cuda.h signature.
        let entries = unsafe {
            Entries {
                lock: *lib
                    .get::<LockFn>(b"cuCheckpointProcessLock")
                    .map_err(|e| load_failure(&info, e))?,
                checkpoint: *lib
                    .get::<ArgsFn>(b"cuCheckpointProcessCheckpoint")
                    .map_err(|e| load_failure(&info, e))?,
                restore: *lib
                    .get::<ArgsFn>(b"cuCheckpointProcessRestore")
                    .map_err(|e| load_failure(&info, e))?,
                unlock: *lib
                    .get::<ArgsFn>(b"cuCheckpointProcessUnlock")
                    .map_err(|e| load_failure(&info, e))?,
                state: *lib
                    .get::<StateFn>(b"cuCheckpointProcessGetState")
                    .map_err(|e| load_failure(&info, e))?,
                error_name: lib.get::<ErrorNameFn>(b"cuGetErrorName").ok().map(|s| *s),
            }
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
            .and_then(|(e, _)| e.error_name)
            .and_then(|f| {
                let mut p: *const c_char = std::ptr::null();
                // SAFETY: out-pointer to a local; the driver stores a static string or null.
                let ok = unsafe { f(code, &mut p) } == 0 && !p.is_null();
                // SAFETY: non-null pointer from cuGetErrorName: static, NUL-terminated.
                ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            })
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
        pick: fn(&Entries) -> ArgsFn,
    ) -> Result<(), DriverError> {
        let f = pick(&self.entries(entry_point, pid)?);
        let raw = Self::raw_pid(pid, entry_point)?;
        let mut args = ReservedArgs { reserved: [0; 8] };
        // SAFETY: a 64-byte zeroed argument block as the driver expects, valid for the call.
        let code = unsafe { f(raw, &mut args) };
        self.check(entry_point, pid, code)
    }
}

fn load_failure(info: &DriverInfo, e: libloading::Error) -> Unsupported {
    Unsupported {
        reason: format!("a process-checkpoint entry point could not be loaded: {e}"),
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
        let f = self.entries(CALL, pid)?.lock;
        let raw = Self::raw_pid(pid, CALL)?;
        // 0 would mean "no timeout": at least 1 ms, at most u32::MAX.
        let ms = timeout.as_millis().clamp(1, u128::from(u32::MAX)) as c_uint;
        let mut args = LockArgs {
            timeout_ms: ms,
            reserved0: 0,
            reserved1: [0; 7],
        };
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
        let f = self.entries(CALL, pid)?.state;
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
