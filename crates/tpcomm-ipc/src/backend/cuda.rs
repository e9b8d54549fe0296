//! The CUDA backend: device memory shared between processes with legacy CUDA IPC.
//!
//! Three levels, in cudarc's shape: cudarc's raw `driver::sys` bindings (the driver library
//! is loaded at run time), the [`result`] module (one checked function per driver call; every
//! `CUresult` becomes [`IpcError::Cuda`] with its raw code, name and description), and RAII
//! types: [`CudaBuffer`] (a `cuMemAlloc` allocation, freed on drop) and [`CudaMapping`] (a
//! peer's allocation opened with `cuIpcOpenMemHandle`, closed on drop).
//!
//! - **Loading.** [`CudaMemory::new`] loads `libcuda` and checks that it has every function
//!   the [`result`] layer calls before calling any of them, so a machine without a driver (or
//!   with one older than those functions) gets [`IpcError::NoDevice`], never a panic from
//!   cudarc's loader. A driver that is present but finds no GPU (`cuInit` fails) or a device
//!   ordinal that does not exist is [`IpcError::NoDevice`] too.
//! - **Handles.** A CUDA IPC handle (64 bytes) names a whole allocation, never a range:
//!   [`CudaHandle`] carries the handle of the allocation's base (`cuMemGetAddressRange`), the
//!   allocation's size, and the exported offset and length. [`CudaMemory::allocate`] rounds
//!   every buffer up to 2 MiB, so no two buffers share an allocation or a handle.
//! - **What can be exported.** Only memory from `cuMemAlloc` / `cudaMalloc` is legacy-IPC
//!   capable. Memory from a stream-ordered pool (`cuMemAllocAsync` / `cudaMallocAsync`) or
//!   mapped with the virtual-memory API (`cuMemCreate` + `cuMemMap`, what the expandable
//!   segments of PyTorch's caching allocator use) is not; neither is managed or host memory.
//!   [`PeerMemory::export`] checks the pointer's attributes and says which case it met in
//!   [`IpcError::NotExportable`].
//! - **Not in the exporting process.** The driver refuses to open a handle in the process that
//!   exported it (`CUDA_ERROR_INVALID_CONTEXT`); [`PeerMemory::open`] refuses a handle carrying
//!   this process's pid with [`IpcError::InvalidHandle`] before asking the driver. The
//!   [`PeerMappings`](crate::PeerMappings) registry never opens its own rank's handles, but
//!   ranks that are threads of one process (a `LocalGroup`) would open each other's: use one
//!   process per rank with this backend, or [`CudaMemory::same_process`], which opens this
//!   process's own handles as aliases of the local allocation (ranks as streams of one GPU). (Processes in different pid namespaces can carry the
//!   same pid; such a handle is refused too.)
//! - **One driver mapping per allocation and process.** Opening the same IPC handle twice in
//!   one context is an error in the driver. A process-wide table keyed by the 64 handle bytes
//!   and the device counts the [`CudaMapping`]s of each opened allocation (two handles of
//!   different ranges of one allocation share it) and closes the driver mapping with the last.
//! - **Addresses.** `cuIpcOpenMemHandle` chooses the address; after a close and a reopen it may
//!   be another one.
//! - **Contexts and copies.** A [`CudaMemory`] retains the device's primary context (the one
//!   the CUDA runtime and PyTorch use) and makes it current on the calling thread before each
//!   driver call. [`PeerMemory::write`] and [`PeerMemory::read`] are synchronous
//!   `cuMemcpyHtoD` / `cuMemcpyDtoH` on the legacy default stream: ordered with this
//!   process's work on that stream, never with other processes' kernels (that takes a
//!   barrier).
//!
//! Requires a driver for CUDA 11.4 or newer (the bindings are cudarc's `cuda-13000`; each
//! driver symbol is resolved on first use, and all those used here exist since 11.4).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr};
use serde::{Deserialize, Serialize};

use crate::error::{IpcError, Result};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Sealed};

/// Granularity of [`CudaMemory::allocate`]: 2 MiB, so that no two buffers share an
/// allocation (and so an IPC handle).
pub const ALLOCATION_GRANULARITY: usize = 2 << 20;

/// The checked layer over cudarc's `driver::sys`: one function per driver call this backend
/// makes. Every function first makes sure the driver library is loaded and complete
/// ([`result::load`]), so none of them can reach cudarc's loader panic; every `CUresult` other than
/// `CUDA_SUCCESS` becomes [`IpcError::Cuda`] (`call`, raw `code`, `cuGetErrorName`,
/// `cuGetErrorString`). Functions that take raw device addresses the driver cannot fully
/// validate (frees, closes, copies) are `unsafe`.
pub mod result {
    use std::ffi::{c_char, c_void, CStr};
    use std::sync::OnceLock;

    use cudarc::driver::sys::{
        self, CUcontext, CUdevice, CUdeviceptr, CUipcMem_flags, CUpointer_attribute, CUresult,
    };

    use crate::error::{IpcError, Result};

    /// Size of a CUDA IPC memory handle.
    pub const IPC_HANDLE_BYTES: usize = 64;

    /// `CU_MEMORYTYPE_DEVICE`, as [`pointer_memory_type`] returns it.
    pub const MEMORYTYPE_DEVICE: u32 = 2;

    /// Every driver function this module calls (checked by [`load`]).
    const SYMBOLS: &[&str] = &[
        "cuGetErrorName",
        "cuGetErrorString",
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxSetCurrent",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemsetD8_v2",
        "cuMemGetAddressRange_v2",
        "cuPointerGetAttribute",
        "cuIpcGetMemHandle",
        "cuIpcOpenMemHandle_v2",
        "cuIpcCloseMemHandle",
        "cuMemcpyHtoD_v2",
        "cuMemcpyDtoH_v2",
        "cuCtxEnablePeerAccess",
    ];

