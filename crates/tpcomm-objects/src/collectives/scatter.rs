//! Scatter: the root announces a length per destination in the block header, then each
//! rank receives its own value in rounds of one all-to-all each.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::{Communicator, Layout};

use super::codec::serialize_all;
use super::engine::{agree_reserved, exchange_blocks, record_rounds, span};
use crate::error::{ObjectError, Result};
use crate::gathered::decode_exact;
use crate::header::{agree_words, read_word, reserve, within_cap, Announce, WORD};
use crate::options::{Checked, Collective, Options, FIELD};
use crate::rounds::{dense_offsets, round, round_count};

/// Scatter from `root`: the root passes `Some(values)` with one value per rank; rank `i`
/// returns `values[i]` (the others' `values` are ignored).
///
/// A root without one value per rank makes every rank return
/// [`ObjectError::MissingInput`]; a root that fails to serialize,
/// [`ObjectError::PeerSerialization`].
/// Every rank must pass the same `root`. The roots travel in the header exchange (no extra
/// transport call): ranks that pass different roots all return
/// [`ObjectError::RootMismatch`] naming every rank's root, before any payload moves; a root
/// out of range on every rank is [`ObjectError::InvalidArgument`] on every rank.
///
/// ```
/// use tpcomm_objects::scatter;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let shards: Vec<Vec<u32>> = (0..3).map(|i| vec![i; i as usize + 1]).collect();
///     scatter(&comm, 0, (comm.rank() == 0).then_some(shards.as_slice()))
/// });
/// assert_eq!(results[2].as_ref().unwrap().as_ref().unwrap(), &vec![2u32, 2, 2]);
/// ```
pub fn scatter<C, T>(comm: &C, root: usize, values: Option<&[T]>) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    scatter_with(comm, root, values, &Options::default())
}

/// [`scatter`] with options.
pub fn scatter_with<C, T>(comm: &C, root: usize, values: Option<&[T]>, opts: &Options) -> Result<T>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let span = span(comm, "scatter");
    let _g = span.enter();
    let (me, size) = (comm.rank(), comm.size());
    let checked = Checked::new(opts, Some(root), Collective::Blocks);
    let mut own_cause = None;
    let mut root_bytes = Vec::new();
    let mut root_lens = Vec::new();
    let mut words = vec![Announce::Len(0); size];
    if me == root {
        let serialized = match values {
            Some(v) if v.len() == size && checked.invalid.is_none() => Some(serialize_all(v)),
            _ => None,
        };
        match serialized {
            None => words.fill(Announce::Missing),
            Some(Err(e)) => {
                words.fill(Announce::Failed);
                own_cause = Some(e);
            }
            Some(Ok((bytes, lens))) => {
                words = lens.iter().map(|&l| Announce::Len(l as u64)).collect();
                root_bytes = bytes;
                root_lens = lens;
            }
        }
    }
    let (header, block) = exchange_blocks(comm, checked, &words)?;
    let lens = agree_words(
        size,
        |d| read_word(&header, root * block + FIELD + d * WORD),
        |_| root,
        opts.max_total_bytes,
        own_cause,
    )?;
    drop(header);
    // Each rank allocates only its own value: the cap applies per destination, and the
    // root announced every length.
    for &l in &lens {
        within_cap([l], |_| root, opts.max_total_bytes)?;
    }
    // The cap bounds each length, not their sum: a root announcing several lengths near the
    // cap could make the sum wrap. Every rank reads the same lengths, so all refuse alike.
    let total = lens
        .iter()
        .try_fold(0usize, |sum, &l| sum.checked_add(l))
        .ok_or_else(|| {
            ObjectError::Corrupt(format!(
                "root {root}: the scatter lengths add up past the address space"
            ))
        })?;
    // Each length, not only their sum: lengths moved between destinations (or a sentinel
    // turned into lengths) would cut the root's bytes at the wrong places.
    if me == root && (lens != root_lens || root_bytes.len() != total) {
        return Err(ObjectError::Corrupt(format!(
            "root {root}: the scatter header lost its own lengths"
        )));
    }
    let largest = lens.iter().copied().max().unwrap_or(0);
    let mut mine = agree_reserved(comm, largest, reserve(lens[me]))?;
    let limit = opts.round_limit(comm.max_count());
    let offsets = dense_offsets(&lens);
    let rounds = round_count(total, limit);
    let zeros = vec![0usize; size];
    for k in 0..rounds {
        let rd = round(&lens, &offsets, limit, k);
        let (send_buf, send_counts, send_displs) = if me == root {
            (
                &root_bytes[rd.window.clone()],
                &rd.counts[..],
                &rd.displs[..],
            )
        } else {
            (&[][..], &zeros[..], &zeros[..])
        };
        let mut recv_counts = zeros.clone();
        recv_counts[root] = rd.counts[me];
        let part = rd.sources[me].clone();
        if mine.len() < part.end {
            mine.resize(part.end, 0);
        }
        comm.all_to_all_varcount(
            Layout {
                buf: send_buf,
                counts: send_counts,
                displs: send_displs,
            },
            Layout {
                buf: &mut mine[part],
                counts: &recv_counts,
                displs: &zeros,
            },
        )?;
    }
    record_rounds(&span, lens[me], rounds);
    decode_exact(root, &mine, opts.max_depth)
}
