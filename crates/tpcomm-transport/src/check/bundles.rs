//! The checked argument bundles of the host collectives, one per collective, each built
//! by its `check` (the only constructor) and read by backends through accessors.

use super::{Group, Shape};
use crate::error::{ArgumentError, Result};
use crate::reduce::{DataType, ReduceOp};

/// Checked arguments of a fixed-size all-gather: every rank sends `send.len()` bytes and
/// `recv` holds `size * send.len()` bytes, rank `i`'s block at `i * send.len()`.
#[derive(Debug)]
pub struct AllGatherArgs<'a> {
    send: &'a [u8],
    recv: &'a mut [u8],
    /// The rank and size the arguments were checked for.
    group: Group,
}

impl<'a> AllGatherArgs<'a> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    #[inline(always)]
    pub(crate) fn check(shape: Shape, send: &'a [u8], recv: &'a mut [u8]) -> Result<Self> {
        shape.count("send count", shape.rank, send.len())?;
        let expected = send.len().checked_mul(shape.size).ok_or_else(|| {
            shape.err(ArgumentError::Overflow {
                what: "size * send length",
            })
        })?;
        if recv.len() != expected {
            return Err(shape.err(ArgumentError::RecvLength {
                expected,
                actual: recv.len(),
            }));
        }
        Ok(Self {
            send,
            recv,
            group: shape.group(),
        })
    }

    /// This rank's contribution.
    pub fn send(&self) -> &[u8] {
        self.send
    }

    /// The receive buffer, `size * send().len()` bytes.
    pub fn recv(&mut self) -> &mut [u8] {
        self.recv
    }

    /// Bytes each rank contributes.
    pub fn block_len(&self) -> usize {
        self.send.len()
    }

    /// Splits into the send slice and the receive buffer.
    pub fn parts(&mut self) -> (&[u8], &mut [u8]) {
        (self.send, self.recv)
    }
}

/// Checked arguments of a varcount all-gather.
///
/// Guarantees: one count and one displacement per rank, each at most `max_count`;
/// `send.len() == counts[rank]`; every region `displs[i]..displs[i] + counts[i]` lies inside
/// `recv`; non-empty regions do not overlap.
#[derive(Debug)]
pub struct VarcountArgs<'a> {
    send: &'a [u8],
    recv: &'a mut [u8],
    counts: &'a [usize],
    displs: &'a [usize],
    /// The rank and size the arguments were checked for.
    group: Group,
}

impl<'a> VarcountArgs<'a> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    #[inline(always)]
    pub(crate) fn check(
        shape: Shape,
        send: &'a [u8],
        recv: &'a mut [u8],
        counts: &'a [usize],
        displs: &'a [usize],
    ) -> Result<Self> {
        shape.layout("receive", counts, displs, recv.len(), true)?;
        if send.len() != counts[shape.rank] {
            return Err(shape.err(ArgumentError::SendLength {
                expected: counts[shape.rank],
                actual: send.len(),
            }));
        }
        Ok(Self {
            send,
            recv,
            counts,
            displs,
            group: shape.group(),
        })
    }

    /// This rank's contribution (`counts()[rank]` bytes).
    pub fn send(&self) -> &[u8] {
        self.send
    }

    /// The receive buffer.
    pub fn recv(&mut self) -> &mut [u8] {
        self.recv
    }

    /// Bytes received from each rank.
    pub fn counts(&self) -> &[usize] {
        self.counts
    }

    /// Where each rank's bytes land in the receive buffer.
    pub fn displs(&self) -> &[usize] {
        self.displs
    }

    /// Splits into the send slice, the receive buffer, counts and displacements.
    pub fn parts(&mut self) -> (&[u8], &mut [u8], &[usize], &[usize]) {
        (self.send, self.recv, self.counts, self.displs)
    }
}

