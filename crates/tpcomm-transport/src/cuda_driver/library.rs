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

/// The file names of the driver library, most specific first: the ones [`library`] tries, in
/// this order.
#[cfg(not(windows))]
pub const LIBRARY_FILES: &[&str] = &["libcuda.so.1", "libcuda.so"];
/// The file names of the driver library, most specific first: the ones [`library`] tries, in
/// this order.
#[cfg(windows)]
pub const LIBRARY_FILES: &[&str] = &["nvcuda.dll"];

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
    let load = load();
    match &load.library {
        Some((lib, _)) => Ok(lib),
        None => Err(load.message()),
    }
}

/// The file name [`library`] loaded the driver library from (one of [`LIBRARY_FILES`]), for
/// tools that report it; when none loaded, `Err` with each file name tried, in order, and
/// the loader's error for it (its `source()` holds `dlerror`'s text). Loads the library as
/// [`library`] does (once per process); calls no driver function.
pub fn library_file() -> Result<&'static str, &'static [(&'static str, libloading::Error)]> {
    let load = load();
    match &load.library {
        Some((_, file)) => Ok(file),
        None => Err(&load.failures),
    }
}

/// What loading the library did, kept for the process.
struct Load {
    /// The library and the file name it was loaded from; `None` when no file name loaded.
    library: Option<(libloading::Library, &'static str)>,
    /// Each file name tried that failed, in order, with the loader's error.
    failures: Vec<(&'static str, libloading::Error)>,
}

impl Load {
    /// Why no library loaded, naming every file name tried and the first failure.
    fn message(&self) -> String {
        let first = self
            .failures
            .first()
            .map(|(name, e)| format!("{name}: {e}"));
        format!(
            "the CUDA driver library (libcuda) is not installed or not on the loader path \
             (looked for {}; first failure: {})",
            LIBRARY_FILES.join(", "),
            first.as_deref().unwrap_or("none")
        )
    }
}

/// Loads the library once per process: the first of [`LIBRARY_FILES`] that loads.
fn load() -> &'static Load {
    static DRIVER: OnceLock<Load> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let mut failures = Vec::new();
        for &name in LIBRARY_FILES {
            // SAFETY: loading the CUDA driver library runs its initialisers, which is how the
            // library is meant to be used; nothing in it is called here.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => {
                    return Load {
                        library: Some((lib, name)),
                        failures,
                    }
                }
                Err(e) => failures.push((name, e)),
            }
        }
        Load {
            library: None,
            failures,
        }
    })
}