    fn try_load() -> std::result::Result<(), String> {
        let missing = tpcomm_transport::backend::cuda_driver::missing_symbols(SYMBOLS)?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the CUDA driver library lacks {missing:?}: the driver is older than CUDA 11.4"
            ))
        }
    }

    /// Checks that the loaded driver library exports every function in `names` (for layers
    /// above this one that call more of the driver); [`IpcError::NoDevice`] names the missing
    /// ones. Never calls them, never panics.
    pub fn require(names: &[&str]) -> Result<()> {
        load()?;
        let missing = tpcomm_transport::backend::cuda_driver::missing_symbols(names)
            .map_err(IpcError::NoDevice)?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(IpcError::NoDevice(format!(
                "the CUDA driver library lacks {missing:?}: the driver is too old"
            )))
        }
    }

    /// Loads the driver library (once per process) and checks that it exports every function
    /// of this module. Fails with [`IpcError::NoDevice`] when the library is missing or
    /// incomplete; never panics. Every other function here calls it first.
    pub fn load() -> Result<()> {
        static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
        LOADED
            .get_or_init(try_load)
            .clone()
            .map_err(IpcError::NoDevice)
    }

    fn c_text(p: *const c_char) -> Option<String> {
        // SAFETY: the driver hands out pointers to static NUL-terminated strings.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// The error of driver function `call` that returned `code` (not `CUDA_SUCCESS`).
    pub fn error(call: &'static str, code: CUresult) -> IpcError {
        let mut name: *const c_char = std::ptr::null();
        let mut message: *const c_char = std::ptr::null();
        // SAFETY: both out-pointers point to locals; the driver stores pointers to static
        // strings (or fails for a code it does not know, leaving them null).
        let (n, m) = unsafe {
            (
                sys::cuGetErrorName(code, &mut name),
                sys::cuGetErrorString(code, &mut message),
            )
        };
        let ok = CUresult::CUDA_SUCCESS;
        IpcError::Cuda {
            call,
            code: code as i32,
            name: (n == ok)
                .then(|| c_text(name))
                .flatten()
                .unwrap_or_else(|| format!("{code:?}")),
            message: (m == ok)
                .then(|| c_text(message))
                .flatten()
                .unwrap_or_else(|| "no description from the driver".into()),
        }
    }

    /// `Ok` for `CUDA_SUCCESS`, else the error of `call`.
    pub fn check(call: &'static str, code: CUresult) -> Result<()> {
        if code == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(error(call, code))
        }
    }

    /// `cuInit(0)`.
    pub fn init() -> Result<()> {
        load()?;
        // SAFETY: no pointers; the library is loaded and has the symbol.
        check("cuInit", unsafe { sys::cuInit(0) })
    }

    /// `cuDriverGetVersion`: the CUDA version of the driver (e.g. 13000).
    pub fn driver_version() -> Result<i32> {
        load()?;
        let mut v = 0;
        // SAFETY: out-pointer to a local.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut v)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_count() -> Result<i32> {
        load()?;
        let mut n = 0;
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n)
    }

    /// `cuDeviceGet`: the device of `ordinal`.
    pub fn device_get(ordinal: i32) -> Result<CUdevice> {
        load()?;
        let mut d = 0;
        // SAFETY: out-pointer to a local; the driver validates the ordinal.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
        Ok(d)
    }

    /// `cuDevicePrimaryCtxRetain`: retains (and creates if needed) the device's primary
    /// context. Balance with [`primary_ctx_release`].
    pub fn primary_ctx_retain(device: CUdevice) -> Result<CUcontext> {
        load()?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the driver validates the device.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        Ok(ctx)
    }

    /// `cuDevicePrimaryCtxRelease_v2`.
    ///
    /// # Safety
    /// Balances one successful [`primary_ctx_retain`] of `device` by the caller; nothing of
    /// the caller uses the context afterwards unless it holds another retain.
    pub unsafe fn primary_ctx_release(device: CUdevice) -> Result<()> {
        load()?;
        // SAFETY: the caller owns one retain of the context.
        check("cuDevicePrimaryCtxRelease_v2", unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(device)
        })
    }

    /// `cuCtxSetCurrent`: makes `ctx` current on the calling thread.
    ///
    /// # Safety
    /// `ctx` is a live context (for a primary context: retained by the caller).
    pub unsafe fn ctx_set_current(ctx: CUcontext) -> Result<()> {
        load()?;
        // SAFETY: `ctx` is live (caller's contract).
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
    }

    /// `cuCtxSynchronize`: waits for all work of the current context.
    pub fn ctx_synchronize() -> Result<()> {
        load()?;
        // SAFETY: no pointers.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// `cuStreamSynchronize` of the legacy default stream: waits for work issued on it (and,
    /// by its implicit ordering, for earlier work of *blocking* streams), never for work of
    /// non-blocking streams, so it cannot wait on another rank's spinning kernel.
    pub fn legacy_stream_synchronize() -> Result<()> {
        load()?;
        // SAFETY: the null stream handle names the legacy default stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })
    }

    /// `cuMemAlloc_v2`: `bytes` bytes of device memory in the current context. Free with
    /// [`mem_free`] (leaking is safe).
    pub fn mem_alloc(bytes: usize) -> Result<CUdeviceptr> {
        load()?;
        let mut p = 0;
        // SAFETY: out-pointer to a local.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut p, bytes)
        })?;
        Ok(p)
    }

    /// `cuMemFree_v2`.
    ///
    /// # Safety
    /// `ptr` came from [`mem_alloc`], is freed once, and nothing uses it afterwards.
    pub unsafe fn mem_free(ptr: CUdeviceptr) -> Result<()> {
        load()?;
        // SAFETY: caller's contract.
        check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
    }

    /// `cuMemsetD8_v2`: sets `bytes` bytes at `ptr` to `value` (asynchronous with the host).
    ///
    /// # Safety
    /// `ptr..ptr + bytes` lies inside one live device allocation whose contents nobody else
    /// relies on.
    pub unsafe fn memset_d8(ptr: CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
        load()?;
        // SAFETY: caller's contract.
        check("cuMemsetD8_v2", unsafe {
            sys::cuMemsetD8_v2(ptr, value, bytes)
        })
    }

    /// `cuMemGetAddressRange_v2`: base and size of the allocation that contains `ptr`.
    pub fn mem_get_address_range(ptr: CUdeviceptr) -> Result<(CUdeviceptr, usize)> {
        load()?;
        let (mut base, mut size) = (0, 0);
        // SAFETY: out-pointers to locals; the driver looks the address up.
        check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        Ok((base, size))
    }

    /// `cuPointerGetAttribute`: the value of `attribute` for `ptr`.
    ///
    /// # Safety
    /// `T` is at least as large as what the driver writes for `attribute`, and every bit
    /// pattern the driver may write is a valid `T` (use integers, never enums).
    pub unsafe fn pointer_get_attribute<T: Copy + Default>(
        attribute: CUpointer_attribute,
        ptr: CUdeviceptr,
    ) -> Result<T> {
        load()?;
        let mut v = T::default();
        // SAFETY: `v` is large enough for the attribute (caller's contract).
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute((&mut v as *mut T).cast::<c_void>(), attribute, ptr)
        })?;
        Ok(v)
    }

    /// Reads a boolean attribute: the driver writes an `int` (some documentation says
    /// `bool`); a zeroed 8-byte integer is non-zero after the call exactly when it wrote true,
    /// whichever width it wrote.
    fn pointer_flag(attribute: CUpointer_attribute, ptr: CUdeviceptr) -> Result<bool> {
        // SAFETY: eight bytes cover every width the driver writes for a flag; any bits are a
        // valid u64.
        Ok(unsafe { pointer_get_attribute::<u64>(attribute, ptr) }? != 0)
    }

    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` as the raw `CUmemorytype` value
    /// ([`MEMORYTYPE_DEVICE`] for device memory). `CUDA_ERROR_INVALID_VALUE` for an address
    /// the driver does not know (plain host memory).
    pub fn pointer_memory_type(ptr: CUdeviceptr) -> Result<u32> {
        // SAFETY: the driver writes a 4-byte enum value; any u32 is valid.
        unsafe {
            pointer_get_attribute::<u32>(CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        }
    }

    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    pub fn pointer_is_managed(ptr: CUdeviceptr) -> Result<bool> {
        pointer_flag(CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
    }

    /// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`: false for memory from a
    /// stream-ordered pool or mapped with the virtual-memory API.
    pub fn pointer_is_legacy_ipc_capable(ptr: CUdeviceptr) -> Result<bool> {
        pointer_flag(
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            ptr,
        )
    }

    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    pub fn pointer_device_ordinal(ptr: CUdeviceptr) -> Result<i32> {
        // SAFETY: the driver writes an int.
        unsafe {
            pointer_get_attribute::<i32>(
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        }
    }

    /// `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`: the memory pool the address came from, 0 when
    /// it is not pool memory.
    pub fn pointer_mempool(ptr: CUdeviceptr) -> Result<u64> {
        // SAFETY: the driver writes a pointer-sized handle; any bits are a valid u64.
        unsafe {
            pointer_get_attribute::<u64>(
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                ptr,
            )
        }
    }

    /// `cuCtxEnablePeerAccess(peer, 0)` from the current context: `Ok(true)` when access
    /// was enabled now, `Ok(false)` when it was enabled before
    /// (`CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` is not a failure).
    ///
    /// # Safety
    /// `peer` is a live context (retained by the caller) of another device.
    pub unsafe fn ctx_enable_peer_access(peer: CUcontext) -> Result<bool> {
        load()?;
        // SAFETY: `peer` is live (caller's contract); no pointers are written.
        match unsafe { sys::cuCtxEnablePeerAccess(peer, 0) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(false),
            code => Err(error("cuCtxEnablePeerAccess", code)),
        }
    }

    /// `cuIpcGetMemHandle`: the IPC handle of the allocation whose base is `base`.
    pub fn ipc_get_mem_handle(base: CUdeviceptr) -> Result<[u8; IPC_HANDLE_BYTES]> {
        load()?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: out-pointer to a local; the driver validates the address.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// `cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: maps another
    /// process's allocation into the current context and returns its base. Close with
    /// [`ipc_close_mem_handle`]. Fails (`CUDA_ERROR_INVALID_CONTEXT`) in the exporting
    /// process, and when this context already has the handle open.
    pub fn ipc_open_mem_handle(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<CUdeviceptr> {
        load()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as c_char),
        };
        let mut p = 0;
        let flags = CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: out-pointer to a local; the handle is passed by value and validated by the
        // driver.
        check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut p, h, flags)
        })?;
        Ok(p)
    }

    /// `cuIpcCloseMemHandle`.
    ///
    /// # Safety
    /// `base` came from [`ipc_open_mem_handle`] in the current context, is closed once, and
    /// nothing uses the mapping afterwards.
    pub unsafe fn ipc_close_mem_handle(base: CUdeviceptr) -> Result<()> {
        load()?;
        // SAFETY: caller's contract.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(base)
        })
    }

    /// `cuMemcpyHtoD_v2`: copies `src` to device address `dst` (synchronous for pageable
    /// host memory).
    ///
    /// # Safety
    /// `dst..dst + src.len()` lies inside live device memory of the current context (an
    /// allocation or an IPC mapping).
    pub unsafe fn memcpy_htod(dst: CUdeviceptr, src: &[u8]) -> Result<()> {
        load()?;
        // SAFETY: caller's contract for `dst`; `src` is a live slice of `src.len()` bytes.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
        })
    }

    /// `cuMemcpyDtoH_v2`: copies `dst.len()` bytes from device address `src` into `dst`.
    ///
    /// # Safety
    /// `src..src + dst.len()` lies inside live device memory of the current context.
    pub unsafe fn memcpy_dtoh(dst: &mut [u8], src: CUdeviceptr) -> Result<()> {
        load()?;
        // SAFETY: caller's contract for `src`; `dst` is a live, exclusive slice.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }
}

