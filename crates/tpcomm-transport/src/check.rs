//! Argument checks shared by every backend.
//!
//! The provided methods of [`Communicator`](crate::Communicator) run these checks and hand
//! the backend a *checked* argument bundle. The bundles have private fields and no public
//! constructor, so a backend can only ever receive arguments that went through this module:
//! the checks live in one place and cannot be skipped by a new backend. Each bundle also
//! records the rank and size it was checked for (`Group`), which every backend compares
//! with its own: a wrapper that forwards a bundle while reporting another rank or size gets
//! an error.
//!
//! The checks run on every call, so their cost is part of every collective's latency. The
//! bundle constructors are `#[inline(always)]`: the provided methods are generic, so they
//! are compiled in the caller's crate, where a constructor that is not inlined returns its
//! `Result<bundle>` through memory and the caller reloads it with wider loads than the
//! stores that wrote it, which x86 cores cannot forward (a store-forwarding stall). A
//! layout is first tried by a short loop that only accepts (see `Shape::layout`); the
//! full check, which names the first problem, runs when that loop is not sure.

use crate::error::{ArgumentError, Op, Result, TransportError};
use crate::reduce::{DataType, ReduceOp};

/// The facts about a communicator that the checks need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) op: Op,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) max_count: usize,
}

/// The rank and size a bundle of arguments was checked for.
///
/// The provided methods of [`Communicator`](crate::Communicator) check arguments against the
/// rank and size of the communicator they are called on. A communicator that wraps another
/// and forwards the checked bundle to it reports its own rank and size, which need not be
/// the inner one's; so every backend compares the bundle's group with its own
/// ([`Group::expect`]) before it touches a buffer: a bundle checked for another group is an
/// error, never a transfer sized for another group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Group {
    rank: usize,
    size: usize,
}

impl Group {
    pub(crate) fn new(rank: usize, size: usize) -> Self {
        Self { rank, size }
    }

    /// `Ok` when the bundle was checked for rank `rank` of a communicator of `size` ranks.
    #[inline(always)]
    pub(crate) fn expect(self, op: Op, rank: usize, size: usize) -> Result<()> {
        if self.rank == rank && self.size == size {
            return Ok(());
        }
        Err(self.mismatch(op, rank, size))
    }

    #[cold]
    #[inline(never)]
    fn mismatch(self, op: Op, rank: usize, size: usize) -> TransportError {
        TransportError::InvalidArgument {
            op,
            rank,
            source: ArgumentError::OtherGroup {
                checked_rank: self.rank,
                checked_size: self.size,
                rank,
                size,
            },
        }
    }
}

impl Shape {
    /// The group arguments checked with this shape were checked for.
    #[inline(always)]
    fn group(&self) -> Group {
        Group::new(self.rank, self.size)
    }

    fn err(&self, source: ArgumentError) -> TransportError {
        TransportError::InvalidArgument {
            op: self.op,
            rank: self.rank,
            source,
        }
    }

