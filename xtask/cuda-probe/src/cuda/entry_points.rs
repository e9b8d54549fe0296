//! The driver entry points the probe declares and resolves itself, with `libloading`: the
//! `cuCheckpointProcess*` family and `cuGetErrorName`, which take and return plain `int`s,
//! their argument blocks, the names of the driver library, and its loading. Every other
//! driver call goes through cudarc's raw `driver::sys` bindings.

use std::ffi::{c_char, c_int, c_uint, CStr};

use super::calls::Calls;
use super::Cuda;

/// The names cudarc also tries for the driver library.
pub(super) const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// `CUcheckpointLockArgs` (CUDA 12.8 to 13.x): `timeoutMs`, a reserved `u32`, seven
/// reserved `u64`.
#[repr(C)]
pub(super) struct LockArgs {
    pub(super) timeout_ms: c_uint,
    pub(super) reserved0: c_uint,
    pub(super) reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`, `CUcheckpointRestoreArgs` (no GPU remapping),
/// `CUcheckpointUnlockArgs`: 64 bytes, reserved, zero.
#[repr(C)]
pub(super) struct ReservedArgs {
    pub(super) reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<ReservedArgs>() == 64);

pub(super) type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> c_int;
pub(super) type ArgsFn = unsafe extern "C" fn(c_int, *mut ReservedArgs) -> c_int;
pub(super) type StateFn = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
pub(super) type ErrorNameFn = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

#[derive(Clone, Copy)]
pub(super) struct Checkpoint {
    pub(super) lock: LockFn,
    pub(super) checkpoint: ArgsFn,
    pub(super) restore: ArgsFn,
    pub(super) unlock: ArgsFn,
    pub(super) state: StateFn,
}

/// `cuGetErrorName` of `code`, or `CUresult N` when the driver has no name for it.
pub(super) fn name_of(error_name: Option<ErrorNameFn>, code: c_int) -> String {
    let Some(f) = error_name else {
        return format!("CUresult {code}");
    };
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: `cuGetErrorName(CUresult, const char**)` as cuda.h declares it; the out-pointer
    // is a local; any int is accepted (unknown codes give an error and no string).
    let got = unsafe { f(code, &mut p) };
    if got == 0 && !p.is_null() {
        // SAFETY: a non-null string from cuGetErrorName is static and NUL-terminated.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("CUresult {code}")
    }
}

impl Cuda {
    /// Loads the driver library (unless it is loaded already) and resolves `cuGetErrorName`
    /// and the five checkpoint entry points, each recorded; false when `Init` cannot go on.
    pub(super) fn load_entry_points(&mut self, c: &mut Calls<'_>) -> bool {
        if self.lib.is_none() {
            let mut errors = Vec::new();
            for name in LIBRARY_NAMES {
                // SAFETY: loading the CUDA driver library runs its initialisers, which have
                // no preconditions.
                match unsafe { libloading::Library::new(name) } {
                    Ok(lib) => {
                        self.lib = Some(lib);
                        c.note("dlopen", true, "OK", format!("{name} loaded"));
                        break;
                    }
                    Err(e) => errors.push(format!("{name}: {}", crate::facts::error_chain(&e))),
                }
            }
            let Some(lib) = &self.lib else {
                c.note("dlopen", false, "NOT_FOUND", errors.join("; "));
                return false;
            };
            // SAFETY: `cuGetErrorName` read with its cuda.h signature (int in, int out).
            self.error_name = unsafe { lib.get::<ErrorNameFn>(b"cuGetErrorName") }
                .ok()
                .map(|s| *s);
            c.error_name = self.error_name;
            let mut missing = Vec::new();
            // SAFETY: each entry point is read with its cuda.h signature (CUDA 12.8+).
            let found = unsafe {
                let get = |name: &[u8]| lib.get::<unsafe extern "C" fn()>(name).ok().map(|s| *s);
                let names: [&[u8]; 5] = [
                    b"cuCheckpointProcessLock",
                    b"cuCheckpointProcessCheckpoint",
                    b"cuCheckpointProcessRestore",
                    b"cuCheckpointProcessUnlock",
                    b"cuCheckpointProcessGetState",
                ];
                for n in names {
                    if get(n).is_none() {
                        missing.push(String::from_utf8_lossy(n).into_owned());
                    }
                }
                match (
                    lib.get::<LockFn>(b"cuCheckpointProcessLock"),
                    lib.get::<ArgsFn>(b"cuCheckpointProcessCheckpoint"),
                    lib.get::<ArgsFn>(b"cuCheckpointProcessRestore"),
                    lib.get::<ArgsFn>(b"cuCheckpointProcessUnlock"),
                    lib.get::<StateFn>(b"cuCheckpointProcessGetState"),
                ) {
                    (Ok(lock), Ok(checkpoint), Ok(restore), Ok(unlock), Ok(state)) => {
                        Some(Checkpoint {
                            lock: *lock,
                            checkpoint: *checkpoint,
                            restore: *restore,
                            unlock: *unlock,
                            state: *state,
                        })
                    }
                    _ => None,
                }
            };
            self.checkpoint = found;
            if missing.is_empty() {
                c.note(
                    "dlsym",
                    true,
                    "OK",
                    "the five cuCheckpointProcess* entry points",
                );
            } else {
                c.note(
                    "dlsym",
                    false,
                    "MISSING",
                    format!("missing: {}", missing.join(", ")),
                );
                return false;
            }
        }
        true
    }
}
