//! The NCCL backend (feature `nccl`): a [`DeviceCommunicator`] over an NCCL communicator,
//! bootstrapped through any host [`Communicator`].
//!
//! Three levels, in cudarc's shape: the NCCL *types*, declared by tpcomm (unique id,
//! communicator handle, data types, reductions; not cudarc's `nccl` module, which would make
//! a program that links cudarc link libnccl too), a checked layer here (every function of libnccl this
//! module calls is resolved up front into [`NcclLibrary`], every `ncclResult_t` is checked and
//! becomes [`TransportError::Nccl`] with the call, the raw code, `ncclGetErrorString` and
//! `ncclGetLastError`), and the RAII type [`NcclCommunicator`] (finalized and destroyed on
//! drop).
//!
//! - **Loading, never a panic.** cudarc's NCCL functions resolve their symbol on first call
//!   and panic if it is missing, and its loader does not look for `libnccl.so.2` (the name the
//!   NCCL packages install, the `nvidia-nccl-cu*` wheels included) unless a `libnccl.so`
//!   development link exists (and when the program links cudarc instead of loading, cudarc
//!   has no loader at all). So this module loads libnccl itself with `libloading`: the path
//!   in `TPCOMM_NCCL_LIBRARY` when set, else `libnccl.so.2` and `libnccl.so`, then resolves
//!   every required function, and returns [`TransportError::LibraryMissing`] when the
//!   library or one of them is absent. The CUDA
//!   driver (used through cudarc's safe driver API for the context, the stream and the
//!   buffers) is probed the same way before its first call; a driver that finds no GPU, or an
//!   ordinal out of range, is [`TransportError::NoDevice`].
//! - **Raw codes.** The functions are called through pointer types that return `c_int`, not
//!   cudarc's `ncclResult_t` enum, so a code this build does not know (a newer NCCL) is kept as
//!   is instead of being an invalid enum value.
//! - **Bootstrap.** [`NcclCommunicator::new`] is collective over the host communicator: every
//!   rank sets up its device (and rank 0 asks for `ncclGetUniqueId`), all ranks all-gather one
//!   status byte so that a rank that failed (no library, no device) makes every rank return an
//!   error instead of leaving the others blocked in NCCL's bootstrap, then the 128-byte unique
//!   id is broadcast as host bytes and every rank calls `ncclCommInitRank`. A failure *inside*
//!   `ncclCommInitRank` on one rank can still leave the others waiting in NCCL.
//! - **Threads.** NCCL communicators must not be used by two threads at once: every call into
//!   NCCL takes the communicator's lock, and binds the device's (primary) context to the
//!   calling thread first.
//! - **Suspend / resume.** NCCL 2.29 added `ncclCommSuspend` (flag `NCCL_SUSPEND_MEM`: release
//!   the communicator's GPU memory) and `ncclCommResume`, both collective. They are looked up
//!   separately; [`NcclCommunicator::suspend`] and [`NcclCommunicator::resume`] return
//!   [`TransportError::Unsupported`] when the loaded library lacks them. While suspended,
//!   collectives are refused with [`TransportError::Suspended`]; repeating a transition is a
//!   no-op. A failed transition returns NCCL's error and leaves the recorded state unchanged.
//! - **Errors are enqueue errors.** NCCL collectives are asynchronous: a returned error means
//!   the call was not enqueued. Failures while running show up in
//!   [`DeviceCommunicator::synchronize`] (the stream's error, then `ncclCommGetAsyncError`).
//!   An asynchronous NCCL error aborts the communicator (`ncclCommAbort`): later calls fail
//!   with [`TransportError::Aborted`].
//! - **Bounded waits.** NCCL's kernels wait for their peers without end. With
//!   [`NcclCommunicator::with_timeout`], `synchronize`, `suspend` and the drain before the
//!   communicator is destroyed look at the stream until its work is done or the time runs
//!   out; then the communicator is aborted (its kernels stop) and the call returns
//!   [`TransportError::Unresponsive`]. Without it they block as `cuStreamSynchronize` does,
//!   and dropping a communicator whose peer never came blocks in `ncclCommFinalize`. What
//!   no timeout bounds: the host-side collective calls NCCL blocks in (`ncclCommInitRank`,
//!   `ncclCommSuspend`, `ncclCommResume`) when a peer never makes them.
//!
//! Requires NCCL 2.14 or newer (`ncclCommFinalize`, `ncclGetLastError`, bf16) and a CUDA
//! driver of CUDA 11.4 or newer.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DriverError};

