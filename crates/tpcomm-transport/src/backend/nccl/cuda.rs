//! The CUDA side of the NCCL backend: the driver probed for what this backend calls through
//! cudarc before the first call, the device opened, and driver errors made typed.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, DriverError};

use crate::cuda_driver::{cudarc_probes, missing_symbols};
use crate::error::{Op, Result, TransportError};

fn load_driver() -> Result<()> {
    fn try_load() -> std::result::Result<(), String> {
        let missing = missing_symbols(cudarc_probes::NCCL_TRANSPORT)?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the CUDA driver lacks {missing:?}: it is older than CUDA 11.4"
            ))
        }
    }
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(try_load)
        .clone()
        .map_err(|detail| TransportError::LibraryMissing {
            library: "libcuda",
            detail,
        })
}

pub(super) fn cuda_error(op: Op, call: &'static str, e: DriverError) -> TransportError {
    let name = e.error_name().map_or_else(
        |_| format!("{:?}", e.0),
        |n| n.to_string_lossy().into_owned(),
    );
    let text = e.error_string().map_or_else(
        |_| "no description from the driver".to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    TransportError::Cuda {
        op,
        call,
        code: e.0 as i32,
        message: format!("{name}: {text}"),
    }
}

/// The device of `ordinal`, after the libraries were probed: its context and a new stream.
pub(super) fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    load_driver()?;
    cudarc::driver::result::init().map_err(|e| {
        TransportError::NoDevice(format!(
            "cuInit failed: {} (no GPU, or the driver cannot reach it)",
            cuda_error(Op::Setup, "cuInit", e)
        ))
    })?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| cuda_error(Op::Setup, "cuDeviceGetCount", e))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(TransportError::NoDevice(format!(
            "device ordinal {ordinal} requested, the driver sees {count} device(s)"
        )));
    }
    CudaContext::new(ordinal).map_err(|e| cuda_error(Op::Setup, "CudaContext::new", e))
}