/// The handle of `len` bytes at `offset` in one `cuMemAlloc` allocation of process `pid`.
///
/// Its serde form is stable: the 64 IPC bytes as one byte string, then the integers in field
/// order (postcard: a length byte of 64, the bytes, varints).
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaHandle {
    /// The CUDA IPC handle of the whole allocation (`cuIpcGetMemHandle` of its base).
    #[serde(with = "serde_bytes")]
    pub ipc: [u8; result::IPC_HANDLE_BYTES],
    /// Size of the whole allocation.
    pub base_len: u64,
    /// Start of the exported range in the allocation.
    pub offset: u64,
    /// Length of the exported range.
    pub len: u64,
    /// Ordinal of the exporter's device, in the exporter's numbering (informational:
    /// `CUDA_VISIBLE_DEVICES` may number devices differently in each process).
    pub device: i32,
    /// Pid of the exporting process.
    pub pid: u32,
}

impl fmt::Debug for CudaHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ipc: String = self.ipc[..8].iter().map(|b| format!("{b:02x}")).collect();
        f.debug_struct("CudaHandle")
            .field("ipc", &format_args!("{ipc}.."))
            .field("base_len", &self.base_len)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("device", &self.device)
            .field("pid", &self.pid)
            .finish()
    }
}

/// A retained primary context; released on drop.
#[derive(Debug)]
pub(crate) struct PrimaryContext {
    ctx: CUcontext,
    pub(crate) device: CUdevice,
    pub(crate) ordinal: i32,
}

