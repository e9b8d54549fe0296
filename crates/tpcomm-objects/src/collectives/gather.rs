//! Gather and all-gather: the rank-ordered gathering protocol (`gather_bytes`: inline
//! slots in the header, the payload path when a value exceeds its slot) and the public
//! functions over it, on bytes, borrowed and owned values.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::Communicator;

use super::codec::{mine_of, serialize};
use super::engine::{
    agree_reserved, exchange_entries, payload_rounds, record, record_rounds, slot_of, span, Mine,
};
use super::{all_gather_into_with, gather_into_with};
use crate::buffers::{receive_offset, Kept};
use crate::error::{ObjectError, Result};
use crate::gathered::Gathered;
use crate::header::{agree_words, read_entry, within_cap, ENTRY, SLOT_AT};
use crate::options::{Checked, Collective, Options};
use crate::rounds::dense_offsets;

/// The gathering protocol shared by all-gather (`root == None`) and gather: header with
/// options and inline slots, agreement, then the payload path when any value exceeds its
/// slot.
pub(super) fn gather_bytes<C: Communicator + ?Sized>(
    comm: &C,
    root: Option<usize>,
    mine: Mine<'_>,
    opts: &Options,
    span: &tracing::Span,
) -> Result<Option<Gathered>> {
    let (me, size) = (comm.rank(), comm.size());
    let checked = Checked::new(opts, root, Collective::Gather);
    let slot = slot_of(opts, &checked);
    let own = mine.entry(&checked.field, slot);
    let header = exchange_entries(comm, checked, &own)?;

    let payload = mine.payload();
    let lens = agree_words(
        size,
        |r| read_entry(&header, r),
        |i| i,
        opts.max_total_bytes,
        mine.into_cause(),
    )?;
    let total = within_cap(lens.iter().copied(), |i| i, opts.max_total_bytes)?;
    // A rank without bytes announced a sentinel, so the agreement above failed, unless the
    // exchange turned its sentinel into a length: then it has nothing to send.
    let Some(payload) = payload else {
        return Err(ObjectError::Corrupt(format!(
            "rank {me} announced no value but the exchange reports {} bytes",
            lens[me]
        )));
    };
    if lens[me] != payload.len() {
        return Err(ObjectError::Corrupt(format!(
            "rank {me} announced {} bytes but the exchange reports {}",
            payload.len(),
            lens[me]
        )));
    }
    let receives = root.is_none_or(|r| r == me);
    if lens.iter().all(|&l| l <= slot) {
        record(span, "small", total, 0);
        if !receives {
            return Ok(None);
        }
        let ranges = (0..size)
            .map(|r| r * ENTRY + SLOT_AT..r * ENTRY + SLOT_AT + lens[r])
            .collect();
        return Ok(Some(Gathered::new(header, 0, ranges, opts.max_depth)));
    }
    let limit = opts.round_limit(comm.max_count());
    let largest = lens.iter().copied().max().unwrap_or(0);
    let base = if receives { receive_offset(largest) } else { 0 };
    let reserved = if receives {
        Kept::Recv.take_at(base, total)
    } else {
        Ok(Vec::new())
    };
    let mut buf = agree_reserved(comm, total, reserved)?;
    let rounds = payload_rounds(
        comm,
        root,
        payload,
        &lens,
        receives.then_some(&mut buf),
        base,
        limit,
    )?;
    record_rounds(span, total, rounds);
    if !receives {
        return Ok(None);
    }
    let offsets = dense_offsets(&lens);
    let ranges = (0..size)
        .map(|r| base + offsets[r]..base + offsets[r] + lens[r])
        .collect();
    Ok(Some(Gathered::new(buf, base, ranges, opts.max_depth)))
}

/// `value` serialized into the kept send buffer, gathered to `root` (to every rank when
/// `None`) in a span named `op`, and handed to `decode` on the ranks that receive (`None`
/// elsewhere). The send buffer is freed only after `decode`: releasing it first hands its
/// memory back to the allocator in the middle of the decode's many small allocations
/// (measured slower).
pub(super) fn gather_value<C, T, R>(
    comm: &C,
    op: &'static str,
    root: Option<usize>,
    value: &T,
    opts: &Options,
    decode: impl FnOnce(Gathered) -> Result<R>,
) -> Result<Option<R>>
where
    C: Communicator + ?Sized,
    T: Serialize + ?Sized,
{
    let span = span(comm, op);
    let _g = span.enter();
    let serialized = serialize(value);
    let Some(gathered) = gather_bytes(comm, root, mine_of(&serialized), opts, &span)? else {
        return Ok(None);
    };
    let decoded = decode(gathered);
    drop(serialized);
    decoded.map(Some)
}

