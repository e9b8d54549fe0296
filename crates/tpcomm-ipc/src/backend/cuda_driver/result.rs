//! The checked layer over cudarc's `driver::sys`: one function per driver call the CUDA
//! backends make through cudarc. Every function first makes sure the driver library is
//! loaded and complete ([`load`]), so none of them can reach cudarc's loader panic; every
//! `CUresult` other than `CUDA_SUCCESS` becomes [`IpcError::Cuda`] (`call`, raw `code`,
//! `cuGetErrorName`, `cuGetErrorString`). Functions that take raw device addresses the
//! driver cannot fully validate (frees, closes, copies) are `unsafe`.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdeviceptr, CUipcMem_flags, CUpointer_attribute, CUresult,
};
use tpcomm_transport::cuda_driver::cudarc_probes::LEGACY_IPC;

use super::cuda_error;
use crate::error::{IpcError, Result};

/// Size of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// `CU_MEMORYTYPE_DEVICE`, as [`pointer_memory_type`] returns it.
pub const MEMORYTYPE_DEVICE: u32 = 2;

fn try_load() -> std::result::Result<(), String> {
    let missing = tpcomm_transport::cuda_driver::missing_symbols(LEGACY_IPC)?;
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
    let missing =
        tpcomm_transport::cuda_driver::missing_symbols(names).map_err(IpcError::NoDevice)?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(IpcError::NoDevice(format!(
            "the CUDA driver library lacks {missing:?}: the driver is too old"
        )))
    }
}

/// Loads the driver library (once per process) and checks that it exports every function
/// of this module (`tpcomm_transport::cuda_driver::cudarc_probes::LEGACY_IPC`). Fails with
/// [`IpcError::NoDevice`] when the library is missing or incomplete; never panics. Every
/// other function here calls it first.
pub fn load() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(try_load)
        .clone()
        .map_err(IpcError::NoDevice)
}

/// The error of driver function `call` that returned `code` (not `CUDA_SUCCESS`).
pub fn error(call: &'static str, code: CUresult) -> IpcError {
    let ok = CUresult::CUDA_SUCCESS;
    cuda_error(
        call,
        code as i32,
        // SAFETY: out-pointer to the caller's local; the driver stores a pointer to a static
        // string (or fails for a code it does not know, leaving it null).
        |name| unsafe { sys::cuGetErrorName(code, name) } == ok,
        // SAFETY: as above.
        |message| unsafe { sys::cuGetErrorString(code, message) } == ok,
        || format!("{code:?}"),
    )
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