use crate::communicator::Communicator;
use crate::device::{DeviceArgs, DeviceCommunicator, DeviceElement, NcclDataType, NcclRedOp};
use crate::error::{Op, Result, TransportError};

/// `ncclSuccess`. (`ncclInProgress` only comes from non-blocking communicators; this module
/// creates blocking ones, so it would be reported as an error like any other code.)
const NCCL_SUCCESS: c_int = 0;
/// `NCCL_SUSPEND_MEM`, bit 0 of `ncclCommSuspend`'s flags: release the GPU memory.
const NCCL_SUSPEND_MEM: c_int = 1;
/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;
const _: () = assert!(std::mem::size_of::<UniqueId>() == UNIQUE_ID_BYTES);

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclComm_t`: an opaque pointer owned by libnccl.
type CommHandle = *mut c_void;
/// `cudaStream_t`, the same pointer as the driver's `CUstream`.
type StreamHandle = *mut c_void;

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
type ReduceFn = unsafe extern "C" fn(
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
    path: String,
    version: i32,
    get_error_string: GetErrorStringFn,
    get_last_error: GetLastErrorFn,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_finalize: CommFn,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    comm_get_async_error: CommGetAsyncErrorFn,
    all_reduce: ReduceFn,
    reduce_scatter: ReduceFn,
    all_gather: AllGatherFn,
    broadcast: BroadcastFn,
    comm_suspend: Option<CommSuspendFn>,
    comm_resume: Option<CommFn>,
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
    fn error(&self, op: Op, call: &'static str, code: c_int, comm: CommHandle) -> TransportError {
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

    fn check(&self, op: Op, call: &'static str, code: c_int, comm: CommHandle) -> Result<()> {
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

/// CUDA driver functions cudarc's safe API calls for what this module does (context, stream,
/// events, synchronization), checked before the first of them is called.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
];

fn load_driver() -> Result<()> {
    fn try_load() -> std::result::Result<(), String> {
        let missing = super::cuda_driver::missing_symbols(DRIVER_SYMBOLS)?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the CUDA driver lacks {missing:?}: it is older than CUDA 11.4"
            ))
        }
    }
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(try_load)
        .clone()
        .map_err(|detail| TransportError::LibraryMissing {
            library: "libcuda",
            detail,
        })
}

fn cuda_error(op: Op, call: &'static str, e: DriverError) -> TransportError {
    let name = e.error_name().map_or_else(
        |_| format!("{:?}", e.0),
        |n| n.to_string_lossy().into_owned(),
    );
    let text = e.error_string().map_or_else(
        |_| "no description from the driver".to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    TransportError::Cuda {
        op,
        call,
        code: e.0 as i32,
        message: format!("{name}: {text}"),
    }
}

/// The device of `ordinal`, after the libraries were probed: its context and a new stream.
fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    load_driver()?;
    cudarc::driver::result::init().map_err(|e| {
        TransportError::NoDevice(format!(
            "cuInit failed: {} (no GPU, or the driver cannot reach it)",
            cuda_error(Op::Setup, "cuInit", e)
        ))
    })?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| cuda_error(Op::Setup, "cuDeviceGetCount", e))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(TransportError::NoDevice(format!(
            "device ordinal {ordinal} requested, the driver sees {count} device(s)"
        )));
    }
    CudaContext::new(ordinal).map_err(|e| cuda_error(Op::Setup, "CudaContext::new", e))
}

/// The lifecycle of an [`NcclCommunicator`]; the lock around it serializes NCCL calls.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Lifecycle {
    Active,
    Suspended,
    /// `ncclCommAbort` was called (a bounded wait ran out, or NCCL reported an asynchronous
    /// error): the handle is gone and every later call fails with this reason.
    Aborted(String),
}

/// The longest pause between two looks at the stream in a bounded wait.
const MAX_POLL_PAUSE: Duration = Duration::from_micros(200);

/// Calls `done` until it says `true` (then `Ok(true)`), fails, or `timeout` has passed since
/// the first call (then `Ok(false)`), pausing between calls from 1 us, doubled each time up
/// to [`MAX_POLL_PAUSE`].
fn poll_until(timeout: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<bool> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(1);
    loop {
        if done()? {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_POLL_PAUSE);
    }
}

/// An NCCL communicator of one rank on one device, running [`DeviceCommunicator`]
/// collectives on its stream.
///
/// Create it with [`new`](Self::new) (a new stream on the device) or
/// [`with_stream`](Self::with_stream) (the caller's stream), collectively over a host
/// communicator. Dropping it finalizes and destroys the NCCL communicator (failures are
/// logged with `tracing::warn`); with a [timeout](Self::with_timeout) it first drains the
/// stream within it, and aborts the communicator instead when that runs out. See the
/// [module docs](self).
///
/// ```no_run
/// use cudarc::driver::CudaContext;
/// use tpcomm_transport::{DeviceCommunicator, LocalGroup, NcclCommunicator, ReduceOp};
///
/// let host = LocalGroup::new(1).communicators()?.remove(0);
/// let nccl = NcclCommunicator::new(&host, 0)?;
/// let mut x = nccl.stream().clone_htod(&[1.0f32, 2.0, 3.0]).expect("copy");
/// nccl.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
/// nccl.synchronize()?;
/// # Ok::<(), tpcomm_transport::TransportError>(())
/// ```
pub struct NcclCommunicator {
    comm: CommHandle,
    lib: &'static NcclLibrary,
    rank: usize,
    size: usize,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<Lifecycle>,
    /// The bound on waits for the stream ([`with_timeout`](NcclCommunicator::with_timeout)).
    timeout: Option<Duration>,
}

