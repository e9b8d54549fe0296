//! The CUDA driver as this backend calls it: the entry points it needs (cudarc's
//! declarations, checked before the first call) and their return codes as typed errors.

use cudarc::driver::{sys, DriverError};
use tpcomm_ipc::backend::cuda::result as cu;

use crate::error::{AllReduceError, Result};

/// Every driver function this module and the cudarc calls it makes use; checked before the
/// first call so that an old driver is a typed error, never cudarc's loader panic.
const SYMBOLS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamIsCapturing",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDeviceGetUuid_v2",
    "cuCtxGetCurrent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
];

pub(crate) fn driver_error(call: &'static str, e: DriverError) -> AllReduceError {
    cu::error(call, e.0).into()
}

pub(super) fn check(call: &'static str, code: sys::CUresult) -> Result<()> {
    Ok(cu::check(call, code)?)
}

/// Checks that the driver has every entry point in [`SYMBOLS`].
pub(super) fn require_symbols() -> Result<()> {
    Ok(cu::require(SYMBOLS)?)
}
