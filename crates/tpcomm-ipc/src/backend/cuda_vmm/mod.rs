//! The CUDA virtual-memory backend: device memory shared between processes as POSIX file
//! descriptors, mapped by peers at addresses they keep.
//!
//! [`CudaVmmMemory`] allocates with the driver's virtual-memory API: physical memory
//! (`cuMemCreate`, pinned device memory that may be exported as a POSIX descriptor), a
//! range of device addresses reserved for it (`cuMemAddressReserve`), mapped there
//! (`cuMemMap`) with read/write access for its device (`cuMemSetAccess`). An allocation is
//! exported as a descriptor at its first export (`cuMemExportToShareableHandle`), held for
//! peers to fetch until the registry that shared it closes its mappings
//! ([`PeerMemory::close_exports`]), and exported afresh at the next export.
//!
//! - **Handles.** A [`CudaVmmHandle`] names the owner's pid, the descriptor's number in the
//!   owner and its identity (device, inode, the character device it is), the allocation's
//!   size and the exported range. A peer fetches the descriptor with `pidfd_getfd` (as the
//!   host backend fetches memfds; `/proc/<pid>/fd` cannot serve: reopening a device file
//!   opens the device anew), checks it before the driver sees it, imports it
//!   (`cuMemImportFromShareableHandle`), closes it, reserves a range of its own, maps the
//!   allocation there and gives its device access. The checks, in an order that never waits
//!   on a file system server (a forged handle may name a FUSE file): the identity from the
//!   kernel's cached attributes (`statx` with `AT_STATX_DONT_SYNC`) must be the handle's,
//!   or the handle is [`IpcError::StaleHandle`]; the file must be a character device of the
//!   NVIDIA driver (a major number `/proc/devices` lists under a name starting with
//!   `nvidia`), or it is [`IpcError::NotAnAllocation`] and is closed again (on a thread of
//!   its own unless it is shmem, as the host backend closes refused files). The size is the
//!   driver's: `cuMemMap` of the announced size fails on a smaller allocation, and the
//!   handle is refused. A range must lie inside the announced size.
//! - **Stable addresses.** A mapping [`detach`](PeerMemory::detach)es by unmapping and
//!   releasing its import while its range stays reserved; [`reattach`](PeerMemory::reattach)
//!   imports a fresh handle of the same size and maps it into the same range. The registry
//!   does both across a suspend and resume, so peer addresses (and every table holding them)
//!   stay as they were.
//! - **Memory that goes at a suspend.** [`release_backing`](PeerMemory::release_backing)
//!   unmaps and releases a buffer's physical memory and closes its descriptor, keeping its
//!   range; [`restore_backing`](PeerMemory::restore_backing) creates fresh memory (zeroed),
//!   maps it at the same address and exports it anew. A process checkpoint moves live
//!   exported memory with difficulty (the driver documents shareable-handle memory as
//!   unsupported during a checkpoint, and a natively restored allocation may refuse to be
//!   exported again), so the all-reduce releases its own buffers before and creates them
//!   afresh after.
//! - **Memory users allocate.** Memory the caller allocated with `cuMemAlloc` / `cudaMalloc`
//!   (an engine's tensors, registered as graph buffers) is shared through legacy CUDA IPC,
//!   as [`CudaMemory`] shares it: [`CudaPeerHandle::Legacy`]. Such a mapping cannot keep its
//!   address (the driver chooses it at every open) and, between processes, cannot be opened
//!   again after a process checkpoint (measured on driver 580: `CUDA_ERROR_NOT_PERMITTED`),
//!   which [`checkpoint_blocker`](PeerMemory::checkpoint_blocker) reports.
//! - **Tables.** [`allocate_private`](PeerMemory::allocate_private) allocates with
//!   `cuMemAlloc` (through [`CudaMemory`]): never exported, restored by a checkpoint with its
//!   contents at its address.
//! - **One process, several ranks.** [`CudaVmmMemory::same_process`] opens handles of this
//!   process as aliases of the local allocation (ranks as threads on one GPU), which keep
//!   their address through a release and restore of the allocation by construction.
//!
//! The entry points are resolved at run time in the driver library tpcomm's probe loaded,
//! with the C signatures of `cuda.h` (CUDA 11.4+) and the `#[repr(C)]` structures that
//! `tpcomm_transport::cuda_driver::vmm` declares, so that the layout does not depend on the
//! CUDA version cudarc's bindings were generated for. A driver that lacks them, or a device
//! without virtual memory management or POSIX descriptor handles, is
//! [`IpcError::Unsupported`] naming what is missing.