// SAFETY: the NCCL communicator handle may be used from any thread, one at a time; every use
// of `comm` (collectives, suspend/resume, destroy) holds `state`'s lock (or `&mut self` in
// `Drop`), and binds the device context to the calling thread first.
unsafe impl Send for NcclCommunicator {}
// SAFETY: see `Send`: shared access reaches `comm` only under the lock.
unsafe impl Sync for NcclCommunicator {}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.ordinal)
            .field("library", self.lib)
            .finish()
    }
}

impl NcclCommunicator {
    /// Collective over `host`: an NCCL communicator with `host`'s ranks, this rank on device
    /// `device_ordinal`, running collectives on a new stream of that device.
    ///
    /// Fails on every rank when any rank could not load libnccl or libcuda
    /// ([`TransportError::LibraryMissing`]), find its device ([`TransportError::NoDevice`]),
    /// or (rank 0) create the unique id: the failing rank returns its own error, the others
    /// [`TransportError::Setup`] naming the failing ranks. Host communicator errors are
    /// returned as they are; an NCCL failure is [`TransportError::Nccl`]. Never panics.
    pub fn new<C: Communicator>(host: &C, device_ordinal: usize) -> Result<Self> {
        Self::bootstrap(host, || {
            let ctx = open_device(device_ordinal)?;
            let stream = ctx
                .new_stream()
                .map_err(|e| cuda_error(Op::Setup, "cuStreamCreate", e))?;
            Ok(stream)
        })
    }

