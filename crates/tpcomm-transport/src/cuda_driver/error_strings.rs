//! `cuGetErrorName` and `cuGetErrorString`: the driver's name and description of a
//! `CUresult`, for error messages.

use std::ffi::{c_char, CStr};

use super::resolve::entry_points;
use super::CuResult;

/// `CUresult cuGetErrorName(CUresult, const char **)`, and `cuGetErrorString`, which has
/// the same signature.
pub type GetErrorNameFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

entry_points! {
    purpose: "error strings",
    since: "CUDA 6.0",
    name: GetErrorNameFn = "cuGetErrorName",
    string: GetErrorNameFn = "cuGetErrorString",
}

impl Entries {
    /// `cuGetErrorName` of `code` (e.g. `"CUDA_ERROR_NOT_SUPPORTED"`); `None` when the
    /// driver does not know the code.
    pub fn name(&self, code: CuResult) -> Option<String> {
        text_of(self.name, code)
    }

    /// `cuGetErrorString` of `code` (e.g. `"operation not supported"`); `None` when the
    /// driver does not know the code.
    pub fn description(&self, code: CuResult) -> Option<String> {
        text_of(self.string, code)
    }
}

impl Available {
    /// [`Entries::name`], `None` also when the library lacks `cuGetErrorName`.
    pub fn name(&self, code: CuResult) -> Option<String> {
        self.name.and_then(|f| text_of(f, code))
    }

    /// [`Entries::description`], `None` also when the library lacks `cuGetErrorString`.
    pub fn description(&self, code: CuResult) -> Option<String> {
        self.string.and_then(|f| text_of(f, code))
    }
}

/// The text `f` gives for `code`, when it succeeds with a non-null string.
fn text_of(f: GetErrorNameFn, code: CuResult) -> Option<String> {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: out-pointer to a local; the driver stores a pointer to a static string or
    // fails for a code it does not know (any code may be passed).
    let ok = unsafe { f(code, &mut p) } == 0 && !p.is_null();
    // SAFETY: a non-null pointer from the driver: a static NUL-terminated string.
    ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
