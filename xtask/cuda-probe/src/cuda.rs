//! The child's side on the real driver: every operation of [`Op`] as CUDA driver calls
//! (cudarc's raw `driver::sys` bindings; the `cuCheckpointProcess*` entry points and
//! `cuGetErrorName` resolved with `libloading`, since they take and return plain `int`s)
//! and system calls (`rustix`), each call recorded with its result code and name.
//!
//! A call that fails ends its operation (what depends on it is not attempted); nothing here
//! panics on a driver failure. cudarc resolves each symbol on its first call and panics when
//! the library or a symbol is missing: the library is loaded here first (an `Init` without
//! it fails cleanly) and the child runs every operation under `catch_unwind`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use cudarc::driver::sys;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

use crate::facts::{bytes, check_pattern, hex, pattern, unhex};
use crate::protocol::{Call, Op, Reply};

/// Bytes written and checked in every allocation (its start).
pub(crate) const CHECK_BYTES: usize = 1 << 20;

/// The names cudarc also tries for the driver library.
const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// `CUcheckpointLockArgs` (CUDA 12.8 to 13.x): `timeoutMs`, a reserved `u32`, seven
/// reserved `u64`.
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`, `CUcheckpointRestoreArgs` (no GPU remapping),
/// `CUcheckpointUnlockArgs`: 64 bytes, reserved, zero.
#[repr(C)]
struct ReservedArgs {
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<ReservedArgs>() == 64);

type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> c_int;
type ArgsFn = unsafe extern "C" fn(c_int, *mut ReservedArgs) -> c_int;
type StateFn = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type ErrorNameFn = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

#[derive(Clone, Copy)]
struct Checkpoint {
    lock: LockFn,
    checkpoint: ArgsFn,
    restore: ArgsFn,
    unlock: ArgsFn,
    state: StateFn,
}

/// One VMM mapping slot: a reservation kept for the process's life, and what is mapped in
/// it now.
#[derive(Default)]
struct Slot {
    reservation: Option<(sys::CUdeviceptr, usize)>,
    handle: Option<sys::CUmemGenericAllocationHandle>,
    mapped: bool,
    /// Descriptors this slot holds: the exported ones (own memory) or the fetched one
    /// (an import).
    fds: Vec<OwnedFd>,
}

/// The child's driver state.
pub(crate) struct Cuda {
    lib: Option<libloading::Library>,
    error_name: Option<ErrorNameFn>,
    checkpoint: Option<Checkpoint>,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    /// Retains of the primary context this process holds.
    retains: u32,
    legacy: Option<(sys::CUdeviceptr, usize)>,
    last_handle: Option<Vec<u8>>,
    peer_legacy: Option<sys::CUdeviceptr>,
    own: Slot,
    import: Slot,
    /// The second reservation of a same-process import.
    second: Slot,
    /// The socket to the peer process the parent gave (descriptor passing).
    peer_socket: Option<OwnedFd>,
}

impl Default for Cuda {
    fn default() -> Self {
        Self {
            lib: None,
            error_name: None,
            checkpoint: None,
            dev: 0,
            ctx: std::ptr::null_mut(),
            retains: 0,
            legacy: None,
            last_handle: None,
            peer_legacy: None,
            own: Slot::default(),
            import: Slot::default(),
            second: Slot::default(),
            peer_socket: None,
        }
    }
}

/// The calls of one operation, recorded as they are made.
struct Calls<'a> {
    calls: &'a mut Vec<Call>,
    error_name: Option<ErrorNameFn>,
}

impl Calls<'_> {
    /// Records a driver call's result; whether it succeeded.
    fn cu(&mut self, call: &str, r: sys::CUresult, detail: impl Into<String>) -> bool {
        // cudarc's `CUresult` is a fieldless `repr(u32)` enum; its value is the raw code.
        let code = r as u32 as c_int;
        self.raw(call, code, detail)
    }

    /// Records a driver call's raw result code; whether it is `CUDA_SUCCESS`.
    fn raw(&mut self, call: &str, code: c_int, detail: impl Into<String>) -> bool {
        let ok = code == 0;
        self.calls.push(Call {
            call: call.into(),
            code: Some(code.into()),
            name: name_of(self.error_name, code),
            ok,
            detail: detail.into(),
        });
        ok
    }

    /// Records a system call's result; whether it succeeded.
    fn sys<T>(&mut self, call: &str, r: &rustix::io::Result<T>, detail: impl Into<String>) -> bool {
        let (code, name) = match r {
            Ok(_) => (0, "OK".to_string()),
            Err(e) => (i64::from(e.raw_os_error()), errno_name(*e)),
        };
        let mut detail = detail.into();
        if let Err(e) = r {
            detail = format!("{detail} ({e})");
        }
        self.calls.push(Call {
            call: call.into(),
            code: Some(code),
            name,
            ok: r.is_ok(),
            detail,
        });
        r.is_ok()
    }

    fn check(&mut self, what: &str, result: Result<String, String>) -> bool {
        let ok = result.is_ok();
        let detail = match result {
            Ok(d) | Err(d) => d,
        };
        self.calls.push(Call::check(what, ok, detail));
        ok
    }

    fn note(&mut self, what: &str, ok: bool, name: &str, detail: impl Into<String>) -> bool {
        self.calls.push(Call::note(what, ok, name, detail));
        ok
    }
}

/// `cuGetErrorName` of `code`, or `CUresult N` when the driver has no name for it.
fn name_of(error_name: Option<ErrorNameFn>, code: c_int) -> String {
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

/// The symbolic name of an errno the probe may meet, else its number.
fn errno_name(e: rustix::io::Errno) -> String {
    use rustix::io::Errno;
    let known = [
        (Errno::PERM, "EPERM"),
        (Errno::NOENT, "ENOENT"),
        (Errno::SRCH, "ESRCH"),
        (Errno::BADF, "EBADF"),
        (Errno::ACCESS, "EACCES"),
        (Errno::INVAL, "EINVAL"),
        (Errno::NOSYS, "ENOSYS"),
        (Errno::MFILE, "EMFILE"),
        (Errno::NOMEM, "ENOMEM"),
    ];
    known.iter().find(|(k, _)| *k == e).map_or_else(
        || format!("errno {}", e.raw_os_error()),
        |(_, n)| n.to_string(),
    )
}

/// The allocation properties of every VMM allocation of the probe: pinned device memory on
/// device `dev`, shareable as a POSIX file descriptor.
fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers, enums whose zero value is valid, a pointer and
    // flag bytes: all-zero is its documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

fn access_desc(dev: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// What a descriptor is: `readlink /proc/self/fd/N` and `fstat`.
fn fd_facts(fd: impl AsFd, values: &mut std::collections::BTreeMap<String, String>) -> String {
    let raw = fd.as_fd().as_raw_fd();
    let link = std::fs::read_link(format!("/proc/self/fd/{raw}"))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|e| format!("(readlink failed: {e})"));
    values.insert("fd_link".into(), link.clone());
    match rustix::fs::fstat(fd) {
        Ok(st) => {
            let kind = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
                rustix::fs::FileType::CharacterDevice => "character device",
                rustix::fs::FileType::BlockDevice => "block device",
                rustix::fs::FileType::RegularFile => "regular file",
                rustix::fs::FileType::Directory => "directory",
                rustix::fs::FileType::Fifo => "fifo",
                rustix::fs::FileType::Socket => "socket",
                rustix::fs::FileType::Symlink => "symlink",
                rustix::fs::FileType::Unknown => "unknown type",
            };
            let rdev = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
            let dev = (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
            values.insert("fd_type".into(), kind.into());
            values.insert("fd_mode".into(), format!("{:o}", st.st_mode));
            values.insert("fd_rdev".into(), format!("{}:{}", rdev.0, rdev.1));
            values.insert("fd_dev".into(), format!("{}:{}", dev.0, dev.1));
            values.insert("fd_ino".into(), st.st_ino.to_string());
            format!(
                "fd {raw} -> {link}: {kind} (st_mode {:o}), st_rdev {}:{}, st_dev {}:{}, st_ino {}",
                st.st_mode, rdev.0, rdev.1, dev.0, dev.1, st.st_ino
            )
        }
        Err(e) => format!("fd {raw} -> {link}: fstat failed: {e}"),
    }
}

impl Cuda {
    /// The driver state with the socket to the peer (from the parent, see
    /// [`crate::protocol::PEER_SOCKET_VAR`]).
    pub(crate) fn with_peer_socket(peer_socket: Option<OwnedFd>) -> Self {
        Self {
            peer_socket,
            ..Self::default()
        }
    }

    /// Runs one operation; its calls and values.
    pub(crate) fn run(&mut self, op: &Op) -> Reply {
        let mut reply = Reply::default();
        let mut values = std::collections::BTreeMap::new();
        let mut calls = Calls {
            calls: &mut reply.calls,
            error_name: self.error_name,
        };
        if self.lib.is_none() && !matches!(op, Op::Init) {
            calls.note(
                "init",
                false,
                "NOT_INITIALIZED",
                "the driver library is not loaded (no successful init)",
            );
        } else {
            match op {
                Op::Init => self.init(&mut calls, &mut values),
                Op::MemInfo => self.mem_info(&mut calls, &mut values),
                Op::LegacyAlloc { bytes, seed } => self.legacy_alloc(&mut calls, *bytes, *seed),
                Op::LegacyExport => self.legacy_export(&mut calls, &mut values),
                Op::LegacyOpen { handle, seed } => self.legacy_open(&mut calls, handle, *seed),
                Op::LegacyReadPeer { seed } => {
                    match self.peer_legacy {
                        Some(p) => {
                            self.read_check(&mut calls, "peer mapping", p, *seed);
                        }
                        None => {
                            calls.note("read", false, "NOT_OPEN", "no peer mapping is open");
                        }
                    };
                }
                Op::LegacyClose => self.legacy_close(&mut calls),
                Op::ReInit => self.re_init(&mut calls, &mut values),
                Op::CtxReset => self.ctx_reset(&mut calls, &mut values),
                Op::CtxReleaseRetain => self.ctx_release_retain(&mut calls, &mut values),
                Op::VmmCreate { bytes, seed } => {
                    self.vmm_create(&mut calls, &mut values, *bytes, *seed)
                }
                Op::VmmFresh { seed } => self.vmm_fresh(&mut calls, &mut values, *seed),
                Op::VmmExport => self.vmm_export(&mut calls, &mut values),
                Op::VmmOffer { fd } => self.vmm_offer(&mut calls, *fd),
                Op::VmmImport {
                    pid,
                    fd,
                    size,
                    seed,
                } => self.vmm_import(&mut calls, &mut values, *pid, *fd, *size, *seed),
                Op::VmmReadPeer { seed } => self.slot_read(&mut calls, Which::Import, *seed),
                Op::VmmWritePeer { seed } => self.slot_write(&mut calls, Which::Import, *seed),
                Op::VmmReadOwn { seed } => self.slot_read(&mut calls, Which::Own, *seed),
                Op::VmmUnmapImport => self.slot_release(&mut calls, Which::Import),
                Op::VmmReleaseOwn => self.slot_release(&mut calls, Which::Own),
                Op::VmmSelfImport { seed, write_seed } => {
                    self.vmm_self_import(&mut calls, &mut values, *seed, *write_seed)
                }
                Op::CkptLock { timeout_ms } => {
                    self.ckpt(&mut calls, &mut values, Step::Lock(*timeout_ms))
                }
                Op::CkptCheckpoint => self.ckpt(&mut calls, &mut values, Step::Checkpoint),
                Op::CkptRestore => self.ckpt(&mut calls, &mut values, Step::Restore),
                Op::CkptUnlock => self.ckpt(&mut calls, &mut values, Step::Unlock),
                Op::State => {
                    self.state(&mut calls, &mut values);
                }
                Op::Exit => {}
            }
        }
        reply.values = values;
        reply
    }

    fn init(&mut self, c: &mut Calls<'_>, values: &mut std::collections::BTreeMap<String, String>) {
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
                return;
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
                return;
            }
        }
        // SAFETY: cuInit(0) has no preconditions.
        let r = unsafe { sys::cuInit(0) };
        if !c.cu("cuInit", r, "flags 0") {
            return;
        }
        let mut version: c_int = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuDriverGetVersion(&mut version) };
        if c.cu("cuDriverGetVersion", r, format!("{version}")) {
            values.insert("driver_version".into(), version.to_string());
        }
        let mut count: c_int = 0;
        // SAFETY: out-pointer to a local, after cuInit.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        if !c.cu("cuDeviceGetCount", r, format!("{count} devices")) {
            return;
        }
        values.insert("device_count".into(), count.to_string());
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuDeviceGet(&mut self.dev, 0) };
        if !c.cu("cuDeviceGet", r, "ordinal 0") {
            return;
        }
        let mut name = [0 as c_char; 128];
        // SAFETY: the buffer and its length; the driver NUL-terminates within it.
        let r = unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, self.dev) };
        // SAFETY: NUL-terminated by the driver on success (zeroed otherwise).
        let device = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        c.cu("cuDeviceGetName", r, device.clone());
        values.insert("device".into(), device);
        self.retain(c, values, "primary context");
        let ptracer = rustix::process::set_ptracer(rustix::process::PTracer::Any);
        // EINVAL: no Yama module, nothing to relax; the step goes on either way.
        c.sys(
            "prctl(PR_SET_PTRACER, ANY)",
            &ptracer,
            "so that the peer may pidfd_getfd from this process",
        );
        if let Some(last) = c.calls.last_mut() {
            last.ok = true;
        }
    }

    /// `cuDevicePrimaryCtxRetain` + `cuCtxSetCurrent`.
    fn retain(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        what: &str,
    ) -> bool {
        let before = self.ctx;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `dev` came from cuDeviceGet.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, self.dev) };
        let same = if before.is_null() {
            String::new()
        } else if before == ctx {
            " (the same handle as before)".into()
        } else {
            format!(" (the handle before was {before:p})")
        };
        if !c.cu(
            "cuDevicePrimaryCtxRetain",
            r,
            format!("{what}: {ctx:p}{same}"),
        ) {
            return false;
        }
        self.retains += 1;
        self.ctx = ctx;
        values.insert("context".into(), format!("{ctx:p}"));
        // SAFETY: a context just retained, made current on this thread.
        let r = unsafe { sys::cuCtxSetCurrent(ctx) };
        c.cu("cuCtxSetCurrent", r, format!("{ctx:p}"))
    }

    fn mem_info(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals; the context is current.
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        let used = total.saturating_sub(free) as u64;
        if c.cu(
            "cuMemGetInfo",
            r,
            format!(
                "free {}, total {}, used {}",
                bytes(free as u64),
                bytes(total as u64),
                bytes(used)
            ),
        ) {
            values.insert("free".into(), free.to_string());
            values.insert("total".into(), total.to_string());
            values.insert("used".into(), used.to_string());
        }
    }

    fn write_pattern(
        &self,
        c: &mut Calls<'_>,
        what: &str,
        ptr: sys::CUdeviceptr,
        seed: u8,
    ) -> bool {
        let data = pattern(seed, CHECK_BYTES);
        // SAFETY: `data` is CHECK_BYTES of host memory; `ptr` names at least CHECK_BYTES of
        // device memory mapped in this context (every allocation of the probe is larger).
        let r = unsafe { sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len()) };
        c.cu(
            "cuMemcpyHtoD",
            r,
            format!(
                "{} of the pattern of seed {seed:#04x} into {what} at {ptr:#x}",
                bytes(CHECK_BYTES as u64)
            ),
        )
    }

    fn read_check(&self, c: &mut Calls<'_>, what: &str, ptr: sys::CUdeviceptr, seed: u8) -> bool {
        let mut got = vec![0u8; CHECK_BYTES];
        // SAFETY: `got` is CHECK_BYTES of host memory; `ptr` names at least CHECK_BYTES of
        // device memory mapped in this context.
        let r = unsafe { sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), ptr, got.len()) };
        if !c.cu(
            "cuMemcpyDtoH",
            r,
            format!("{} from {what} at {ptr:#x}", bytes(CHECK_BYTES as u64)),
        ) {
            return false;
        }
        c.check("verify", check_pattern(seed, &got))
    }

    fn legacy_alloc(&mut self, c: &mut Calls<'_>, size: u64, seed: u8) {
        let size = (size as usize).max(CHECK_BYTES);
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, size) };
        if !c.cu(
            "cuMemAlloc",
            r,
            format!("{} at {ptr:#x}", bytes(size as u64)),
        ) {
            return;
        }
        self.legacy = Some((ptr, size));
        self.last_handle = None;
        self.write_pattern(c, "the allocation", ptr, seed);
    }

    fn legacy_export(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let Some((ptr, _)) = self.legacy else {
            c.note(
                "cuIpcGetMemHandle",
                false,
                "NO_ALLOCATION",
                "no legacy allocation",
            );
            return;
        };
        // SAFETY: a plain 64-byte C struct; zero is a valid value.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer to a local; `ptr` is this context's cuMemAlloc allocation.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) };
        let handle: Vec<u8> = h.reserved.iter().map(|&b| b as u8).collect();
        let compared = match &self.last_handle {
            None => String::new(),
            Some(prev) if *prev == handle => ", the same bytes as the previous export".into(),
            Some(_) => ", different bytes from the previous export".into(),
        };
        if c.cu(
            "cuIpcGetMemHandle",
            r,
            format!("allocation {ptr:#x}{compared}"),
        ) {
            values.insert("handle".into(), hex(&handle));
            self.last_handle = Some(handle);
        }
    }

    fn legacy_open(&mut self, c: &mut Calls<'_>, handle: &str, seed: u8) {
        let Some(raw) = unhex(handle, 64) else {
            c.note(
                "cuIpcOpenMemHandle",
                false,
                "BAD_HANDLE",
                "not 64 bytes of hex",
            );
            return;
        };
        if self.peer_legacy.is_some() {
            self.legacy_close(c);
        }
        // SAFETY: a plain 64-byte C struct; zero is a valid value.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(&raw) {
            *d = *s as c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the handle is passed by value; flag 1 is
        // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
            )
        };
        if !c.cu(
            "cuIpcOpenMemHandle",
            r,
            format!("the peer's handle -> {ptr:#x}"),
        ) {
            return;
        }
        self.peer_legacy = Some(ptr);
        self.read_check(c, "the peer's allocation", ptr, seed);
    }

    fn legacy_close(&mut self, c: &mut Calls<'_>) {
        if let Some(ptr) = self.peer_legacy.take() {
            // SAFETY: a mapping this process opened with cuIpcOpenMemHandle.
            let r = unsafe { sys::cuIpcCloseMemHandle(ptr) };
            c.cu("cuIpcCloseMemHandle", r, format!("{ptr:#x}"));
        }
    }

    fn re_init(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        // SAFETY: cuInit(0) has no preconditions.
        let r = unsafe { sys::cuInit(0) };
        if !c.cu("cuInit", r, "again, after the restore") {
            return;
        }
        self.retain(c, values, "retained again");
    }

    /// Forgets every allocation and mapping (the context that held them is gone).
    fn forget_memory(&mut self) {
        self.legacy = None;
        self.last_handle = None;
        self.peer_legacy = None;
        for slot in [&mut self.own, &mut self.import, &mut self.second] {
            slot.reservation = None;
            slot.handle = None;
            slot.mapped = false;
            slot.fds.clear();
        }
    }

    fn ctx_reset(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        // SAFETY: `dev` came from cuDeviceGet; nothing of the old context is used after it.
        let r = unsafe { sys::cuDevicePrimaryCtxReset_v2(self.dev) };
        let reset = c.cu(
            "cuDevicePrimaryCtxReset",
            r,
            "every allocation of the primary context destroyed",
        );
        if reset {
            self.forget_memory();
        }
        self.primary_state(c);
        if reset {
            self.retain(c, values, "retained after the reset");
        }
    }

    fn ctx_release_retain(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let held = self.retains;
        for i in 1..=held {
            // SAFETY: this process retained the primary context `held` times.
            let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
            if !c.cu(
                "cuDevicePrimaryCtxRelease",
                r,
                format!("release {i} of {held}"),
            ) {
                self.primary_state(c);
                return;
            }
            self.retains -= 1;
        }
        self.forget_memory();
        self.ctx = std::ptr::null_mut();
        self.primary_state(c);
        self.retain(c, values, "retained after releasing to zero");
    }

    fn primary_state(&self, c: &mut Calls<'_>) {
        let (mut flags, mut active): (c_uint, c_int) = (0, 0);
        // SAFETY: out-pointers to locals.
        let r = unsafe { sys::cuDevicePrimaryCtxGetState(self.dev, &mut flags, &mut active) };
        c.cu(
            "cuDevicePrimaryCtxGetState",
            r,
            format!("active {active}, flags {flags:#x}"),
        );
    }

    fn granularity(
        &self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) -> Option<usize> {
        let prop = vmm_prop(self.dev);
        let mut found = [0usize; 2];
        for (i, (flag, label)) in [
            (
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                "minimum",
            ),
            (
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                "recommended",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            // SAFETY: out-pointer to a local; `prop` is a valid property block.
            let r = unsafe { sys::cuMemGetAllocationGranularity(&mut found[i], &prop, flag) };
            if !c.cu(
                "cuMemGetAllocationGranularity",
                r,
                format!(
                    "{label}: {} (pinned device memory, POSIX fd)",
                    bytes(found[i] as u64)
                ),
            ) {
                return None;
            }
            values.insert(format!("granularity_{label}"), found[i].to_string());
        }
        Some(found[0].max(found[1]).max(1))
    }

    /// `cuMemCreate` of `size` and its mapping at `va` with read/write access.
    fn create_and_map(&mut self, c: &mut Calls<'_>, va: sys::CUdeviceptr, size: usize) -> bool {
        let prop = vmm_prop(self.dev);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; `prop` is a valid property block.
        let r = unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) };
        if !c.cu(
            "cuMemCreate",
            r,
            format!(
                "{} pinned device memory, POSIX fd shareable",
                bytes(size as u64)
            ),
        ) {
            return false;
        }
        self.own.handle = Some(h);
        // SAFETY: `va` is a reservation of this process of `size` bytes with nothing
        // mapped; `h` an allocation of `size` bytes.
        let r = unsafe { sys::cuMemMap(va, size, 0, h, 0) };
        if !c.cu("cuMemMap", r, format!("at {va:#x}")) {
            return false;
        }
        self.own.mapped = true;
        let desc = access_desc(self.dev);
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
        c.cu("cuMemSetAccess", r, "read/write for device 0")
    }

    fn vmm_create(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        want: u64,
        seed: u8,
    ) {
        if self.own.reservation.is_some() {
            c.note(
                "vmm_create",
                false,
                "EXISTS",
                "the own reservation exists already",
            );
            return;
        }
        let Some(g) = self.granularity(c, values) else {
            return;
        };
        let size = (want as usize).max(CHECK_BYTES).div_ceil(g) * g;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; any size that is a multiple of the granularity.
        let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
        if !c.cu(
            "cuMemAddressReserve",
            r,
            format!("{} at {va:#x} (kept)", bytes(size as u64)),
        ) {
            return;
        }
        self.own.reservation = Some((va, size));
        values.insert("va".into(), format!("{va:#x}"));
        values.insert("size".into(), size.to_string());
        if self.create_and_map(c, va, size) {
            self.write_pattern(c, "the own allocation", va, seed);
        }
    }

    fn vmm_fresh(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        seed: u8,
    ) {
        let Some((va, size)) = self.own.reservation else {
            c.note("vmm_fresh", false, "NO_RESERVATION", "no kept reservation");
            return;
        };
        if self.own.handle.is_some() || self.own.mapped {
            c.note(
                "vmm_fresh",
                false,
                "IN_USE",
                "the own allocation is still held",
            );
            return;
        }
        values.insert("va".into(), format!("{va:#x}"));
        values.insert("size".into(), size.to_string());
        if self.create_and_map(c, va, size) {
            self.write_pattern(c, "the fresh allocation at the kept address", va, seed);
        }
    }

    fn vmm_export(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let Some(h) = self.own.handle else {
            c.note(
                "cuMemExportToShareableHandle",
                false,
                "NO_ALLOCATION",
                "no own allocation",
            );
            return;
        };
        let mut fd: c_int = -1;
        // SAFETY: for POSIX descriptors the out-parameter is an `int*`; `h` is this
        // process's allocation, created with POSIX descriptor handles.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        if !c.cu("cuMemExportToShareableHandle", r, format!("POSIX fd {fd}")) {
            return;
        }
        if fd < 0 {
            c.note(
                "cuMemExportToShareableHandle",
                false,
                "BAD_FD",
                format!("fd {fd}"),
            );
            return;
        }
        // SAFETY: the driver returned a new descriptor of this process, owned by the caller.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let facts = fd_facts(&owned, values);
        c.note("fstat", true, "OK", facts);
        values.insert("fd".into(), fd.to_string());
        values.insert("held_fds".into(), (self.own.fds.len() + 1).to_string());
        self.own.fds.push(owned);
    }

    #[allow(clippy::too_many_arguments)]
    fn vmm_import(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        pid: u32,
        fd: i32,
        size: u64,
        seed: u8,
    ) {
        let by_pidfd = fetch_by_pidfd(c, pid, fd);
        // The copy the peer offered over the socket is always taken, so that the socket holds
        // no stale descriptor for the next import; it serves when pidfd_getfd did not.
        let by_socket = self.receive_offered(c, by_pidfd.is_some());
        let fetched = match (by_pidfd, by_socket) {
            (Some(p), Some(s)) => {
                let same = match (rustix::fs::fstat(&p), rustix::fs::fstat(&s)) {
                    (Ok(a), Ok(b)) => (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
                    _ => false,
                };
                c.note(
                    "compare",
                    true,
                    "OK",
                    format!(
                        "the pidfd_getfd copy and the socket copy are {} (st_dev, st_ino); the pidfd_getfd copy is imported",
                        if same { "the same file" } else { "different files" }
                    ),
                );
                values.insert("fd_via".into(), "pidfd_getfd".into());
                p
            }
            (Some(p), None) => {
                values.insert("fd_via".into(), "pidfd_getfd".into());
                p
            }
            (None, Some(s)) => {
                values.insert("fd_via".into(), "socket".into());
                c.note(
                    "fallback",
                    true,
                    "OK",
                    "pidfd_getfd did not serve: the descriptor passed over the socket (SCM_RIGHTS) is imported",
                );
                s
            }
            (None, None) => {
                c.note(
                    "fetch",
                    false,
                    "NO_DESCRIPTOR",
                    "neither pidfd_getfd nor the socket gave the peer's descriptor",
                );
                return;
            }
        };
        let mut fetched_facts = std::collections::BTreeMap::new();
        let facts = fd_facts(&fetched, &mut fetched_facts);
        c.note("fstat", true, "OK", format!("fetched: {facts}"));
        if self.import.mapped || self.import.handle.is_some() {
            self.slot_release(c, Which::Import);
        }
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX descriptors the OS handle is the descriptor's value cast to a
        // pointer; `fetched` stays open for the call.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fetched.as_raw_fd() as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        self.import.fds.push(fetched);
        if !c.cu(
            "cuMemImportFromShareableHandle",
            r,
            format!("fetched fd of pid {pid}"),
        ) {
            return;
        }
        self.import.handle = Some(h);
        let size = size as usize;
        let va = match self.import.reservation {
            Some((va, reserved)) if reserved >= size => {
                values.insert("same_address".into(), "yes".into());
                va
            }
            Some((va, reserved)) => {
                c.note(
                    "cuMemMap",
                    false,
                    "TOO_SMALL",
                    format!(
                        "the kept reservation at {va:#x} has {reserved} bytes, the import {size}"
                    ),
                );
                return;
            }
            None => {
                let mut va: sys::CUdeviceptr = 0;
                // SAFETY: out-pointer to a local.
                let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
                if !c.cu(
                    "cuMemAddressReserve",
                    r,
                    format!("{} at {va:#x} for imports (kept)", bytes(size as u64)),
                ) {
                    return;
                }
                self.import.reservation = Some((va, size));
                va
            }
        };
        values.insert("va".into(), format!("{va:#x}"));
        // SAFETY: `va` is this process's reservation of at least `size` bytes with nothing
        // mapped; `h` is the imported allocation of `size` bytes.
        let r = unsafe { sys::cuMemMap(va, size, 0, h, 0) };
        if !c.cu("cuMemMap", r, format!("the import at {va:#x}")) {
            return;
        }
        self.import.mapped = true;
        let desc = access_desc(self.dev);
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
        if !c.cu("cuMemSetAccess", r, "read/write for device 0") {
            return;
        }
        self.read_check(c, "the import", va, seed);
    }

    /// Sends the own exported descriptor `fd` to the peer over the socket the parent gave
    /// (`SCM_RIGHTS`).
    fn vmm_offer(&mut self, c: &mut Calls<'_>, fd: i32) {
        let Some(sock) = &self.peer_socket else {
            c.note("sendmsg", false, "NO_SOCKET", "no socket to the peer");
            return;
        };
        let Some(own) = self.own.fds.iter().find(|f| f.as_raw_fd() == fd) else {
            c.note(
                "sendmsg",
                false,
                "NOT_EXPORTED",
                format!("fd {fd} is not an exported descriptor of this process"),
            );
            return;
        };
        let fds = [own.as_fd()];
        let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            c.note(
                "sendmsg",
                false,
                "NO_SPACE",
                "the control buffer is too small",
            );
            return;
        }
        let sent = rustix::net::sendmsg(
            sock,
            &[std::io::IoSlice::new(&[1u8])],
            &mut control,
            SendFlags::empty(),
        );
        c.sys(
            "sendmsg(SCM_RIGHTS)",
            &sent,
            format!("fd {fd} to the peer over the socket"),
        );
    }

    /// The descriptor the peer offered, received within 2 s. `pidfd_served`: a failure here
    /// does not fail the import.
    fn receive_offered(&mut self, c: &mut Calls<'_>, pidfd_served: bool) -> Option<OwnedFd> {
        let Some(sock) = &self.peer_socket else {
            c.note(
                "recvmsg",
                pidfd_served,
                "NO_SOCKET",
                "no socket to the peer",
            );
            return None;
        };
        let timeout = rustix::net::sockopt::set_socket_timeout(
            sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(std::time::Duration::from_secs(2)),
        );
        if !c.sys("setsockopt(SO_RCVTIMEO)", &timeout, "2 s") {
            return None;
        }
        let mut byte = [0u8; 1];
        let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            sock,
            &mut [std::io::IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let ok = c.sys("recvmsg(SCM_RIGHTS)", &got, "the peer's offered descriptor");
        if !ok {
            if let Some(last) = c.calls.last_mut() {
                last.ok = pidfd_served;
            }
            return None;
        }
        let mut received = None;
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for fd in fds {
                    received.get_or_insert(fd);
                }
            }
        }
        if received.is_none() {
            c.note(
                "recvmsg(SCM_RIGHTS)",
                pidfd_served,
                "NO_RIGHTS",
                "a message without a descriptor",
            );
        }
        received
    }

    fn slot(&mut self, which: Which) -> &mut Slot {
        match which {
            Which::Own => &mut self.own,
            Which::Import => &mut self.import,
            Which::Second => &mut self.second,
        }
    }

    fn mapped_at(&mut self, c: &mut Calls<'_>, which: Which) -> Option<sys::CUdeviceptr> {
        let slot = self.slot(which);
        match (slot.mapped, slot.reservation) {
            (true, Some((va, _))) => Some(va),
            _ => {
                c.note(
                    "map",
                    false,
                    "NOT_MAPPED",
                    format!("nothing is mapped in the {which:?} slot"),
                );
                None
            }
        }
    }

    fn slot_read(&mut self, c: &mut Calls<'_>, which: Which, seed: u8) {
        if let Some(va) = self.mapped_at(c, which) {
            self.read_check(c, which.describe(), va, seed);
        }
    }

    fn slot_write(&mut self, c: &mut Calls<'_>, which: Which, seed: u8) {
        if let Some(va) = self.mapped_at(c, which) {
            self.write_pattern(c, which.describe(), va, seed);
        }
    }

    /// Unmaps and releases what the slot holds and closes its descriptors; the reservation
    /// stays.
    fn slot_release(&mut self, c: &mut Calls<'_>, which: Which) {
        let slot = self.slot(which);
        let (reservation, mapped, handle) = (slot.reservation, slot.mapped, slot.handle);
        if let (true, Some((va, size))) = (mapped, reservation) {
            // SAFETY: the range is this process's mapping; nothing reads it after this.
            let r = unsafe { sys::cuMemUnmap(va, size) };
            let ok = c.cu(
                "cuMemUnmap",
                r,
                format!("{} at {va:#x} (reservation kept)", which.describe()),
            );
            if ok {
                self.slot(which).mapped = false;
            }
        }
        if let Some(h) = handle {
            // SAFETY: a handle this process created or imported, released once.
            let r = unsafe { sys::cuMemRelease(h) };
            if c.cu(
                "cuMemRelease",
                r,
                format!("the handle of {}", which.describe()),
            ) {
                self.slot(which).handle = None;
            }
        }
        let fds = std::mem::take(&mut self.slot(which).fds);
        if !fds.is_empty() {
            let n = fds.len();
            drop(fds);
            c.note(
                "close",
                true,
                "OK",
                format!("{n} descriptor(s) of {} closed", which.describe()),
            );
        }
    }

    fn vmm_self_import(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        seed: u8,
        write_seed: u8,
    ) {
        let (Some(own_h), Some((own_va, size))) = (self.own.handle, self.own.reservation) else {
            c.note(
                "vmm_self_import",
                false,
                "NO_ALLOCATION",
                "no own allocation",
            );
            return;
        };
        let Some(fd) = self.own.fds.last().map(AsRawFd::as_raw_fd) else {
            c.note(
                "vmm_self_import",
                false,
                "NO_FD",
                "the own allocation is not exported",
            );
            return;
        };
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the OS handle is this process's exported descriptor's value; it stays open.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        let same = if h == own_h {
            "the same handle value as the own allocation"
        } else {
            "a new handle value"
        };
        if !c.cu(
            "cuMemImportFromShareableHandle",
            r,
            format!("own fd {fd}: {same}"),
        ) {
            return;
        }
        values.insert("same_handle".into(), (h == own_h).to_string());
        self.second.handle = Some(h);
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
        if !c.cu(
            "cuMemAddressReserve",
            r,
            format!("a second address {va:#x}"),
        ) {
            return;
        }
        self.second.reservation = Some((va, size));
        // SAFETY: a fresh reservation of `size` bytes; `h` the imported allocation.
        let r = unsafe { sys::cuMemMap(va, size, 0, h, 0) };
        if !c.cu(
            "cuMemMap",
            r,
            format!("the own allocation again at {va:#x}"),
        ) {
            return;
        }
        self.second.mapped = true;
        let desc = access_desc(self.dev);
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
        if !c.cu("cuMemSetAccess", r, "read/write for device 0") {
            return;
        }
        if !self.read_check(c, "the second mapping", va, seed) {
            return;
        }
        if self.write_pattern(c, "the second mapping", va, write_seed) {
            self.read_check(c, "the first mapping", own_va, write_seed);
        }
        self.slot_release(c, Which::Second);
    }

    fn state(
        &self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) -> bool {
        let Some(f) = self.checkpoint.map(|e| e.state) else {
            return c.note(
                "cuCheckpointProcessGetState",
                false,
                "MISSING",
                "entry point not found",
            );
        };
        let pid = std::process::id() as c_int;
        let mut state: c_int = -1;
        // SAFETY: out-pointer to a local `CUprocessState` (int-sized).
        let code = unsafe { f(pid, &mut state) };
        let label = match state {
            0 => "running",
            1 => "locked",
            2 => "checkpointed",
            3 => "failed",
            _ => "unknown",
        };
        let ok = c.raw(
            "cuCheckpointProcessGetState",
            code,
            format!("{label} ({state})"),
        );
        if ok {
            values.insert("state".into(), state.to_string());
        }
        // A state that cannot be read does not stop the sequence.
        if let Some(last) = c.calls.last_mut() {
            last.ok = true;
        }
        ok
    }

    fn ckpt(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        step: Step,
    ) {
        let Some(e) = self.checkpoint else {
            c.note(step.name(), false, "MISSING", "entry point not found");
            return;
        };
        let pid = std::process::id() as c_int;
        let started = std::time::Instant::now();
        let code = match step {
            Step::Lock(timeout_ms) => {
                let mut args = LockArgs {
                    timeout_ms: timeout_ms.max(1),
                    reserved0: 0,
                    reserved1: [0; 7],
                };
                // SAFETY: a 64-byte argument block valid for the call, on this process's pid.
                unsafe { (e.lock)(pid, &mut args) }
            }
            other => {
                let f = match other {
                    Step::Checkpoint => e.checkpoint,
                    Step::Restore => e.restore,
                    _ => e.unlock,
                };
                let mut args = ReservedArgs { reserved: [0; 8] };
                // SAFETY: a zeroed 64-byte argument block valid for the call, on this
                // process's pid.
                unsafe { f(pid, &mut args) }
            }
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let detail = match step {
            Step::Lock(t) => format!("own pid {pid}, timeout {t} ms, {ms:.1} ms"),
            _ => format!("own pid {pid}, {ms:.1} ms"),
        };
        // On failure the state says what the call left; on success it is known (and a
        // state query from a locked process is probed on its own, `state-query`).
        if !c.raw(step.name(), code, detail) {
            self.state(c, values);
        }
    }
}

/// `pidfd_open(pid)` + `pidfd_getfd(fd)`: the peer's descriptor, or `None` (recorded, not a
/// failure of the import: the socket copy may serve).
fn fetch_by_pidfd(c: &mut Calls<'_>, pid: u32, fd: i32) -> Option<OwnedFd> {
    let Some(pid_) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        c.note("pidfd_open", false, "BAD_PID", format!("pid {pid}"));
        return None;
    };
    let pidfd = rustix::process::pidfd_open(pid_, PidfdFlags::empty());
    c.sys("pidfd_open", &pidfd, format!("pid {pid}"));
    let fetched = match pidfd {
        Ok(pidfd) => {
            let fetched =
                rustix::process::pidfd_getfd(&pidfd, fd as RawFd, PidfdGetfdFlags::empty());
            c.sys("pidfd_getfd", &fetched, format!("fd {fd} of pid {pid}"));
            fetched.ok()
        }
        Err(_) => None,
    };
    if let Some(last) = c.calls.last_mut() {
        last.ok = true;
    }
    fetched
}

#[derive(Debug, Clone, Copy)]
enum Which {
    Own,
    Import,
    Second,
}

impl Which {
    fn describe(self) -> &'static str {
        match self {
            Which::Own => "the own allocation",
            Which::Import => "the import",
            Which::Second => "the second mapping",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Lock(u32),
    Checkpoint,
    Restore,
    Unlock,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::Lock(_) => "cuCheckpointProcessLock",
            Step::Checkpoint => "cuCheckpointProcessCheckpoint",
            Step::Restore => "cuCheckpointProcessRestore",
            Step::Unlock => "cuCheckpointProcessUnlock",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(v: &mut Vec<Call>) -> Calls<'_> {
        Calls {
            calls: v,
            error_name: None,
        }
    }

    fn memfd(name: &str) -> OwnedFd {
        rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    /// The descriptor-passing fallback without a GPU: one side offers an exported
    /// descriptor over a socket pair, the other takes it; the same file arrives.
    #[test]
    fn an_offered_descriptor_arrives_over_the_socket_pair() {
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::DGRAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let mut exporter = Cuda::with_peer_socket(Some(a));
        let mut importer = Cuda::with_peer_socket(Some(b));
        let file = memfd("offered");
        let raw = file.as_raw_fd();
        let want = rustix::fs::fstat(&file).unwrap();
        exporter.own.fds.push(file);

        let mut v = Vec::new();
        exporter.vmm_offer(&mut calls(&mut v), raw);
        assert!(v.iter().all(|c| c.ok), "{v:?}");
        let mut v = Vec::new();
        let got = importer
            .receive_offered(&mut calls(&mut v), false)
            .expect("a descriptor");
        assert!(v.iter().all(|c| c.ok), "{v:?}");
        let st = rustix::fs::fstat(&got).unwrap();
        assert_eq!((st.st_dev, st.st_ino), (want.st_dev, want.st_ino));

        // Nothing offered: the receive gives up after its timeout, a failure only when
        // pidfd_getfd did not serve either.
        let mut v = Vec::new();
        assert!(importer.receive_offered(&mut calls(&mut v), true).is_none());
        assert!(v.iter().all(|c| c.ok), "{v:?}");
        let mut v = Vec::new();
        assert!(importer
            .receive_offered(&mut calls(&mut v), false)
            .is_none());
        assert!(v.iter().any(|c| !c.ok), "{v:?}");

        // A number that is not an exported descriptor is refused.
        let mut v = Vec::new();
        exporter.vmm_offer(&mut calls(&mut v), 9999);
        assert_eq!(v[0].name, "NOT_EXPORTED");
    }

    #[test]
    fn pidfd_getfd_of_this_process_gives_the_same_file_and_facts_describe_it() {
        let file = memfd("fetched");
        let want = rustix::fs::fstat(&file).unwrap();
        let mut v = Vec::new();
        let got = fetch_by_pidfd(&mut calls(&mut v), std::process::id(), file.as_raw_fd());
        // Some sandboxes forbid pidfd_getfd even on the own process: then it is recorded.
        match got {
            Some(got) => {
                let st = rustix::fs::fstat(&got).unwrap();
                assert_eq!((st.st_dev, st.st_ino), (want.st_dev, want.st_ino));
                assert_eq!(v.last().unwrap().name, "OK");
            }
            None => assert!(v.iter().any(|c| c.name != "OK"), "{v:?}"),
        }
        assert!(
            v.iter().all(|c| c.ok),
            "never a failure of the import: {v:?}"
        );
        let mut values = std::collections::BTreeMap::new();
        let text = fd_facts(&file, &mut values);
        assert!(text.contains("memfd:fetched"), "{text}");
        assert_eq!(values["fd_type"], "regular file");
        assert_eq!(values["fd_ino"], want.st_ino.to_string());
        let mut v = Vec::new();
        assert!(fetch_by_pidfd(&mut calls(&mut v), 0, 1).is_none());
        assert_eq!(v[0].name, "BAD_PID");
    }

    /// Every operation but `Init` refuses to run before the driver is loaded: no cudarc
    /// call (which would panic without a library) is reached.
    #[test]
    fn operations_before_init_are_refused_without_driver_calls() {
        let mut cuda = Cuda::default();
        for op in [
            Op::MemInfo,
            Op::LegacyExport,
            Op::CkptLock { timeout_ms: 1 },
            Op::State,
        ] {
            let r = cuda.run(&op);
            assert_eq!(r.calls.len(), 1);
            assert_eq!(r.calls[0].name, "NOT_INITIALIZED");
        }
    }
}