    /// [`new`](Self::new) with collectives enqueued on `stream` (and its device); for
    /// collectives ordered with the caller's kernels without events.
    pub fn with_stream<C: Communicator>(host: &C, stream: Arc<CudaStream>) -> Result<Self> {
        Self::bootstrap(host, || {
            // The stream exists, so the driver is loaded; probe libnccl next, as `new` does.
            Ok(stream)
        })
    }

    fn bootstrap<C: Communicator>(
        host: &C,
        local: impl FnOnce() -> Result<Arc<CudaStream>>,
    ) -> Result<Self> {
        let (rank, size) = (host.rank(), host.size());
        let _span = tracing::debug_span!("nccl_bootstrap", rank, size).entered();
        let prepared = NcclLibrary::load().and_then(|lib| {
            let stream = local()?;
            let id = if rank == 0 {
                stream
                    .context()
                    .bind_to_thread()
                    .map_err(|e| cuda_error(Op::Setup, "cuCtxSetCurrent", e))?;
                let mut id = UniqueId { internal: [0; 128] };
                // SAFETY: out-pointer to a local of the right type.
                let code = unsafe { (lib.get_unique_id)(&mut id) };
                lib.check(Op::Setup, "ncclGetUniqueId", code, std::ptr::null_mut())?;
                Some(id)
            } else {
                None
            };
            Ok((lib, stream, id))
        });
        // Every rank learns whether every rank is ready before anyone enters NCCL.
        let mut ready = vec![0u8; size];
        host.all_gather(&[u8::from(prepared.is_ok())], &mut ready)?;
        let failed: Vec<usize> = (0..size).filter(|&r| ready[r] == 0).collect();
        let (lib, stream, id) = prepared?;
        if !failed.is_empty() {
            return Err(TransportError::Setup(format!(
                "NCCL communicator not created: ranks {failed:?} could not set up NCCL or \
                 their device (see their errors)"
            )));
        }
        let mut id_bytes = [0u8; UNIQUE_ID_BYTES];
        if let Some(id) = &id {
            for (b, &c) in id_bytes.iter_mut().zip(id.internal.iter()) {
                *b = c as u8;
            }
        }
        host.broadcast(0, &mut id_bytes)?;
        let mut id = UniqueId { internal: [0; 128] };
        for (c, &b) in id.internal.iter_mut().zip(id_bytes.iter()) {
            *c = b as c_char;
        }
        let too_large = |what: &str, v: usize| {
            TransportError::Setup(format!("{what} {v} does not fit NCCL's int"))
        };
        let nranks = c_int::try_from(size).map_err(|_| too_large("size", size))?;
        let my_rank = c_int::try_from(rank).map_err(|_| too_large("rank", rank))?;
        let ctx = stream.context().clone();
        ctx.bind_to_thread()
            .map_err(|e| cuda_error(Op::Setup, "cuCtxSetCurrent", e))?;
        let mut comm: CommHandle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `id` is the id rank 0 created, the same on every
        // rank; rank and size are in range and the device's context is current.
        let code = unsafe { (lib.comm_init_rank)(&mut comm, nranks, id, my_rank) };
        lib.check(Op::Setup, "ncclCommInitRank", code, std::ptr::null_mut())?;
        tracing::debug!(
            rank,
            size,
            device = ctx.ordinal(),
            nccl = lib.version,
            "NCCL communicator created"
        );
        Ok(Self {
            comm,
            lib,
            rank,
            size,
            ordinal: ctx.ordinal(),
            ctx,
            stream,
            state: Mutex::new(Lifecycle::Active),
            timeout: None,
        })
    }

