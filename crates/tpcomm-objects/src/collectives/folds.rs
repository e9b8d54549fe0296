//! The folds with a closure: all-reduce and reduce (a gather, then a fold in rank order)
//! and the inclusive and exclusive scans (each rank's value sent once to the ranks that
//! fold it, through the all-to-all protocol).

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::copy::extend_from_slice;
use tpcomm_transport::Communicator;

use super::all_gather_with;
use super::all_to_all::all_to_all_bytes;
use super::codec::serialize;
use super::engine::span;
use super::gather::gather_value;
use crate::error::{ObjectError, Result};
use crate::gathered::decode_exact;
use crate::options::{Checked, Collective, Options};

/// All-reduce with a closure: every rank gets `f(...f(f(v0, v1), v2)..., vN)`, folded in
/// rank order, so every rank computes the same result.
///
/// ```
/// use tpcomm_objects::all_reduce_with;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(4).run(|comm| {
///     all_reduce_with(&comm, &vec![comm.rank() as u64], |mut a, b| {
///         a.extend(b);
///         a
///     })
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![0, 1, 2, 3]);
/// }
/// ```
pub fn all_reduce_with<C, T, F>(comm: &C, value: &T, f: F) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    all_reduce_with_options(comm, value, &Options::default(), f)
}

/// [`all_reduce_with`] with options.
pub fn all_reduce_with_options<C, T, F>(comm: &C, value: &T, opts: &Options, f: F) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    let values: Vec<T> = all_gather_with(comm, value, opts)?;
    Ok(fold_in_rank_order(values, f))
}

/// `f(...f(f(v0, v1), v2)..., vN)` over one value per rank.
fn fold_in_rank_order<T>(values: Vec<T>, f: impl FnMut(T, T) -> T) -> T {
    values
        .into_iter()
        .reduce(f)
        .expect("a communicator has at least one rank")
}

/// Reduce to `root` with a closure, mpi4py's `comm.reduce(value, op, root)`: the root gets
/// `Some(f(...f(f(v0, v1), v2)..., vN))`, folded in rank order; the other ranks get `None`.
///
/// The values are gathered to the root only. Failures follow the gather's protocol: a rank
/// that fails to serialize makes *every* rank return [`ObjectError::PeerSerialization`]
/// naming it, an announced total over the cap makes every rank return
/// [`ObjectError::TooLarge`]; bytes the root cannot decode are a
/// [`Decode`](ObjectError::Decode) error on the root.
/// Every rank must pass the same `root`. The roots travel in the header exchange (no extra
/// transport call): ranks that pass different roots all return
/// [`ObjectError::RootMismatch`] naming every rank's root, before any payload moves; a root
/// out of range on every rank is [`ObjectError::InvalidArgument`] on every rank.
///
/// ```
/// use tpcomm_objects::reduce_with;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     reduce_with(&comm, 2, &format!("r{}", comm.rank()), |a, b| a + "," + &b)
/// });
/// assert_eq!(results[2].as_ref().unwrap().as_ref().unwrap().as_deref(), Some("r0,r1,r2"));
/// assert_eq!(results[0].as_ref().unwrap().as_ref().unwrap(), &None);
/// ```
pub fn reduce_with<C, T, F>(comm: &C, root: usize, value: &T, f: F) -> Result<Option<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    reduce_with_options(comm, root, value, &Options::default(), f)
}

/// [`reduce_with`] with options.
pub fn reduce_with_options<C, T, F>(
    comm: &C,
    root: usize,
    value: &T,
    opts: &Options,
    f: F,
) -> Result<Option<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    gather_value(comm, "reduce", Some(root), value, opts, |gathered| {
        let values: Vec<T> = gathered.decode()?;
        Ok(fold_in_rank_order(values, f))
    })
}

/// Inclusive scan with a closure, mpi4py's `comm.scan(value, op)`: rank `i` gets
/// `f(...f(f(v0, v1), v2)..., vi)`, folded in rank order (rank 0 gets its own value).
///
/// Rank `s` sends its value, serialized once, to ranks `s..size` only (one all-to-all), so
/// a rank receives only the values it folds. Failures are agreed as for
/// [`all_to_all`]: a rank that fails to serialize makes every rank return
/// [`ObjectError::PeerSerialization`] naming it; an announced total over the cap makes every
/// rank return [`ObjectError::TooLarge`].
///
/// ```
/// use tpcomm_objects::scan_with;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(4).run(|comm| scan_with(&comm, &(comm.rank() as u64 + 1), |a, b| a * b));
/// let prefixes: Vec<u64> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
/// assert_eq!(prefixes, [1, 2, 6, 24]);
/// ```
///
/// [`all_to_all`]: super::all_to_all
pub fn scan_with<C, T, F>(comm: &C, value: &T, f: F) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    scan_with_options(comm, value, &Options::default(), f)
}

