//! `DevicePeerMemory`: the CUDA backends whose buffers and mappings are `CudaBuffer`s and
//! `CudaMapping`s, what the CUDA all-reduce runs on.

use super::{CudaBuffer, CudaMapping};
use crate::error::Result;
use crate::memory::PeerMemory;

/// Implemented by this crate's CUDA backends only.
pub(crate) mod sealed {
    pub trait Sealed {}
}

/// CUDA peer memory of one device whose buffers and mappings are [`CudaBuffer`]s and
/// [`CudaMapping`]s: what the CUDA all-reduce runs on ([`CudaMemory`](crate::CudaMemory),
/// legacy IPC; [`CudaVmmMemory`](crate::CudaVmmMemory), virtual memory). Sealed: implemented
/// by this crate's backends only.
pub trait DevicePeerMemory:
    PeerMemory<Buffer = CudaBuffer, Mapping = CudaMapping> + Clone + sealed::Sealed
{
    /// The device ordinal it allocates on and maps into.
    fn device_ordinal(&self) -> i32;

    /// Makes its primary context current on the calling thread.
    fn bind_to_thread(&self) -> Result<()>;

    /// Whether `len` bytes at `addr` can be exported to peers as they are (zero-copy), or
    /// [`IpcError::NotExportable`] saying why not. Only queries the driver's records:
    /// allowed while a stream is being captured.
    ///
    /// [`IpcError::NotExportable`]: crate::IpcError::NotExportable
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()>;
}
