//! The [`DeviceCommunicator`] trait: collectives over device buffers (feature `nccl`).
//!
//! Buffers are cudarc's device slices: anything that implements [`DevicePtr`] (read) or
//! [`DevicePtrMut`] (written), that is `CudaSlice<T>`, `CudaView<'_, T>` and
//! `CudaViewMut<'_, T>`. Element types are the [`DeviceElement`]s (a sealed set, each with its
//! NCCL data type), so a buffer's length in elements is always what the library is told.
//!
//! As for host bytes ([`Communicator`](crate::Communicator)), the provided methods are the API:
//! they check the arguments in one place ([`check::device_count`](crate::check::device_count) for lengths and roots, and
//! the buffers' device against the communicator's), open a `collective` tracing span, and
//! hand the backend a checked [`DeviceArgs`] bundle that only this module can build. A bad
//! argument is [`TransportError::InvalidArgument`] before anything is enqueued.
//!
//! Collectives are *enqueued* on the communicator's stream ([`DeviceCommunicator::stream`])
//! and return before the data has moved. cudarc's event tracking orders them with earlier
//! writes to the buffers (made on other streams of the same context) and later reads;
//! [`DeviceCommunicator::synchronize`] waits for everything enqueued so far.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::check::{device_count, DeviceCollective, Group};
use crate::error::{ArgumentError, Op, Result, TransportError};

pub use crate::reduce::ReduceOp;

impl ReduceOp {
    /// NCCL's code for the reduction.
    pub fn nccl(self) -> NcclRedOp {
        match self {
            ReduceOp::Sum => NcclRedOp::Sum,
            ReduceOp::Prod => NcclRedOp::Prod,
            ReduceOp::Max => NcclRedOp::Max,
            ReduceOp::Min => NcclRedOp::Min,
        }
    }
}

