//! GPU memory figures from NVML (`libnvidia-ml.so.1`, or the file `TPCOMM_NVML_LIBRARY`
//! names), loaded at run time, never linked. NVML is not the CUDA driver API: it answers
//! while this process's CUDA calls are locked or its GPU state is checkpointed, which is when
//! the figures matter (what a checkpoint released).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

type NvmlReturn = c_int;
type NvmlDevice = *mut c_void;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlProcessInfo_t` (the `_v3` query's element).
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type CountFn = unsafe extern "C" fn(*mut c_uint) -> NvmlReturn;
type HandleFn = unsafe extern "C" fn(c_uint, *mut NvmlDevice) -> NvmlReturn;
type MemoryFn = unsafe extern "C" fn(NvmlDevice, *mut Memory) -> NvmlReturn;
type ProcessesFn = unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut ProcessInfo) -> NvmlReturn;

/// NVML's "not available" value of `usedGpuMemory`.
const NOT_AVAILABLE: u64 = u64::MAX;
/// `NVML_ERROR_INSUFFICIENT_SIZE`.
const INSUFFICIENT_SIZE: NvmlReturn = 7;

/// GPU memory in use, summed over every GPU NVML sees.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuMemory {
    /// Bytes in use on the devices (`nvmlDeviceGetMemoryInfo`'s `used`).
    pub device_used: u64,
    /// Bytes of every compute process NVML lists (pid, bytes): a process whose GPU state is
    /// checkpointed is not listed. Empty when NVML does not report processes (some
    /// containers); pids are as NVML sees them (the host's pid namespace).
    pub processes: Vec<(u32, u64)>,
}

impl GpuMemory {
    /// The bytes NVML lists for `pid` (0 when not listed).
    pub fn of_process(&self, pid: u32) -> u64 {
        self.processes
            .iter()
            .filter(|(p, _)| *p == pid)
            .map(|(_, b)| b)
            .sum()
    }

    /// Reads the figures now; why not, in words (no NVML, a failed call). NVML is loaded
    /// and initialised once per process and stays loaded (as in engines that poll it).
    pub fn probe() -> Result<Self, String> {
        static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
        NVML.get_or_init(Nvml::load)
            .as_ref()
            .map_err(Clone::clone)?
            .figures()
    }
}

/// NVML's functions this module calls, initialised.
struct Nvml {
    count: CountFn,
    handle: HandleFn,
    memory: MemoryFn,
    processes: Option<ProcessesFn>,
    // Keeps the functions above loaded.
    _lib: libloading::Library,
}

fn check(call: &str, code: NvmlReturn) -> Result<(), String> {
    if code == 0 {
        Ok(())
    } else {
        Err(format!("{call} failed with NVML error {code}"))
    }
}

impl Nvml {
    fn load() -> Result<Self, String> {
        let path =
            std::env::var("TPCOMM_NVML_LIBRARY").unwrap_or_else(|_| "libnvidia-ml.so.1".into());
        // SAFETY: loading NVML runs its initialisers, which is how it is meant to be used.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("NVML ({path}) cannot be loaded: {e}"))?;
        let missing = |name: &str, e: libloading::Error| format!("NVML lacks {name}: {e}");
        // SAFETY: each symbol is read with its nvml.h signature and called only through it;
        // the library stays loaded as long as the copied pointers (`_lib`).
        let nvml = unsafe {
            let init = *lib
                .get::<InitFn>(b"nvmlInit_v2")
                .map_err(|e| missing("nvmlInit_v2", e))?;
            check("nvmlInit_v2", init())?;
            Nvml {
                count: *lib
                    .get::<CountFn>(b"nvmlDeviceGetCount_v2")
                    .map_err(|e| missing("nvmlDeviceGetCount_v2", e))?,
                handle: *lib
                    .get::<HandleFn>(b"nvmlDeviceGetHandleByIndex_v2")
                    .map_err(|e| missing("nvmlDeviceGetHandleByIndex_v2", e))?,
                memory: *lib
                    .get::<MemoryFn>(b"nvmlDeviceGetMemoryInfo")
                    .map_err(|e| missing("nvmlDeviceGetMemoryInfo", e))?,
                processes: lib
                    .get::<ProcessesFn>(b"nvmlDeviceGetComputeRunningProcesses_v3")
                    .ok()
                    .map(|f| *f),
                _lib: lib,
            }
        };
        Ok(nvml)
    }

    fn figures(&self) -> Result<GpuMemory, String> {
        let mut devices: c_uint = 0;
        // SAFETY: out-pointer to a local; NVML is initialised.
        check("nvmlDeviceGetCount_v2", unsafe {
            (self.count)(&mut devices)
        })?;
        let mut figures = GpuMemory::default();
        for index in 0..devices {
            let mut device: NvmlDevice = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; index below the count.
            check("nvmlDeviceGetHandleByIndex_v2", unsafe {
                (self.handle)(index, &mut device)
            })?;
            let mut m = Memory::default();
            // SAFETY: a device handle from NVML, out-pointer to a local struct of nvml.h's
            // layout.
            check("nvmlDeviceGetMemoryInfo", unsafe {
                (self.memory)(device, &mut m)
            })?;
            figures.device_used += m.used;
            if let Some(list) = self.processes {
                let mut infos = vec![ProcessInfo::default(); 256];
                let mut n = infos.len() as c_uint;
                // SAFETY: `n` is the capacity of `infos`; NVML writes at most `n` entries
                // and stores how many it wrote.
                let code = unsafe { list(device, &mut n, infos.as_mut_ptr()) };
                // The per-process list is best effort (some containers refuse it, a device
                // may run more than 256 processes): the device figure stands without it.
                if code != 0 {
                    tracing::debug!(
                        code,
                        insufficient_size = code == INSUFFICIENT_SIZE,
                        "nvmlDeviceGetComputeRunningProcesses_v3 failed; no per-process figures"
                    );
                    continue;
                }
                figures.processes.extend(
                    infos[..(n as usize).min(infos.len())]
                        .iter()
                        .filter(|p| p.used_gpu_memory != NOT_AVAILABLE)
                        .map(|p| (p.pid, p.used_gpu_memory)),
                );
            }
        }
        Ok(figures)
    }
}

#[cfg(test)]
mod tests {
    use super::GpuMemory;

    #[test]
    fn a_machine_without_nvml_gets_a_reason_not_a_panic() {
        if let Err(why) = GpuMemory::probe() {
            assert!(why.contains("NVML"), "{why}");
        }
    }
}