    /// Bounds every wait for this communicator's stream by `timeout`: `synchronize`,
    /// `suspend`, and the drain before the communicator is destroyed. NCCL's kernels wait
    /// for their peers without end, so without a bound a peer that never launches its part
    /// keeps `synchronize` waiting for good, and `Drop` too (in `ncclCommFinalize`).
    ///
    /// When a bounded wait runs out, the communicator is aborted (`ncclCommAbort`, which
    /// also stops its kernels) and the call returns [`TransportError::Unresponsive`], naming
    /// every peer as unchecked (NCCL does not say which one is missing); an asynchronous
    /// NCCL error seen while waiting aborts it too. Every later call then fails with
    /// [`TransportError::Aborted`], and dropping it frees nothing more. Without a timeout a
    /// wait is `cuStreamSynchronize`. Not collective: each rank sets its own. The bound
    /// covers all the work on the stream (on a caller's stream, the caller's own kernels
    /// too), and a zero timeout aborts a communicator with any work in flight at its first
    /// wait. The lock is held while waiting, as it is in `cuStreamSynchronize`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The bound set by [`with_timeout`](Self::with_timeout), if any.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Whether the communicator was aborted (see [`with_timeout`](Self::with_timeout)).
    pub fn is_aborted(&self) -> bool {
        matches!(*self.lock(), Lifecycle::Aborted(_))
    }

    /// Waits for the work enqueued on the stream (called with the lock held and the context
    /// bound): `cuStreamSynchronize` without a timeout; with one, looks at the stream and at
    /// NCCL's asynchronous error until the work is done, and aborts the communicator when
    /// the time runs out or NCCL reports an error.
    fn drain(&self, state: &mut Lifecycle, op: Op) -> Result<()> {
        let Some(timeout) = self.timeout else {
            return self
                .stream
                .synchronize()
                .map_err(|e| cuda_error(op, "cuStreamSynchronize", e));
        };
        let stream = self.stream.cu_stream();
        let finished = poll_until(timeout, || {
            // SAFETY: `stream` is this communicator's stream, kept alive by `self.stream`;
            // the context is bound.
            match unsafe { cudarc::driver::sys::cuStreamQuery(stream) } {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(true),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {
                    self.async_error(op).map(|()| false)
                }
                code => Err(cuda_error(op, "cuStreamQuery", DriverError(code))),
            }
        });
        match finished {
            Ok(true) => Ok(()),
            Ok(false) => {
                let error = TransportError::Unresponsive {
                    op,
                    rank: self.rank,
                    waited: timeout,
                    gone: Vec::new(),
                    unchecked: (0..self.size).filter(|&r| r != self.rank).collect(),
                };
                self.abort(state, error.to_string());
                Err(error)
            }
            Err(e) => {
                if matches!(e, TransportError::Nccl { .. }) {
                    self.abort(state, e.to_string());
                }
                Err(e)
            }
        }
    }

    /// NCCL's asynchronous error of the communicator (called with the lock held).
    fn async_error(&self, op: Op) -> Result<()> {
        let mut async_error = NCCL_SUCCESS;
        // SAFETY: out-pointer to a local; `comm` is live under the lock.
        let code = unsafe { (self.lib.comm_get_async_error)(self.comm, &mut async_error) };
        self.lib
            .check(op, "ncclCommGetAsyncError", code, self.comm)?;
        self.lib
            .check(op, "asynchronous NCCL error", async_error, self.comm)
    }

    /// Aborts the communicator (`ncclCommAbort`: its kernels stop, its resources are freed,
    /// the handle is gone); `state` records why, for every later call.
    fn abort(&self, state: &mut Lifecycle, reason: String) {
        tracing::warn!(rank = self.rank, %reason, "aborting the NCCL communicator");
        // SAFETY: `comm` is live (the state is not Aborted: every path that reaches here
        // checked it under the lock, which the caller holds) and is never used again: the
        // state says Aborted from now on, and `Drop` frees nothing of an aborted one.
        let code = unsafe { (self.lib.comm_abort)(self.comm) };
        if let Err(e) = self
            .lib
            .check(Op::Setup, "ncclCommAbort", code, std::ptr::null_mut())
        {
            tracing::warn!(rank = self.rank, error = %e, "ncclCommAbort failed");
        }
        *state = Lifecycle::Aborted(reason);
    }