// SAFETY: a CUDA context is not tied to the thread that retained it: the driver API is
// thread-safe and any thread may make the context current.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above; `&PrimaryContext` only hands the context to driver calls.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub(crate) fn make_current(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        unsafe { result::ctx_set_current(self.ctx) }
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: releases the one retain taken in `CudaMemory::new`; every buffer and
        // mapping holds an `Arc` of this value, so none outlives the context.
        if let Err(e) = unsafe { result::primary_ctx_release(self.device) } {
            tracing::warn!(error = %e, device = self.ordinal, "releasing the primary context failed");
        }
    }
}

/// The CUDA IPC peer-memory backend for one device. Cheap to clone; clones share the
/// retained primary context.
#[derive(Debug, Clone)]
pub struct CudaMemory {
    ctx: Arc<PrimaryContext>,
    same_process: bool,
}

/// A device allocation of this process (`cuMemAlloc`, a multiple of 2 MiB, zeroed), freed
/// on drop. Peers map it through [`CudaHandle`]s.
#[derive(Debug)]
pub struct CudaBuffer {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) ctx: Arc<PrimaryContext>,
    /// Allocated by `CudaVmmMemory` (virtual memory: a reserved range with physical memory
    /// mapped into it), not by `cuMemAlloc`.
    pub(crate) vmm: bool,
}

/// This process's mapping of (a range of) a peer's allocation; closed on drop, or by
/// [`PeerMemory::close`], which reports failures.
pub struct CudaMapping {
    pub(crate) key: OpenKey,
    pub(crate) base: CUdeviceptr,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) ctx: Arc<PrimaryContext>,
    pub(crate) released: bool,
    /// A same-process alias of this process's own allocation ([`CudaMemory::same_process`]):
    /// nothing was opened in the driver, nothing is closed.
    pub(crate) alias: bool,
    /// Opened by `CudaVmmMemory` from a virtual-memory handle: how it maps the peer's
    /// allocation (`key` and `alias` are then unused).
    pub(crate) vmm: Option<super::cuda_vmm::VmmMapping>,
}

impl fmt::Debug for CudaMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaMapping")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("allocation_base", &format_args!("{:#x}", self.base))
            .field("device", &self.ctx.ordinal)
            .field("alias", &self.alias)
            .field("vmm", &self.vmm)
            .finish()
    }
}

impl Sealed for CudaBuffer {}
impl Sealed for CudaMapping {}

impl MemoryRegion for CudaBuffer {
    fn addr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl MemoryRegion for CudaMapping {
    fn addr(&self) -> u64 {
        self.base + self.offset
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl CudaBuffer {
    /// The device address of the first byte (for kernels and tables).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The first `len` elements of `T` of this buffer as a cudarc device slice on `stream`,
    /// for cudarc APIs such as NCCL's collectives. Ordering is the stream's: no event is
    /// recorded or waited for. Fails with [`IpcError::OutOfBounds`] when they do not fit, and
    /// with [`IpcError::WrongDevice`] when `stream` belongs to another device (the view
    /// reports its stream's device, which consumers check their buffers against).
    pub fn view<'a, T>(
        &'a self,
        len: usize,
        stream: &'a Arc<cudarc::driver::CudaStream>,
    ) -> Result<BufferView<'a, T>> {
        let stream_device = stream.context().ordinal();
        if usize::try_from(self.ctx.ordinal).ok() != Some(stream_device) {
            return Err(IpcError::WrongDevice {
                buffer: self.ctx.ordinal,
                stream: stream_device,
            });
        }
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        check_range(0, bytes, self.len)?;
        Ok(BufferView {
            ptr: self.ptr,
            len,
            stream,
            _buffer: std::marker::PhantomData,
        })
    }
}

/// Elements of a [`CudaBuffer`] seen as a cudarc device slice ([`CudaBuffer::view`]); borrows
/// the buffer, so it cannot outlive it.
#[derive(Debug)]
pub struct BufferView<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<cudarc::driver::CudaStream>,
    _buffer: std::marker::PhantomData<(&'a CudaBuffer, T)>,
}

impl<T> cudarc::driver::DeviceSlice<T> for BufferView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        self.stream
    }
}

impl<T> cudarc::driver::DevicePtr<T> for BufferView<'_, T> {
    fn device_ptr<'a>(
        &'a self,
        _stream: &'a cudarc::driver::CudaStream,
    ) -> (CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
        (self.ptr, cudarc::driver::SyncOnDrop::Record(None))
    }
}

impl<T> cudarc::driver::DevicePtrMut<T> for BufferView<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a cudarc::driver::CudaStream,
    ) -> (CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
        (self.ptr, cudarc::driver::SyncOnDrop::Record(None))
    }
}

impl CudaMapping {
    /// The device address of the first byte of the mapped range.
    pub fn device_ptr(&self) -> u64 {
        self.addr()
    }

    /// The device address where the whole peer allocation is mapped.
    pub fn allocation_base(&self) -> u64 {
        self.base
    }

    /// Drops this mapping's reference to the driver mapping; the last one closes it.
    fn release(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) || self.alias {
            return Ok(());
        }
        if let Some(vmm) = self.vmm.take() {
            return super::cuda_vmm::release_mapping(self.base, vmm, &self.ctx);
        }
        let mut table = open_table();
        let Some(entry) = table.get_mut(&self.key) else {
            return Ok(());
        };
        entry.refs -= 1;
        if entry.refs > 0 {
            return Ok(());
        }
        table.remove(&self.key);
        // Closed under the table lock, so a concurrent open of the same handle cannot reach
        // the driver while it is still open.
        self.ctx.make_current()?;
        // SAFETY: `base` was opened by `ipc_open_mem_handle` in this context; this was its
        // last mapping, so nothing reaches the memory through the safe API any more.
        unsafe { result::ipc_close_mem_handle(self.base) }?;
        tracing::trace!(base = self.base, "CUDA IPC mapping closed");
        Ok(())
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.vmm {
            return super::cuda_vmm::free_buffer(self.ptr, self.len, &self.ctx);
        }
        export_table().retain(|_, base| *base != self.ptr);
        let freed = self.ctx.make_current().and_then(|()| {
            // SAFETY: `ptr` came from `mem_alloc` in `allocate` and is freed once, here. This
            // process holds no other reference to it. A peer that still has it mapped must not
            // use it any more (CUDA documents freeing before the importers' cuIpcCloseMemHandle
            // as undefined behaviour): collective closes order the free after every peer's
            // last use (see `CustomAllReduce::close_with`).
            unsafe { result::mem_free(self.ptr) }
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "freeing a CUDA buffer failed");
        }
    }
}

