//! What the GPU suites share: whether device 0 is usable (a test without one says why it
//! skips), and the group their ranks run on.

use std::time::Duration;

use tpcomm_ipc::{CudaMemory, IpcError};
use tpcomm_transport::testing::skip_without_gpu;
use tpcomm_transport::LocalGroup;

/// True when device 0 is usable; otherwise records why the test skips (a failure under
/// `TPCOMM_REQUIRE_GPU=1`).
pub(crate) fn gpu() -> bool {
    match CudaMemory::same_process(0) {
        Ok(_) => true,
        Err(IpcError::NoDevice(why)) => {
            skip_without_gpu(&format!("no CUDA device: {why}"));
            false
        }
        Err(e) => panic!("CudaMemory::same_process(0) failed with {e}"),
    }
}

/// The threads group of `n` ranks sharing device 0 (a 120 s transport timeout).
pub(crate) fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(120))
}
