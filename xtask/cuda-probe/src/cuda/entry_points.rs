//! The driver library and the entry points cudarc does not bind (the `cuCheckpointProcess*`
//! family, which takes and returns plain `int`s) and `cuGetErrorName`, as tpcomm declares
//! them once (`tpcomm_transport::cuda_driver`): loading the library and resolving them, each
//! step recorded, and a result code's name. Every other driver call goes through cudarc's raw
//! `driver::sys` bindings.

use std::ffi::c_int;

use tpcomm_transport::cuda_driver::{
    error_strings, library_file, process_checkpoint, ResolveError,
};

use super::calls::Calls;
use super::Cuda;

/// `cuGetErrorName` of `code`, or `CUresult N` when the driver has no name for it.
pub(super) fn name_of(error_name: Option<&error_strings::Available>, code: c_int) -> String {
    error_name
        .and_then(|e| e.name(code))
        .unwrap_or_else(|| format!("CUresult {code}"))
}

impl Cuda {
    /// Loads the driver library (unless it is loaded already) and resolves `cuGetErrorName`
    /// and the five checkpoint entry points, each recorded; false when `Init` cannot go on.
    pub(super) fn load_entry_points(&mut self, c: &mut Calls<'_>) -> bool {
        if !self.library_loaded {
            match library_file() {
                Ok(file) => {
                    self.library_loaded = true;
                    c.note("dlopen", true, "OK", format!("{file} loaded"));
                }
                Err(failures) => {
                    let errors: Vec<String> = failures
                        .iter()
                        .map(|(name, e)| format!("{name}: {}", crate::facts::error_chain(e)))
                        .collect();
                    c.note("dlopen", false, "NOT_FOUND", errors.join("; "));
                    return false;
                }
            }
            self.error_name = error_strings::available().ok();
            c.error_name = self.error_name;
            let (checkpoint, missing) = match process_checkpoint::entries() {
                Ok(entries) => (Some(*entries), Vec::new()),
                Err(ResolveError::Missing { missing, .. }) => (None, missing),
                // Not reached with the library loaded and every name present: the reads are
                // the lookups that found them.
                Err(_) => (None, Vec::new()),
            };
            self.checkpoint = checkpoint;
            if missing.is_empty() {
                c.note(
                    "dlsym",
                    true,
                    "OK",
                    "the five cuCheckpointProcess* entry points",
                );
            } else {
                c.note(
                    "dlsym",
                    false,
                    "MISSING",
                    format!("missing: {}", missing.join(", ")),
                );
                return false;
            }
        }
        true
    }
}
