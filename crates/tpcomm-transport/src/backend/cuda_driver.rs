//! Probing the CUDA driver library (`libcuda`) before any call through cudarc, whose lazy
//! loader panics when the library or a function is missing. Shared by the NCCL transport and
//! the CUDA peer-memory backend of `tpcomm-ipc`.

use cudarc::driver::sys;

/// Loads `libcuda` (once per process, through cudarc's loader) and returns the names in
/// `symbols` it does not export; `Err` with a message naming every file name tried when no
/// driver library is found. Calls no driver function, never panics.
pub fn missing_symbols<'n>(symbols: &[&'n str]) -> Result<Vec<&'n str>, String> {
    // SAFETY: loading the CUDA driver library runs its initialisers, which is how the library
    // is meant to be used; nothing is called.
    if !unsafe { sys::is_culib_present() } {
        let mut names = cudarc::get_lib_name_candidates("cuda");
        let mut seen = std::collections::HashSet::new();
        names.retain(|n| seen.insert(n.clone()));
        return Err(format!(
            "the CUDA driver library (libcuda) is not installed or not on the loader path \
             (looked for {})",
            names.join(", ")
        ));
    }
    // SAFETY: `is_culib_present` just loaded one of the same candidates, so `culib` finds a
    // library and does not panic.
    let lib = unsafe { sys::culib() };
    Ok(symbols
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up (as an opaque function pointer), never called
        // through this type.
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect())
}