/// [`scan_with`] with options.
pub fn scan_with_options<C, T, F>(comm: &C, value: &T, opts: &Options, f: F) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    let span = span(comm, "scan");
    let _g = span.enter();
    let folded = prefix_fold(comm, value, opts, &span, true, f)?;
    Ok(folded.expect("an inclusive scan folds at least this rank's own value"))
}

/// Exclusive scan with a closure, mpi4py's `comm.exscan(value, op)`: rank `i > 0` gets
/// `Some(f(...f(v0, v1)..., v(i-1)))`, folded in rank order; rank 0 gets `None`.
///
/// The protocol and its failures are those of [`scan_with`]; the last rank's value goes
/// nowhere, but it still joins (and a failure to serialize it is still agreed).
///
/// ```
/// use tpcomm_objects::exscan_with;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// // Offsets of each rank's shard from the shard lengths: an exclusive prefix sum.
/// let results = LocalGroup::new(3).run(|comm| exscan_with(&comm, &[10u32, 20, 5][comm.rank()], |a, b| a + b));
/// let offsets: Vec<Option<u32>> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
/// assert_eq!(offsets, [None, Some(10), Some(30)]);
/// ```
pub fn exscan_with<C, T, F>(comm: &C, value: &T, f: F) -> Result<Option<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    exscan_with_options(comm, value, &Options::default(), f)
}

/// [`exscan_with`] with options.
pub fn exscan_with_options<C, T, F>(comm: &C, value: &T, opts: &Options, f: F) -> Result<Option<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    let span = span(comm, "exscan");
    let _g = span.enter();
    prefix_fold(comm, value, opts, &span, false, f)
}

/// The scans: rank `s` sends its value to every rank `d >= s` (inclusive) or `d > s`
/// (exclusive) through the all-to-all protocol, and rank `d` folds what it received in
/// rank order. `None` when there is nothing to fold (rank 0 of an exclusive scan).
fn prefix_fold<C, T, F>(
    comm: &C,
    value: &T,
    opts: &Options,
    span: &tracing::Span,
    inclusive: bool,
    f: F,
) -> Result<Option<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
    F: FnMut(T, T) -> T,
{
    let (me, size) = (comm.rank(), comm.size());
    let receives_from = |d: usize, s: usize| if inclusive { s <= d } else { s < d };
    let kind = if inclusive {
        Collective::Scan
    } else {
        Collective::Exscan
    };
    let checked = Checked::new(opts, None, kind);
    let outgoing = checked.invalid.is_none().then(|| {
        serialize(value).and_then(|bytes| {
            let lens: Vec<usize> = (0..size)
                .map(|d| if receives_from(d, me) { bytes.len() } else { 0 })
                .collect();
            // One copy per receiver: refused like a value that does not serialize (every
            // rank fails together) when it overflows or cannot be allocated, never an abort.
            let mut packed = Vec::new();
            lens.iter()
                .try_fold(0usize, |sum, &l| sum.checked_add(l))
                .and_then(|total| packed.try_reserve_exact(total).ok())
                .ok_or(postcard::Error::SerializeBufferFull)?;
            for _ in lens.iter().filter(|&&l| l > 0) {
                extend_from_slice(&mut packed, &bytes);
            }
            Ok((packed, lens))
        })
    });
    let (buf, ranges) = all_to_all_bytes(comm, checked, outgoing, opts, span, |lens| {
        scan_shape(size, lens, receives_from)
    })?;
    let mut values = Vec::with_capacity(size);
    for (s, range) in ranges.into_iter().enumerate() {
        if receives_from(me, s) {
            values.push(decode_exact::<T>(s, &buf[range], opts.max_depth)?);
        } else if !range.is_empty() {
            return Err(ObjectError::Corrupt(format!(
                "rank {s} sent {} bytes to rank {me}, which takes nothing from it in a scan",
                range.len()
            )));
        }
    }
    Ok(values.into_iter().reduce(f))
}

/// The lengths of a scan (`lens[s * size + d]`, agreed by every rank): rank `s` sends its
/// one serialized value to every rank `d` with `receives_from(d, s)`, so the same number of
/// bytes to each of them, and nothing to the others. Anything else (a peer that called
/// another collective, or a scan of the other kind) is refused by every rank alike.
fn scan_shape(
    size: usize,
    lens: &[usize],
    receives_from: impl Fn(usize, usize) -> bool,
) -> Result<()> {
    for s in 0..size {
        let row = &lens[s * size..(s + 1) * size];
        let mut first: Option<(usize, usize)> = None;
        for (d, &len) in row.iter().enumerate() {
            if !receives_from(d, s) {
                if len != 0 {
                    return Err(ObjectError::Corrupt(format!(
                        "rank {s} announced {len} bytes for rank {d}, which takes nothing \
                         from it in this scan"
                    )));
                }
            } else if let Some((d0, len0)) = first {
                if len != len0 {
                    return Err(ObjectError::Corrupt(format!(
                        "rank {s} announced {len0} bytes for rank {d0} but {len} for rank \
                         {d}: a scan sends one value to every rank that folds it"
                    )));
                }
            } else {
                first = Some((d, len));
            }
        }
    }
    Ok(())
}
