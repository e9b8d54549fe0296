//! Stable addresses: a peer mapping detached (unmapped, its import released, its range kept)
//! and reattached to a fresh handle in the same range; a buffer's memory released and restored
//! at its address.

use std::sync::atomic::Ordering;

use super::allocation::own_allocation;
use super::handle_checks::check_fields;
use super::{CudaPeerHandle, CudaVmmMemory, VmmMapping, NAME};
use crate::backend::cuda::{CudaBuffer, CudaMapping};
use crate::backend::cuda_driver::vmm::{check, entries};
use crate::backend::cuda_region::vmm::{owned, unback, IMPORTED};
use crate::error::{IpcError, Result};
use crate::memory::MemoryRegion;

impl CudaVmmMemory {
    pub(super) fn detach_mapping(&self, mapping: &mut CudaMapping) -> Result<()> {
        let addr = mapping.addr();
        match &mut mapping.vmm {
            None => Err(IpcError::Unsupported {
                backend: NAME,
                what: "keeping the address of a legacy CUDA IPC mapping".into(),
            }),
            Some(VmmMapping::Alias { detached, .. }) => {
                *detached = true;
                Ok(())
            }
            Some(VmmMapping::Imported { phys, size }) => {
                let Some(p) = *phys else {
                    return Ok(());
                };
                let e = entries()?;
                self.ctx().make_current()?;
                // SAFETY: the import's mapping over this mapping's own range; callers
                // (the registry, after the all-reduce drained its launches) no longer use
                // it; copies through it are refused from here on.
                let code = unsafe { (e.unmap)(mapping.base, *size) };
                check(e, "cuMemUnmap", code)?;
                *phys = None;
                IMPORTED.fetch_sub(1, Ordering::SeqCst);
                // SAFETY: the import's handle, released once (its mapping is gone).
                let code = unsafe { (e.release)(p) };
                let released = check(e, "cuMemRelease", code);
                if let Err(err) = released {
                    tracing::warn!(error = %err, addr, "releasing a detached import failed");
                }
                tracing::trace!(addr, "CUDA virtual-memory mapping detached");
                Ok(())
            }
        }
    }

    pub(super) fn reattach_mapping(
        &self,
        mapping: &mut CudaMapping,
        handle: &CudaPeerHandle,
    ) -> Result<()> {
        let addr = mapping.addr();
        let not_kept = |reason: String| IpcError::AddressNotKept { addr, reason };
        let CudaPeerHandle::Vmm(h) = handle else {
            return Err(not_kept(
                "a legacy CUDA IPC handle opens where the driver chooses".into(),
            ));
        };
        let size = check_fields(h, self.granularity)?;
        let (kept_size, detached) = match &mapping.vmm {
            Some(VmmMapping::Imported { phys, size }) => (*size, phys.is_none()),
            Some(VmmMapping::Alias { detached, size }) => (*size, *detached),
            None => return Err(not_kept("a legacy CUDA IPC mapping keeps no range".into())),
        };
        if !detached {
            return Err(not_kept("the mapping is not detached".into()));
        }
        if size != kept_size || h.offset != mapping.offset || h.len as usize != mapping.len {
            return Err(not_kept(format!(
                "the handle names {} bytes at offset {} of a {size}-byte allocation; the kept \
                 range is {} bytes at offset {} of {kept_size}",
                h.len, h.offset, mapping.len, mapping.offset
            )));
        }
        if let Some(VmmMapping::Alias { detached, .. }) = &mut mapping.vmm {
            if h.pid != std::process::id() {
                return Err(not_kept("an alias keeps its own process's address".into()));
            }
            if own_allocation(h, size)? != mapping.base {
                return Err(not_kept("the handle names another allocation".into()));
            }
            *detached = false;
            return Ok(());
        }
        if h.pid == std::process::id() {
            return Err(not_kept("a handle of this process maps as an alias".into()));
        }
        let e = entries()?;
        let phys = self.import(e, h)?;
        self.map_import(e, mapping.base, size, phys)?;
        if let Some(VmmMapping::Imported { phys: kept, .. }) = &mut mapping.vmm {
            *kept = Some(phys);
        }
        tracing::trace!(addr, pid = h.pid, "CUDA virtual-memory mapping reattached");
        Ok(())
    }

    pub(super) fn release_buffer(&self, buffer: &mut CudaBuffer) -> Result<usize> {
        if !buffer.vmm {
            return Err(IpcError::Unsupported {
                backend: NAME,
                what: "releasing the memory of a cuMemAlloc buffer".into(),
            });
        }
        let Some(o) = owned().remove(&buffer.ptr) else {
            return Ok(0);
        };
        let e = entries()?;
        self.ctx().make_current()?;
        let size = o.size;
        unback(e, buffer.ptr, o)?;
        tracing::trace!(va = buffer.ptr, size, "CUDA virtual-memory buffer released");
        Ok(size)
    }

    pub(super) fn restore_buffer(&self, buffer: &mut CudaBuffer) -> Result<()> {
        if !buffer.vmm {
            return Err(IpcError::Unsupported {
                backend: NAME,
                what: "restoring the memory of a cuMemAlloc buffer".into(),
            });
        }
        if owned().contains_key(&buffer.ptr) {
            return Ok(());
        }
        let e = entries()?;
        self.back(e, buffer.ptr, buffer.len)?;
        tracing::trace!(va = buffer.ptr, "CUDA virtual-memory buffer restored");
        Ok(())
    }
}
