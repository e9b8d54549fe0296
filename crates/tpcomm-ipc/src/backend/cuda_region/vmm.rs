//! Virtual memory's records of device memory, process-wide: this process's allocations mapped
//! now ([`owned`]) and the peer imports mapped now ([`IMPORTED`]); and how a buffer's or a
//! mapping's memory is unmapped, released and its range freed.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::CUdeviceptr;

use super::VmmMapping;
use crate::backend::cuda_driver::context::PrimaryContext;
use crate::backend::cuda_driver::vmm::{check, entries, Entries};
use crate::backend::descriptor::Identity;
use crate::error::Result;

/// One allocation of this process, mapped now.
pub(crate) struct Owned {
    pub(crate) size: usize,
    pub(crate) phys: u64,
    pub(crate) device: i32,
    /// The descriptor exported for peers to fetch, and what it is; made by the first export
    /// and closed by [`PeerMemory::close_exports`] (every peer has imported by then).
    ///
    /// [`PeerMemory::close_exports`]: crate::PeerMemory::close_exports
    pub(crate) exported: Option<(OwnedFd, Identity)>,
}

/// The allocations of this process that are mapped now, by base address (for `export`, and
/// for same-process opens). A buffer whose backing is released has no entry.
pub(crate) fn owned() -> MutexGuard<'static, BTreeMap<u64, Owned>> {
    static TABLE: Mutex<BTreeMap<u64, Owned>> = Mutex::new(BTreeMap::new());
    // Nothing panics while holding the lock.
    TABLE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Peer allocations imported and mapped now, over every backend of this process.
pub(crate) static IMPORTED: AtomicUsize = AtomicUsize::new(0);

/// Peer allocations this process imports and maps now (detached ones hold only addresses).
pub(crate) fn imported_now() -> usize {
    IMPORTED.load(Ordering::SeqCst)
}

/// Frees a reservation (logging a failure).
pub(crate) fn free_range(e: &Entries, va: CUdeviceptr, size: usize) {
    // SAFETY: a reservation of the VMM backend with nothing mapped in it, freed once.
    let code = unsafe { (e.address_free)(va, size) };
    if let Err(err) = check(e, "cuMemAddressFree", code) {
        tracing::warn!(error = %err, "freeing a device address reservation failed");
    }
}

/// Unmaps and releases an allocation of this process that was mapped at `va` (its entry
/// was just removed from the table).
pub(crate) fn unback(e: &Entries, va: CUdeviceptr, o: Owned) -> Result<()> {
    // SAFETY: the allocation's mapping made by `back`, unmapped once (its entry is gone);
    // peers that imported it keep their own reference to the memory.
    let code = unsafe { (e.unmap)(va, o.size) };
    let unmapped = check(e, "cuMemUnmap", code);
    // SAFETY: the allocation handle made by `back`, released once.
    let code = unsafe { (e.release)(o.phys) };
    let released = check(e, "cuMemRelease", code);
    drop(o.exported);
    unmapped.and(released)
}

/// `Drop` of a [`CudaBuffer`] of the VMM backend: unmaps and releases its memory (if backed)
/// and frees its range.
///
/// [`CudaBuffer`]: super::CudaBuffer
pub(crate) fn free_buffer(ptr: CUdeviceptr, len: usize, ctx: &PrimaryContext) {
    let Ok(e) = entries() else {
        return;
    };
    let entry = owned().remove(&ptr);
    let freed = ctx.make_current().and_then(|()| {
        if let Some(o) = entry {
            unback(e, ptr, o)?;
        }
        free_range(e, ptr, len);
        Ok(())
    });
    if let Err(err) = freed {
        tracing::warn!(error = %err, "freeing a CUDA virtual-memory buffer failed");
    }
}

/// [`CudaMapping`]'s release for a mapping of the VMM backend: unmaps and releases the import
/// (if mapped) and frees the range (an alias owns neither).
///
/// [`CudaMapping`]: super::CudaMapping
pub(crate) fn release_mapping(
    base: CUdeviceptr,
    vmm: VmmMapping,
    ctx: &PrimaryContext,
) -> Result<()> {
    let VmmMapping::Imported { phys, size } = vmm else {
        return Ok(());
    };
    let e = entries()?;
    ctx.make_current()?;
    let mut outcome = Ok(());
    if let Some(phys) = phys {
        // SAFETY: the import's mapping over the mapping's own range, unmapped once.
        let code = unsafe { (e.unmap)(base, size) };
        outcome = check(e, "cuMemUnmap", code);
        // SAFETY: the import's handle, released once.
        let code = unsafe { (e.release)(phys) };
        outcome = outcome.and(check(e, "cuMemRelease", code));
        IMPORTED.fetch_sub(1, Ordering::SeqCst);
    }
    free_range(e, base, size);
    outcome
}
