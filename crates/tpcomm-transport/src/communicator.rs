//! The [`Communicator`] trait: collectives over host bytes.

use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, GatherRecv, Layout,
    Shape, VarcountArgs,
};
use crate::error::{Op, Result, TransportError};
use crate::reduce::{describe_reduction, reduce_into, slice_of, DataType, Element, ReduceOp};

/// A group of ranks that run collectives over host bytes.
///
/// Every rank of the group calls the same collectives in the same order (MPI semantics).
/// The provided methods (`barrier`, `all_gather`, ...) are the API: they check their
/// arguments (see [`crate::check`]), open a `tracing` span with the rank, the size and the
/// byte count (when `DEBUG` is enabled), and call the backend's `raw_*` hook with a checked argument bundle. A bad
/// argument is an [`InvalidArgument`](crate::TransportError::InvalidArgument) error raised
/// on the calling rank before anything is sent; nothing is truncated or panics.
///
/// Backends implement `rank`, `size`, `max_count`, the `raw_*` hooks and `split`.
/// Waits on peers are bounded where the backend can bound them (the local backend always
/// does, with an error naming the ranks that never arrived).
///
/// ```
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut all = vec![0u8; comm.size()];
///     comm.all_gather(&[comm.rank() as u8 * 10], &mut all)?;
///     Ok::<_, tpcomm_transport::TransportError>(all)
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![0, 10, 20]);
/// }
/// ```
pub trait Communicator: Send + Sync {
    /// This rank's index, `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group (at least 1).
    fn size(&self) -> usize;

    /// The largest count (and displacement) one call accepts, in bytes: `i32::MAX` for MPI-3.
    /// Upper layers split larger transfers into rounds, each rank from its own value: it
    /// must be the same on every rank of the communicator.
    fn max_count(&self) -> usize;

    /// A short name of the backend (`"local"`, `"mpi"`), for spans and reports.
    fn backend_name(&self) -> &'static str;

    /// Blocks until every rank has entered the barrier.
    fn barrier(&self) -> Result<()> {
        let _span = enter_span(self, Op::Barrier, || 0);
        self.raw_barrier()
    }