use std::ffi::c_int;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::cuda::{CudaBuffer, CudaHandle, CudaMapping, CudaMemory, DevicePeerMemory};
use super::cuda_driver::context::PrimaryContext;
use super::cuda_driver::vmm::{self, check, entries, NAME};
use super::cuda_region::vmm::{free_range, owned};
use super::cuda_region::{sealed, VmmMapping};
use crate::error::{IpcError, Result};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Region};

mod allocation;
mod handle_checks;
mod import;
mod stable;

pub use super::cuda::legacy_checkpoint_blocker;
use allocation::{allocation_prop, owned_range};
pub use handle_checks::nvidia_majors;

/// The handle of `len` bytes at `offset` in one virtual-memory allocation of process `pid`,
/// exported as descriptor `fd` there.
///
/// Its serde form is stable: the fields in order (postcard: varints).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaVmmHandle {
    /// Pid of the exporting process.
    pub pid: u32,
    /// The exported descriptor's number in the exporter.
    pub fd: i32,
    /// Device of the descriptor's inode.
    pub dev: u64,
    /// Inode of the descriptor: its identity.
    pub inode: u64,
    /// The character device the descriptor is (`st_rdev`).
    pub rdev: u64,
    /// Size of the whole allocation.
    pub base_len: u64,
    /// Start of the exported range in the allocation.
    pub offset: u64,
    /// Length of the exported range.
    pub len: u64,
    /// Ordinal of the exporter's device, in the exporter's numbering (informational).
    pub device: i32,
}

/// A handle of [`CudaVmmMemory`]: a virtual-memory allocation's descriptor, or legacy CUDA
/// IPC for memory the caller allocated with `cuMemAlloc` / `cudaMalloc`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CudaPeerHandle {
    /// Memory of `cuMemAlloc` (see [`CudaMemory`]).
    Legacy(CudaHandle),
    /// Memory of `cuMemCreate` exported as a POSIX descriptor.
    Vmm(CudaVmmHandle),
}

/// The CUDA virtual-memory peer-memory backend for one device (see the module
/// documentation). Cheap to clone; clones share the retained primary context.
#[derive(Debug, Clone)]
pub struct CudaVmmMemory {
    legacy: CudaMemory,
    granularity: usize,
}

impl CudaVmmMemory {
    /// A backend on device `device_ordinal`: loads the driver, initialises it, retains the
    /// device's primary context, and checks that the device supports virtual memory
    /// management with POSIX descriptor handles.
    ///
    /// Fails with [`IpcError::NoDevice`] as [`CudaMemory::new`] does, and with
    /// [`IpcError::Unsupported`] naming what is missing: the driver's virtual-memory entry
    /// points, `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` or
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
    pub fn new(device_ordinal: i32) -> Result<Self> {
        Self::with(CudaMemory::new(device_ordinal)?)
    }

    /// [`new`](Self::new) for ranks that are threads of one process sharing the device:
    /// handles of this process open as aliases of the local allocation (see
    /// [`CudaMemory::same_process`]).
    pub fn same_process(device_ordinal: i32) -> Result<Self> {
        Self::with(CudaMemory::same_process(device_ordinal)?)
    }

