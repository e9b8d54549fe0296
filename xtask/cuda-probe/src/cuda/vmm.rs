//! Virtual memory management (VMM) sharing through POSIX descriptors: allocations created
//! and mapped at kept reservations, exported, imported from a fetched descriptor (at the
//! importer's kept address), released with their reservations kept, and an import of the
//! own descriptor at a second address.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use cudarc::driver::sys;

use super::calls::Calls;
use super::descriptors::{fd_facts, fetch_by_pidfd};
use super::{Cuda, Which, CHECK_BYTES};
use crate::facts::bytes;

/// The allocation properties of every VMM allocation of the probe: pinned device memory on
/// device `dev`, shareable as a POSIX file descriptor.
fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers, enums whose zero value is valid, a pointer and
    // flag bytes: all-zero is its documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

fn access_desc(dev: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

impl Cuda {
    fn granularity(
        &self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) -> Option<usize> {
        let prop = vmm_prop(self.dev);
        let mut found = [0usize; 2];
        for (i, (flag, label)) in [
            (
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                "minimum",
            ),
            (
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                "recommended",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            // SAFETY: out-pointer to a local; `prop` is a valid property block.
            let r = unsafe { sys::cuMemGetAllocationGranularity(&mut found[i], &prop, flag) };
            if !c.cu(
                "cuMemGetAllocationGranularity",
                r,
                format!(
                    "{label}: {} (pinned device memory, POSIX fd)",
                    bytes(found[i] as u64)
                ),
            ) {
                return None;
            }
            values.insert(format!("granularity_{label}"), found[i].to_string());
        }
        Some(found[0].max(found[1]).max(1))
    }

    /// `cuMemCreate` of `size` and its mapping at `va` with read/write access.
    fn create_and_map(&mut self, c: &mut Calls<'_>, va: sys::CUdeviceptr, size: usize) -> bool {
        let prop = vmm_prop(self.dev);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; `prop` is a valid property block.
        let r = unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) };
        if !c.cu(
            "cuMemCreate",
            r,
            format!(
                "{} pinned device memory, POSIX fd shareable",
                bytes(size as u64)
            ),
        ) {
            return false;
        }
        self.own.handle = Some(h);
        // SAFETY: `va` is a reservation of this process of `size` bytes with nothing
        // mapped; `h` an allocation of `size` bytes.
        let r = unsafe { sys::cuMemMap(va, size, 0, h, 0) };
        if !c.cu("cuMemMap", r, format!("at {va:#x}")) {
            return false;
        }
        self.own.mapped = true;
        let desc = access_desc(self.dev);
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
        c.cu("cuMemSetAccess", r, "read/write for device 0")
    }

    pub(super) fn vmm_create(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        want: u64,
        seed: u8,
    ) {
        if self.own.reservation.is_some() {
            c.note(
                "vmm_create",
                false,
                "EXISTS",
                "the own reservation exists already",
            );
            return;
        }
        let Some(g) = self.granularity(c, values) else {
            return;
        };
        let size = (want as usize).max(CHECK_BYTES).div_ceil(g) * g;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; any size that is a multiple of the granularity.
        let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
        if !c.cu(
            "cuMemAddressReserve",
            r,
            format!("{} at {va:#x} (kept)", bytes(size as u64)),
        ) {
            return;
        }
        self.own.reservation = Some((va, size));
        values.insert("va".into(), format!("{va:#x}"));
        values.insert("size".into(), size.to_string());
        if self.create_and_map(c, va, size) {
            self.write_pattern(c, "the own allocation", va, seed);
        }
    }

    pub(super) fn vmm_fresh(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        seed: u8,
    ) {
        let Some((va, size)) = self.own.reservation else {
            c.note("vmm_fresh", false, "NO_RESERVATION", "no kept reservation");
            return;
        };
        if self.own.handle.is_some() || self.own.mapped {
            c.note(
                "vmm_fresh",
                false,
                "IN_USE",
                "the own allocation is still held",
            );
            return;
        }
        values.insert("va".into(), format!("{va:#x}"));
        values.insert("size".into(), size.to_string());
        if self.create_and_map(c, va, size) {
            self.write_pattern(c, "the fresh allocation at the kept address", va, seed);
        }
    }

    pub(super) fn vmm_export(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let Some(h) = self.own.handle else {
            c.note(
                "cuMemExportToShareableHandle",
                false,
                "NO_ALLOCATION",
                "no own allocation",
            );
            return;
        };
        let mut fd: c_int = -1;
        // SAFETY: for POSIX descriptors the out-parameter is an `int*`; `h` is this
        // process's allocation, created with POSIX descriptor handles.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        if !c.cu("cuMemExportToShareableHandle", r, format!("POSIX fd {fd}")) {
            return;
        }
        if fd < 0 {
            c.note(
                "cuMemExportToShareableHandle",
                false,
                "BAD_FD",
                format!("fd {fd}"),
            );
            return;
        }
        // SAFETY: the driver returned a new descriptor of this process, owned by the caller.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let facts = fd_facts(&owned, values);
        c.note("fstat", true, "OK", facts);
        values.insert("fd".into(), fd.to_string());
        values.insert("held_fds".into(), (self.own.fds.len() + 1).to_string());
        self.own.fds.push(owned);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn vmm_import(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        pid: u32,
        fd: i32,
        size: u64,
        seed: u8,
    ) {
        let by_pidfd = fetch_by_pidfd(c, pid, fd);
        // The copy the peer offered over the socket is always taken, so that the socket holds
        // no stale descriptor for the next import; it serves when pidfd_getfd did not.
        let by_socket = self.receive_offered(c, by_pidfd.is_some());
        let fetched = match (by_pidfd, by_socket) {
            (Some(p), Some(s)) => {
                let same = match (rustix::fs::fstat(&p), rustix::fs::fstat(&s)) {
                    (Ok(a), Ok(b)) => (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
                    _ => false,
                };
                c.note(
                    "compare",
                    true,
                    "OK",
                    format!(
                        "the pidfd_getfd copy and the socket copy are {} (st_dev, st_ino); the pidfd_getfd copy is imported",
                        if same { "the same file" } else { "different files" }
                    ),
                );
                values.insert("fd_via".into(), "pidfd_getfd".into());
                p
            }
            (Some(p), None) => {
                values.insert("fd_via".into(), "pidfd_getfd".into());
                p
            }
            (None, Some(s)) => {
                values.insert("fd_via".into(), "socket".into());
                c.note(
                    "fallback",
                    true,
                    "OK",
                    "pidfd_getfd did not serve: the descriptor passed over the socket (SCM_RIGHTS) is imported",
                );
                s
            }
            (None, None) => {
                c.note(
                    "fetch",
                    false,
                    "NO_DESCRIPTOR",
                    "neither pidfd_getfd nor the socket gave the peer's descriptor",
                );
                return;
            }
        };
        let mut fetched_facts = std::collections::BTreeMap::new();
        let facts = fd_facts(&fetched, &mut fetched_facts);
        c.note("fstat", true, "OK", format!("fetched: {facts}"));
        if self.import.mapped || self.import.handle.is_some() {
            self.slot_release(c, Which::Import);
        }
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX descriptors the OS handle is the descriptor's value cast to a
        // pointer; `fetched` stays open for the call.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fetched.as_raw_fd() as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        self.import.fds.push(fetched);
        if !c.cu(
            "cuMemImportFromShareableHandle",
            r,
            format!("fetched fd of pid {pid}"),
        ) {
            return;
        }
        self.import.handle = Some(h);
        let size = size as usize;
        let va = match self.import.reservation {
            Some((va, reserved)) if reserved >= size => {
                values.insert("same_address".into(), "yes".into());
                va
            }
            Some((va, reserved)) => {
                c.note(
                    "cuMemMap",
                    false,
                    "TOO_SMALL",
                    format!(
                        "the kept reservation at {va:#x} has {reserved} bytes, the import {size}"
                    ),
                );
                return;
            }
            None => {
                let mut va: sys::CUdeviceptr = 0;
                // SAFETY: out-pointer to a local.
                let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
                if !c.cu(
                    "cuMemAddressReserve",
                    r,
                    format!("{} at {va:#x} for imports (kept)", bytes(size as u64)),
                ) {
                    return;
                }
                self.import.reservation = Some((va, size));
                va
            }
        };
        values.insert("va".into(), format!("{va:#x}"));
        // SAFETY: `va` is this process's reservation of at least `size` bytes with nothing
        // mapped; `h` is the imported allocation of `size` bytes.
        let r = unsafe { sys::cuMemMap(va, size, 0, h, 0) };
        if !c.cu("cuMemMap", r, format!("the import at {va:#x}")) {
            return;
        }
        self.import.mapped = true;
        let desc = access_desc(self.dev);
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
        if !c.cu("cuMemSetAccess", r, "read/write for device 0") {
            return;
        }
        self.read_check(c, "the import", va, seed);
    }

    pub(super) fn vmm_self_import(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        seed: u8,
        write_seed: u8,
    ) {
        let (Some(own_h), Some((own_va, size))) = (self.own.handle, self.own.reservation) else {
            c.note(
                "vmm_self_import",
                false,
                "NO_ALLOCATION",
                "no own allocation",
            );
            return;
        };
        let Some(fd) = self.own.fds.last().map(AsRawFd::as_raw_fd) else {
            c.note(
                "vmm_self_import",
                false,
                "NO_FD",
                "the own allocation is not exported",
            );
            return;
        };
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the OS handle is this process's exported descriptor's value; it stays open.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        let same = if h == own_h {
            "the same handle value as the own allocation"
        } else {
            "a new handle value"
        };
        if !c.cu(
            "cuMemImportFromShareableHandle",
            r,
            format!("own fd {fd}: {same}"),
        ) {
            return;
        }
        values.insert("same_handle".into(), (h == own_h).to_string());
        self.second.handle = Some(h);
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
        if !c.cu(
            "cuMemAddressReserve",
            r,
            format!("a second address {va:#x}"),
        ) {
            return;
        }
        self.second.reservation = Some((va, size));
        // SAFETY: a fresh reservation of `size` bytes; `h` the imported allocation.
        let r = unsafe { sys::cuMemMap(va, size, 0, h, 0) };
        if !c.cu(
            "cuMemMap",
            r,
            format!("the own allocation again at {va:#x}"),
        ) {
            return;
        }
        self.second.mapped = true;
        let desc = access_desc(self.dev);
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
        if !c.cu("cuMemSetAccess", r, "read/write for device 0") {
            return;
        }
        if !self.read_check(c, "the second mapping", va, seed) {
            return;
        }
        if self.write_pattern(c, "the second mapping", va, write_seed) {
            self.read_check(c, "the first mapping", own_va, write_seed);
        }
        self.slot_release(c, Which::Second);
    }
}
