//! Inputs one custom launch cannot take, reduced in several: what
//! [`Reproducibility::BitStable`](crate::dispatch::Reproducibility::BitStable) does instead
//! of the transport's all-reduce. An input above `max_bytes` goes in pieces of the largest
//! size the staging buffers hold, and a last piece that is not a multiple of 16 bytes is
//! padded to one. Every element is summed over the ranks in rank order with f32
//! accumulation whichever launch carries it, so the pieces give the same bits as one
//! launch would. Every rank passes the same count and so cuts the same pieces. Host slices
//! (`all_reduce_or_transport`) and, on CUDA, cudarc views
//! ([`all_reduce_device_in_pieces`](CustomAllReduce::all_reduce_device_in_pieces), which
//! `DeviceAllReduce` calls instead of NCCL).

use std::ops::Range;

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
#[cfg(feature = "cuda")]
use tpcomm_ipc::DevicePeerMemory;

use super::CustomAllReduce;
#[cfg(feature = "cuda")]
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
#[cfg(feature = "cuda")]
use crate::dispatch::FallbackReason;
use crate::dtype::Element;
#[cfg(feature = "cuda")]
use crate::error::AllReduceError;
use crate::error::Result;

/// Bytes of a launch's smallest unit: custom launches move whole 16-byte packs.
const PACK: usize = 16;

/// One launch of an input cut into pieces: the elements `range`, and when their bytes are
/// not a multiple of 16, the element count of the padded launch that carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) range: Range<usize>,
    pub(crate) padded: Option<usize>,
}

/// The pieces of `count` elements of `elem` bytes for staging buffers of `max_bytes`
/// (at least 16): as many pieces of the largest multiple of 16 bytes that fits as needed,
/// the rest in whole packs, then the last elements short of a pack, padded. Empty for 0.
pub(crate) fn pieces(count: usize, elem: usize, max_bytes: usize) -> Vec<Piece> {
    let per_pack = PACK / elem;
    let chunk = (max_bytes / PACK).max(1) * per_pack;
    let mut out = Vec::with_capacity(count / chunk + 2);
    let mut start = 0;
    while count - start >= chunk {
        out.push(Piece {
            range: start..start + chunk,
            padded: None,
        });
        start += chunk;
    }
    let whole = (count - start) / per_pack * per_pack;
    if whole > 0 {
        out.push(Piece {
            range: start..start + whole,
            padded: None,
        });
        start += whole;
    }
    if start < count {
        out.push(Piece {
            range: start..count,
            padded: Some(per_pack),
        });
    }
    out
}

impl<B: Backend> CustomAllReduce<B> {
    /// Collective: reduces `input` into `output` (equal lengths, checked by the caller) in
    /// the launches [`pieces`] cuts; returns how many ran.
    pub(super) fn all_reduce_in_pieces<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<usize> {
        let plan = pieces(input.len(), T::DTYPE.size(), self.config.max_bytes);
        for piece in &plan {
            let range = piece.range.clone();
            match piece.padded {
                None => {
                    self.all_reduce(&input[range.clone()], &mut output[range])?;
                }
                Some(padded) => {
                    // At most 8 elements (16 bytes of f16); the padding's sums are dropped.
                    let zero = <T as bytemuck::Zeroable>::zeroed();
                    let (mut padded_in, mut padded_out) = ([zero; PACK / 2], [zero; PACK / 2]);
                    let n = range.len();
                    padded_in[..n].copy_from_slice(&input[range.clone()]);
                    self.all_reduce(&padded_in[..padded], &mut padded_out[..padded])?;
                    output[range].copy_from_slice(&padded_out[..n]);
                }
            }
        }
        Ok(plan.len())
    }
}