impl Drop for CudaMapping {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(error = %e, "closing a CUDA IPC mapping failed");
        }
    }
}

/// An opened allocation: the 64 handle bytes and the opening device's ordinal.
pub(crate) type OpenKey = ([u8; result::IPC_HANDLE_BYTES], i32);

#[derive(Debug)]
struct Opened {
    base: CUdeviceptr,
    size: u64,
    refs: usize,
}

/// The allocations this process has open, with the number of [`CudaMapping`]s of each.
fn open_table() -> MutexGuard<'static, HashMap<OpenKey, Opened>> {
    static TABLE: OnceLock<Mutex<HashMap<OpenKey, Opened>>> = OnceLock::new();
    // Nothing panics while holding the lock.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Allocations this process exported: the 64 handle bytes -> the allocation's base, so that a
/// [`CudaMemory::same_process`] backend can open its own handles as aliases.
///
/// Entries are never looked up by peers of other processes, only by this process's own
/// aliases, and an alias is checked against the allocation now at `base`: the driver must
/// give the same handle for it ([`CudaMemory::open_alias`]), which a new allocation at a
/// freed one's address does not. Entries are dropped when a [`CudaBuffer`] is freed; a
/// stale entry (memory tpcomm did not allocate, freed by its owner, or a handle from
/// before a process checkpoint) is refused that way. After a checkpoint and restore the
/// driver hands out a *different* handle for the same allocation (the old one no longer
/// opens anywhere: `CUDA_ERROR_INVALID_HANDLE`); the registry's resume exports again and
/// inserts the new handle next to the old one, both naming the same base (a restore keeps
/// every allocation at its virtual address).
fn export_table() -> MutexGuard<'static, HashMap<[u8; result::IPC_HANDLE_BYTES], CUdeviceptr>> {
    static TABLE: OnceLock<Mutex<HashMap<[u8; result::IPC_HANDLE_BYTES], CUdeviceptr>>> =
        OnceLock::new();
    // Nothing panics while holding the lock.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The number of peer allocations this process has open through legacy CUDA IPC
/// (`cuIpcOpenMemHandle`) right now, over every [`CudaMemory`] and device: each counts once
/// however many [`CudaMapping`]s share it; plus the virtual-memory imports of every
/// `CudaVmmMemory` mapped now (a detached one is not: it holds only its address range).
/// Same-process aliases ([`CudaMemory::same_process`]) open nothing in the driver and are not
/// counted.
///
/// A process checkpoint (`cuCheckpointProcessCheckpoint`) must not run while this is above
/// zero: on driver 580 the checkpoint of an importer succeeds but its restore fails
/// (`CUDA_ERROR_INVALID_VALUE`) and leaves the process checkpointed for good, so
/// `tpcomm-checkpoint` refuses before locking. The count is taken under the table's lock;
/// another thread may open or close a mapping right after it is read.
pub fn imported_allocations() -> usize {
    open_table().len() + super::cuda_vmm::imported_now()
}

/// Turns a failed open into [`IpcError::OwnerGone`] when the exporting process is gone.
fn owner_gone_or(e: IpcError, pid: u32) -> IpcError {
    let gone = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH));
    if gone {
        IpcError::OwnerGone { pid }
    } else {
        e
    }
}

impl CudaMemory {
    /// A backend on device `device_ordinal`: loads the driver, initialises it, and retains
    /// the device's primary context.
    ///
    /// Fails with [`IpcError::NoDevice`] (never a panic) when the driver library is missing
    /// or older than CUDA 11.4, when `cuInit` or `cuDeviceGetCount` fail (no GPU, no kernel
    /// module, a stub library: the message keeps the CUDA error code), and when no device has
    /// this ordinal. Other driver failures are [`IpcError::Cuda`].
    pub fn new(device_ordinal: i32) -> Result<Self> {
        result::load()?;
        let unusable = |e: IpcError| IpcError::NoDevice(format!("no usable CUDA driver: {e}"));
        result::init().map_err(unusable)?;
        let count = result::device_count().map_err(unusable)?;
        if !(0..count).contains(&device_ordinal) {
            return Err(IpcError::NoDevice(format!(
                "CUDA device {device_ordinal} does not exist: the driver sees {count} device(s)"
            )));
        }
        let device = result::device_get(device_ordinal)?;
        let ctx = result::primary_ctx_retain(device)?;
        let ctx = Arc::new(PrimaryContext {
            ctx,
            device,
            ordinal: device_ordinal,
        });
        ctx.make_current()?;
        tracing::debug!(
            device = device_ordinal,
            driver = result::driver_version().unwrap_or(0),
            "CUDA peer-memory backend ready"
        );
        Ok(Self {
            ctx,
            same_process: false,
        })
    }

    /// A backend for ranks that are threads of one process sharing device
    /// `device_ordinal` (one-GPU tests and benchmarks of the multi-rank kernels): a handle
    /// exported by this process opens as an *alias* of the exporter's allocation (the same
    /// device address, nothing opened or closed in the driver), since CUDA IPC cannot open a
    /// handle in the process that exported it. Handles of other processes open through CUDA
    /// IPC as with [`new`](Self::new).
    ///
    /// An alias does not keep the allocation alive: the exporting rank must keep its buffer
    /// until every rank has closed its mappings (the all-reduce's lifecycle does). Aliases
    /// never move, so a close and reopen gives the same address.
    pub fn same_process(device_ordinal: i32) -> Result<Self> {
        let mut memory = Self::new(device_ordinal)?;
        memory.same_process = true;
        Ok(memory)
    }

    /// True for a [`same_process`](Self::same_process) backend.
    pub fn is_same_process(&self) -> bool {
        self.same_process
    }

