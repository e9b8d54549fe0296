//! A buffer's elements seen as a cudarc device slice (`CudaBuffer::view`), so that cudarc
//! APIs (NCCL's collectives) take tpcomm's exportable memory as it is.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;

use super::CudaBuffer;
use crate::error::{IpcError, Result};
use crate::memory::check_range;

impl CudaBuffer {
    /// The device address of the first byte (for kernels and tables).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The first `len` elements of `T` of this buffer as a cudarc device slice on `stream`,
    /// for cudarc APIs such as NCCL's collectives. Ordering is the stream's: no event is
    /// recorded or waited for. Fails with [`IpcError::OutOfBounds`] when they do not fit, and
    /// with [`IpcError::WrongDevice`] when `stream` belongs to another device (the view
    /// reports its stream's device, which consumers check their buffers against).
    pub fn view<'a, T>(
        &'a self,
        len: usize,
        stream: &'a Arc<cudarc::driver::CudaStream>,
    ) -> Result<BufferView<'a, T>> {
        let stream_device = stream.context().ordinal();
        if usize::try_from(self.ctx.ordinal).ok() != Some(stream_device) {
            return Err(IpcError::WrongDevice {
                buffer: self.ctx.ordinal,
                stream: stream_device,
            });
        }
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        check_range(0, bytes, self.len)?;
        Ok(BufferView {
            ptr: self.ptr,
            len,
            stream,
            _buffer: std::marker::PhantomData,
        })
    }
}

/// Elements of a [`CudaBuffer`] seen as a cudarc device slice ([`CudaBuffer::view`]); borrows
/// the buffer, so it cannot outlive it.
#[derive(Debug)]
pub struct BufferView<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<cudarc::driver::CudaStream>,
    _buffer: std::marker::PhantomData<(&'a CudaBuffer, T)>,
}

impl<T> cudarc::driver::DeviceSlice<T> for BufferView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        self.stream
    }
}

impl<T> cudarc::driver::DevicePtr<T> for BufferView<'_, T> {
    fn device_ptr<'a>(
        &'a self,
        _stream: &'a cudarc::driver::CudaStream,
    ) -> (CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
        (self.ptr, cudarc::driver::SyncOnDrop::Record(None))
    }
}

impl<T> cudarc::driver::DevicePtrMut<T> for BufferView<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a cudarc::driver::CudaStream,
    ) -> (CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
        (self.ptr, cudarc::driver::SyncOnDrop::Record(None))
    }
}
