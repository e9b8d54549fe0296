//! Broadcast: the root's entry in the header (inline when it fits its slot), then its
//! bytes in broadcasts of at most one round each.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::Communicator;

use super::codec::{mine_of, serialize};
use super::engine::{agree_reserved, exchange_entries, record, record_rounds, slot_of, span, Mine};
use crate::buffers::{receive_offset, Kept};
use crate::error::{ObjectError, Result};
use crate::gathered::decode_exact;
use crate::header::{agree, entry_inline, read_entry, within_cap, write_entry, Announce, ENTRY};
use crate::options::{Checked, Collective, Options};
use crate::rounds::round_count;

/// Broadcast from `root`: the root passes `Some(value)`, the others `None` (ignored when
/// given); every rank returns the root's value.
///
/// A root that passes `None` or fails to serialize makes every rank return the same error
/// ([`ObjectError::MissingInput`] or [`ObjectError::PeerSerialization`]).
/// Every rank must pass the same `root`. The roots travel in the header exchange (no extra
/// transport call): ranks that pass different roots all return
/// [`ObjectError::RootMismatch`] naming every rank's root, before any payload moves; a root
/// out of range on every rank is [`ObjectError::InvalidArgument`] on every rank.
///
/// ```
/// use tpcomm_objects::broadcast;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(4).run(|comm| {
///     let config = (comm.rank() == 0).then(|| vec!["tp=4".to_string(), "pp=1".to_string()]);
///     broadcast(&comm, 0, config.as_ref())
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec!["tp=4", "pp=1"]);
/// }
/// ```
pub fn broadcast<C, T>(comm: &C, root: usize, value: Option<&T>) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    broadcast_with(comm, root, value, &Options::default())
}

/// [`broadcast`] with options.
pub fn broadcast_with<C, T>(comm: &C, root: usize, value: Option<&T>, opts: &Options) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    broadcast_decode(comm, root, value, opts, |bytes| {
        decode_exact(root, bytes, opts.max_depth)
    })
}

/// The broadcast of `root`'s value, its bytes handed to `decode` on every rank.
pub(super) fn broadcast_decode<C, T, R>(
    comm: &C,
    root: usize,
    value: Option<&T>,
    opts: &Options,
    decode: impl FnOnce(&[u8]) -> Result<R>,
) -> Result<R>
where
    C: Communicator + ?Sized,
    T: Serialize,
{
    let span = span(comm, "broadcast");
    let _g = span.enter();
    let me = comm.rank();
    let is_root = me == root;
    let checked = Checked::new(opts, Some(root), Collective::Broadcast);
    let slot = slot_of(opts, &checked);
    let mut serialized = match (is_root && checked.invalid.is_none(), value) {
        (true, Some(v)) => Some(serialize(v)),
        _ => None,
    };
    // Every rank sends an entry (the root's with its length and inline bytes, the others'
    // with their options only), so that every rank sees every rank's options.
    let own = if is_root {
        let mine = serialized.as_ref().map_or(Mine::Missing, mine_of);
        mine.entry(&checked.field, slot)
    } else {
        let mut own = [0u8; ENTRY];
        write_entry(&mut own, Announce::Len(0), &checked.field, None, 0);
        own
    };
    let header = exchange_entries(comm, checked, &own)?;
    let own_cause = match &serialized {
        Some(Err(e)) => Some(e.clone()),
        _ => None,
    };
    let lens = agree(
        &[read_entry(&header, root)],
        |_| root,
        opts.max_total_bytes,
        own_cause,
    )?;
    let len = within_cap(lens, |_| root, opts.max_total_bytes)?;
    // The root checks that the exchange carries the length it sent, as a gather's sender
    // does: a sentinel turned into a length, or a length changed, would otherwise have it
    // return bytes it never sent (inline zeros, or its own receive buffer).
    let sent = match &serialized {
        Some(Ok(bytes)) => Some(bytes.len()),
        _ => None,
    };
    let lost = (is_root && sent != Some(len)).then(|| {
        ObjectError::Corrupt(format!(
            "root {root} announced {} but the broadcast header reports {len} bytes",
            sent.map_or_else(|| "no value".to_string(), |n| format!("{n} bytes"))
        ))
    });
    if len <= slot {
        if let Some(lost) = lost {
            return Err(lost);
        }
        record(&span, "small", len, 0);
        return decode(entry_inline(&header, root, len));
    }
    drop(header);
    let root_bytes = serialized.take();
    // The root decodes from its send buffer, which goes back to where it came from.
    let (base, kept) = if root_bytes.is_none() {
        (receive_offset(len), Kept::Recv)
    } else {
        (0, Kept::Send)
    };
    // A root whose length was lost votes "not reserved" (on calls that agree it), so that
    // its peers return `PeerAllocation` instead of waiting for its payload.
    let reserved = match (lost, root_bytes) {
        (Some(lost), _) => Err(lost),
        (None, Some(Ok(bytes))) if bytes.len() == len => Ok(bytes.into_vec()),
        // Not reached: `lost` covers a root whose bytes differ from the length.
        (None, Some(_)) => Err(ObjectError::Corrupt(format!(
            "root {root}: the broadcast header lost its own length"
        ))),
        (None, None) => kept.take_at(base, len),
    };
    let mut buf = agree_reserved(comm, len, reserved)?;
    let rounds = broadcast_payload(
        comm,
        root,
        &mut buf,
        base,
        len,
        opts.round_limit(comm.max_count()),
    )?;
    record_rounds(&span, len, rounds);
    let value = decode(&buf[base..]);
    kept.give_back(buf);
    value
}

/// Broadcast of the root's `len` bytes into `buf` from byte `base` on, in calls of at most
/// `limit` bytes (one call when it fits). On the root `buf` holds the bytes (`base` is 0);
/// elsewhere it is a buffer of length `base` and capacity `base + len`, grown one round at
/// a time.
fn broadcast_payload<C: Communicator + ?Sized>(
    comm: &C,
    root: usize,
    buf: &mut Vec<u8>,
    base: usize,
    len: usize,
    limit: usize,
) -> Result<usize> {
    let rounds = round_count(len, limit);
    for k in 0..rounds {
        let start = base + k * limit;
        let end = start.saturating_add(limit).min(base + len);
        if buf.len() < end {
            buf.resize(end, 0);
        }
        comm.broadcast(root, &mut buf[start..end])?;
    }
    Ok(rounds)
}
