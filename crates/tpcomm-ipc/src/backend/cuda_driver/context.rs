//! The device's primary context (the one the CUDA runtime and PyTorch use), retained by a
//! backend and released with the last buffer or mapping that holds it.

use cudarc::driver::sys::{CUcontext, CUdevice};

use super::result;
use crate::error::Result;

/// A retained primary context; released on drop.
#[derive(Debug)]
pub(crate) struct PrimaryContext {
    pub(crate) ctx: CUcontext,
    pub(crate) device: CUdevice,
    pub(crate) ordinal: i32,
}

// SAFETY: a CUDA context is not tied to the thread that retained it: the driver API is
// thread-safe and any thread may make the context current.
unsafe impl Send for PrimaryContext {}

// SAFETY: as above; `&PrimaryContext` only hands the context to driver calls.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub(crate) fn make_current(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        unsafe { result::ctx_set_current(self.ctx) }
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: releases the one retain taken in `CudaMemory::new`; every buffer and
        // mapping holds an `Arc` of this value, so none outlives the context.
        if let Err(e) = unsafe { result::primary_ctx_release(self.device) } {
            tracing::warn!(error = %e, device = self.ordinal, "releasing the primary context failed");
        }
    }
}