    fn with(legacy: CudaMemory) -> Result<Self> {
        let e = entries()?;
        let ctx = legacy.context();
        let attribute = |attribute: c_int, what: &str| -> Result<()> {
            let mut value: c_int = 0;
            // SAFETY: out-pointer to a local; the driver validates the attribute and device.
            let code = unsafe { (e.attribute)(&mut value, attribute, ctx.device) };
            // A driver that does not know the attribute cannot provide what it names.
            check(e, "cuDeviceGetAttribute", code).map_err(|err| IpcError::Unsupported {
                backend: NAME,
                what: format!("{what} (the driver cannot tell: {err})"),
            })?;
            if value == 0 {
                return Err(IpcError::Unsupported {
                    backend: NAME,
                    what: format!("{what} on device {}", ctx.ordinal),
                });
            }
            Ok(())
        };
        attribute(vmm::ATTRIBUTE_VMM, "virtual memory management")?;
        attribute(
            vmm::ATTRIBUTE_POSIX_FD,
            "POSIX file descriptor handles of allocations",
        )?;
        let prop = allocation_prop(ctx.ordinal);
        let mut granularity = 0usize;
        ctx.make_current()?;
        // SAFETY: out-pointer to a local; `prop` is a valid property block for the call.
        let code = unsafe { (e.granularity)(&mut granularity, &prop, vmm::GRANULARITY_MINIMUM) };
        check(e, "cuMemGetAllocationGranularity", code)?;
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(IpcError::Unsupported {
                backend: NAME,
                what: format!("an allocation granularity of {granularity} bytes"),
            });
        }
        tracing::debug!(
            device = ctx.ordinal,
            granularity,
            "CUDA virtual-memory peer-memory backend ready"
        );
        Ok(Self {
            legacy,
            granularity,
        })
    }

    /// The granularity allocations are rounded to (the driver's minimum for pinned device
    /// memory with POSIX descriptor handles; 2 MiB on current GPUs).
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The legacy CUDA IPC backend this one shares memory the caller allocated through.
    pub fn legacy(&self) -> &CudaMemory {
        &self.legacy
    }

    /// The device ordinal this backend allocates on and maps into.
    pub fn device_ordinal(&self) -> i32 {
        self.legacy.device_ordinal()
    }

    /// Makes this backend's primary context current on the calling thread.
    pub fn bind_to_thread(&self) -> Result<()> {
        self.legacy.bind_to_thread()
    }

    /// True for a [`same_process`](Self::same_process) backend.
    pub fn is_same_process(&self) -> bool {
        self.legacy.is_same_process()
    }

    /// Whether `len` bytes at `addr` can be exported: inside an allocation of this backend
    /// (mapped now), or memory legacy CUDA IPC exports ([`CudaMemory::check_exportable`]).
    pub fn check_exportable(&self, addr: u64, len: usize) -> Result<()> {
        if owned_range(&owned(), addr, len).is_some() {
            return Ok(());
        }
        self.legacy.check_exportable(addr, len).map(drop)
    }

    fn ctx(&self) -> &Arc<PrimaryContext> {
        self.legacy.context()
    }

    /// Whether `region` (one of this crate's CUDA types) is backed now.
    fn check_backed<R: MemoryRegion>(&self, region: &R) -> Result<()> {
        let any = region.as_any();
        let unbacked = |what| IpcError::Unbacked {
            addr: region.addr(),
            len: region.len(),
            what,
        };
        if let Some(b) = any.downcast_ref::<CudaBuffer>() {
            if b.vmm && !owned().contains_key(&b.ptr) {
                return Err(unbacked("a released buffer"));
            }
            return Ok(());
        }
        if let Some(m) = any.downcast_ref::<CudaMapping>() {
            return match &m.vmm {
                Some(VmmMapping::Imported { phys: None, .. })
                | Some(VmmMapping::Alias { detached: true, .. }) => {
                    Err(unbacked("a detached mapping"))
                }
                _ => Ok(()),
            };
        }
        Err(IpcError::ForeignRegion {
            backend: NAME,
            region: std::any::type_name::<R>(),
        })
    }
}

impl PeerMemory for CudaVmmMemory {
    type Handle = CudaPeerHandle;

    type Buffer = CudaBuffer;

    type Mapping = CudaMapping;