    fn root(&self, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.err(ArgumentError::RootOutOfRange {
                root,
                size: self.size,
            }));
        }
        Ok(())
    }

    fn count(&self, which: &'static str, index: usize, value: usize) -> Result<()> {
        if value > self.max_count {
            return Err(self.err(ArgumentError::CountTooLarge {
                which,
                index,
                value,
                max: self.max_count,
            }));
        }
        Ok(())
    }

    /// Checks one counts/displacements table against a buffer of `buffer_len` bytes.
    ///
    /// A valid layout whose non-empty regions are in rank order (the common case) is
    /// accepted by [`layout_fits`](Self::layout_fits), a short loop that builds nothing;
    /// anything else goes through [`layout_detail`](Self::layout_detail), which accepts
    /// exactly the same layouts and names the first problem of the others.
    #[inline(always)]
    fn layout(
        &self,
        which: &'static str,
        counts: &[usize],
        displs: &[usize],
        buffer_len: usize,
        reject_overlap: bool,
    ) -> Result<()> {
        if self.layout_fits(counts, displs, buffer_len, reject_overlap) {
            return Ok(());
        }
        self.layout_detail(which, counts, displs, buffer_len, reject_overlap)
    }

    /// True when [`layout_detail`](Self::layout_detail) is sure to accept the layout: right
    /// table lengths, every count and displacement at most `max_count`, every region inside
    /// the buffer, and (when overlap is rejected) the non-empty regions in ascending order
    /// without overlap. A `false` only means "look closer".
    #[inline(always)]
    fn layout_fits(
        &self,
        counts: &[usize],
        displs: &[usize],
        buffer_len: usize,
        reject_overlap: bool,
    ) -> bool {
        if counts.len() != self.size || displs.len() != self.size {
            return false;
        }
        let mut ascending = true;
        let mut prev_end = 0;
        for (&count, &displacement) in counts.iter().zip(displs) {
            if count > self.max_count || displacement > self.max_count {
                return false;
            }
            let Some(end) = displacement.checked_add(count) else {
                return false;
            };
            if end > buffer_len {
                return false;
            }
            if count != 0 {
                ascending &= displacement >= prev_end;
                prev_end = end;
            }
        }
        ascending || !reject_overlap
    }

    /// The full check behind [`layout`](Self::layout): the first problem in table, then
    /// rank, order; regions not in rank order are sorted (allocating) to look for
    /// overlaps.
    #[cold]
    #[inline(never)]
    fn layout_detail(
        &self,
        which: &'static str,
        counts: &[usize],
        displs: &[usize],
        buffer_len: usize,
        reject_overlap: bool,
    ) -> Result<()> {
        let (counts_name, displs_name) = match which {
            "send" => ("send counts", "send displacements"),
            _ => ("counts", "displacements"),
        };
        for (name, table) in [(counts_name, counts), (displs_name, displs)] {
            if table.len() != self.size {
                return Err(self.err(ArgumentError::TableLength {
                    which: name,
                    expected: self.size,
                    actual: table.len(),
                }));
            }
        }
        for (index, (&count, &displacement)) in counts.iter().zip(displs).enumerate() {
            self.count(counts_name, index, count)?;
            self.count(displs_name, index, displacement)?;
            let end = displacement.checked_add(count).ok_or_else(|| {
                self.err(ArgumentError::Overflow {
                    what: "displacement + count",
                })
            })?;
            if end > buffer_len {
                return Err(self.err(ArgumentError::OutOfBounds {
                    which,
                    index,
                    displacement,
                    count,
                    buffer_len,
                }));
            }
        }
        if reject_overlap && !ascending_disjoint(counts, displs) {
            let mut regions: Vec<(usize, usize, usize)> = counts
                .iter()
                .zip(displs)
                .enumerate()
                .filter(|(_, (&c, _))| c > 0)
                .map(|(i, (&c, &d))| (d, d + c, i))
                .collect();
            regions.sort_unstable();
            for pair in regions.windows(2) {
                if pair[1].0 < pair[0].1 {
                    return Err(self.err(ArgumentError::Overlap {
                        which,
                        first: pair[0].2,
                        second: pair[1].2,
                    }));
                }
            }
        }
        Ok(())
    }
}

