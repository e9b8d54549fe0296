//! The driver's initialisation and the primary context: the library and `cuInit`, the
//! device, retaining, releasing and resetting the primary context, its state, and the
//! device's memory figures.

use std::ffi::{c_char, c_int, c_uint, CStr};

use cudarc::driver::sys;

use super::calls::Calls;
use super::Cuda;
use crate::facts::bytes;

impl Cuda {
    pub(super) fn init(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        if !self.load_entry_points(c) {
            return;
        }
        // SAFETY: cuInit(0) has no preconditions.
        let r = unsafe { sys::cuInit(0) };
        if !c.cu("cuInit", r, "flags 0") {
            return;
        }
        let mut version: c_int = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuDriverGetVersion(&mut version) };
        if c.cu("cuDriverGetVersion", r, format!("{version}")) {
            values.insert("driver_version".into(), version.to_string());
        }
        let mut count: c_int = 0;
        // SAFETY: out-pointer to a local, after cuInit.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        if !c.cu("cuDeviceGetCount", r, format!("{count} devices")) {
            return;
        }
        values.insert("device_count".into(), count.to_string());
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuDeviceGet(&mut self.dev, 0) };
        if !c.cu("cuDeviceGet", r, "ordinal 0") {
            return;
        }
        let mut name = [0 as c_char; 128];
        // SAFETY: the buffer and its length; the driver NUL-terminates within it.
        let r = unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, self.dev) };
        // SAFETY: NUL-terminated by the driver on success (zeroed otherwise).
        let device = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        c.cu("cuDeviceGetName", r, device.clone());
        values.insert("device".into(), device);
        self.retain(c, values, "primary context");
        let ptracer = rustix::process::set_ptracer(rustix::process::PTracer::Any);
        // EINVAL: no Yama module, nothing to relax; the step goes on either way.
        c.sys(
            "prctl(PR_SET_PTRACER, ANY)",
            &ptracer,
            "so that the peer may pidfd_getfd from this process",
        );
        if let Some(last) = c.calls.last_mut() {
            last.ok = true;
        }
    }

    /// `cuDevicePrimaryCtxRetain` + `cuCtxSetCurrent`.
    fn retain(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
        what: &str,
    ) -> bool {
        let before = self.ctx;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `dev` came from cuDeviceGet.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, self.dev) };
        let same = if before.is_null() {
            String::new()
        } else if before == ctx {
            " (the same handle as before)".into()
        } else {
            format!(" (the handle before was {before:p})")
        };
        if !c.cu(
            "cuDevicePrimaryCtxRetain",
            r,
            format!("{what}: {ctx:p}{same}"),
        ) {
            return false;
        }
        self.retains += 1;
        self.ctx = ctx;
        values.insert("context".into(), format!("{ctx:p}"));
        // SAFETY: a context just retained, made current on this thread.
        let r = unsafe { sys::cuCtxSetCurrent(ctx) };
        c.cu("cuCtxSetCurrent", r, format!("{ctx:p}"))
    }

    pub(super) fn mem_info(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals; the context is current.
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        let used = total.saturating_sub(free) as u64;
        if c.cu(
            "cuMemGetInfo",
            r,
            format!(
                "free {}, total {}, used {}",
                bytes(free as u64),
                bytes(total as u64),
                bytes(used)
            ),
        ) {
            values.insert("free".into(), free.to_string());
            values.insert("total".into(), total.to_string());
            values.insert("used".into(), used.to_string());
        }
    }

    pub(super) fn re_init(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        // SAFETY: cuInit(0) has no preconditions.
        let r = unsafe { sys::cuInit(0) };
        if !c.cu("cuInit", r, "again, after the restore") {
            return;
        }
        self.retain(c, values, "retained again");
    }

    /// Forgets every allocation and mapping (the context that held them is gone).
    fn forget_memory(&mut self) {
        self.legacy = None;
        self.last_handle = None;
        self.peer_legacy = None;
        for slot in [&mut self.own, &mut self.import, &mut self.second] {
            slot.reservation = None;
            slot.handle = None;
            slot.mapped = false;
            slot.fds.clear();
        }
    }

    pub(super) fn ctx_reset(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        // SAFETY: `dev` came from cuDeviceGet; nothing of the old context is used after it.
        let r = unsafe { sys::cuDevicePrimaryCtxReset_v2(self.dev) };
        let reset = c.cu(
            "cuDevicePrimaryCtxReset",
            r,
            "every allocation of the primary context destroyed",
        );
        if reset {
            self.forget_memory();
        }
        self.primary_state(c);
        if reset {
            self.retain(c, values, "retained after the reset");
        }
    }

    pub(super) fn ctx_release_retain(
        &mut self,
        c: &mut Calls<'_>,
        values: &mut std::collections::BTreeMap<String, String>,
    ) {
        let held = self.retains;
        for i in 1..=held {
            // SAFETY: this process retained the primary context `held` times.
            let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
            if !c.cu(
                "cuDevicePrimaryCtxRelease",
                r,
                format!("release {i} of {held}"),
            ) {
                self.primary_state(c);
                return;
            }
            self.retains -= 1;
        }
        self.forget_memory();
        self.ctx = std::ptr::null_mut();
        self.primary_state(c);
        self.retain(c, values, "retained after releasing to zero");
    }

    fn primary_state(&self, c: &mut Calls<'_>) {
        let (mut flags, mut active): (c_uint, c_int) = (0, 0);
        // SAFETY: out-pointers to locals.
        let r = unsafe { sys::cuDevicePrimaryCtxGetState(self.dev, &mut flags, &mut active) };
        c.cu(
            "cuDevicePrimaryCtxGetState",
            r,
            format!("active {active}, flags {flags:#x}"),
        );
    }
}
