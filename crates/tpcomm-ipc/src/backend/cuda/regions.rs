//! The regions this backend hands out: its buffers (`CudaBuffer`, `cuMemAlloc` memory freed
//! on drop) and the mappings of peers' allocations (`CudaMapping`, closed with the last
//! mapping of the allocation), with their traits and release.

use std::fmt;

use super::alias::export_table;
use super::opened::open_table;
use super::{CudaBuffer, CudaMapping};
use crate::backend::cuda_driver::result;
use crate::error::Result;
use crate::memory::{MemoryRegion, Sealed};

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
    pub(super) fn release(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) || self.alias {
            return Ok(());
        }
        if let Some(vmm) = self.vmm.take() {
            return crate::backend::cuda_vmm::release_mapping(self.base, vmm, &self.ctx);
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
            return crate::backend::cuda_vmm::free_buffer(self.ptr, self.len, &self.ctx);
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
