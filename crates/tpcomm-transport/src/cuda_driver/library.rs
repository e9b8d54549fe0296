//! Loading the CUDA driver library (`libcuda`) once per process, and probing it for
//! functions before any call through cudarc, whose lazy loader panics when the library or a
//! function is missing.
//!
//! The probe opens the library itself (with `libloading`) instead of asking cudarc's loader,
//! because cudarc's loader only exists when cudarc is built with `dynamic-loading`: a program
//! may link cudarc dynamically (`dynamic-linking`, as candle does) or statically instead, and
//! tpcomm leaves that choice to the program (it asks only for `fallback-dynamic-loading`).
//! The names tried are the two the driver package installs; cudarc's loader tries both of
//! them too (among others), so when the probe finds the library, cudarc's loader finds the
//! same one, and when cudarc links it, the loader hands back the copy already in the process.

use std::sync::OnceLock;

/// The file names of the driver library, most specific first.
#[cfg(not(windows))]
const CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];
#[cfg(windows)]
const CANDIDATES: &[&str] = &["nvcuda.dll"];

/// Loads `libcuda` (once per process; the library stays loaded) and returns the names in
/// `symbols` it does not export; `Err` with a message naming every file name tried when no
/// driver library is found. Calls no driver function, never panics.
pub fn missing_symbols<'n>(symbols: &[&'n str]) -> Result<Vec<&'n str>, String> {
    let lib = library()?;
    Ok(symbols
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up (as an opaque function pointer), never called
        // through this type.
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect())
}

/// The driver library as the probe loaded it (once per process; it stays loaded), for layers
/// that resolve driver functions cudarc does not bind (the process-checkpoint entry points of
/// `tpcomm-checkpoint`). `Err` as for [`missing_symbols`]. Calls no driver function.
pub fn library() -> Result<&'static libloading::Library, String> {
    static DRIVER: OnceLock<Result<libloading::Library, String>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<libloading::Library, String> {
    let mut failures = Vec::new();
    for &name in CANDIDATES {
        // SAFETY: loading the CUDA driver library runs its initialisers, which is how the
        // library is meant to be used; nothing in it is called here.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return Ok(lib),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "the CUDA driver library (libcuda) is not installed or not on the loader path \
         (looked for {}; first failure: {})",
        CANDIDATES.join(", "),
        failures.first().map_or("none", String::as_str)
    ))
}