    /// The error of a call on an aborted communicator.
    fn aborted(&self, op: Op, reason: &str) -> TransportError {
        TransportError::Aborted {
            op,
            rank: self.rank,
            by: self.rank,
            reason: format!("this NCCL communicator was aborted: {reason}"),
        }
    }

    /// The loaded NCCL library (path, version, whether it can suspend).
    pub fn library(&self) -> &'static NcclLibrary {
        self.lib
    }

    /// Whether the communicator is suspended.
    pub fn is_suspended(&self) -> bool {
        *self.lock() == Lifecycle::Suspended
    }

    /// Collective: releases the communicator's GPU memory (`ncclCommSuspend` with
    /// `NCCL_SUSPEND_MEM`) after waiting for the work enqueued on its stream. A no-op when
    /// already suspended. [`TransportError::Unsupported`] when the library is older than
    /// 2.29; NCCL's failure as [`TransportError::Nccl`].
    pub fn suspend(&self) -> Result<()> {
        let _span = tracing::debug_span!("nccl_suspend", rank = self.rank).entered();
        let mut state = self.lock();
        match &*state {
            Lifecycle::Suspended => return Ok(()),
            Lifecycle::Aborted(reason) => return Err(self.aborted(Op::Suspend, reason)),
            Lifecycle::Active => {}
        }
        let suspend = self
            .lib
            .comm_suspend
            .ok_or_else(|| self.unsupported(Op::Suspend))?;
        self.bind(Op::Suspend)?;
        self.drain(&mut state, Op::Suspend)?;
        // SAFETY: `comm` is live and this thread holds the lock.
        let code = unsafe { suspend(self.comm, NCCL_SUSPEND_MEM) };
        self.lib
            .check(Op::Suspend, "ncclCommSuspend", code, self.comm)?;
        *state = Lifecycle::Suspended;
        tracing::debug!(rank = self.rank, "NCCL communicator suspended");
        Ok(())
    }

    /// Collective: restores what [`suspend`](Self::suspend) released (`ncclCommResume`). A
    /// no-op when active. Errors as for `suspend`.
    pub fn resume(&self) -> Result<()> {
        let _span = tracing::debug_span!("nccl_resume", rank = self.rank).entered();
        let mut state = self.lock();
        match &*state {
            Lifecycle::Active => return Ok(()),
            Lifecycle::Aborted(reason) => return Err(self.aborted(Op::Resume, reason)),
            Lifecycle::Suspended => {}
        }
        let resume = self
            .lib
            .comm_resume
            .ok_or_else(|| self.unsupported(Op::Resume))?;
        self.bind(Op::Resume)?;
        // SAFETY: `comm` is live and this thread holds the lock.
        let code = unsafe { resume(self.comm) };
        self.lib
            .check(Op::Resume, "ncclCommResume", code, self.comm)?;
        *state = Lifecycle::Active;
        tracing::debug!(rank = self.rank, "NCCL communicator resumed");
        Ok(())
    }

    fn unsupported(&self, op: Op) -> TransportError {
        TransportError::Unsupported {
            op,
            reason: format!(
                "NCCL {} ({}) has no ncclCommSuspend/ncclCommResume (NCCL 2.29 or newer has)",
                self.lib.version, self.lib.path
            ),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lifecycle> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bind(&self, op: Op) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error(op, "cuCtxSetCurrent", e))
    }

    /// Takes the lock for a collective: refused while suspended or after an abort; binds
    /// the context.
    fn enter(&self, op: Op) -> Result<MutexGuard<'_, Lifecycle>> {
        let state = self.lock();
        match &*state {
            Lifecycle::Suspended => {
                return Err(TransportError::Suspended {
                    op,
                    rank: self.rank,
                })
            }
            Lifecycle::Aborted(reason) => return Err(self.aborted(op, reason)),
            Lifecycle::Active => {}
        }
        self.bind(op)?;
        Ok(state)
    }

    fn cu_stream(&self) -> StreamHandle {
        self.stream.cu_stream().cast()
    }

    /// Enqueues one reduction (`ncclAllReduce` or `ncclReduceScatter`).
    fn reduce<T: DeviceElement>(
        &self,
        op: Op,
        call: &'static str,
        f: ReduceFn,
        mut args: DeviceArgs<'_, T>,
    ) -> Result<()> {
        args.group().expect(op, self.rank(), self.size())?;
        let _state = self.enter(op)?;
        let (count, reduce) = (args.count(), args.reduce().nccl());
        let (send, recv) = args.buffers();
        let (dst, _record_dst) = recv.device_ptr_mut(&self.stream);
        let (src, _record_src) = match send {
            Some(send) => {
                let (src, record) = send.device_ptr(&self.stream);
                (src, Some(record))
            }
            None => (dst, None),
        };
        // SAFETY: `src` and `dst` are device pointers of live buffers on this communicator's
        // device, checked to hold the element counts NCCL derives from `count` (see
        // `DeviceArgs`); `T::NCCL_TYPE` has `T`'s size; the buffers are borrowed (and cudarc
        // records their use on the stream) until the call is enqueued, and cudarc's events
        // keep later accesses ordered after it; `comm` is live under the lock.
        let code = unsafe {
            f(
                src as usize as *const c_void,
                dst as usize as *mut c_void,
                count,
                T::NCCL_TYPE,
                reduce,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib.check(op, call, code, self.comm)
    }
}

impl DeviceCommunicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn backend_name(&self) -> &'static str {
        "nccl"
    }

    fn synchronize(&self) -> Result<()> {
        let mut state = self.lock();
        if let Lifecycle::Aborted(reason) = &*state {
            return Err(self.aborted(Op::Barrier, reason));
        }
        self.bind(Op::Barrier)?;
        self.drain(&mut state, Op::Barrier)?;
        let checked = self.async_error(Op::Barrier);
        if let Err(e @ TransportError::Nccl { .. }) = &checked {
            self.abort(&mut state, e.to_string());
        }
        checked
    }

    fn raw_all_reduce<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()> {
        self.reduce(Op::AllReduce, "ncclAllReduce", self.lib.all_reduce, args)
    }

    fn raw_reduce_scatter<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()> {
        self.reduce(
            Op::ReduceScatter,
            "ncclReduceScatter",
            self.lib.reduce_scatter,
            args,
        )
    }

    fn raw_all_gather<T: DeviceElement>(&self, mut args: DeviceArgs<'_, T>) -> Result<()> {
        args.group()
            .expect(Op::AllGather, self.rank(), self.size())?;
        let _state = self.enter(Op::AllGather)?;
        let count = args.count();
        let (send, recv) = args.buffers();
        let Some(send) = send else {
            return Err(TransportError::Setup(
                "all_gather needs a send buffer (internal error)".into(),
            ));
        };
        let (dst, _record_dst) = recv.device_ptr_mut(&self.stream);
        let (src, _record_src) = send.device_ptr(&self.stream);
        // SAFETY: as in `reduce`: live buffers on this device, `send` holds `count` and
        // `recv` `size * count` elements of `T` (checked), `comm` is live under the lock.
        let code = unsafe {
            (self.lib.all_gather)(
                src as usize as *const c_void,
                dst as usize as *mut c_void,
                count,
                T::NCCL_TYPE,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib
            .check(Op::AllGather, "ncclAllGather", code, self.comm)
    }

    fn raw_broadcast<T: DeviceElement>(&self, mut args: DeviceArgs<'_, T>) -> Result<()> {
        args.group()
            .expect(Op::Broadcast, self.rank(), self.size())?;
        let _state = self.enter(Op::Broadcast)?;
        let (count, root) = (args.count(), args.root());
        let root = c_int::try_from(root)
            .map_err(|_| TransportError::Setup(format!("root {root} does not fit NCCL's int")))?;
        let (_, buf) = args.buffers();
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: as in `reduce`: a live buffer of `count` elements of `T` on this device,
        // used in place (NCCL allows send == recv); `root` is a rank; `comm` is live.
        let code = unsafe {
            (self.lib.broadcast)(
                ptr as usize as *const c_void,
                ptr as usize as *mut c_void,
                count,
                T::NCCL_TYPE,
                root,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib
            .check(Op::Broadcast, "ncclBroadcast", code, self.comm)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let rank = self.rank;
        let mut state = std::mem::replace(&mut *self.lock(), Lifecycle::Active);
        if matches!(state, Lifecycle::Aborted(_)) {
            // `ncclCommAbort` freed it already.
            return;
        }
        if let Err(e) = self.bind(Op::Setup) {
            tracing::warn!(rank, error = %e, "cannot bind the device before destroying the NCCL communicator");
        }
        // Finalizing waits for the enqueued work, which a missing peer never lets finish:
        // with a timeout, drain first and abort instead when it runs out.
        if self.timeout.is_some() {
            if let Err(e) = self.drain(&mut state, Op::Setup) {
                tracing::warn!(rank, error = %e, "NCCL communicator dropped with unfinished work");
                if !matches!(state, Lifecycle::Aborted(_)) {
                    self.abort(&mut state, e.to_string());
                }
                return;
            }
        }
        // SAFETY: `comm` is live and used by nobody else (`&mut self`); it is finalized then
        // destroyed once, and never used afterwards.
        let finalized = unsafe { (self.lib.comm_finalize)(self.comm) };
        if let Err(e) = self
            .lib
            .check(Op::Setup, "ncclCommFinalize", finalized, self.comm)
        {
            tracing::warn!(rank, error = %e, "NCCL communicator not finalized");
        }
        // SAFETY: as above; destroy frees the communicator even after a failed finalize.
        let destroyed = unsafe { (self.lib.comm_destroy)(self.comm) };
        if let Err(e) = self.lib.check(
            Op::Setup,
            "ncclCommDestroy",
            destroyed,
            std::ptr::null_mut(),
        ) {
            tracing::warn!(rank, error = %e, "NCCL communicator not destroyed");
        }
    }
}

#[cfg(test)]
mod tests {
    //! The bounded wait's loop, without a GPU.

    use std::cell::Cell;

    use super::*;

    #[test]
    fn a_wait_whose_work_finishes_returns_at_the_look_that_sees_it() {
        let looks = Cell::new(0);
        let done = poll_until(Duration::from_secs(60), || {
            looks.set(looks.get() + 1);
            Ok(looks.get() == 3)
        });
        assert!(done.unwrap());
        assert_eq!(looks.get(), 3);
    }

    #[test]
    fn a_wait_whose_work_never_finishes_ends_after_the_timeout() {
        let looks = Cell::new(0u32);
        let start = Instant::now();
        let done = poll_until(Duration::from_millis(200), || {
            looks.set(looks.get() + 1);
            Ok(false)
        });
        assert!(!done.unwrap());
        assert!(start.elapsed() >= Duration::from_millis(200));
        assert!(looks.get() > 1, "looked {} times", looks.get());
    }

    #[test]
    fn a_failed_look_ends_the_wait_with_its_error() {
        let looks = Cell::new(0);
        let done = poll_until(Duration::from_secs(60), || {
            looks.set(looks.get() + 1);
            if looks.get() == 2 {
                Err(TransportError::Setup("the look failed".into()))
            } else {
                Ok(false)
            }
        });
        assert!(matches!(done, Err(TransportError::Setup(m)) if m == "the look failed"));
        assert_eq!(looks.get(), 2);
    }

    #[test]
    fn a_zero_timeout_looks_once() {
        let looks = Cell::new(0);
        let done = poll_until(Duration::ZERO, || {
            looks.set(looks.get() + 1);
            Ok(false)
        });
        assert!(!done.unwrap());
        assert_eq!(looks.get(), 1);
    }
}