/// True when the non-empty regions, taken in rank order, each start at or after the end of
/// the previous one: the common (dense, rank-ordered) layout, proved disjoint without
/// allocating or sorting. Regions must already be known to be in bounds (no overflow).
fn ascending_disjoint(counts: &[usize], displs: &[usize]) -> bool {
    let mut end = 0;
    for (&c, &d) in counts.iter().zip(displs) {
        if c == 0 {
            continue;
        }
        if d < end {
            return false;
        }
        end = d + c;
    }
    true
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape(size: usize, rank: usize, max_count: usize) -> Shape {
        Shape {
            op: Op::AllGatherVarcount,
            rank,
            size,
            max_count,
        }
    }

    /// The specification of a valid varcount layout, written the slow obvious way.
    fn valid_by_model(
        size: usize,
        rank: usize,
        max: usize,
        send_len: usize,
        recv_len: usize,
        counts: &[usize],
        displs: &[usize],
    ) -> bool {
        if counts.len() != size || displs.len() != size {
            return false;
        }
        for i in 0..size {
            if counts[i] > max || displs[i] > max {
                return false;
            }
            match displs[i].checked_add(counts[i]) {
                Some(end) if end <= recv_len => {}
                _ => return false,
            }
        }
        for i in 0..size {
            for j in 0..size {
                let both = i != j && counts[i] > 0 && counts[j] > 0;
                if both && displs[i] < displs[j] + counts[j] && displs[j] < displs[i] + counts[i] {
                    return false;
                }
            }
        }
        send_len == counts[rank]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn varcount_check_accepts_exactly_the_valid_layouts(
            size in 1usize..6,
            rank_pick in any::<usize>(),
            max in 1usize..64,
            send_len in 0usize..40,
            recv_len in 0usize..100,
            counts in prop::collection::vec(0usize..40, 0..7),
            displs in prop::collection::vec(0usize..80, 0..7),
        ) {
            let rank = rank_pick % size;
            let send = vec![0u8; send_len];
            let mut recv = vec![0u8; recv_len];
            let accepted =
                VarcountArgs::check(shape(size, rank, max), &send, &mut recv, &counts, &displs).is_ok();
            prop_assert_eq!(
                accepted,
                valid_by_model(size, rank, max, send_len, recv_len, &counts, &displs)
            );
        }

        #[test]
        fn layout_fast_path_agrees_with_the_full_check(
            (size, counts, displs) in (1usize..6).prop_flat_map(|size| (
                Just(size),
                prop::collection::vec(prop_oneof![Just(0usize), 0usize..20], size),
                prop::collection::vec(0usize..60, size),
            )),
            max in 1usize..64,
            buffer_len in 0usize..100,
            reject_overlap in any::<bool>(),
            send_side in any::<bool>(),
        ) {
            let s = shape(size, 0, max);
            let which = if send_side { "send" } else { "receive" };
            let fits = s.layout_fits(&counts, &displs, buffer_len, reject_overlap);
            let full = s.layout_detail(which, &counts, &displs, buffer_len, reject_overlap);
            if fits {
                prop_assert!(full.is_ok(), "accepted by the fast path, rejected by the full check: {:?}", full);
            }
            let checked = s.layout(which, &counts, &displs, buffer_len, reject_overlap);
            prop_assert_eq!(format!("{checked:?}"), format!("{full:?}"));
        }

        #[test]
        fn all_gather_check_requires_size_times_send(
            size in 1usize..9,
            send_len in 0usize..50,
            recv_len in 0usize..400,
        ) {
            let send = vec![0u8; send_len];
            let mut recv = vec![0u8; recv_len];
            let accepted = AllGatherArgs::check(shape(size, 0, 1 << 20), &send, &mut recv).is_ok();
            prop_assert_eq!(accepted, recv_len == size * send_len);
        }
    }

    #[test]
    fn device_broadcast_root_must_be_a_rank() {
        let err = device_count(DeviceCollective::Broadcast { root: 3 }, 0, 3, 0, 8, 4);
        assert!(matches!(
            err,
            Err(TransportError::InvalidArgument {
                op: Op::Broadcast,
                source: ArgumentError::RootOutOfRange { root: 3, size: 3 },
                ..
            })
        ));
        assert_eq!(
            device_count(DeviceCollective::Broadcast { root: 2 }, 0, 3, 0, 8, 4).unwrap(),
            8
        );
    }

    #[test]
    fn device_lengths_are_reported_in_bytes() {
        let err = device_count(DeviceCollective::AllReduce, 1, 2, 4, 5, 2).unwrap_err();
        assert!(matches!(
            err,
            TransportError::InvalidArgument {
                op: Op::AllReduce,
                rank: 1,
                source: ArgumentError::RecvLength {
                    expected: 8,
                    actual: 10
                },
            }
        ));
    }

    #[test]
    fn device_size_times_length_overflow_is_an_error() {
        let err = device_count(DeviceCollective::AllGather, 0, 2, usize::MAX, 0, 1).unwrap_err();
        assert!(matches!(
            err,
            TransportError::InvalidArgument {
                source: ArgumentError::Overflow { .. },
                ..
            }
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn device_check_accepts_exactly_the_matching_lengths(
            size in 1usize..9,
            send_len in 0usize..64,
            recv_len in 0usize..512,
            root in 0usize..10,
            which in 0usize..4,
        ) {
            let (kind, valid, count) = match which {
                0 => (DeviceCollective::AllReduce, send_len == recv_len, send_len),
                1 => (DeviceCollective::AllGather, recv_len == size * send_len, send_len),
                2 => (DeviceCollective::ReduceScatter, send_len == size * recv_len, recv_len),
                _ => (DeviceCollective::Broadcast { root }, root < size, recv_len),
            };
            let checked = device_count(kind, 0, size, send_len, recv_len, 2);
            prop_assert_eq!(checked.is_ok(), valid);
            if let Ok(c) = checked {
                prop_assert_eq!(c, count);
            }
        }
    }
}
