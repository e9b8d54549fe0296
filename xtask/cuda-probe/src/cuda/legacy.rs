//! Legacy CUDA IPC (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle`): an allocation exported as a
//! 64-byte handle, the peer's handle opened and its data checked, the mapping closed.

use std::ffi::{c_char, c_uint};

use cudarc::driver::sys;

use super::calls::Calls;
use super::{Cuda, CHECK_BYTES};
use crate::facts::{bytes, hex, unhex};

impl Cuda {
    pub(super) fn legacy_alloc(&mut self, c: &mut Calls<'_>, size: u64, seed: u8) {
        let size = (size as usize).max(CHECK_BYTES);
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, size) };
        if !c.cu(
            "cuMemAlloc",
            r,
            format!("{} at {ptr:#x}", bytes(size as u64)),
        ) {
            return;
        }
        self.legacy = Some((ptr, size));
        self.last_handle = None;
        self.write_pattern(c, "the allocation", ptr, seed);
    }

    pub(super) fn legacy_export(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let Some((ptr, _)) = self.legacy else {
            c.note(
                "cuIpcGetMemHandle",
                false,
                "NO_ALLOCATION",
                "no legacy allocation",
            );
            return;
        };
        // SAFETY: a plain 64-byte C struct; zero is a valid value.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer to a local; `ptr` is this context's cuMemAlloc allocation.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) };
        let handle: Vec<u8> = h.reserved.iter().map(|&b| b as u8).collect();
        let compared = match &self.last_handle {
            None => String::new(),
            Some(prev) if *prev == handle => ", the same bytes as the previous export".into(),
            Some(_) => ", different bytes from the previous export".into(),
        };
        if c.cu(
            "cuIpcGetMemHandle",
            r,
            format!("allocation {ptr:#x}{compared}"),
        ) {
            values.insert("handle".into(), hex(&handle));
            self.last_handle = Some(handle);
        }
    }

    pub(super) fn legacy_open(&mut self, c: &mut Calls<'_>, handle: &str, seed: u8) {
        let Some(raw) = unhex(handle, 64) else {
            c.note(
                "cuIpcOpenMemHandle",
                false,
                "BAD_HANDLE",
                "not 64 bytes of hex",
            );
            return;
        };
        if self.peer_legacy.is_some() {
            self.legacy_close(c);
        }
        // SAFETY: a plain 64-byte C struct; zero is a valid value.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(&raw) {
            *d = *s as c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the handle is passed by value; flag 1 is
        // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
            )
        };
        if !c.cu(
            "cuIpcOpenMemHandle",
            r,
            format!("the peer's handle -> {ptr:#x}"),
        ) {
            return;
        }
        self.peer_legacy = Some(ptr);
        self.read_check(c, "the peer's allocation", ptr, seed);
    }

    pub(super) fn legacy_close(&mut self, c: &mut Calls<'_>) {
        if let Some(ptr) = self.peer_legacy.take() {
            // SAFETY: a mapping this process opened with cuIpcOpenMemHandle.
            let r = unsafe { sys::cuIpcCloseMemHandle(ptr) };
            c.cu("cuIpcCloseMemHandle", r, format!("{ptr:#x}"));
        }
    }
}
