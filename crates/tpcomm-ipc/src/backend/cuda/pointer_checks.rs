//! What the driver's pointer attributes say an address is: memory legacy CUDA IPC can export
//! (and, if not, which kind it is), and device memory a copy may touch.

use super::CudaMemory;
use crate::backend::cuda_driver::result;
use crate::error::{IpcError, Result};

impl CudaMemory {
    /// Fails unless `addr` is device memory (so a host region never reaches a device copy).
    pub(super) fn check_device_memory(&self, addr: u64, len: usize) -> Result<()> {
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
    /// [`allocate`](crate::PeerMemory::allocate) and pass [`CudaBuffer::view`] wherever cudarc
    /// takes a `DevicePtr` / `DevicePtrMut`.
    ///
    /// [`PeerMemory::export`]: crate::PeerMemory::export
    /// [`CudaBuffer::view`]: super::CudaBuffer::view
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
