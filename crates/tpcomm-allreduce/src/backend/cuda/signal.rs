//! The Signal block as the host sees it: the launch state reset (everything before the
//! nonce), and the error word a kernel records (a barrier timeout naming the peer, a launch
//! shape mismatch naming both shapes), read after the stream drained.

use std::mem::offset_of;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cudarc::driver::sys;
use tpcomm_ipc::{CudaBuffer, DevicePeerMemory};
use tpcomm_kernels as kernels;

use super::driver_api::check;
use super::CudaBackend;
use crate::error::{AllReduceError, Result};

/// Byte offset of the error word in a Signal block.
const ERROR_OFFSET: usize = offset_of!(kernels::Signal, error);
/// Byte offset of the two shape words a shape mismatch records (own, peer's).
const MISMATCH_OFFSET: usize = offset_of!(kernels::Signal, mismatch);
/// Byte offset of the nonce in a Signal block (everything before it is launch state).
pub(super) const NONCE_OFFSET: usize = offset_of!(kernels::Signal, nonce);

impl<M: DevicePeerMemory> CudaBackend<M> {
    /// Zeroes the launch state of this rank's Signal block (everything before the nonce)
    /// on the stream, and waits for it
    /// ([`Backend::reset_signal`](crate::backend::Backend::reset_signal)).
    pub(super) fn reset_launch_state(&self, signal: &CudaBuffer) -> Result<()> {
        self.refuse_while_capturing("resetting the Signal block")?;
        self.bind()?;
        // SAFETY: this rank's own Signal block (a live CudaBuffer of at least SIGNAL_BYTES,
        // checked by the allocation), written on this backend's stream.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(
                signal.device_ptr(),
                0,
                NONCE_OFFSET,
                self.stream.cu_stream(),
            )
        })?;
        self.sync_stream()
    }

    /// Drains the stream, then reports the error a kernel recorded in this rank's Signal
    /// block ([`Backend::synchronize`](crate::backend::Backend::synchronize)).
    pub(super) fn drain(&self, memory: &M, own_signal: &CudaBuffer) -> Result<()> {
        self.refuse_while_capturing("synchronizing")?;
        self.sync_stream()?;
        let mut word = [0u8; 4];
        memory.read(own_signal, ERROR_OFFSET, &mut word)?;
        let word = u32::from_le_bytes(word);
        let mut shapes = [0u32; 2];
        if matches!(
            kernels::ErrorWord::decode(word),
            kernels::ErrorWord::ShapeMismatch(_)
        ) {
            let mut raw = [0u8; 8];
            memory.read(own_signal, MISMATCH_OFFSET, &mut raw)?;
            shapes = [
                u32::from_le_bytes(raw[..4].try_into().expect("4 bytes")),
                u32::from_le_bytes(raw[4..].try_into().expect("4 bytes")),
            ];
        }
        let waited = Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed));
        match device_error(word, shapes, self.rank, waited) {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// The error a kernel recorded in an error word, as the driver reports it; `shapes` are the
/// Signal block's mismatch words (this rank's launch shape, the peer's), read only for a
/// shape mismatch.
pub(super) fn device_error(
    word: u32,
    shapes: [u32; 2],
    rank: usize,
    timeout: Duration,
) -> Option<AllReduceError> {
    match kernels::ErrorWord::decode(word) {
        kernels::ErrorWord::Clear => None,
        kernels::ErrorWord::ShapeMismatch(m) => {
            let mine = kernels::LaunchShape::decode(shapes[0]);
            let theirs = kernels::LaunchShape::decode(shapes[1]);
            Some(AllReduceError::LaunchMismatch {
                rank,
                bytes: mine.bytes,
                dtype: mine.dtype,
                slot: None,
                peer: m.peer,
                peer_bytes: theirs.bytes,
                peer_dtype: theirs.dtype,
                peer_slot: None,
            })
        }
        kernels::ErrorWord::Timeout(t) => Some(AllReduceError::Timeout {
            rank,
            peer: t.peer,
            barrier: match t.barrier {
                kernels::BarrierKind::Start => "start",
                kernels::BarrierKind::End => "end",
                kernels::BarrierKind::Mid => "mid",
            },
            waited: timeout,
        }),
        kernels::ErrorWord::Unknown(w) => Some(AllReduceError::InvalidArgument(format!(
            "the kernel recorded an unknown error word {w:#x}"
        ))),
    }
}