/// NCCL's `ncclRedOp_t` for the built-in reductions, with the values `nccl.h` gives them.
///
/// tpcomm declares the few NCCL types it passes instead of taking cudarc's: cudarc's NCCL
/// module makes a program that links cudarc (`dynamic-linking`) link libnccl too, while
/// tpcomm loads libnccl at run time and reports its absence as an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)] // a C enum: an `int`
pub enum NcclRedOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclProd`.
    Prod = 1,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
}

/// NCCL's `ncclDataType_t` for the element types of [`DeviceElement`], with the values
/// `nccl.h` gives them (NCCL 2.10 and newer, bf16 included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)] // a C enum: an `int`
pub enum NcclDataType {
    /// `ncclInt8`.
    Int8 = 0,
    /// `ncclUint8`.
    Uint8 = 1,
    /// `ncclInt32`.
    Int32 = 2,
    /// `ncclUint32`.
    Uint32 = 3,
    /// `ncclInt64`.
    Int64 = 4,
    /// `ncclUint64`.
    Uint64 = 5,
    /// `ncclFloat16`.
    Float16 = 6,
    /// `ncclFloat32`.
    Float32 = 7,
    /// `ncclFloat64`.
    Float64 = 8,
    /// `ncclBfloat16`.
    Bfloat16 = 9,
}

mod sealed {
    #[allow(unreachable_pub)] // the sealed-trait pattern: public, but not nameable outside
    pub trait Sealed {}
}

/// An element type of device collectives, with the NCCL data type that describes it.
///
/// Sealed: the set is fixed here so that the data type NCCL is told always has the element's
/// size (a wrong one would make NCCL read or write past a buffer).
pub trait DeviceElement: sealed::Sealed + DeviceRepr + Copy + Send + Sync + 'static {
    /// NCCL's data type for this element.
    const NCCL_TYPE: NcclDataType;
    /// A short name (`"f32"`, `"bf16"`...), for spans and reports.
    const NAME: &'static str;
}

macro_rules! device_element {
    ($($t:ty => $nccl:ident, $name:literal;)*) => {$(
        impl sealed::Sealed for $t {}
        impl DeviceElement for $t {
            const NCCL_TYPE: NcclDataType = NcclDataType::$nccl;
            const NAME: &'static str = $name;
        }
    )*};
}

device_element! {
    i8 => Int8, "i8";
    u8 => Uint8, "u8";
    i32 => Int32, "i32";
    u32 => Uint32, "u32";
    i64 => Int64, "i64";
    u64 => Uint64, "u64";
    half::f16 => Float16, "f16";
    f32 => Float32, "f32";
    f64 => Float64, "f64";
    half::bf16 => Bfloat16, "bf16";
}

/// Checked arguments of one device collective, built only by [`DeviceCommunicator`]'s
/// provided methods.
///
/// Guarantees: the lengths fit the collective and the world size ([`check::device_count`](crate::check::device_count)),
/// `count` is the element count the library takes, the root (broadcast) is a rank, and both
/// buffers are on the communicator's device.
pub struct DeviceArgs<'a, T> {
    send: Option<&'a dyn DevicePtr<T>>,
    recv: &'a mut dyn DevicePtrMut<T>,
    count: usize,
    reduce: ReduceOp,
    root: usize,
    /// The rank and size the arguments were checked for.
    group: Group,
}

impl<T> std::fmt::Debug for DeviceArgs<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceArgs")
            .field("in_place", &self.send.is_none())
            .field("count", &self.count)
            .field("reduce", &self.reduce)
            .field("root", &self.root)
            .finish()
    }
}

impl<'a, T> DeviceArgs<'a, T> {
    /// The rank and size the arguments were checked for (see [`Group`]).
    pub(crate) fn group(&self) -> Group {
        self.group
    }

    /// The element count the library takes (see [`check::device_count`](crate::check::device_count)).
    pub fn count(&self) -> usize {
        self.count
    }

    /// The reduction (all-reduce, reduce-scatter; `Sum` elsewhere).
    pub fn reduce(&self) -> ReduceOp {
        self.reduce
    }

    /// The root rank (broadcast; 0 elsewhere).
    pub fn root(&self) -> usize {
        self.root
    }

    /// The send buffer (`None`: in place, the receive buffer is also the input) and the
    /// receive buffer.
    pub fn buffers(&mut self) -> (Option<&dyn DevicePtr<T>>, &mut dyn DevicePtrMut<T>) {
        (self.send, &mut *self.recv)
    }
}

/// A group of ranks that run collectives over device buffers, one device per rank.
///
/// Every rank calls the same collectives in the same order, with matching lengths (the
/// checks only see this rank's arguments). See the [module docs](self) for buffers, streams
/// and checks. Backends implement the accessors and the `raw_*` hooks.
pub trait DeviceCommunicator: Send + Sync {
    /// This rank's index, `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks (at least 1).
    fn size(&self) -> usize;

    /// The CUDA device ordinal this rank's buffers must live on.
    fn device_ordinal(&self) -> usize;

    /// The stream collectives are enqueued on.
    fn stream(&self) -> &Arc<CudaStream>;

    /// A short name of the backend (`"nccl"`).
    fn backend_name(&self) -> &'static str;

    /// Waits until every collective enqueued so far has finished; reports an error the
    /// device or the library hit meanwhile.
    fn synchronize(&self) -> Result<()>;

    /// Element-wise reduction of `send` over all ranks into `recv` (same length as `send`).
    fn all_reduce<T, S, R>(&self, send: &S, recv: &mut R, op: ReduceOp) -> Result<()>
    where
        T: DeviceElement,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let kind = DeviceCollective::AllReduce;
        let _span = span::<T, Self>(self, kind.op(), recv.len());
        let args = check_args(self, kind, Some(send as &dyn DevicePtr<T>), recv, op)?;
        self.raw_all_reduce(args)
    }

    /// [`all_reduce`](Self::all_reduce) with `buf` as both input and output.
    fn all_reduce_in_place<T, R>(&self, buf: &mut R, op: ReduceOp) -> Result<()>
    where
        T: DeviceElement,
        R: DevicePtrMut<T>,
    {
        let kind = DeviceCollective::AllReduce;
        let _span = span::<T, Self>(self, kind.op(), buf.len());
        let args = check_args::<T, R, Self>(self, kind, None, buf, op)?;
        self.raw_all_reduce(args)
    }

    /// Every rank's `send` (the same length on every rank) into `recv`, which holds
    /// `size() * send.len()` elements: rank `i`'s at `i * send.len()`.
    fn all_gather<T, S, R>(&self, send: &S, recv: &mut R) -> Result<()>
    where
        T: DeviceElement,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let kind = DeviceCollective::AllGather;
        let _span = span::<T, Self>(self, kind.op(), recv.len());
        let args = check_args(
            self,
            kind,
            Some(send as &dyn DevicePtr<T>),
            recv,
            ReduceOp::Sum,
        )?;
        self.raw_all_gather(args)
    }

    /// Element-wise reduction of `send` (`size() * recv.len()` elements) over all ranks;
    /// rank `i` receives block `i` of the result in `recv`.
    fn reduce_scatter<T, S, R>(&self, send: &S, recv: &mut R, op: ReduceOp) -> Result<()>
    where
        T: DeviceElement,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let kind = DeviceCollective::ReduceScatter;
        let _span = span::<T, Self>(self, kind.op(), send.len());
        let args = check_args(self, kind, Some(send as &dyn DevicePtr<T>), recv, op)?;
        self.raw_reduce_scatter(args)
    }

    /// Root's `buf` into every rank's `buf` (the same length on every rank), in place.
    fn broadcast<T, R>(&self, root: usize, buf: &mut R) -> Result<()>
    where
        T: DeviceElement,
        R: DevicePtrMut<T>,
    {
        let kind = DeviceCollective::Broadcast { root };
        let _span = span::<T, Self>(self, kind.op(), buf.len());
        let mut args = check_args::<T, R, Self>(self, kind, None, buf, ReduceOp::Sum)?;
        args.root = root;
        self.raw_broadcast(args)
    }

    /// Backend hook of [`all_reduce`](Self::all_reduce) and
    /// [`all_reduce_in_place`](Self::all_reduce_in_place); arguments already checked.
    fn raw_all_reduce<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()>;

    /// Backend hook of [`all_gather`](Self::all_gather); arguments already checked.
    fn raw_all_gather<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()>;

    /// Backend hook of [`reduce_scatter`](Self::reduce_scatter); arguments already checked.
    fn raw_reduce_scatter<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()>;

    /// Backend hook of [`broadcast`](Self::broadcast) (in place: no send buffer); arguments
    /// already checked.
    fn raw_broadcast<T: DeviceElement>(&self, args: DeviceArgs<'_, T>) -> Result<()>;
}