    /// Opens a handle this process exported as an alias of the local allocation, after
    /// checking that the allocation still exists with the size the handle names and is the
    /// one exported (the driver gives the same handle for it: a new allocation at a freed
    /// one's address has another).
    fn open_alias(&self, h: &CudaHandle, len: usize) -> Result<CudaMapping> {
        let base = export_table().get(&h.ipc).copied().ok_or_else(|| {
            IpcError::InvalidHandle(
                "the handle names this process but no allocation it exported".into(),
            )
        })?;
        self.ctx.make_current()?;
        match result::mem_get_address_range(base) {
            Ok((b, size)) if b == base && size as u64 == h.base_len => {}
            Ok((_, size)) => {
                return Err(IpcError::InvalidHandle(format!(
                    "the allocation is {size} bytes, the handle says {}",
                    h.base_len
                )))
            }
            Err(e) => {
                return Err(IpcError::InvalidHandle(format!(
                    "the exported allocation at {base:#x} is gone: {e}"
                )))
            }
        }
        if result::ipc_get_mem_handle(base)? != h.ipc {
            return Err(IpcError::StaleHandle(format!(
                "the allocation exported at {base:#x} was freed; another one lies there now"
            )));
        }
        let owner = result::pointer_device_ordinal(base)?;
        match alias_access(self.ctx.ordinal, h.device, owner)? {
            AliasAccess::SameDevice => {}
            AliasAccess::Peer(device) => self.enable_peer_access(device)?,
        }
        Ok(CudaMapping {
            key: (h.ipc, self.ctx.ordinal),
            base,
            offset: h.offset,
            len,
            ctx: self.ctx.clone(),
            released: false,
            alias: true,
            vmm: None,
        })
    }

    /// Lets this backend's context read and write device `peer`'s memory (ranks that are
    /// threads of one process on several GPUs: kernels of this device read a peer's
    /// aliases). Enabling twice is fine; a refusal (no P2P between the devices, too many
    /// peers) is [`IpcError::PeerAccess`] with the driver's error.
    pub fn enable_peer_access(&self, peer: i32) -> Result<()> {
        let fail = |cause: IpcError| IpcError::PeerAccess {
            device: self.ctx.ordinal,
            peer_device: peer,
            cause: Box::new(cause),
        };
        let device = result::device_get(peer).map_err(fail)?;
        let peer_ctx = result::primary_ctx_retain(device).map_err(fail)?;
        let enabled = self.ctx.make_current().and_then(|()| {
            // SAFETY: `peer_ctx` is retained until the release below.
            unsafe { result::ctx_enable_peer_access(peer_ctx) }
        });
        // SAFETY: balances the retain above; the peer access, once enabled, belongs to the
        // contexts, and the peer's own CudaMemory keeps its context alive.
        if let Err(e) = unsafe { result::primary_ctx_release(device) } {
            tracing::warn!(error = %e, device = peer, "releasing a peer's primary context failed");
        }
        let now = enabled.map_err(fail)?;
        tracing::debug!(
            device = self.ctx.ordinal,
            peer,
            newly = now,
            "peer access enabled"
        );
        Ok(())
    }

    /// The device ordinal this backend allocates on and opens into.
    pub fn device_ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    /// The retained primary context (shared with `CudaVmmMemory`).
    pub(crate) fn context(&self) -> &Arc<PrimaryContext> {
        &self.ctx
    }

    /// Makes this backend's primary context current on the calling thread (for callers that
    /// mix in their own driver calls; every method here does it by itself).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx.make_current()
    }

    /// Fails unless `addr` is device memory (so a host region never reaches a device copy).
    fn check_device_memory(&self, addr: u64, len: usize) -> Result<()> {
        let not_device = |why: String| {
            IpcError::NoSuchMapping(format!(
                "{len} bytes at {addr:#x} are not CUDA device memory ({why}): \
                 pass a CudaBuffer or CudaMapping"
            ))
        };
        match result::pointer_memory_type(addr) {
            Ok(result::MEMORYTYPE_DEVICE) => Ok(()),
            Ok(t) => Err(not_device(format!("memory type {t}"))),
            Err(IpcError::Cuda { name, .. }) => Err(not_device(name)),
            Err(e) => Err(e),
        }
    }
}

/// How a same-process alias reaches its allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AliasAccess {
    /// The allocation is on the importer's own device.
    SameDevice,
    /// The allocation is on this other device: the importer's context needs peer access.
    Peer(i32),
}

/// Checks a same-process alias against its device: `handle_device` is the device the
/// handle says (the exporter's), `owner_device` the one the allocation at its address is
/// on now (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`), `own_device` the importer's. An
/// allocation on another device than the handle says (freed and replaced) is
/// [`IpcError::InvalidHandle`]; on another device than the importer's, it needs peer access.
pub fn alias_access(own_device: i32, handle_device: i32, owner_device: i32) -> Result<AliasAccess> {
    if owner_device != handle_device {
        return Err(IpcError::InvalidHandle(format!(
            "the handle names an allocation of device {handle_device}, but the memory at its \
             address is on device {owner_device}"
        )));
    }
    Ok(if owner_device == own_device {
        AliasAccess::SameDevice
    } else {
        AliasAccess::Peer(owner_device)
    })
}

/// A reservation of device virtual addresses (`cuMemAddressReserve` at a fixed address),
/// released on drop. While it lives nothing else (an IPC mapping included) can be placed in
/// the range: tests hold the addresses of closed peer mappings so that reopening them has to
/// choose new ones, as a process resumed elsewhere would.
#[derive(Debug)]
pub struct CudaAddressHold {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<PrimaryContext>,
}

impl CudaAddressHold {
    /// The first reserved address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for CudaAddressHold {
    fn drop(&mut self) {
        let freed = self.ctx.make_current().and_then(|()| {
            // SAFETY: reserved by `hold_address` with this size, freed once; nothing is
            // mapped in a range only this value knows.
            result::check("cuMemAddressFree", unsafe {
                cudarc::driver::sys::cuMemAddressFree(self.ptr, self.len)
            })
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "releasing a device address reservation failed");
        }
    }
}

