//! The driver's virtual-memory entry points as the VMM backend uses them: the table, C types
//! and `#[repr(C)]` structures that `tpcomm_transport::cuda_driver::vmm` declares (once for
//! the workspace), resolved after the checked layer's own probe ([`result::load`]) with every
//! failure as [`IpcError::Unsupported`], and the check that turns a `CUresult` into
//! [`IpcError::Cuda`].

pub(crate) use tpcomm_transport::cuda_driver::vmm::{
    AccessDesc, AllocFlags, AllocationProp, CuResult, Entries, Location, ACCESS_READWRITE,
    ALLOCATION_PINNED, ATTRIBUTE_POSIX_FD, ATTRIBUTE_VMM, GRANULARITY_MINIMUM, HANDLE_POSIX_FD,
    LOCATION_DEVICE,
};

use super::{cuda_error, result};
use crate::error::{IpcError, Result};

/// The VMM backend's name, in its errors and as its `PeerMemory::name`.
pub(crate) const NAME: &str = "cuda-vmm";

/// The entry points, or why they cannot be used (resolved once per process): the checked
/// layer's load failure (no driver library, or one older than its functions), or the
/// entry points a driver older than CUDA 11.4 lacks, as [`IpcError::Unsupported`] of
/// [`NAME`].
pub(crate) fn entries() -> Result<&'static Entries> {
    let unsupported = |what: String| IpcError::Unsupported {
        backend: NAME,
        what,
    };
    result::load().map_err(|e| unsupported(e.to_string()))?;
    tpcomm_transport::cuda_driver::vmm::entries().map_err(|e| unsupported(e.to_string()))
}

/// `Ok` for `CUDA_SUCCESS` (0), else [`IpcError::Cuda`] of `call` with the driver's name and
/// description of `code`.
pub(crate) fn check(e: &Entries, call: &'static str, code: CuResult) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    Err(cuda_error(
        call,
        code,
        // SAFETY: out-pointer to the caller's local; the driver stores a pointer to a static
        // string or fails for a code it does not know.
        |name| unsafe { (e.error_name)(code, name) } == 0,
        // SAFETY: as above.
        |message| unsafe { (e.error_string)(code, message) } == 0,
        || format!("CUresult {code}"),
    ))
}