/// The one argument check of device collectives: lengths and root
/// ([`check::device_count`](crate::check::device_count)), then the buffers' device.
fn check_args<'a, T, R, C>(
    comm: &C,
    kind: DeviceCollective,
    send: Option<&'a dyn DevicePtr<T>>,
    recv: &'a mut R,
    reduce: ReduceOp,
) -> Result<DeviceArgs<'a, T>>
where
    T: DeviceElement,
    R: DevicePtrMut<T>,
    C: DeviceCommunicator + ?Sized,
{
    let (rank, size) = (comm.rank(), comm.size());
    let send_len = send.map_or(recv.len(), |s| s.len());
    let count = device_count(
        kind,
        rank,
        size,
        send_len,
        recv.len(),
        std::mem::size_of::<T>(),
    )?;
    let expected = comm.device_ordinal();
    let sides = [
        ("send", send.map(|s| s.stream().context().ordinal())),
        ("receive", Some(recv.stream().context().ordinal())),
    ];
    for (which, actual) in sides {
        if let Some(actual) = actual.filter(|&a| a != expected) {
            return Err(TransportError::InvalidArgument {
                op: kind.op(),
                rank,
                source: ArgumentError::WrongDevice {
                    which,
                    expected,
                    actual,
                },
            });
        }
    }
    Ok(DeviceArgs {
        send,
        recv,
        count,
        reduce,
        root: 0,
        group: Group::new(rank, size),
    })
}

/// The `collective` span of one device call (entered only when `DEBUG` is enabled).
fn span<T: DeviceElement, C: DeviceCommunicator + ?Sized>(
    comm: &C,
    op: Op,
    elems: usize,
) -> Option<tracing::span::EnteredSpan> {
    tracing::enabled!(tracing::Level::DEBUG).then(|| {
        tracing::debug_span!(
            "collective",
            op = op.name(),
            backend = comm.backend_name(),
            rank = comm.rank(),
            size = comm.size(),
            dtype = T::NAME,
            bytes = elems.saturating_mul(std::mem::size_of::<T>())
        )
        .entered()
    })
}
