//! Copies on the backend's stream, ordered with its launches: table writes (host to device),
//! the staging copy of an input (device to device), and whether a caller's input can be
//! shared with peers zero-copy instead of staged.

use std::ffi::c_void;

use cudarc::driver::sys;
use tpcomm_ipc::{CudaBuffer, DevicePeerMemory, MemoryRegion};

use super::driver_api::check;
use super::CudaBackend;
use crate::error::{AllReduceError, Result};

impl<M: DevicePeerMemory> CudaBackend<M> {
    /// Copies `bytes` from device address `src` to `offset` of the staging buffer on the
    /// backend's stream (recorded into the graph while the stream is being captured). The
    /// caller guarantees that `src` holds `bytes` readable bytes until the copy has run (a
    /// live buffer, or a cudarc view whose `device_ptr` guard is held, ordered on this
    /// stream).
    pub(crate) fn stage_from(
        &self,
        src: u64,
        staging: &CudaBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if offset
            .checked_add(bytes)
            .is_none_or(|end| end > staging.len())
        {
            return Err(AllReduceError::InvalidArgument(format!(
                "{bytes} bytes at offset {offset} do not fit the {}-byte staging buffer",
                staging.len()
            )));
        }
        self.bind()?;
        // SAFETY: the destination lies inside the live staging buffer (checked above); the
        // source holds `bytes` bytes (the caller's contract: a buffer or view it borrows for
        // the call, both checked against the element count); the copy is ordered on this
        // backend's stream with the launch that reads the staging buffer.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                staging.device_ptr() + offset as u64,
                src,
                bytes,
                self.stream.cu_stream(),
            )
        })
    }

    /// Writes `bytes` at `offset` of `table` (a stable table or the nonce of the Signal
    /// block) on the stream, and waits for it
    /// ([`Backend::write_table`](crate::backend::Backend::write_table)).
    pub(super) fn write_on_stream(
        &self,
        table: &CudaBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        if offset
            .checked_add(bytes.len())
            .is_none_or(|end| end > table.len())
        {
            return Err(AllReduceError::InvalidArgument(format!(
                "{} bytes at offset {offset} do not fit the {}-byte table",
                bytes.len(),
                table.len()
            )));
        }
        self.refuse_while_capturing("writing a table")?;
        self.bind()?;
        // SAFETY: the range lies inside a live CudaBuffer (checked above); the source is
        // pageable host memory, which the driver stages before the call returns.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                table.device_ptr() + offset as u64,
                bytes.as_ptr().cast::<c_void>(),
                bytes.len(),
                self.stream.cu_stream(),
            )
        })?;
        self.sync_stream()
    }

    /// Copies the bytes `range` of `input` to the same bytes of `staging` on the stream
    /// ([`Backend::stage`](crate::backend::Backend::stage)).
    pub(super) fn stage_range(
        &self,
        input: &CudaBuffer,
        staging: &CudaBuffer,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        if range.start > range.end || range.end > input.len() {
            return Err(AllReduceError::InvalidArgument(format!(
                "bytes {range:?} do not fit the {}-byte input",
                input.len(),
            )));
        }
        // The input is a live CudaBuffer holding `range` (checked above).
        self.stage_from(
            input.device_ptr() + range.start as u64,
            staging,
            range.start,
            range.len(),
        )
    }
}

/// Bytes of the packs the kernels move: outputs and zero-copy inputs are aligned to it.
const PACK_BYTES: usize = 16;

/// Whether a caller's input can be shared with peers zero-copy: 16-byte aligned and
/// exportable by legacy CUDA IPC; `false` (the staging copy is captured instead) for memory
/// legacy IPC cannot export, with the reason traced.
pub(crate) fn shareable_input<M: DevicePeerMemory>(
    memory: &M,
    addr: u64,
    bytes: usize,
) -> Result<bool> {
    if !addr.is_multiple_of(PACK_BYTES as u64) {
        tracing::debug!(
            addr,
            "captured input is not 16-byte aligned: its staging copy is captured"
        );
        return Ok(false);
    }
    match memory.check_shareable(addr, bytes) {
        Ok(()) => Ok(true),
        Err(tpcomm_ipc::IpcError::NotExportable { reason, .. }) => {
            tracing::debug!(addr, %reason, "captured input is not exportable: its staging copy is captured");
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}
