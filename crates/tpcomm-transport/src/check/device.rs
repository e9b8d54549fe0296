//! The length check of device collectives (NCCL): one function for every kind, returning
//! the element count NCCL takes.

use super::Shape;
#[cfg(doc)]
use crate::error::TransportError;
use crate::error::{ArgumentError, Op, Result};

/// A collective on device buffers, as the device argument check sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCollective {
    /// Send and receive hold the same number of elements (in place: one buffer).
    AllReduce,
    /// The receive buffer holds `size` times the send buffer's elements.
    AllGather,
    /// The send buffer holds `size` times the receive buffer's elements.
    ReduceScatter,
    /// One buffer, the same length on every rank, sent from `root`.
    Broadcast {
        /// The rank whose buffer is sent.
        root: usize,
    },
}

impl DeviceCollective {
    /// The transport operation this collective reports in errors and spans.
    pub fn op(self) -> Op {
        match self {
            DeviceCollective::AllReduce => Op::AllReduce,
            DeviceCollective::AllGather => Op::AllGather,
            DeviceCollective::ReduceScatter => Op::ReduceScatter,
            DeviceCollective::Broadcast { .. } => Op::Broadcast,
        }
    }
}

/// Checks the buffer lengths (in elements of `elem_bytes` bytes) of a device collective on
/// rank `rank` of `size` ranks, and returns the element count NCCL takes: the whole buffer
/// for all-reduce and broadcast, the *send* length for all-gather, the *receive* length for
/// reduce-scatter.
///
/// The one place where device collectives' arguments are checked (the provided methods of
/// `DeviceCommunicator` call it before anything is enqueued). Errors are
/// [`TransportError::InvalidArgument`] whose lengths are in bytes, as for host buffers:
/// [`ArgumentError::RootOutOfRange`], [`ArgumentError::SendLength`] /
/// [`ArgumentError::RecvLength`] (which side is reported: the receive side for all-reduce
/// and all-gather, the send side for reduce-scatter), [`ArgumentError::Overflow`] when
/// `size * length` does not fit in `usize`. For a broadcast only `recv_len` is looked at.
///
/// ```
/// use tpcomm_transport::check::{device_count, DeviceCollective};
///
/// // 4 ranks all-gather 3 f32 each into 12.
/// assert_eq!(device_count(DeviceCollective::AllGather, 0, 4, 3, 12, 4).unwrap(), 3);
/// assert!(device_count(DeviceCollective::AllGather, 0, 4, 3, 11, 4).is_err());
/// ```
pub fn device_count(
    kind: DeviceCollective,
    rank: usize,
    size: usize,
    send_len: usize,
    recv_len: usize,
    elem_bytes: usize,
) -> Result<usize> {
    let shape = Shape {
        op: kind.op(),
        rank,
        size,
        max_count: usize::MAX,
    };
    let bytes = |elems: usize| elems.saturating_mul(elem_bytes);
    let times_size = |len: usize| {
        len.checked_mul(size).ok_or_else(|| {
            shape.err(ArgumentError::Overflow {
                what: "size * buffer length",
            })
        })
    };
    match kind {
        DeviceCollective::AllReduce => {
            if send_len != recv_len {
                return Err(shape.err(ArgumentError::RecvLength {
                    expected: bytes(send_len),
                    actual: bytes(recv_len),
                }));
            }
            Ok(send_len)
        }
        DeviceCollective::AllGather => {
            let expected = times_size(send_len)?;
            if recv_len != expected {
                return Err(shape.err(ArgumentError::RecvLength {
                    expected: bytes(expected),
                    actual: bytes(recv_len),
                }));
            }
            Ok(send_len)
        }
        DeviceCollective::ReduceScatter => {
            let expected = times_size(recv_len)?;
            if send_len != expected {
                return Err(shape.err(ArgumentError::SendLength {
                    expected: bytes(expected),
                    actual: bytes(send_len),
                }));
            }
            Ok(recv_len)
        }
        DeviceCollective::Broadcast { root } => {
            shape.root(root)?;
            Ok(recv_len)
        }
    }
}