    fn name(&self) -> &'static str {
        NAME
    }

    fn allocate(&self, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return Err(IpcError::InvalidAllocation("zero bytes".into()));
        }
        let size = bytes
            .checked_next_multiple_of(self.granularity)
            .ok_or_else(|| {
                IpcError::InvalidAllocation(format!(
                    "{bytes} bytes overflow when rounded to {} bytes",
                    self.granularity
                ))
            })?;
        let e = entries()?;
        let va = self.reserve(e, size)?;
        if let Err(err) = self.back(e, va, size) {
            free_range(e, va, size);
            return Err(err);
        }
        tracing::trace!(size, va, "CUDA virtual-memory buffer allocated");
        Ok(CudaBuffer {
            ptr: va,
            len: size,
            ctx: self.ctx().clone(),
            vmm: true,
        })
    }

    /// `cuMemAlloc` memory (through [`CudaMemory`]): never exported by the all-reduce, and
    /// brought back by a process checkpoint with its contents at its address.
    fn allocate_private(&self, bytes: usize) -> Result<CudaBuffer> {
        self.legacy.allocate(bytes)
    }

    fn export(&self, addr: u64, len: usize) -> Result<CudaPeerHandle> {
        let mut table = owned();
        let Some((base, _)) = owned_range(&table, addr, len) else {
            drop(table);
            return self.legacy.export(addr, len).map(CudaPeerHandle::Legacy);
        };
        let e = entries()?;
        self.ctx().make_current()?;
        let o = table.get_mut(&base).expect("found just above");
        let (fd, id) = self.exported(e, base, o)?;
        Ok(CudaPeerHandle::Vmm(CudaVmmHandle {
            pid: std::process::id(),
            fd,
            dev: id.dev,
            inode: id.inode,
            rdev: id.rdev,
            base_len: o.size as u64,
            offset: addr - base,
            len: len as u64,
            device: o.device,
        }))
    }

    /// Closes the exported descriptors of the allocations holding `regions`: peers that
    /// imported keep their imports, handles exported before go stale, and the next export
    /// makes a fresh descriptor. A process checkpoint then finds no descriptor of them open.
    fn close_exports(&self, regions: &mut dyn Iterator<Item = Region>) {
        let mut table = owned();
        for r in regions {
            let base = owned_range(&table, r.addr, r.len).map(|(base, _)| base);
            if let Some(o) = base.and_then(|b| table.get_mut(&b)) {
                o.exported = None;
            }
        }
    }

    fn export_all(&self, regions: &[Region]) -> Result<Vec<CudaPeerHandle>> {
        regions.iter().map(|r| self.export(r.addr, r.len)).collect()
    }

    fn open(&self, handle: &CudaPeerHandle) -> Result<CudaMapping> {
        match handle {
            CudaPeerHandle::Legacy(h) => self.legacy.open(h),
            CudaPeerHandle::Vmm(h) => self.open_vmm(h),
        }
    }

    fn close(&self, mapping: CudaMapping) -> Result<()> {
        self.legacy.close(mapping)
    }

    fn keeps_addresses(&self) -> bool {
        true
    }

    fn detach(&self, mapping: &mut CudaMapping) -> Result<()> {
        self.detach_mapping(mapping)
    }

    fn reattach(&self, mapping: &mut CudaMapping, handle: &CudaPeerHandle) -> Result<()> {
        self.reattach_mapping(mapping, handle)
    }

    fn releases_backing(&self) -> bool {
        true
    }

    fn release_backing(&self, buffer: &mut CudaBuffer) -> Result<usize> {
        self.release_buffer(buffer)
    }

    fn restore_backing(&self, buffer: &mut CudaBuffer) -> Result<()> {
        self.restore_buffer(buffer)
    }

    fn checkpoint_blocker(&self, handle: &CudaPeerHandle) -> Option<String> {
        match handle {
            CudaPeerHandle::Legacy(h) => legacy_checkpoint_blocker(h.pid, std::process::id()),
            CudaPeerHandle::Vmm(_) => None,
        }
    }

    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()> {
        self.check_backed(region)?;
        check_range(offset, src.len(), region.len())?;
        self.legacy.write(region, offset, src)
    }

    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_backed(region)?;
        check_range(offset, dst.len(), region.len())?;
        self.legacy.read(region, offset, dst)
    }
}

impl sealed::Sealed for CudaVmmMemory {}

impl DevicePeerMemory for CudaVmmMemory {
    fn device_ordinal(&self) -> i32 {
        CudaVmmMemory::device_ordinal(self)
    }
    fn bind_to_thread(&self) -> Result<()> {
        CudaVmmMemory::bind_to_thread(self)
    }
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()> {
        self.check_exportable(addr, len)
    }
}

#[cfg(test)]
mod tests;
