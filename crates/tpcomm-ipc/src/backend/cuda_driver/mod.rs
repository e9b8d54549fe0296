//! The CUDA driver as both CUDA backends call it, below them both (neither backend is
//! imported here): the checked layer over cudarc's `driver::sys` ([`result`], public as
//! `tpcomm_ipc::backend::cuda::result`), the virtual-memory entry points that
//! `tpcomm_transport::cuda_driver::vmm` declares, resolved and checked for this crate
//! ([`vmm`]), the retained primary context ([`context`]), and the one mapping of a failed
//! call's `CUresult` to [`IpcError::Cuda`] ([`cuda_error`]).

use std::ffi::{c_char, CStr};

use crate::error::IpcError;

pub(crate) mod context;
pub mod result;
pub(crate) mod vmm;

/// [`IpcError::Cuda`] of driver function `call` that returned `code` (not `CUDA_SUCCESS`),
/// with the driver's name and description of the code: `name_of` and `description_of` call
/// `cuGetErrorName` and `cuGetErrorString` for `code` with the out-pointer they are given and
/// say whether the call succeeded. A code the driver does not know is named `unnamed()`.
pub(crate) fn cuda_error(
    call: &'static str,
    code: i32,
    name_of: impl FnOnce(*mut *const c_char) -> bool,
    description_of: impl FnOnce(*mut *const c_char) -> bool,
    unnamed: impl FnOnce() -> String,
) -> IpcError {
    IpcError::Cuda {
        call,
        code,
        name: driver_text(name_of).unwrap_or_else(unnamed),
        message: driver_text(description_of)
            .unwrap_or_else(|| "no description from the driver".into()),
    }
}

/// The string a `cuGetErrorName`-like call stores through its out-pointer: `get` makes the
/// call and says whether it succeeded; `None` when it failed or stored null.
fn driver_text(get: impl FnOnce(*mut *const c_char) -> bool) -> Option<String> {
    let mut p: *const c_char = std::ptr::null();
    let ok = get(&mut p);
    // SAFETY: the driver hands out pointers to static NUL-terminated strings.
    (ok && !p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
