//! All-to-all: every rank announces a length per destination in the block header, then
//! the payload moves in one varcount all-to-all, or, past the round limit, as one windowed
//! gather per destination. The byte protocol (`all_to_all_bytes`) also carries the scans.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::{dense_displacements, Communicator, Layout};

use super::codec::{serialize_all, Packed};
use super::engine::{agree_reserved, exchange_blocks, payload_rounds, record, span};
use crate::buffers::receive_offset;
use crate::error::{ObjectError, Result};
use crate::gathered::decode_exact;
use crate::header::{agree_words, read_word, reserve, within_cap, Announce, WORD};
use crate::options::{Checked, Collective, Options, FIELD};
use crate::rounds::dense_offsets;

/// All-to-all: `values[j]` goes to rank `j`; returns the value every rank sent to this one,
/// in rank order. `values` must hold one value per rank (otherwise every rank returns
/// [`ObjectError::MissingInput`] naming this rank).
///
/// ```
/// use tpcomm_objects::all_to_all;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let outgoing: Vec<String> = (0..3).map(|to| format!("{}->{to}", comm.rank())).collect();
///     all_to_all(&comm, &outgoing)
/// });
/// assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap(), &vec!["0->1", "1->1", "2->1"]);
/// ```
pub fn all_to_all<C, T>(comm: &C, values: &[T]) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    all_to_all_with(comm, values, &Options::default())
}

/// [`all_to_all`] with options.
pub fn all_to_all_with<C, T>(comm: &C, values: &[T], opts: &Options) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let span = span(comm, "all_to_all");
    let _g = span.enter();
    let size = comm.size();
    let checked = Checked::new(opts, None, Collective::Blocks);
    let outgoing =
        (values.len() == size && checked.invalid.is_none()).then(|| serialize_all(values));
    let (buf, ranges) = all_to_all_bytes(comm, checked, outgoing, opts, &span, |_| Ok(()))?;
    ranges
        .into_iter()
        .enumerate()
        .map(|(s, range)| decode_exact(s, &buf[range], opts.max_depth))
        .collect()
}

/// The all-to-all protocol on bytes, shared by [`all_to_all_with`] and the scans.
/// `outgoing` is this rank's bytes, packed in destination order, with the length for each
/// destination; `None` when it has no valid input (every rank then returns
/// [`ObjectError::MissingInput`] naming it), `Some(Err)` when it failed to serialize (every
/// rank returns [`ObjectError::PeerSerialization`]). Returns the bytes this rank received
/// and where each source's lie in them.
///
/// `shape` checks the agreed lengths (`lens[s * size + d]`: bytes rank `s` sends to rank
/// `d`) against what the caller's protocol allows, on every rank, before any payload moves,
/// so that every rank refuses a sender that breaks it alike.
pub(super) fn all_to_all_bytes<C: Communicator + ?Sized>(
    comm: &C,
    checked: Checked,
    outgoing: Option<Packed>,
    opts: &Options,
    span: &tracing::Span,
    shape: impl FnOnce(&[usize]) -> Result<()>,
) -> Result<(Vec<u8>, Vec<std::ops::Range<usize>>)> {
    let (me, size) = (comm.rank(), comm.size());
    let (announce, own_cause, send, send_lens): (Vec<Announce>, _, Vec<u8>, Vec<usize>) =
        match outgoing {
            None => (
                vec![Announce::Missing; size],
                None,
                Vec::new(),
                vec![0; size],
            ),
            Some(Err(e)) => (
                vec![Announce::Failed; size],
                Some(e),
                Vec::new(),
                vec![0; size],
            ),
            Some(Ok((bytes, lens))) => (
                lens.iter().map(|&l| Announce::Len(l as u64)).collect(),
                None,
                bytes,
                lens,
            ),
        };
    let (header, block) = exchange_blocks(comm, checked, &announce)?;
    // lens[s * size + d]: bytes rank s sends to rank d.
    let lens = agree_words(
        size * size,
        |i| read_word(&header, (i / size) * block + FIELD + (i % size) * WORD),
        |i| i / size,
        opts.max_total_bytes,
        own_cause,
    )?;
    drop(header);
    let mut recv_total = 0;
    let mut largest = 0;
    for d in 0..size {
        // Every rank checks every receiver's total, so all ranks agree on a violation.
        let t = within_cap(
            (0..size).map(|s| lens[s * size + d]),
            |s| s,
            opts.max_total_bytes,
        )?;
        if d == me {
            recv_total = t;
        }
        largest = largest.max(t);
    }
    shape(&lens)?;
    if lens[me * size..(me + 1) * size] != send_lens[..] {
        return Err(ObjectError::Corrupt(format!(
            "rank {me}: the all-to-all header lost its own lengths"
        )));
    }
    let recv_lens: Vec<usize> = (0..size).map(|s| lens[s * size + me]).collect();
    let limit = opts.round_limit(comm.max_count());
    let fits = (0..size).all(|r| {
        // Saturating: the cap bounds each receiver's column, not a sender's row, which can
        // add up past usize; a row that large does not fit either way.
        let sent = lens[r * size..(r + 1) * size]
            .iter()
            .fold(0usize, |sum, &l| sum.saturating_add(l));
        let received: usize = (0..size).map(|s| lens[s * size + r]).sum();
        sent <= limit && received <= limit
    });
    let base = receive_offset(recv_lens.iter().copied().max().unwrap_or(0));
    let mut buf = agree_reserved(comm, largest, reserve(recv_total.saturating_add(base)))?;
    buf.resize(base, 0);
    let recv_offsets = dense_offsets(&recv_lens);
    if fits {
        buf.resize(base + recv_total, 0);
        let (send_displs, _) =
            dense_displacements(&send_lens).expect("checked by within_cap on the sender");
        comm.all_to_all_varcount(
            Layout {
                buf: &send,
                counts: &send_lens,
                displs: &send_displs,
            },
            Layout {
                buf: &mut buf[base..],
                counts: &recv_lens,
                displs: &recv_offsets,
            },
        )?;
        record(span, "single", recv_total, 1);
    } else {
        // Over the limit: one windowed gather per destination, in rank order.
        let send_offsets = dense_offsets(&send_lens);
        let mut rounds = 0;
        for d in 0..size {
            let column: Vec<usize> = (0..size).map(|s| lens[s * size + d]).collect();
            let payload = &send[send_offsets[d]..send_offsets[d] + send_lens[d]];
            let target = (d == me).then_some(&mut buf);
            rounds += payload_rounds(comm, Some(d), payload, &column, target, base, limit)?;
        }
        record(span, "rounds", recv_total, rounds);
    }
    let ranges = (0..size)
        .map(|s| base + recv_offsets[s]..base + recv_offsets[s] + recv_lens[s])
        .collect();
    Ok((buf, ranges))
}