impl CudaMemory {
    /// Reserves `len` bytes of device virtual addresses at exactly `addr` (rounded down to
    /// 2 MiB, the length up). Fails with [`IpcError::InvalidAllocation`] when the driver
    /// places the reservation elsewhere (the range is in use), releasing it.
    pub fn hold_address(&self, addr: u64, len: usize) -> Result<CudaAddressHold> {
        result::require(&["cuMemAddressReserve", "cuMemAddressFree"])?;
        let granule = ALLOCATION_GRANULARITY as u64;
        let start = addr / granule * granule;
        let len = addr
            .checked_add(len as u64)
            .and_then(|end| (end - start).checked_next_multiple_of(granule))
            .and_then(|len| usize::try_from(len).ok())
            .ok_or_else(|| {
                IpcError::InvalidAllocation(format!(
                    "{len} bytes at {addr:#x} run past the address space"
                ))
            })?;
        self.ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; a reservation maps nothing, so it cannot touch
        // live memory.
        result::check("cuMemAddressReserve", unsafe {
            cudarc::driver::sys::cuMemAddressReserve(
                &mut ptr,
                len,
                ALLOCATION_GRANULARITY,
                start,
                0,
            )
        })?;
        let hold = CudaAddressHold {
            ptr,
            len,
            ctx: self.ctx.clone(),
        };
        if ptr != start {
            return Err(IpcError::InvalidAllocation(format!(
                "the driver reserved {len} bytes at {ptr:#x}, not at {start:#x}: the range is in use"
            )));
        }
        Ok(hold)
    }
}

impl CudaMemory {
    /// Whether `len` bytes at `addr` can be exported with legacy CUDA IPC
    /// ([`PeerMemory::export`] would succeed): device memory (not managed, not host) that
    /// is legacy-IPC capable (`cuMemAlloc` / `cudaMalloc`, not a stream-ordered pool's
    /// `cuMemAllocAsync` nor VMM), the range inside one allocation. Returns the allocation's
    /// base and size; [`IpcError::NotExportable`] names the kind of memory otherwise. Only
    /// queries pointer attributes: allowed while a stream is being captured.
    ///
    /// cudarc's `CudaStream::alloc*` allocate from the device's stream-ordered pool on every
    /// device that has one, so their `CudaSlice`s are *not* exportable; allocate with
    /// [`allocate`](PeerMemory::allocate) and pass [`CudaBuffer::view`] wherever cudarc
    /// takes a `DevicePtr` / `DevicePtrMut`.
    pub fn check_exportable(&self, addr: u64, len: usize) -> Result<(u64, usize)> {
        let not = |reason: String| IpcError::NotExportable { addr, len, reason };
        self.ctx.make_current()?;
        match result::pointer_memory_type(addr) {
            Ok(result::MEMORYTYPE_DEVICE) => {}
            Ok(t) => {
                return Err(not(format!(
                    "host memory (CUmemorytype {t}): only device memory can be shared"
                )))
            }
            Err(IpcError::Cuda { code, name, .. }) => {
                return Err(not(format!(
                    "the CUDA driver does not know this address ({name}, code {code}): not \
                     device memory"
                )))
            }
            Err(e) => return Err(e),
        }
        if result::pointer_is_managed(addr)? {
            return Err(not(
                "managed (unified) memory is not legacy-CUDA-IPC capable".into(),
            ));
        }
        if !result::pointer_is_legacy_ipc_capable(addr)? {
            let kind = match result::pointer_mempool(addr) {
                Ok(pool) if pool != 0 => {
                    "memory from a stream-ordered pool (cuMemAllocAsync / cudaMallocAsync)"
                }
                Ok(_) => "memory mapped with the virtual memory management API (VMM: cuMemCreate / cuMemMap, e.g. expandable segments)",
                Err(_) => "memory from a stream-ordered pool or mapped with the virtual memory management API (VMM)",
            };
            return Err(not(format!(
                "{kind} is not legacy-CUDA-IPC capable; allocate with cuMemAlloc / cudaMalloc \
                 (CudaMemory::allocate)"
            )));
        }
        let (base, size) = result::mem_get_address_range(addr)?;
        let offset = addr - base;
        if len == 0
            || offset
                .checked_add(len as u64)
                .is_none_or(|end| end > size as u64)
        {
            return Err(not(format!(
                "range not inside one allocation (or empty): the allocation at {base:#x} has \
                 {size} bytes, the range starts {offset} bytes in"
            )));
        }
        Ok((base, size))
    }
}

mod sealed {
    pub trait Sealed {}
}

/// CUDA peer memory of one device whose buffers and mappings are [`CudaBuffer`]s and
/// [`CudaMapping`]s: what the CUDA all-reduce runs on ([`CudaMemory`], legacy IPC;
/// [`CudaVmmMemory`](crate::CudaVmmMemory), virtual memory). Sealed: implemented by this
/// crate's backends only.
pub trait DevicePeerMemory:
    PeerMemory<Buffer = CudaBuffer, Mapping = CudaMapping> + Clone + sealed::Sealed
{
    /// The device ordinal it allocates on and maps into.
    fn device_ordinal(&self) -> i32;

    /// Makes its primary context current on the calling thread.
    fn bind_to_thread(&self) -> Result<()>;

    /// Whether `len` bytes at `addr` can be exported to peers as they are (zero-copy), or
    /// [`IpcError::NotExportable`] saying why not. Only queries the driver's records:
    /// allowed while a stream is being captured.
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()>;
}

impl sealed::Sealed for CudaMemory {}
impl sealed::Sealed for crate::CudaVmmMemory {}

impl DevicePeerMemory for CudaMemory {
    fn device_ordinal(&self) -> i32 {
        CudaMemory::device_ordinal(self)
    }
    fn bind_to_thread(&self) -> Result<()> {
        CudaMemory::bind_to_thread(self)
    }
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()> {
        self.check_exportable(addr, len).map(drop)
    }
}

impl DevicePeerMemory for crate::CudaVmmMemory {
    fn device_ordinal(&self) -> i32 {
        crate::CudaVmmMemory::device_ordinal(self)
    }
    fn bind_to_thread(&self) -> Result<()> {
        crate::CudaVmmMemory::bind_to_thread(self)
    }
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()> {
        self.check_exportable(addr, len)
    }
}

/// Accepts only this backend's own region types: device memory it allocated or mapped.
fn cuda_region<R: MemoryRegion>(region: &R) -> Result<()> {
    let any = region.as_any();
    if any.is::<CudaBuffer>() || any.is::<CudaMapping>() {
        Ok(())
    } else {
        Err(IpcError::ForeignRegion {
            backend: "cuda",
            region: std::any::type_name::<R>(),
        })
    }
}