    /// Fixed-size all-gather: every rank sends `send.len()` bytes (the same on every rank);
    /// `recv` must hold `size() * send.len()` bytes and receives rank `i`'s bytes at
    /// `i * send.len()`.
    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let _span = enter_span(self, Op::AllGather, || recv.len());
        let args = AllGatherArgs::check(shape(self, Op::AllGather), send, recv)?;
        self.raw_all_gather(args)
    }

    /// Varcount all-gather: rank `i` sends `counts[i]` bytes, received by every rank at
    /// `recv[displs[i]..displs[i] + counts[i]]`. `counts` and `displs` must be the same on
    /// every rank; regions must lie inside `recv` and not overlap.
    fn all_gather_varcount(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        displs: &[usize],
    ) -> Result<()> {
        let _span = enter_span(self, Op::AllGatherVarcount, || saturating_sum(counts));
        let args = VarcountArgs::check(
            shape(self, Op::AllGatherVarcount),
            send,
            recv,
            counts,
            displs,
        )?;
        self.raw_all_gather_varcount(args)
    }

    /// Varcount gather to `root`: the root passes `Some(GatherRecv)` describing where each
    /// rank's bytes land; the other ranks pass `None`.
    fn gather_varcount(
        &self,
        root: usize,
        send: &[u8],
        recv: Option<GatherRecv<'_>>,
    ) -> Result<()> {
        let _span = enter_span(self, Op::GatherVarcount, || send.len());
        let args = GatherArgs::check(shape(self, Op::GatherVarcount), root, send, recv)?;
        self.raw_gather_varcount(args)
    }

    /// Broadcast of `buf.len()` bytes from `root`; every rank passes a buffer of the same
    /// length.
    fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<()> {
        let _span = enter_span(self, Op::Broadcast, || buf.len());
        let args = BroadcastArgs::check(shape(self, Op::Broadcast), root, buf)?;
        self.raw_broadcast(args)
    }

    /// Varcount all-to-all: this rank sends `send.counts[j]` bytes at `send.displs[j]` to
    /// rank `j` and receives `recv.counts[j]` bytes from rank `j` at `recv.displs[j]`.
    /// `recv.counts[j]` on this rank must equal `send.counts[me]` on rank `j`.
    fn all_to_all_varcount(
        &self,
        send: Layout<'_, &[u8]>,
        recv: Layout<'_, &mut [u8]>,
    ) -> Result<()> {
        let _span = enter_span(self, Op::AllToAllVarcount, || saturating_sum(send.counts));
        let args = AllToAllArgs::check(shape(self, Op::AllToAllVarcount), send, recv)?;
        self.raw_all_to_all_varcount(args)
    }

    /// Numeric all-reduce: element-wise `op` of every rank's `send` into every rank's
    /// `recv` (the same length as `send`, the same on every rank).
    ///
    /// Element types are the [`Element`]s: the integer types (wrapping), `f32`, `f64`,
    /// `half::f16` and `half::bf16` (reduced in `f32`, rounded once); see
    /// [`reduce`](crate::reduce) for the exact semantics. Under MPI this is
    /// `MPI_Allreduce` (`MPI_Iallreduce` on the timed path); the local backend reduces in
    /// rank order, each rank one slice (reduce-scatter, then all-gather), so every rank gets
    /// bitwise the same result, and a rank whose count, type or op differs from a peer's
    /// gets [`Mismatch`](crate::TransportError::Mismatch) on every rank. A count above
    /// [`max_count`](Self::max_count) elements is an
    /// [`InvalidArgument`](crate::TransportError::InvalidArgument).
    ///
    /// ```
    /// use tpcomm_transport::{Communicator, LocalGroup, ReduceOp};
    ///
    /// let results = LocalGroup::new(3).run(|comm| {
    ///     let send = [comm.rank() as f32, 1.0];
    ///     let mut sum = [0f32; 2];
    ///     comm.all_reduce(&send, &mut sum, ReduceOp::Sum)?;
    ///     Ok::<_, tpcomm_transport::TransportError>(sum)
    /// });
    /// for r in results {
    ///     assert_eq!(r.unwrap().unwrap(), [3.0, 3.0]);
    /// }
    /// ```
    fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()>
    where
        Self: Sized,
    {
        self.all_reduce_bytes(
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }

    /// [`all_reduce`](Self::all_reduce) with `buf` as both input and output.
    ///
    /// ```
    /// use half::bf16;
    /// use tpcomm_transport::{Communicator, LocalGroup, ReduceOp};
    ///
    /// let results = LocalGroup::new(2).run(|comm| {
    ///     let mut x = [bf16::from_f32(comm.rank() as f32 + 1.0); 4];
    ///     comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
    ///     Ok::<_, tpcomm_transport::TransportError>(x)
    /// });
    /// for r in results {
    ///     assert_eq!(r.unwrap().unwrap(), [bf16::from_f32(2.0); 4]);
    /// }
    /// ```
    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()>
    where
        Self: Sized,
    {
        self.all_reduce_bytes(None, bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// The untyped form of [`all_reduce`](Self::all_reduce): `send` (`None`: in place, `recv`
    /// is the input) and `recv` hold elements of `dtype` in native byte order, at any
    /// alignment. Both must hold the same whole number of elements; anything else is an
    /// [`InvalidArgument`](crate::TransportError::InvalidArgument)
    /// ([`PartialElement`](crate::ArgumentError::PartialElement),
    /// [`SendLength`](crate::ArgumentError::SendLength)) raised before anything is sent.
    fn all_reduce_bytes(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let _span = enter_span(self, Op::AllReduce, || recv.len());
        let args = AllReduceArgs::check(shape(self, Op::AllReduce), send, recv, dtype, op)?;
        self.raw_all_reduce(args)
    }

    /// Collective: splits the group into sub-groups, one per `color`; ranks of a sub-group
    /// are ordered by `(key, rank in this group)`. A rank passing `None` as color joins no
    /// sub-group and gets `Ok(None)`. Collectives in sibling sub-groups run concurrently
    /// without interfering.
    fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Self>>
    where
        Self: Sized;

    /// Collective: bounds every later wait of this communicator's collectives by
    /// `timeout` (not its parent's, nor those of communicators split from it before), where
    /// the backend can bound them; returns whether it did. A wait past `timeout` fails as
    /// the backend's own bound does (the local backend: [`TransportError::Timeout`]
    /// naming the ranks that did not arrive, the group aborted; MPI: the timed path of
    /// `MpiCommunicator::with_timeout`, [`TransportError::Unresponsive`], the communicator
    /// broken). A library that runs its own collectives on a communicator it split (the
    /// broadcast queue's transport path) bounds them by its own timeout this way. Every
    /// rank passes its own `timeout`. Backends without a bounded path keep their waits as
    /// they are and return `Ok(false)` (the default).
    fn bound_waits(&mut self, timeout: std::time::Duration) -> Result<bool> {
        let _ = timeout;
        Ok(false)
    }

    /// Backend hook of [`barrier`](Self::barrier).
    fn raw_barrier(&self) -> Result<()>;

    /// Backend hook of [`all_gather`](Self::all_gather); arguments already checked.
    fn raw_all_gather(&self, args: AllGatherArgs<'_>) -> Result<()>;

    /// Backend hook of [`all_gather_varcount`](Self::all_gather_varcount); arguments
    /// already checked.
    fn raw_all_gather_varcount(&self, args: VarcountArgs<'_>) -> Result<()>;

    /// Backend hook of [`gather_varcount`](Self::gather_varcount); arguments already checked.
    fn raw_gather_varcount(&self, args: GatherArgs<'_>) -> Result<()>;

    /// Backend hook of [`broadcast`](Self::broadcast); arguments already checked.
    fn raw_broadcast(&self, args: BroadcastArgs<'_>) -> Result<()>;

    /// Backend hook of [`all_to_all_varcount`](Self::all_to_all_varcount); arguments
    /// already checked.
    fn raw_all_to_all_varcount(&self, args: AllToAllArgs<'_>) -> Result<()>;

    /// Backend hook of [`all_reduce_bytes`](Self::all_reduce_bytes) (and the typed
    /// all-reduces); arguments already checked.
    ///
    /// The default composes the other hooks, for wrappers and backends without a native
    /// reduction: a reduce-scatter through
    /// [`all_to_all_varcount`](Self::all_to_all_varcount) (rank `j` receives every rank's
    /// slice `j` and reduces it in rank order), then
    /// [`all_gather_varcount`](Self::all_gather_varcount) of the reduced slices, after a
    /// 16-byte [`all_gather`](Self::all_gather) of every rank's (count, type, op): a rank
    /// that differs is a [`TransportError::Mismatch`](crate::TransportError::Mismatch)
    /// naming it on every rank, before any data moves, and the ranks stay in step. Every
    /// rank gets bitwise the same result. The local and MPI backends override it.
    fn raw_all_reduce(&self, args: AllReduceArgs<'_>) -> Result<()> {
        composed_all_reduce(self, args)
    }
}

/// The default [`Communicator::raw_all_reduce`]: reduce-scatter by all-to-all, then
/// all-gather of the reduced slices.
fn composed_all_reduce<C: Communicator + ?Sized>(
    comm: &C,
    mut args: AllReduceArgs<'_>,
) -> Result<()> {
    let (me, size) = (comm.rank(), comm.size());
    let (dtype, op, elem) = (args.dtype(), args.op(), args.dtype().size());
    agree_on_reduction(comm, args.count(), dtype, op)?;
    let slices: Vec<(usize, usize)> = (0..size).map(|r| slice_of(args.count(), size, r)).collect();
    let counts: Vec<usize> = slices.iter().map(|&(lo, hi)| (hi - lo) * elem).collect();
    let displs: Vec<usize> = slices.iter().map(|&(lo, _)| lo * elem).collect();
    let mine = counts[me];
    let piece_displs: Vec<usize> = (0..size).map(|r| r * mine).collect();
    let mut pieces = vec![0u8; size * mine];
    comm.all_to_all_varcount(
        Layout {
            buf: args.input(),
            counts: &counts,
            displs: &displs,
        },
        Layout {
            buf: &mut pieces,
            counts: &vec![mine; size],
            displs: &piece_displs,
        },
    )?;
    let inputs: Vec<&[u8]> = (0..size)
        .map(|r| &pieces[r * mine..(r + 1) * mine])
        .collect();
    let mut reduced = vec![0u8; mine];
    reduce_into(dtype, op, &inputs, &mut reduced);
    let (_, recv) = args.parts();
    comm.all_gather_varcount(&reduced, recv, &counts, &displs)
}

/// Every rank's (count, type, op) of one composed all-reduce, compared: the all-to-all that
/// follows would catch a different count on some ranks only (those whose slice differs),
/// and a different type or op on none.
fn agree_on_reduction<C: Communicator + ?Sized>(
    comm: &C,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    const WORD: usize = 16;
    let mut mine = [0u8; WORD];
    mine[..8].copy_from_slice(&(count as u64).to_le_bytes());
    mine[8] = dtype.index() as u8;
    mine[9] = op.index() as u8;
    let mut all = vec![0u8; WORD * comm.size()];
    comm.all_gather(&mine, &mut all)?;
    let differ: Vec<usize> = all
        .chunks_exact(WORD)
        .enumerate()
        .filter(|(_, word)| *word != mine)
        .map(|(r, _)| r)
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    let describe = |word: &[u8]| {
        let count = u64::from_le_bytes(word[..8].try_into().expect("8 bytes"));
        describe_reduction(count, usize::from(word[8]), usize::from(word[9]))
    };
    let first = differ[0];
    Err(TransportError::Mismatch {
        op: Op::AllReduce,
        rank: comm.rank(),
        detail: format!(
            "this rank reduces {}, rank {first} {} (ranks differing from this one: {differ:?})",
            describe(&mine),
            describe(&all[first * WORD..(first + 1) * WORD])
        ),
    })
}

fn shape<C: Communicator + ?Sized>(comm: &C, op: Op) -> Shape {
    Shape {
        op,
        rank: comm.rank(),
        size: comm.size(),
        max_count: comm.max_count(),
    }
}

/// Enters the `collective` span of one call, or returns `None` without creating anything
/// when `DEBUG` is disabled (the usual case outside debugging). `bytes` is only computed
/// for an enabled span.
///
/// This is the test `debug_span!` starts with, done first and inline: a disabled
/// `tracing::Span` is still a 40-byte value, which `span` (not inlined) wrote with two
/// 8-byte stores and the caller reloaded with 16-byte loads to move it into the entered
/// span, a store-forwarding stall on every collective. `None` is a single store.
#[inline(always)]
fn enter_span<C: Communicator + ?Sized>(
    comm: &C,
    op: Op,
    bytes: impl FnOnce() -> usize,
) -> Option<tracing::span::EnteredSpan> {
    let debug = tracing::Level::DEBUG;
    if debug <= tracing::level_filters::STATIC_MAX_LEVEL
        && debug <= tracing::level_filters::LevelFilter::current()
    {
        Some(span(comm, op, bytes()).entered())
    } else {
        None
    }
}

/// The sum of `counts`, saturating (a byte count for the span only).
fn saturating_sum(counts: &[usize]) -> usize {
    counts.iter().fold(0usize, |a, &c| a.saturating_add(c))
}

/// The `collective` span (kept out of line: it is only called when `DEBUG` is enabled).
#[inline(never)]
fn span<C: Communicator + ?Sized>(comm: &C, op: Op, bytes: usize) -> tracing::Span {
    tracing::debug_span!(
        "collective",
        op = op.name(),
        backend = comm.backend_name(),
        rank = comm.rank(),
        size = comm.size(),
        bytes
    )
}

/// Counts and displacements of a dense layout: `counts` packed back to back from 0.
///
/// Returns `None` when the total overflows `usize`.
pub fn dense_displacements(counts: &[usize]) -> Option<(Vec<usize>, usize)> {
    let mut displs = Vec::with_capacity(counts.len());
    let mut total = 0usize;
    for &c in counts {
        displs.push(total);
        total = total.checked_add(c)?;
    }
    Some((displs, total))
}