/// All-gather of raw bytes: every rank receives every rank's bytes in one buffer with a view
/// per rank. Small contributions travel in the length exchange (one transport call).
///
/// ```
/// use tpcomm_objects::all_gather_bytes;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mine = vec![comm.rank() as u8; comm.rank()]; // 0, 1 and 2 bytes
///     let all = all_gather_bytes(&comm, &mine)?;
///     Ok::<_, tpcomm_objects::ObjectError>(all.iter().map(<[u8]>::to_vec).collect::<Vec<_>>())
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![vec![], vec![1], vec![2, 2]]);
/// }
/// ```
pub fn all_gather_bytes<C: Communicator + ?Sized>(comm: &C, bytes: &[u8]) -> Result<Gathered> {
    all_gather_bytes_with(comm, bytes, &Options::default())
}

/// [`all_gather_bytes`] with options.
pub fn all_gather_bytes_with<C: Communicator + ?Sized>(
    comm: &C,
    bytes: &[u8],
    opts: &Options,
) -> Result<Gathered> {
    let span = span(comm, "all_gather_bytes");
    let _g = span.enter();
    Ok(gather_bytes(comm, None, Mine::Bytes(bytes), opts, &span)?.expect("every rank receives"))
}

/// All-gather of a value, returning the serialized values of every rank in a [`Gathered`]
/// from which they can be decoded *borrowing* (`&str`, `&[u8]`).
pub fn all_gather_borrowed<C, T>(comm: &C, value: &T) -> Result<Gathered>
where
    C: Communicator + ?Sized,
    T: Serialize + ?Sized,
{
    all_gather_borrowed_with(comm, value, &Options::default())
}

/// [`all_gather_borrowed`] with options.
pub fn all_gather_borrowed_with<C, T>(comm: &C, value: &T, opts: &Options) -> Result<Gathered>
where
    C: Communicator + ?Sized,
    T: Serialize + ?Sized,
{
    let gathered = gather_value(comm, "all_gather", None, value, opts, Ok)?;
    Ok(gathered.expect("every rank receives"))
}

/// All-gather: every rank gets every rank's value, in rank order.
///
/// Errors are agreed: when any rank fails to serialize, every rank returns
/// [`ObjectError::PeerSerialization`] naming all failing ranks; when the announced total
/// exceeds the cap, every rank returns [`ObjectError::TooLarge`]. No rank is left blocked.
///
/// ```
/// use tpcomm_objects::all_gather;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mine = (comm.rank() as u32, format!("worker-{}", comm.rank()));
///     all_gather(&comm, &mine)
/// });
/// for r in results {
///     let all = r.unwrap().unwrap();
///     assert_eq!(all[2], (2, "worker-2".to_string()));
/// }
/// ```
pub fn all_gather<C, T>(comm: &C, value: &T) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    all_gather_with(comm, value, &Options::default())
}

/// [`all_gather`] with options.
pub fn all_gather_with<C, T>(comm: &C, value: &T, opts: &Options) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let mut values = Vec::with_capacity(comm.size());
    all_gather_into_with(comm, value, &mut values, opts)?;
    Ok(values)
}

/// Gather to `root`: `Some(values)` on the root (rank order), `None` elsewhere.
///
/// Errors are agreed as for [`all_gather`].
/// Every rank must pass the same `root`. The roots travel in the header exchange (no extra
/// transport call): ranks that pass different roots all return
/// [`ObjectError::RootMismatch`] naming every rank's root, before any payload moves; a root
/// out of range on every rank is [`ObjectError::InvalidArgument`] on every rank.
///
/// ```
/// use tpcomm_objects::gather;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| gather(&comm, 1, &(comm.rank() * 10)));
/// assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap(), &Some(vec![0usize, 10, 20]));
/// assert_eq!(results[0].as_ref().unwrap().as_ref().unwrap(), &None);
/// ```
pub fn gather<C, T>(comm: &C, root: usize, value: &T) -> Result<Option<Vec<T>>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    gather_with(comm, root, value, &Options::default())
}

/// [`gather`] with options.
pub fn gather_with<C, T>(comm: &C, root: usize, value: &T, opts: &Options) -> Result<Option<Vec<T>>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    // Only the root fills it.
    let mut values = Vec::with_capacity(if comm.rank() == root { comm.size() } else { 0 });
    let filled = gather_into_with(comm, root, value, &mut values, opts)?;
    Ok(filled.then_some(values))
}
