//! This process's allocations: physical memory created and mapped into a reservation of its
//! own, exported as a descriptor at its first export (renewed first where the driver refuses
//! to export a restored allocation again), unmapped and released with its buffer.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::CUdeviceptr;

use super::{CudaVmmHandle, CudaVmmMemory};
use crate::backend::cuda_driver::result;
use crate::backend::cuda_driver::vmm::{
    self, check, AccessDesc, AllocFlags, AllocationProp, Entries, Location,
};
use crate::backend::cuda_region::vmm::{free_range, owned, Owned};
use crate::backend::descriptor::{self, Identity, IfStatxRefused};
use crate::error::{IpcError, Result};

/// The properties of every allocation of this backend on device `ordinal`.
pub(super) fn allocation_prop(ordinal: i32) -> AllocationProp {
    AllocationProp {
        kind: vmm::ALLOCATION_PINNED,
        requested_handle_types: vmm::HANDLE_POSIX_FD,
        location: Location {
            kind: vmm::LOCATION_DEVICE,
            id: ordinal,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: AllocFlags::default(),
    }
}

/// Read/write access for device `ordinal`.
pub(super) fn access(ordinal: i32) -> AccessDesc {
    AccessDesc {
        location: Location {
            kind: vmm::LOCATION_DEVICE,
            id: ordinal,
        },
        flags: vmm::ACCESS_READWRITE,
    }
}

impl CudaVmmMemory {
    /// Creates physical memory of `size` bytes and maps it at `va` (a reservation of this
    /// backend of `size` bytes with nothing mapped in it) with access for this device, zeroed
    /// when `zero`; its handle. On failure, whatever was made is undone and `va` stays
    /// reserved.
    pub(super) fn create_mapped(
        &self,
        e: &Entries,
        va: CUdeviceptr,
        size: usize,
        zero: bool,
    ) -> Result<u64> {
        let ordinal = self.device_ordinal();
        let prop = allocation_prop(ordinal);
        self.ctx().make_current()?;
        let mut phys = 0u64;
        // SAFETY: out-pointer to a local; `prop` is valid for the call.
        let code = unsafe { (e.create)(&mut phys, size, &prop, 0) };
        check(e, "cuMemCreate", code)?;
        let release = |e: &Entries| {
            // SAFETY: `phys` was created above and is released once, here, on failure.
            let code = unsafe { (e.release)(phys) };
            if let Err(err) = check(e, "cuMemRelease", code) {
                tracing::warn!(error = %err, "releasing a refused allocation failed");
            }
        };
        // SAFETY: `va..va + size` is a reservation of this backend with nothing mapped in
        // it (the caller's contract); `phys` holds `size` bytes.
        let code = unsafe { (e.map)(va, size, 0, phys, 0) };
        if let Err(err) = check(e, "cuMemMap", code) {
            release(e);
            return Err(err);
        }
        let unmap = |e: &Entries| {
            // SAFETY: mapped above, unmapped once on failure; nothing else uses it yet.
            let code = unsafe { (e.unmap)(va, size) };
            if let Err(err) = check(e, "cuMemUnmap", code) {
                tracing::warn!(error = %err, "unmapping a refused allocation failed");
            }
            release(e);
        };
        let desc = access(ordinal);
        // SAFETY: the range was just mapped; one access descriptor.
        let granted = unsafe { (e.set_access)(va, size, &desc, 1) };
        let made = check(e, "cuMemSetAccess", granted).and_then(|()| {
            if !zero {
                return Ok(());
            }
            // SAFETY: the fresh mapping, readable and writable by this device, not shared.
            unsafe { result::memset_d8(va, 0, size) }?;
            result::legacy_stream_synchronize()
        });
        if let Err(err) = made {
            unmap(e);
            return Err(err);
        }
        Ok(phys)
    }

    /// Fresh zeroed physical memory of `size` bytes mapped at `va` (a reservation of this
    /// backend with nothing mapped in it), recorded as an allocation of this process.
    pub(super) fn back(&self, e: &Entries, va: CUdeviceptr, size: usize) -> Result<()> {
        let phys = self.create_mapped(e, va, size, true)?;
        owned().insert(
            va,
            Owned {
                size,
                phys,
                device: self.device_ordinal(),
                exported: None,
            },
        );
        Ok(())
    }

    /// Exports the allocation at `base` (made before or now); its descriptor's number and
    /// identity. A restored allocation that the driver refuses to export again is renewed
    /// first ([`Self::renew`]): fresh physical memory with its contents, at its address.
    pub(super) fn exported(
        &self,
        e: &Entries,
        base: CUdeviceptr,
        o: &mut Owned,
    ) -> Result<(i32, Identity)> {
        if let Some((fd, id)) = &o.exported {
            return Ok((fd.as_raw_fd(), *id));
        }
        let made = match export_descriptor(e, o.phys) {
            Ok(made) => made,
            Err(IpcError::Cuda { code, name, .. }) => {
                tracing::debug!(
                    base,
                    code,
                    %name,
                    "the driver refuses to export an allocation again: renewing it"
                );
                self.renew(e, base, o)?;
                export_descriptor(e, o.phys)?
            }
            Err(err) => return Err(err),
        };
        let out = (made.0.as_raw_fd(), made.1);
        o.exported = Some(made);
        Ok(out)
    }

    /// Replaces the physical memory under the allocation at `base` with fresh memory holding
    /// the same bytes, mapped at the same address: what a natively restored allocation
    /// needs when the driver refuses to export it again. The bytes go through a second,
    /// temporary mapping of the fresh memory (a device-to-device copy); the old memory is
    /// released.
    pub(super) fn renew(&self, e: &Entries, base: CUdeviceptr, o: &mut Owned) -> Result<()> {
        let size = o.size;
        let temp = self.reserve(e, size)?;
        let fresh = match self.create_mapped(e, temp, size, false) {
            Ok(phys) => phys,
            Err(err) => {
                free_range(e, temp, size);
                return Err(err);
            }
        };
        // SAFETY: both ranges are mapped, `size` bytes each, readable and writable by this
        // device; the copy is synchronous.
        let code = unsafe { (e.copy)(temp, base, size) };
        let copied = check(e, "cuMemcpyDtoD_v2", code);
        // SAFETY: the temporary mapping made above, unmapped once; `fresh` keeps the memory.
        let code = unsafe { (e.unmap)(temp, size) };
        let unmapped = check(e, "cuMemUnmap", code);
        free_range(e, temp, size);
        if let Err(err) = copied.and(unmapped) {
            // SAFETY: `fresh` is mapped nowhere now, released once.
            let _ = unsafe { (e.release)(fresh) };
            return Err(err);
        }
        // SAFETY: the allocation's own mapping at `base`, replaced below; nobody uses the
        // buffer during a resume.
        let code = unsafe { (e.unmap)(base, size) };
        check(e, "cuMemUnmap", code)?;
        // SAFETY: the old memory, mapped nowhere now, released once.
        let code = unsafe { (e.release)(o.phys) };
        if let Err(err) = check(e, "cuMemRelease", code) {
            tracing::warn!(error = %err, "releasing renewed memory failed");
        }
        o.phys = fresh;
        // SAFETY: `base..base + size` is the allocation's reservation, empty since the
        // unmap above; `fresh` holds `size` bytes.
        let code = unsafe { (e.map)(base, size, 0, fresh, 0) };
        check(e, "cuMemMap", code)?;
        let desc = access(self.device_ordinal());
        // SAFETY: the range was just mapped; one access descriptor.
        let code = unsafe { (e.set_access)(base, size, &desc, 1) };
        check(e, "cuMemSetAccess", code)?;
        tracing::debug!(base, size, "allocation renewed with its contents");
        Ok(())
    }

    /// Reserves `size` bytes of device addresses aligned to the granularity.
    pub(super) fn reserve(&self, e: &Entries, size: usize) -> Result<CUdeviceptr> {
        self.ctx().make_current()?;
        let mut va = 0u64;
        // SAFETY: out-pointer to a local; a reservation maps nothing.
        let code = unsafe { (e.reserve)(&mut va, size, self.granularity, 0, 0) };
        check(e, "cuMemAddressReserve", code)?;
        Ok(va)
    }
}

/// Exports allocation handle `phys` as a POSIX descriptor: the descriptor and its identity.
fn export_descriptor(e: &Entries, phys: u64) -> Result<(OwnedFd, Identity)> {
    let mut raw: c_int = -1;
    let out = (&mut raw as *mut c_int).cast::<c_void>();
    // SAFETY: for a POSIX descriptor handle the driver writes an `int` at `out`.
    let code = unsafe { (e.export)(out, phys, vmm::HANDLE_POSIX_FD, 0) };
    check(e, "cuMemExportToShareableHandle", code)?;
    if raw < 0 {
        return Err(IpcError::InvalidAllocation(format!(
            "cuMemExportToShareableHandle gave descriptor {raw}"
        )));
    }
    // SAFETY: the driver made this descriptor for this process and gave it to us; nothing
    // else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let id = descriptor::cached_identity(fd.as_fd(), IfStatxRefused::Fail)?;
    Ok((fd, id))
}

/// The allocation of this process that `h` names (by descriptor and identity), mapped now at
/// its base with `size` bytes; its base.
pub(super) fn own_allocation(h: &CudaVmmHandle, size: usize) -> Result<CUdeviceptr> {
    let table = owned();
    let found = table.iter().find(|(_, o)| {
        o.exported.as_ref().is_some_and(|(fd, id)| {
            fd.as_raw_fd() == h.fd && id.inode == h.inode && id.dev == h.dev
        })
    });
    match found {
        Some((&base, o)) if o.size == size => Ok(base),
        Some((_, o)) => Err(IpcError::InvalidHandle(format!(
            "the allocation is {} bytes, the handle says {size}",
            o.size
        ))),
        None => Err(IpcError::StaleHandle(format!(
            "no allocation of this process is exported as descriptor {} (inode {})",
            h.fd, h.inode
        ))),
    }
}

/// The allocation of `table` that holds `addr..addr + len`: its base and entry.
pub(super) fn owned_range(
    table: &BTreeMap<u64, Owned>,
    addr: u64,
    len: usize,
) -> Option<(u64, &Owned)> {
    let (&base, o) = table.range(..=addr).next_back()?;
    let end = addr.checked_add(len as u64)?;
    (len > 0 && end <= base + o.size as u64).then_some((base, o))
}