/// The receive side of a gather, passed by the root only.
#[derive(Debug)]
pub struct GatherRecv<'a> {
    /// Buffer the root receives into.
    pub recv: &'a mut [u8],
    /// Bytes expected from each rank.
    pub counts: &'a [usize],
    /// Where each rank's bytes land in `recv`.
    pub displs: &'a [usize],
}

/// Checked arguments of a varcount gather to a root.
///
/// Guarantees: `root < size`; `send.len() <= max_count`; on the root, a receive layout
/// checked as for [`VarcountArgs`] with `send.len() == counts[root]`; elsewhere, no receive
/// layout.
#[derive(Debug)]
pub struct GatherArgs<'a> {
    root: usize,
    send: &'a [u8],
    recv: Option<GatherRecv<'a>>,
    /// The rank and size the arguments were checked for.
    group: Group,
}

impl<'a> GatherArgs<'a> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    #[inline(always)]
    pub(crate) fn check(
        shape: Shape,
        root: usize,
        send: &'a [u8],
        recv: Option<GatherRecv<'a>>,
    ) -> Result<Self> {
        shape.root(root)?;
        shape.count("send count", shape.rank, send.len())?;
        let recv = if shape.rank == root {
            let r = recv.ok_or_else(|| shape.err(ArgumentError::MissingRootReceive))?;
            shape.layout("receive", r.counts, r.displs, r.recv.len(), true)?;
            if send.len() != r.counts[root] {
                return Err(shape.err(ArgumentError::SendLength {
                    expected: r.counts[root],
                    actual: send.len(),
                }));
            }
            Some(r)
        } else {
            None
        };
        Ok(Self {
            root,
            send,
            recv,
            group: shape.group(),
        })
    }

    /// The root rank.
    pub fn root(&self) -> usize {
        self.root
    }

    /// This rank's contribution.
    pub fn send(&self) -> &[u8] {
        self.send
    }

    /// The receive layout: `Some` on the root only.
    pub fn recv(&mut self) -> Option<&mut GatherRecv<'a>> {
        self.recv.as_mut()
    }

    /// Splits into the send slice and the receive layout (root only).
    pub fn parts(&mut self) -> (&[u8], Option<&mut GatherRecv<'a>>) {
        (self.send, self.recv.as_mut())
    }
}

/// Checked arguments of a broadcast: `root < size`, `buf.len() <= max_count`.
#[derive(Debug)]
pub struct BroadcastArgs<'a> {
    root: usize,
    buf: &'a mut [u8],
    /// The rank and size the arguments were checked for.
    group: Group,
}

impl<'a> BroadcastArgs<'a> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    #[inline(always)]
    pub(crate) fn check(shape: Shape, root: usize, buf: &'a mut [u8]) -> Result<Self> {
        shape.root(root)?;
        shape.count("buffer length", shape.rank, buf.len())?;
        Ok(Self {
            root,
            buf,
            group: shape.group(),
        })
    }

    /// The root rank.
    pub fn root(&self) -> usize {
        self.root
    }

    /// The buffer: read on the root, written elsewhere.
    pub fn buf(&mut self) -> &mut [u8] {
        self.buf
    }
}

/// Checked arguments of a varcount all-to-all: rank `i` sends
/// `send[send_displs[j]..][..send_counts[j]]` to rank `j`, which receives it at
/// `recv[recv_displs[i]..][..recv_counts[i]]`.
///
/// Guarantees: both layouts have one entry per rank, each at most `max_count`, inside their
/// buffers; non-empty receive regions do not overlap.
#[derive(Debug)]
pub struct AllToAllArgs<'a> {
    send: &'a [u8],
    send_counts: &'a [usize],
    send_displs: &'a [usize],
    recv: &'a mut [u8],
    recv_counts: &'a [usize],
    recv_displs: &'a [usize],
    /// The rank and size the arguments were checked for.
    group: Group,
}

