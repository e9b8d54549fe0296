//! Opening the device: the driver's entry points checked, its primary context, the stream
//! (fresh, or the caller's, checked), and the fatbin loaded with every kernel resolved.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};
use tpcomm_ipc::DevicePeerMemory;
use tpcomm_kernels as kernels;

use super::driver_api::{check, driver_error, require_symbols};
use super::CudaBackend;
use crate::error::{AllReduceError, Result};

/// The loaded fatbin and its entry points, in [`kernels::KERNELS`] order.
#[derive(Debug)]
pub(super) struct Module {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread
// once the owning context is current (every use binds it first).
unsafe impl Send for Module {}
// SAFETY: as above; launches only read the handles.
unsafe impl Sync for Module {}

impl Module {
    fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: FATBIN is a complete, 16-byte aligned fatbin image that lives for the
        // whole program; the driver copies what it needs.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, kernels::FATBIN.as_ptr().cast::<c_void>())
        })?;
        let mut loaded = Module {
            ctx: ctx.clone(),
            module,
            functions: Vec::with_capacity(kernels::KERNELS.len()),
        };
        for name in kernels::KERNELS {
            let c_name = CString::new(name).expect("kernel names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `module` was loaded above and is alive; out-pointer to a local.
            check("cuModuleGetFunction", unsafe {
                sys::cuModuleGetFunction(&mut f, loaded.module, c_name.as_ptr())
            })?;
            loaded.functions.push(f);
        }
        Ok(loaded)
    }

    pub(super) fn function(&self, name: &str) -> Result<sys::CUfunction> {
        kernels::KERNELS
            .iter()
            .position(|k| *k == name)
            .map(|i| self.functions[i])
            .ok_or_else(|| AllReduceError::InvalidArgument(format!("no kernel named {name}")))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let unloaded = self
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e));
        let unloaded = unloaded.and_then(|()| {
            // SAFETY: loaded in `Module::load`, unloaded once; the backend owning it drains
            // its stream when dropped (before its fields), so no launch of it is pending.
            check("cuModuleUnload", unsafe {
                sys::cuModuleUnload(self.module)
            })
        });
        if let Err(e) = unloaded {
            tracing::warn!(error = %e, "unloading the all-reduce kernels failed");
        }
    }
}

impl<M: DevicePeerMemory> CudaBackend<M> {
    #[allow(clippy::type_complexity)]
    pub(super) fn open_device(
        memory: &M,
        stream: Option<Arc<CudaStream>>,
    ) -> Result<(Arc<CudaContext>, Arc<CudaStream>, Module, u32, [u8; 16])> {
        require_symbols()?;
        let ordinal = memory.device_ordinal() as usize;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: this backend's own CudaContext handle never allocates cudarc CudaSlices,
        // whose synchronization the event tracking manages; turning it off keeps stream
        // creation from synchronizing the whole context (which would wait on other ranks'
        // spinning kernels). A caller's stream keeps its own context handle and settings.
        unsafe { ctx.disable_event_tracking() };
        let stream = match stream {
            Some(stream) => {
                check_stream_context(
                    memory.device_ordinal(),
                    ctx.cu_ctx() as usize,
                    stream.context().cu_ctx() as usize,
                    stream.context().ordinal(),
                )?;
                stream
            }
            None => ctx
                .new_stream()
                .map_err(|e| driver_error("cuStreamCreate", e))?,
        };
        let module = Module::load(&ctx)?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))?;
        let uuid = ctx
            .uuid()
            .map_err(|e| driver_error("cuDeviceGetUuid_v2", e))?;
        Ok((
            ctx,
            stream,
            module,
            multiprocessors.max(1) as u32,
            uuid.bytes.map(|b| b as u8),
        ))
    }
}

/// Fails unless a caller's stream (in context `found_ctx` of device `found_device`) can
/// carry the work of an all-reduce on `device`, whose primary context is `primary`.
pub(super) fn check_stream_context(
    device: i32,
    primary: usize,
    found_ctx: usize,
    found_device: usize,
) -> Result<()> {
    if found_ctx == primary {
        return Ok(());
    }
    let found = if found_device as i64 == i64::from(device) {
        format!("another context of device {found_device} (not its primary context)")
    } else {
        format!("device {found_device}")
    };
    Err(AllReduceError::ForeignStream { device, found })
}
