//! The CUDA driver as this backend calls it: the entry points it needs (cudarc's
//! declarations, listed in `tpcomm_transport::cuda_driver::cudarc_probes::ALL_REDUCE` and
//! checked before the first call) and their return codes as typed errors.

use cudarc::driver::{sys, DriverError};
use tpcomm_ipc::backend::cuda::result as cu;
use tpcomm_transport::cuda_driver::cudarc_probes::ALL_REDUCE;

use crate::error::{AllReduceError, Result};

pub(crate) fn driver_error(call: &'static str, e: DriverError) -> AllReduceError {
    cu::error(call, e.0).into()
}

pub(super) fn check(call: &'static str, code: sys::CUresult) -> Result<()> {
    Ok(cu::check(call, code)?)
}

/// Checks that the driver has every entry point this backend and the cudarc calls it makes
/// use ([`ALL_REDUCE`]), so that an old driver is a typed error, never cudarc's loader panic.
pub(super) fn require_symbols() -> Result<()> {
    Ok(cu::require(ALL_REDUCE)?)
}