/// One side (send or receive) of an all-to-all.
#[derive(Debug)]
pub struct Layout<'a, B> {
    /// The buffer.
    pub buf: B,
    /// Bytes per peer.
    pub counts: &'a [usize],
    /// Offset of each peer's bytes in `buf`.
    pub displs: &'a [usize],
}

impl<'a> AllToAllArgs<'a> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    #[inline(always)]
    pub(crate) fn check(
        shape: Shape,
        send: Layout<'a, &'a [u8]>,
        recv: Layout<'a, &'a mut [u8]>,
    ) -> Result<Self> {
        shape.layout("send", send.counts, send.displs, send.buf.len(), false)?;
        shape.layout("receive", recv.counts, recv.displs, recv.buf.len(), true)?;
        if send.counts[shape.rank] != recv.counts[shape.rank] {
            return Err(shape.err(ArgumentError::SendLength {
                expected: recv.counts[shape.rank],
                actual: send.counts[shape.rank],
            }));
        }
        Ok(Self {
            send: send.buf,
            send_counts: send.counts,
            send_displs: send.displs,
            recv: recv.buf,
            recv_counts: recv.counts,
            recv_displs: recv.displs,
            group: shape.group(),
        })
    }

    /// The send side.
    pub fn send(&self) -> Layout<'_, &[u8]> {
        Layout {
            buf: self.send,
            counts: self.send_counts,
            displs: self.send_displs,
        }
    }

    /// Splits into the send side and the receive side.
    pub fn parts(&mut self) -> (Layout<'_, &[u8]>, Layout<'_, &mut [u8]>) {
        (
            Layout {
                buf: self.send,
                counts: self.send_counts,
                displs: self.send_displs,
            },
            Layout {
                buf: &mut *self.recv,
                counts: self.recv_counts,
                displs: self.recv_displs,
            },
        )
    }
}

/// Checked arguments of a numeric all-reduce
/// ([`Communicator::all_reduce`](crate::Communicator::all_reduce)).
///
/// Guarantees: the receive buffer holds a whole number of `dtype` elements, `count()` of
/// them, at most `max_count`; the send buffer, when there is one (out of place), has the
/// same length. `None` as send buffer means in place: the receive buffer is also the input.
#[derive(Debug)]
pub struct AllReduceArgs<'a> {
    send: Option<&'a [u8]>,
    recv: &'a mut [u8],
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    /// The rank and size the arguments were checked for.
    group: Group,
}

impl<'a> AllReduceArgs<'a> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    #[inline(always)]
    pub(crate) fn check(
        shape: Shape,
        send: Option<&'a [u8]>,
        recv: &'a mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Self> {
        let elem = dtype.size();
        if !recv.len().is_multiple_of(elem) {
            return Err(shape.err(ArgumentError::PartialElement {
                which: "receive",
                len: recv.len(),
                dtype: dtype.name(),
                elem,
            }));
        }
        if let Some(send) = send {
            if send.len() != recv.len() {
                return Err(shape.err(ArgumentError::SendLength {
                    expected: recv.len(),
                    actual: send.len(),
                }));
            }
        }
        let count = recv.len() / elem;
        shape.count("element count", shape.rank, count)?;
        Ok(Self {
            send,
            recv,
            dtype,
            op,
            count,
            group: shape.group(),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The reduction.
    pub fn op(&self) -> ReduceOp {
        self.op
    }

    /// Elements per rank (the same on every rank, which the local backend checks).
    pub fn count(&self) -> usize {
        self.count
    }

    /// Whether the receive buffer is also the input.
    pub fn in_place(&self) -> bool {
        self.send.is_none()
    }

    /// The send buffer (`None` in place, where the receive buffer holds the input) and the
    /// receive buffer.
    pub fn parts(&mut self) -> (Option<&[u8]>, &mut [u8]) {
        (self.send, self.recv)
    }

    /// This rank's input: the send buffer, or the receive buffer's current bytes in place.
    pub fn input(&self) -> &[u8] {
        self.send.unwrap_or(self.recv)
    }
}
