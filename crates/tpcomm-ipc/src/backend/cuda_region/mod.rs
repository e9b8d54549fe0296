//! The regions both CUDA backends hand out, below them both (neither backend is imported
//! here): buffers (`CudaBuffer`: `cuMemAlloc` memory of `CudaMemory`, or a virtual-memory
//! allocation of `CudaVmmMemory`, freed on drop) and mappings of peers' allocations
//! (`CudaMapping`: a legacy IPC mapping closed with the last mapping of its allocation, or a
//! virtual-memory import), with their traits and release; the process-wide records their
//! release updates ([`legacy`], [`vmm`]) and what they count ([`imported_allocations`]);
//! their cudarc views ([`BufferView`]); and `DevicePeerMemory`, the backends whose regions
//! they are.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;

use self::legacy::{export_table, open_table, OpenKey};
use crate::backend::cuda_driver::context::PrimaryContext;
use crate::backend::cuda_driver::result;
use crate::error::Result;
use crate::memory::{MemoryRegion, Sealed};

mod buffer_view;
mod device_peer_memory;
pub(crate) mod legacy;
pub(crate) mod vmm;

pub use buffer_view::BufferView;
pub(crate) use device_peer_memory::sealed;
pub use device_peer_memory::DevicePeerMemory;

/// A device allocation of this process (`cuMemAlloc`, a multiple of 2 MiB, zeroed), freed
/// on drop. Peers map it through [`CudaHandle`](crate::CudaHandle)s.
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
/// [`PeerMemory::close`](crate::PeerMemory::close), which reports failures.
pub struct CudaMapping {
    pub(crate) key: OpenKey,
    pub(crate) base: CUdeviceptr,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) ctx: Arc<PrimaryContext>,
    pub(crate) released: bool,
    /// A same-process alias of this process's own allocation
    /// ([`CudaMemory::same_process`](crate::CudaMemory::same_process)):
    /// nothing was opened in the driver, nothing is closed.
    pub(crate) alias: bool,
    /// Opened by `CudaVmmMemory` from a virtual-memory handle: how it maps the peer's
    /// allocation (`key` and `alias` are then unused).
    pub(crate) vmm: Option<VmmMapping>,
}

/// How a mapping of [`CudaVmmMemory`](crate::CudaVmmMemory) maps its peer's virtual-memory
/// allocation.
#[derive(Debug)]
pub(crate) enum VmmMapping {
    /// Imported and mapped over the whole reserved range at the mapping's base: `phys` is the
    /// imported allocation handle, `None` while detached.
    Imported { phys: Option<u64>, size: usize },
    /// This process's own allocation, seen at its own address (ranks as threads).
    Alias { detached: bool, size: usize },
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
///
/// [`CudaMemory`]: crate::CudaMemory
/// [`CudaMemory::same_process`]: crate::CudaMemory::same_process
pub fn imported_allocations() -> usize {
    open_table().len() + vmm::imported_now()
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
    pub(crate) fn release(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) || self.alias {
            return Ok(());
        }
        if let Some(vmm) = self.vmm.take() {
            return vmm::release_mapping(self.base, vmm, &self.ctx);
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
            return vmm::free_buffer(self.ptr, self.len, &self.ctx);
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