#[cfg(feature = "cuda")]
impl<M: DevicePeerMemory> CustomAllReduce<CudaBackend<M>> {
    /// [`all_reduce_device`](Self::all_reduce_device) of an input of any size that is a
    /// multiple of 16 bytes: in launches of at most `max_bytes` each, which give the same
    /// bits as one launch would (every element summed in rank order with f32 accumulation,
    /// whichever launch carries it). Returns the launches issued (0 for an empty input).
    /// [`DeviceAllReduce`](crate::DeviceAllReduce) takes it for inputs above `max_bytes`
    /// with [`Reproducibility::BitStable`](crate::dispatch::Reproducibility::BitStable).
    ///
    /// Collective, every rank with the same count. A size that is not a multiple of 16
    /// bytes is [`FallbackReason::SizeNotMultipleOf16`] before anything runs (the kernels
    /// have no padded launch of caller memory); every other refusal is
    /// [`all_reduce_device`](Self::all_reduce_device)'s, on the first piece.
    pub fn all_reduce_device_in_pieces<T, I, O>(
        &mut self,
        input: &I,
        output: &mut O,
    ) -> Result<usize>
    where
        T: Element,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let count = input.len();
        super::caller_memory::output_holds(output.len(), count)?;
        let bytes = count.saturating_mul(T::DTYPE.size());
        if !bytes.is_multiple_of(PACK) {
            return Err(AllReduceError::Fallback(
                FallbackReason::SizeNotMultipleOf16 { bytes },
            ));
        }
        let plan = pieces(count, T::DTYPE.size(), self.config.max_bytes);
        for piece in &plan {
            let part = Window {
                inner: input,
                start: piece.range.start,
                len: piece.range.len(),
                marker: std::marker::PhantomData,
            };
            let mut out = WindowMut {
                inner: &mut *output,
                start: piece.range.start,
                len: piece.range.len(),
                marker: std::marker::PhantomData,
            };
            self.all_reduce_device(&part, &mut out)?;
        }
        Ok(plan.len())
    }
}

/// Elements `start..start + len` of a caller's input, for one piece.
#[cfg(feature = "cuda")]
struct Window<'i, T, I: DevicePtr<T>> {
    inner: &'i I,
    start: usize,
    len: usize,
    marker: std::marker::PhantomData<T>,
}

#[cfg(feature = "cuda")]
impl<T, I: DevicePtr<T>> DeviceSlice<T> for Window<'_, T, I> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }
}

#[cfg(feature = "cuda")]
impl<T, I: DevicePtr<T>> DevicePtr<T> for Window<'_, T, I> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        let (base, sync) = self.inner.device_ptr(stream);
        (base + (self.start * std::mem::size_of::<T>()) as u64, sync)
    }
}

/// Elements `start..start + len` of a caller's output, for one piece.
#[cfg(feature = "cuda")]
struct WindowMut<'o, T, O: DevicePtrMut<T>> {
    inner: &'o mut O,
    start: usize,
    len: usize,
    marker: std::marker::PhantomData<T>,
}

#[cfg(feature = "cuda")]
impl<T, O: DevicePtrMut<T>> DeviceSlice<T> for WindowMut<'_, T, O> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }
}

#[cfg(feature = "cuda")]
impl<T, O: DevicePtrMut<T>> DevicePtrMut<T> for WindowMut<'_, T, O> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        let (base, sync) = self.inner.device_ptr_mut(stream);
        (base + (self.start * std::mem::size_of::<T>()) as u64, sync)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(range: Range<usize>, padded: Option<usize>) -> Piece {
        Piece { range, padded }
    }

    #[test]
    fn an_input_is_cut_into_full_staging_buffers_whole_packs_and_a_padded_tail() {
        // 4 KiB staging, f32: 1024 elements a piece, packs of 4.
        assert_eq!(
            pieces(2500, 4, 4096),
            vec![
                piece(0..1024, None),
                piece(1024..2048, None),
                piece(2048..2500, None),
            ]
        );
        assert_eq!(
            pieces(2051, 4, 4096),
            vec![
                piece(0..1024, None),
                piece(1024..2048, None),
                piece(2048..2051, Some(4)),
            ]
        );
        // f16: packs of 8; 12 elements are a pack and 4 padded to 8.
        assert_eq!(
            pieces(12, 2, 4096),
            vec![piece(0..8, None), piece(8..12, Some(8))]
        );
        // max_bytes not a multiple of 16: pieces of the multiple below it.
        assert_eq!(
            pieces(10, 4, 40),
            vec![piece(0..8, None), piece(8..10, Some(4))]
        );
        assert!(pieces(0, 4, 4096).is_empty());
    }

    #[test]
    fn the_pieces_cover_every_element_once_in_order_within_the_staging_buffer() {
        for elem in [2, 4] {
            for max_bytes in [16, 48, 4096, 4100] {
                for count in 0..300 {
                    let plan = pieces(count, elem, max_bytes);
                    let mut next = 0;
                    for p in &plan {
                        assert_eq!(p.range.start, next, "{count} {elem} {max_bytes}");
                        assert!(!p.range.is_empty());
                        let launched = p.padded.unwrap_or(p.range.len());
                        assert!(launched * elem <= max_bytes.max(16));
                        assert_eq!(launched * elem % 16, 0);
                        assert!(launched >= p.range.len());
                        next = p.range.end;
                    }
                    assert_eq!(next, count);
                }
            }
        }
    }
}