impl PeerMemory for CudaMemory {
    type Handle = CudaHandle;
    type Buffer = CudaBuffer;
    type Mapping = CudaMapping;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn allocate(&self, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return Err(IpcError::InvalidAllocation("zero bytes".into()));
        }
        let len = bytes
            .checked_next_multiple_of(ALLOCATION_GRANULARITY)
            .ok_or_else(|| {
                IpcError::InvalidAllocation(format!("{bytes} bytes overflow when rounded to 2 MiB"))
            })?;
        self.ctx.make_current()?;
        let buffer = CudaBuffer {
            ptr: result::mem_alloc(len)?,
            len,
            ctx: self.ctx.clone(),
            vmm: false,
        };
        // SAFETY: the whole fresh allocation, not yet shared with anyone.
        unsafe { result::memset_d8(buffer.ptr, 0, len) }?;
        // Zeroed before anyone can export it. The memset ran on the legacy default stream;
        // waiting for that stream alone (not the whole context) never waits on kernels of
        // other ranks that share this context (ranks as threads, `same_process`).
        result::legacy_stream_synchronize()?;
        tracing::trace!(len, ptr = buffer.ptr, "CUDA buffer allocated");
        Ok(buffer)
    }

    fn export(&self, addr: u64, len: usize) -> Result<CudaHandle> {
        let (base, size) = self.check_exportable(addr, len)?;
        let offset = addr - base;
        let device = result::pointer_device_ordinal(addr)?;
        let ipc = result::ipc_get_mem_handle(base)?;
        export_table().insert(ipc, base);
        Ok(CudaHandle {
            ipc,
            base_len: size as u64,
            offset,
            len: len as u64,
            device,
            pid: std::process::id(),
        })
    }

    fn open(&self, h: &CudaHandle) -> Result<CudaMapping> {
        if h.len == 0 || h.offset.checked_add(h.len).is_none_or(|e| e > h.base_len) {
            return Err(IpcError::InvalidHandle(format!(
                "range {}+{} outside a {}-byte allocation (or empty)",
                h.offset, h.len, h.base_len
            )));
        }
        let len = usize::try_from(h.len)
            .map_err(|_| IpcError::InvalidHandle("length out of range".into()))?;
        if h.pid == std::process::id() && self.same_process {
            if h.ipc.iter().all(|&b| b == 0) {
                return Err(IpcError::InvalidHandle("all-zero CUDA IPC handle".into()));
            }
            return self.open_alias(h, len);
        }
        if h.pid == std::process::id() {
            return Err(IpcError::InvalidHandle(format!(
                "the handle was exported by this process (pid {}): CUDA IPC cannot open a \
                 handle in the exporting process; use the local buffer (or \
                 CudaMemory::same_process for ranks that are threads of one process)",
                h.pid
            )));
        }
        if h.ipc.iter().all(|&b| b == 0) {
            return Err(IpcError::InvalidHandle("all-zero CUDA IPC handle".into()));
        }
        let key = (h.ipc, self.ctx.ordinal);
        let mut table = open_table();
        let base = if let Some(entry) = table.get_mut(&key) {
            if entry.size != h.base_len {
                return Err(IpcError::InvalidHandle(format!(
                    "the allocation is {} bytes, the handle says {}",
                    entry.size, h.base_len
                )));
            }
            entry.refs += 1;
            entry.base
        } else {
            self.ctx.make_current()?;
            let base = result::ipc_open_mem_handle(&h.ipc).map_err(|e| owner_gone_or(e, h.pid))?;
            let close = || {
                // SAFETY: opened just above in this context, not handed out.
                if let Err(e) = unsafe { result::ipc_close_mem_handle(base) } {
                    tracing::warn!(error = %e, "closing a refused CUDA IPC mapping failed");
                }
            };
            match result::mem_get_address_range(base) {
                Ok((b, size)) if b == base && size as u64 == h.base_len => {}
                Ok((_, size)) => {
                    close();
                    return Err(IpcError::InvalidHandle(format!(
                        "the allocation is {size} bytes, the handle says {}",
                        h.base_len
                    )));
                }
                Err(e) => {
                    close();
                    return Err(e);
                }
            }
            table.insert(
                key,
                Opened {
                    base,
                    size: h.base_len,
                    refs: 1,
                },
            );
            tracing::trace!(
                base,
                size = h.base_len,
                pid = h.pid,
                "CUDA IPC handle opened"
            );
            base
        };
        Ok(CudaMapping {
            key,
            base,
            offset: h.offset,
            len,
            ctx: self.ctx.clone(),
            released: false,
            alias: false,
            vmm: None,
        })
    }

    fn close(&self, mut mapping: CudaMapping) -> Result<()> {
        mapping.release()
    }

    /// A mapping of another process's memory: after both processes are checkpointed and
    /// restored, the driver refuses to open fresh legacy IPC handles.
    fn checkpoint_blocker(&self, handle: &CudaHandle) -> Option<String> {
        super::cuda_vmm::legacy_checkpoint_blocker(handle.pid, std::process::id())
    }

    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()> {
        cuda_region(region)?;
        check_range(offset, src.len(), region.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.make_current()?;
        self.check_device_memory(region.addr(), region.len())?;
        // SAFETY: `region` is device memory (checked above) that stays mapped while the
        // borrow lives (a CudaBuffer or CudaMapping, checked above), and the range was
        // checked against its length.
        unsafe { result::memcpy_htod(region.addr() + offset as u64, src) }
    }

    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        cuda_region(region)?;
        check_range(offset, dst.len(), region.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.make_current()?;
        self.check_device_memory(region.addr(), region.len())?;
        // SAFETY: as in `write`.
        unsafe { result::memcpy_dtoh(dst, region.addr() + offset as u64) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alias_on_the_importers_device_needs_nothing() {
        assert_eq!(alias_access(0, 0, 0).unwrap(), AliasAccess::SameDevice);
    }

    #[test]
    fn an_alias_on_another_device_needs_peer_access_to_it() {
        assert_eq!(alias_access(0, 3, 3).unwrap(), AliasAccess::Peer(3));
        assert_eq!(alias_access(2, 1, 1).unwrap(), AliasAccess::Peer(1));
    }

    #[test]
    fn an_alias_whose_memory_moved_to_another_device_is_refused() {
        match alias_access(0, 1, 2) {
            Err(IpcError::InvalidHandle(why)) => {
                assert!(
                    why.contains("device 1") && why.contains("device 2"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
