//! `DevicePeerMemory`: the CUDA backends whose buffers and mappings are `CudaBuffer`s and
//! `CudaMapping`s, what the CUDA all-reduce runs on.

use super::{CudaBuffer, CudaMapping, CudaMemory};
use crate::error::Result;
use crate::memory::PeerMemory;

mod sealed {
    pub trait Sealed {}
}

/// CUDA peer memory of one device whose buffers and mappings are [`CudaBuffer`]s and
/// [`CudaMapping`]s: what the CUDA all-reduce runs on ([`CudaMemory`], legacy IPC;
/// [`CudaVmmMemory`](crate::CudaVmmMemory), virtual memory). Sealed: implemented by this
/// crate's backends only.
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

impl sealed::Sealed for CudaMemory {}

impl sealed::Sealed for crate::CudaVmmMemory {}

impl DevicePeerMemory for CudaMemory {
    fn device_ordinal(&self) -> i32 {
        CudaMemory::device_ordinal(self)
    }
    fn bind_to_thread(&self) -> Result<()> {
        CudaMemory::bind_to_thread(self)
    }
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()> {
        self.check_exportable(addr, len).map(drop)
    }
}

impl DevicePeerMemory for crate::CudaVmmMemory {
    fn device_ordinal(&self) -> i32 {
        crate::CudaVmmMemory::device_ordinal(self)
    }
    fn bind_to_thread(&self) -> Result<()> {
        crate::CudaVmmMemory::bind_to_thread(self)
    }
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()> {
        self.check_exportable(addr, len)
    }
}
