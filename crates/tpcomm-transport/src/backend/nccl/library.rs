//! libnccl, loaded at run time: the NCCL types tpcomm declares (unique id, handles, the
//! C signatures of the functions it calls), every function resolved once into
//! [`NcclLibrary`], and every `ncclResult_t` checked into [`TransportError::Nccl`].

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::sync::OnceLock;

use crate::device::{NcclDataType, NcclRedOp};
use crate::error::{Op, Result, TransportError};

/// `ncclSuccess`. (`ncclInProgress` only comes from non-blocking communicators; this module
/// creates blocking ones, so it would be reported as an error like any other code.)
pub(super) const NCCL_SUCCESS: c_int = 0;
/// `NCCL_SUSPEND_MEM`, bit 0 of `ncclCommSuspend`'s flags: release the GPU memory.
pub(super) const NCCL_SUSPEND_MEM: c_int = 1;
/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;
const _: () = assert!(std::mem::size_of::<UniqueId>() == UNIQUE_ID_BYTES);

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UniqueId {
    pub(super) internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclComm_t`: an opaque pointer owned by libnccl.
pub(super) type CommHandle = *mut c_void;
/// `cudaStream_t`, the same pointer as the driver's `CUstream`.
pub(super) type StreamHandle = *mut c_void;

/// Environment variable naming the NCCL library to load instead of the default names.
pub const NCCL_LIBRARY_ENV: &str = "TPCOMM_NCCL_LIBRARY";

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(CommHandle) -> *const c_char;
type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut CommHandle, c_int, UniqueId, c_int) -> c_int;
type CommFn = unsafe extern "C" fn(CommHandle) -> c_int;
type CommGetAsyncErrorFn = unsafe extern "C" fn(CommHandle, *mut c_int) -> c_int;
type CommSuspendFn = unsafe extern "C" fn(CommHandle, c_int) -> c_int;
pub(super) type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    NcclDataType,
    NcclRedOp,
    CommHandle,
    StreamHandle,
) -> c_int;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    NcclDataType,
    CommHandle,
    StreamHandle,
) -> c_int;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    NcclDataType,
    c_int,
    CommHandle,
    StreamHandle,
) -> c_int;

/// libnccl, loaded once per process, with every function this module calls resolved.
///
/// The function pointers stay valid for the life of the process: the library is kept in a
/// `static` and never unloaded.
pub struct NcclLibrary {
    _lib: libloading::Library,
    pub(super) path: String,
    pub(super) version: i32,
    pub(super) get_error_string: GetErrorStringFn,
    pub(super) get_last_error: GetLastErrorFn,
    pub(super) get_unique_id: GetUniqueIdFn,
    pub(super) comm_init_rank: CommInitRankFn,
    pub(super) comm_finalize: CommFn,
    pub(super) comm_destroy: CommFn,
    pub(super) comm_abort: CommFn,
    pub(super) comm_get_async_error: CommGetAsyncErrorFn,
    pub(super) all_reduce: ReduceFn,
    pub(super) reduce_scatter: ReduceFn,
    pub(super) all_gather: AllGatherFn,
    pub(super) broadcast: BroadcastFn,
    pub(super) comm_suspend: Option<CommSuspendFn>,
    pub(super) comm_resume: Option<CommFn>,
}

impl fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("suspend_resume", &self.supports_suspend())
            .finish()
    }
}

impl NcclLibrary {
    /// Loads libnccl (once per process; later calls return the same result) and resolves
    /// every function this backend calls. Calls nothing of CUDA.
    ///
    /// Fails with [`TransportError::LibraryMissing`] (`library: "libnccl"`) when no candidate
    /// loads, a required function is missing, or `ncclGetVersion` fails.
    pub fn load() -> Result<&'static NcclLibrary> {
        static LOADED: OnceLock<std::result::Result<NcclLibrary, String>> = OnceLock::new();
        LOADED
            .get_or_init(Self::try_load)
            .as_ref()
            .map_err(|detail| TransportError::LibraryMissing {
                library: "libnccl",
                detail: detail.clone(),
            })
    }

    /// Where the library was loaded from (the name passed to the loader).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `ncclGetVersion`: `major * 10000 + minor * 100 + patch` (e.g. 22903 for 2.29.3).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Whether the library has `ncclCommSuspend` and `ncclCommResume` (NCCL 2.29+).
    pub fn supports_suspend(&self) -> bool {
        self.comm_suspend.is_some() && self.comm_resume.is_some()
    }

    fn candidates() -> Vec<String> {
        if let Some(path) = std::env::var_os(NCCL_LIBRARY_ENV) {
            return vec![path.to_string_lossy().into_owned()];
        }
        // The names the NCCL packages (and the `nvidia-nccl-cu*` wheels) install. Not
        // cudarc's candidate list: that exists only when cudarc loads libraries at run time,
        // and the program may link cudarc instead.
        vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()]
    }

    fn try_load() -> std::result::Result<NcclLibrary, String> {
        let candidates = Self::candidates();
        let mut failures = Vec::new();
        let mut loaded = None;
        for name in &candidates {
            // SAFETY: loading libnccl runs its initialisers, which is how the library is meant
            // to be used; nothing else runs here.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => {
                    loaded = Some((lib, name.clone()));
                    break;
                }
                Err(e) => failures.push(format!("{name}: {}", error_chain(&e))),
            }
        }
        let Some((lib, path)) = loaded else {
            return Err(format!(
                "not installed or not on the loader path (tried {}; set {} to its path); \
                 first failure: {}",
                candidates.join(", "),
                NCCL_LIBRARY_ENV,
                failures.first().map_or("none", String::as_str)
            ));
        };
        let mut missing = Vec::new();
        macro_rules! resolve {
            ($name:literal, $ty:ty) => {{
                // SAFETY: `$ty` is the C signature of `$name` in nccl.h (NCCL 2.14+), with the
                // `ncclResult_t` return read as `c_int`; the pointer is copied out and stays
                // valid because the library is kept alive with it in `NcclLibrary`.
                match unsafe { lib.get::<$ty>($name.as_bytes()) } {
                    Ok(symbol) => Some(*symbol),
                    Err(_) => {
                        missing.push($name);
                        None
                    }
                }
            }};
        }
        let get_version = resolve!("ncclGetVersion", GetVersionFn);
        let get_error_string = resolve!("ncclGetErrorString", GetErrorStringFn);
        let get_last_error = resolve!("ncclGetLastError", GetLastErrorFn);
        let get_unique_id = resolve!("ncclGetUniqueId", GetUniqueIdFn);
        let comm_init_rank = resolve!("ncclCommInitRank", CommInitRankFn);
        let comm_finalize = resolve!("ncclCommFinalize", CommFn);
        let comm_destroy = resolve!("ncclCommDestroy", CommFn);
        let comm_abort = resolve!("ncclCommAbort", CommFn);
        let comm_get_async_error = resolve!("ncclCommGetAsyncError", CommGetAsyncErrorFn);
        let all_reduce = resolve!("ncclAllReduce", ReduceFn);
        let reduce_scatter = resolve!("ncclReduceScatter", ReduceFn);
        let all_gather = resolve!("ncclAllGather", AllGatherFn);
        let broadcast = resolve!("ncclBroadcast", BroadcastFn);
        let required = missing.clone();
        let comm_suspend = resolve!("ncclCommSuspend", CommSuspendFn);
        let comm_resume = resolve!("ncclCommResume", CommFn);
        let (
            Some(get_version),
            Some(get_error_string),
            Some(get_last_error),
            Some(get_unique_id),
            Some(comm_init_rank),
            Some(comm_finalize),
            Some(comm_destroy),
            Some(comm_abort),
            Some(comm_get_async_error),
            Some(all_reduce),
            Some(reduce_scatter),
            Some(all_gather),
            Some(broadcast),
        ) = (
            get_version,
            get_error_string,
            get_last_error,
            get_unique_id,
            comm_init_rank,
            comm_finalize,
            comm_destroy,
            comm_abort,
            comm_get_async_error,
            all_reduce,
            reduce_scatter,
            all_gather,
            broadcast,
        )
        else {
            return Err(format!(
                "{path} lacks {required:?}: NCCL 2.14 or newer is required"
            ));
        };
        let mut version = 0;
        // SAFETY: out-pointer to a local; the function was resolved with its C signature.
        let code = unsafe { get_version(&mut version) };
        if code != NCCL_SUCCESS {
            return Err(format!("{path}: ncclGetVersion failed with code {code}"));
        }
        Ok(NcclLibrary {
            _lib: lib,
            path,
            version,
            get_error_string,
            get_last_error,
            get_unique_id,
            comm_init_rank,
            comm_finalize,
            comm_destroy,
            comm_abort,
            comm_get_async_error,
            all_reduce,
            reduce_scatter,
            all_gather,
            broadcast,
            comm_suspend: comm_suspend.zip(comm_resume).map(|(s, _)| s),
            comm_resume: comm_suspend.zip(comm_resume).map(|(_, r)| r),
        })
    }

    /// The error of `call` that returned `code`, with the library's description of the code
    /// and, when `comm` is given and NCCL has one, its last error message.
    pub(super) fn error(
        &self,
        op: Op,
        call: &'static str,
        code: c_int,
        comm: CommHandle,
    ) -> TransportError {
        // SAFETY: ncclGetErrorString accepts any code and returns a static string (or null).
        let mut message = c_text(unsafe { (self.get_error_string)(code) })
            .unwrap_or_else(|| "no description from NCCL".into());
        // SAFETY: `comm` is null or a live communicator; NCCL returns a thread-local or
        // communicator-owned string, copied out at once.
        if let Some(last) = c_text(unsafe { (self.get_last_error)(comm) }) {
            if !last.is_empty() {
                message = format!("{message} ({last})");
            }
        }
        TransportError::Nccl {
            op,
            call,
            code,
            message,
        }
    }

    pub(super) fn check(
        &self,
        op: Op,
        call: &'static str,
        code: c_int,
        comm: CommHandle,
    ) -> Result<()> {
        if code == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(self.error(op, call, code, comm))
        }
    }
}

/// `e` and its sources, joined (libloading's own message is only "dlopen failed").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

fn c_text(p: *const c_char) -> Option<String> {
    // SAFETY: NCCL hands out NUL-terminated strings that live at least until the next call
    // on this thread; the text is copied at once.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
