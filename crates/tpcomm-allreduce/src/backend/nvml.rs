//! The NVML part of the topology probe: `libnvidia-ml.so.1` loaded at run time (never
//! linked, so programs build and run where NVML is absent), asked whether two GPUs of the
//! node are connected by NVLink (`nvmlDeviceGetP2PStatus` with `NVML_P2P_CAPS_INDEX_NVLINK`,
//! vLLM's test) or can read each other over PCIe (`NVML_P2P_CAPS_INDEX_READ`). NVML sees
//! every GPU of the node whatever `CUDA_VISIBLE_DEVICES` says, so it answers for peers that
//! the CUDA driver of this process cannot see. GPUs are named by UUID
//! (`nvmlDeviceGetHandleByUUID`, `GPU-xxxxxxxx-xxxx-...`), the same as the driver's.

use std::ffi::{c_char, c_int, c_void, CString};

use crate::topology::Link;

type NvmlReturn = c_int;
type NvmlDevice = *mut c_void;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_P2P_CAPS_INDEX_READ: c_int = 0;
const NVML_P2P_CAPS_INDEX_NVLINK: c_int = 2;
const NVML_P2P_STATUS_OK: c_int = 0;

type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type ShutdownFn = unsafe extern "C" fn() -> NvmlReturn;
type HandleByUuidFn = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> NvmlReturn;
type P2pStatusFn = unsafe extern "C" fn(NvmlDevice, NvmlDevice, c_int, *mut c_int) -> NvmlReturn;
type ErrorStringFn = unsafe extern "C" fn(NvmlReturn) -> *const c_char;

/// An initialized NVML; shut down on drop.
pub(crate) struct Nvml {
    shutdown: ShutdownFn,
    handle_by_uuid: HandleByUuidFn,
    p2p_status: P2pStatusFn,
    error_string: Option<ErrorStringFn>,
    // Keeps the functions above loaded; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

/// The driver's UUID bytes as NVML names the GPU.
pub(crate) fn uuid_string(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// An NVML error in words: the call, the code and NVML's description.
fn describe(error_string: Option<ErrorStringFn>, call: &str, code: NvmlReturn) -> String {
    let text = error_string.and_then(|f| {
        // SAFETY: nvmlErrorString returns a static NUL-terminated string (or null).
        let p = unsafe { f(code) };
        (!p.is_null()).then(|| {
            // SAFETY: a non-null pointer from nvmlErrorString: a static NUL-terminated string.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        })
    });
    format!(
        "{call} failed with NVML error {code} ({})",
        text.unwrap_or_default()
    )
}

impl Nvml {
    /// The process's NVML, loaded and initialized on first use and kept for the life of the
    /// process (no `nvmlShutdown`: initialization is slow, and probes happen at every
    /// communicator creation); why not, in words, when it cannot be loaded.
    pub(crate) fn shared() -> Result<&'static Nvml, String> {
        static SHARED: std::sync::OnceLock<Result<Nvml, String>> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(Nvml::load)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Loads and initializes NVML; why not, in words, when it cannot.
    pub(crate) fn load() -> Result<Self, String> {
        let path =
            std::env::var("TPCOMM_NVML_LIBRARY").unwrap_or_else(|_| "libnvidia-ml.so.1".into());
        // SAFETY: loading NVML runs its initializers, which only set up the library (it is
        // the vendor's library, loaded by path or soname like nvidia-smi does).
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| format!("{path}: {e}"))?;
        // SAFETY: each symbol is looked up with the C signature NVML documents for it
        // (nvml.h); the copies of the function pointers live no longer than `_lib` in `Nvml`.
        let (init, shutdown, handle_by_uuid, p2p_status, error_string) = unsafe {
            let get = |name: &[u8]| -> Result<*const c_void, String> {
                lib.get::<*const c_void>(name)
                    .map(|s| *s)
                    .map_err(|e| format!("{path}: {e}"))
            };
            (
                std::mem::transmute::<*const c_void, InitFn>(get(b"nvmlInit_v2\0")?),
                std::mem::transmute::<*const c_void, ShutdownFn>(get(b"nvmlShutdown\0")?),
                std::mem::transmute::<*const c_void, HandleByUuidFn>(get(
                    b"nvmlDeviceGetHandleByUUID\0",
                )?),
                std::mem::transmute::<*const c_void, P2pStatusFn>(get(
                    b"nvmlDeviceGetP2PStatus\0",
                )?),
                get(b"nvmlErrorString\0")
                    .ok()
                    .map(|f| std::mem::transmute::<*const c_void, ErrorStringFn>(f)),
            )
        };
        // SAFETY: no arguments; NVML counts initializations (balanced in Drop).
        let code = unsafe { init() };
        if code != NVML_SUCCESS {
            // Not initialized: nothing to shut down; the library is unloaded here.
            return Err(describe(error_string, "nvmlInit_v2", code));
        }
        Ok(Nvml {
            shutdown,
            handle_by_uuid,
            p2p_status,
            error_string,
            _lib: lib,
        })
    }

    fn describe(&self, call: &str, code: NvmlReturn) -> String {
        describe(self.error_string, call, code)
    }

    fn device(&self, uuid: &[u8; 16]) -> Result<NvmlDevice, String> {
        let name = CString::new(uuid_string(uuid)).expect("no NUL in a UUID string");
        let mut device: NvmlDevice = std::ptr::null_mut();
        // SAFETY: a NUL-terminated string and an out-pointer to a local.
        let code = unsafe { (self.handle_by_uuid)(name.as_ptr(), &mut device) };
        if code == NVML_SUCCESS {
            Ok(device)
        } else {
            Err(self.describe("nvmlDeviceGetHandleByUUID", code))
        }
    }

    fn p2p(&self, a: NvmlDevice, b: NvmlDevice, index: c_int) -> Result<bool, String> {
        let mut status: c_int = -1;
        // SAFETY: both handles came from nvmlDeviceGetHandleByUUID of this initialized NVML;
        // out-pointer to a local.
        let code = unsafe { (self.p2p_status)(a, b, index, &mut status) };
        if code == NVML_SUCCESS {
            Ok(status == NVML_P2P_STATUS_OK)
        } else {
            Err(self.describe("nvmlDeviceGetP2PStatus", code))
        }
    }

    /// How the GPU `a` reaches GPU `b` (by driver UUID): NVLink, PCIe P2P, or none.
    pub(crate) fn link(&self, a: &[u8; 16], b: &[u8; 16]) -> Result<Link, String> {
        let (da, db) = (self.device(a)?, self.device(b)?);
        if self.p2p(da, db, NVML_P2P_CAPS_INDEX_NVLINK)? {
            Ok(Link::NvLink)
        } else if self.p2p(da, db, NVML_P2P_CAPS_INDEX_READ)? {
            Ok(Link::Pcie)
        } else {
            Ok(Link::NoP2p)
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: balances the successful nvmlInit_v2 of `load`.
        let code = unsafe { (self.shutdown)() };
        if code != NVML_SUCCESS {
            tracing::debug!(code, "nvmlShutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_named_as_nvml_names_them() {
        let uuid = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(
            uuid_string(&uuid),
            "GPU-12345678-9abc-def0-0123-456789abcdef"
        );
    }

    #[test]
    fn a_machine_without_nvml_gets_a_reason_not_a_panic() {
        // Whatever this machine has: either NVML loads, or the reason names the library.
        if let Err(why) = Nvml::load() {
            assert!(!why.is_empty());
        }
    }
}
