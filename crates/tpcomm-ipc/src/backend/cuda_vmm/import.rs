//! Peers' allocations: a handle's descriptor fetched (`pidfd_getfd`) and checked before the
//! driver sees it, imported, mapped into a reservation of this process, and released with the
//! mapping; this process's own handles open as aliases in a same-process backend.

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use cudarc::driver::sys::CUdeviceptr;

use super::allocation::{access, own_allocation};
use super::handle_checks::{check_descriptor, check_fields, machine_majors, DescriptorProblem};
use super::{CudaVmmHandle, CudaVmmMemory, VmmMapping, NAME};
use crate::backend::cuda::CudaMapping;
use crate::backend::cuda_driver::result;
use crate::backend::cuda_driver::vmm::{self, check, entries, Entries};
use crate::backend::cuda_region::vmm::{free_range, IMPORTED};
use crate::backend::descriptor::{self, Got, IfStatxRefused, Pidfd};
use crate::error::{IpcError, Result};

/// Fetches descriptor `fd` of process `pid` with `pidfd_getfd`.
fn fetch(pid: u32, fd: i32) -> Result<OwnedFd> {
    let owner = descriptor::process(pid)
        .map_err(|_| IpcError::InvalidHandle(format!("pid {pid} is not a process id")))?;
    let pidfd = match descriptor::open_pidfd(owner, pid)? {
        Pidfd::Open(p) => p,
        Pidfd::Refused(source) => {
            return Err(IpcError::Os {
                call: "pidfd_open",
                source,
            })
        }
    };
    match descriptor::get_fd(&pidfd, pid, fd)? {
        Got::Fd(got) => Ok(got),
        Got::Refused => Err(IpcError::Unsupported {
            backend: NAME,
            what: format!(
                "fetching descriptor {fd} of pid {pid}: pidfd_getfd is not allowed here \
                 (ptrace restrictions, or a kernel before 5.6)"
            ),
        }),
    }
}

impl CudaVmmMemory {
    /// Fetches, checks and imports the allocation `h` names (`size` bytes, checked by
    /// [`check_fields`]); its allocation handle.
    pub(super) fn import(&self, e: &Entries, h: &CudaVmmHandle) -> Result<u64> {
        let fd = descriptor::checked(fetch(h.pid, h.fd)?, |fd| {
            let id = descriptor::cached_identity(fd.as_fd(), IfStatxRefused::Fail)?;
            check_descriptor(h, &id, machine_majors()).map_err(|problem| match problem {
                DescriptorProblem::Stale => IpcError::StaleHandle(format!(
                    "descriptor {} of pid {} names inode {} now, not inode {}",
                    h.fd, h.pid, id.inode, h.inode
                )),
                DescriptorProblem::Foreign(found) => IpcError::NotAnAllocation {
                    pid: h.pid,
                    fd: h.fd,
                    found,
                },
            })
        })?;
        self.ctx().make_current()?;
        let mut phys = 0u64;
        // SAFETY: out-pointer to a local; for a POSIX descriptor handle the driver takes the
        // descriptor's number as the pointer value, and `fd` stays open for the call.
        let code = unsafe {
            (e.import)(
                &mut phys,
                fd.as_raw_fd() as usize as *mut c_void,
                vmm::HANDLE_POSIX_FD,
            )
        };
        // The import holds the allocation; the descriptor is not needed any more.
        drop(fd);
        check(e, "cuMemImportFromShareableHandle", code)?;
        Ok(phys)
    }

    /// Maps the imported allocation `phys` over `va..va + size` with access for this device;
    /// releases `phys` on failure (the range stays reserved).
    pub(super) fn map_import(
        &self,
        e: &Entries,
        va: CUdeviceptr,
        size: usize,
        phys: u64,
    ) -> Result<()> {
        let release = || {
            // SAFETY: `phys` is the caller's import, released once here on failure.
            let code = unsafe { (e.release)(phys) };
            if let Err(err) = check(e, "cuMemRelease", code) {
                tracing::warn!(error = %err, "releasing a refused import failed");
            }
        };
        // SAFETY: `va..va + size` is this mapping's reservation with nothing mapped in it;
        // the driver refuses a size larger than the allocation.
        let code = unsafe { (e.map)(va, size, 0, phys, 0) };
        let mapped = check(e, "cuMemMap", code);
        if let Err(err) = mapped {
            release();
            return Err(match err {
                IpcError::Cuda { code, name, .. } => IpcError::InvalidHandle(format!(
                    "the allocation cannot be mapped with the {size} bytes the handle \
                     announces ({name}, code {code}): it is smaller, or not this device's"
                )),
                other => other,
            });
        }
        let desc = access(self.device_ordinal());
        // SAFETY: the range was just mapped; one access descriptor.
        let code = unsafe { (e.set_access)(va, size, &desc, 1) };
        let granted = check(e, "cuMemSetAccess", code);
        if let Err(err) = granted {
            // SAFETY: mapped above, unmapped once on failure.
            let _ = unsafe { (e.unmap)(va, size) };
            release();
            return Err(err);
        }
        IMPORTED.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    pub(super) fn open_vmm(&self, h: &CudaVmmHandle) -> Result<CudaMapping> {
        let e = entries()?;
        let size = check_fields(h, self.granularity)?;
        let len = h.len as usize;
        if h.pid == std::process::id() {
            return self.open_alias(h, size, len);
        }
        let phys = self.import(e, h)?;
        let va = match self.reserve(e, size) {
            Ok(va) => va,
            Err(err) => {
                // SAFETY: imported above, released once on failure.
                let _ = unsafe { (e.release)(phys) };
                return Err(err);
            }
        };
        if let Err(err) = self.map_import(e, va, size, phys) {
            free_range(e, va, size);
            return Err(err);
        }
        tracing::trace!(
            va,
            size,
            pid = h.pid,
            "CUDA virtual-memory allocation imported"
        );
        Ok(self.mapping(
            va,
            h.offset,
            len,
            VmmMapping::Imported {
                phys: Some(phys),
                size,
            },
        ))
    }

    pub(super) fn mapping(
        &self,
        base: CUdeviceptr,
        offset: u64,
        len: usize,
        vmm: VmmMapping,
    ) -> CudaMapping {
        CudaMapping {
            key: ([0; result::IPC_HANDLE_BYTES], self.device_ordinal()),
            base,
            offset,
            len,
            ctx: self.ctx().clone(),
            released: false,
            alias: false,
            vmm: Some(vmm),
        }
    }

    /// A handle of this process: the local allocation, seen at its own address, for a
    /// [`same_process`](Self::same_process) backend; refused otherwise, as legacy IPC
    /// refuses it.
    pub(super) fn open_alias(
        &self,
        h: &CudaVmmHandle,
        size: usize,
        len: usize,
    ) -> Result<CudaMapping> {
        if !self.is_same_process() {
            return Err(IpcError::InvalidHandle(format!(
                "the handle was exported by this process (pid {}): use the local buffer (or \
                 CudaVmmMemory::same_process for ranks that are threads of one process)",
                h.pid
            )));
        }
        let base = own_allocation(h, size)?;
        Ok(self.mapping(
            base,
            h.offset,
            len,
            VmmMapping::Alias {
                detached: false,
                size,
            },
        ))
    }
}
