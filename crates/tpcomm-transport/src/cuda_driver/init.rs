//! `cuInit` and `cuDriverGetVersion`: starting the driver, and the CUDA version it
//! implements (which needs no `cuInit`).

use std::ffi::{c_int, c_uint};

use super::resolve::entry_points;
use super::CuResult;

/// `CUresult cuInit(unsigned int flags)`.
pub type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
/// `CUresult cuDriverGetVersion(int *driverVersion)`.
pub type DriverGetVersionFn = unsafe extern "C" fn(*mut c_int) -> CuResult;

entry_points! {
    purpose: "driver initialization",
    since: "CUDA 2.2",
    init: InitFn = "cuInit",
    driver_get_version: DriverGetVersionFn = "cuDriverGetVersion",
}

impl Entries {
    /// `cuInit(0)`: `Err` with the raw code when it fails (no usable GPU, for one).
    /// Idempotent and thread-safe, as the driver documents it.
    pub fn init(&self) -> Result<(), CuResult> {
        init_with(self.init)
    }

    /// `cuDriverGetVersion`: the CUDA version the driver implements, `1000 * major + 10 *
    /// minor` (e.g. 13000); `Err` with the raw code when it fails. Needs no `cuInit`.
    pub fn driver_version(&self) -> Result<i32, CuResult> {
        driver_version_with(self.driver_get_version)
    }
}

impl Available {
    /// [`Entries::init`], `None` when the library lacks `cuInit`.
    pub fn init(&self) -> Option<Result<(), CuResult>> {
        self.init.map(init_with)
    }

    /// [`Entries::driver_version`], `None` when the library lacks `cuDriverGetVersion`.
    pub fn driver_version(&self) -> Option<Result<i32, CuResult>> {
        self.driver_get_version.map(driver_version_with)
    }
}

/// `cuInit(0)` through `f`.
fn init_with(f: InitFn) -> Result<(), CuResult> {
    // SAFETY: no pointers; cuInit(0) may be called any number of times, from any thread.
    match unsafe { f(0) } {
        0 => Ok(()),
        code => Err(code),
    }
}

/// `cuDriverGetVersion` through `f`.
fn driver_version_with(f: DriverGetVersionFn) -> Result<i32, CuResult> {
    let mut version: c_int = 0;
    // SAFETY: out-pointer to a local; the call needs no initialized driver.
    match unsafe { f(&mut version) } {
        0 => Ok(version),
        code => Err(code),
    }
}
