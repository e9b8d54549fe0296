//! The two phases every collective is built from: the header exchange (a fixed-size
//! all-gather of each rank's length words, options and root, checked alike on every rank)
//! and the payload, in one transport call or in rounds of at most `max_count` bytes; with
//! the agreed reservation that turns one rank's refused allocation into an error on every
//! rank, and the `tracing` span every collective records its path in.

use tpcomm_transport::copy::copy_slice;
use tpcomm_transport::{Communicator, GatherRecv};
use tracing::field::Empty;

use crate::error::{ObjectError, Result};
use crate::header::{alloc, entry_field, write_entry, Announce, ENTRY, WORD};
use crate::options::{Checked, Options, FIELD};
use crate::rounds::{dense_offsets, round, round_count};

/// What this rank contributes: bytes, or why it has none.
pub(super) enum Mine<'a> {
    Bytes(&'a [u8]),
    Failed(postcard::Error),
    Missing,
}

impl<'a> Mine<'a> {
    fn announce(&self) -> Announce {
        match self {
            Mine::Bytes(b) => Announce::Len(b.len() as u64),
            Mine::Failed(_) => Announce::Failed,
            Mine::Missing => Announce::Missing,
        }
    }

    pub(super) fn payload(&self) -> Option<&'a [u8]> {
        match self {
            Mine::Bytes(b) => Some(b),
            _ => None,
        }
    }

    pub(super) fn into_cause(self) -> Option<postcard::Error> {
        match self {
            Mine::Failed(e) => Some(e),
            _ => None,
        }
    }

    /// This rank's header entry: its announcement, its options `field`, and its bytes inline
    /// when they fit `slot`.
    pub(super) fn entry(&self, field: &[u8; FIELD], slot: usize) -> [u8; ENTRY] {
        let mut own = [0u8; ENTRY];
        write_entry(&mut own, self.announce(), field, self.payload(), slot);
        own
    }
}

pub(super) fn span<C: Communicator + ?Sized>(comm: &C, op: &'static str) -> tracing::Span {
    tracing::debug_span!(
        "object_collective",
        op,
        rank = comm.rank(),
        size = comm.size(),
        path = Empty,
        bytes = Empty,
        rounds = Empty
    )
}

pub(super) fn record(span: &tracing::Span, path: &'static str, bytes: usize, rounds: usize) {
    span.record("path", path);
    span.record("bytes", bytes);
    span.record("rounds", rounds);
}

/// Records a payload moved in `rounds` calls: the `single` path for one, `rounds` otherwise.
pub(super) fn record_rounds(span: &tracing::Span, bytes: usize, rounds: usize) {
    record(
        span,
        if rounds == 1 { "single" } else { "rounds" },
        bytes,
        rounds,
    );
}

pub(super) fn header_len(entries: usize, entry: usize) -> Result<usize> {
    entries
        .checked_mul(entry)
        .ok_or_else(|| ObjectError::InvalidArgument("header size overflows usize".into()))
}

/// The inline slot this rank uses: its option when valid, 0 otherwise (an invalid rank only
/// flags itself in the header).
pub(super) fn slot_of(opts: &Options, checked: &Checked) -> usize {
    if checked.invalid.is_some() {
        0
    } else {
        opts.small_slot_bytes
    }
}

/// Fixed-size all-gather of `send` (equal length on every rank), in chunks of at most
/// `max_count` bytes when it is larger (only ever the case with an artificially small
/// `max_count`).
pub(super) fn all_gather_fixed<C: Communicator + ?Sized>(
    comm: &C,
    send: &[u8],
    recv: &mut [u8],
) -> Result<()> {
    let max = comm.max_count().max(1);
    if send.len() <= max {
        return Ok(comm.all_gather(send, recv)?);
    }
    let entry = send.len();
    let mut chunk_recv = vec![0u8; max * comm.size()];
    for (c, chunk) in send.chunks(max).enumerate() {
        let part = &mut chunk_recv[..chunk.len() * comm.size()];
        comm.all_gather(chunk, part)?;
        for (r, got) in part.chunks_exact(chunk.len()).enumerate() {
            let at = r * entry + c * max;
            copy_slice(&mut recv[at..at + chunk.len()], got);
        }
    }
    Ok(())
}

/// Moves every rank's payload (`lens` agreed) to `root`, or to every rank when `root` is
/// `None`, in the windowed round schedule, straight into `buf` from byte `base` on (on
/// receivers only: a buffer of length `base` and capacity `base + sum(lens)`, grown one
/// window at a time, so that only what arrived is ever written).
pub(super) fn payload_rounds<C: Communicator + ?Sized>(
    comm: &C,
    root: Option<usize>,
    payload: &[u8],
    lens: &[usize],
    mut buf: Option<&mut Vec<u8>>,
    base: usize,
    limit: usize,
) -> Result<usize> {
    let me = comm.rank();
    let total: usize = lens.iter().sum();
    let offsets = dense_offsets(lens);
    let rounds = round_count(total, limit);
    for k in 0..rounds {
        let rd = round(lens, &offsets, limit, k);
        let chunk = &payload[rd.sources[me].clone()];
        let window = buf.as_deref_mut().map(|b| {
            if b.len() < base + rd.window.end {
                b.resize(base + rd.window.end, 0);
            }
            &mut b[base + rd.window.start..base + rd.window.end]
        });
        match root {
            None => comm.all_gather_varcount(
                chunk,
                window.expect("every rank receives an all-gather"),
                &rd.counts,
                &rd.displs,
            )?,
            Some(root) => {
                let recv = window.map(|recv| GatherRecv {
                    recv,
                    counts: &rd.counts,
                    displs: &rd.displs,
                });
                comm.gather_varcount(root, chunk, recv)?
            }
        }
    }
    Ok(rounds)
}

/// A call whose largest receive buffer (on any rank; every rank computes it from the same
/// header) is at least this many bytes agrees, in a one-byte all-gather, that every rank
/// reserved its buffer before any payload moves: a rank refused memory then fails the call
/// on every rank ([`ObjectError::PeerAllocation`]) instead of leaving its peers in a payload
/// call it never joins. Below it (a few microseconds of extra latency would matter, and
/// memory that small is refused only to a process about to fail anyway) the payload starts
/// at once.
pub const AGREED_RESERVE_BYTES: usize = 4 << 20;

/// `reserved` (this rank's receive buffer, or why it has none), after the agreement of
/// [`AGREED_RESERVE_BYTES`] when `largest` calls for it: this rank's own error, or
/// [`ObjectError::PeerAllocation`] naming the ranks that had none.
pub(super) fn agree_reserved<C: Communicator + ?Sized>(
    comm: &C,
    largest: usize,
    reserved: Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    if largest < AGREED_RESERVE_BYTES {
        return reserved;
    }
    let mut all = vec![0u8; comm.size()];
    comm.all_gather(&[u8::from(reserved.is_ok())], &mut all)?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r] != 1).collect();
    match reserved {
        Ok(_) if !failed.is_empty() => Err(ObjectError::PeerAllocation { ranks: failed }),
        reserved => reserved,
    }
}

/// The header of the gathering protocol and the broadcast: every rank all-gathers its
/// [`ENTRY`]-byte entry (`own`, made with the options field of `checked`), and every rank
/// checks every rank's options. Returns the header.
pub(super) fn exchange_entries<C: Communicator + ?Sized>(
    comm: &C,
    checked: Checked,
    own: &[u8; ENTRY],
) -> Result<Vec<u8>> {
    let size = comm.size();
    let mut header = alloc(header_len(size, ENTRY)?)?;
    all_gather_fixed(comm, own, &mut header)?;
    checked.agree(size, |r| entry_field(&header, r))?;
    Ok(header)
}

/// The header of `scatter` and `all_to_all`: every rank all-gathers a block of its options
/// field followed by one length word per destination (`words`), and every rank checks every
/// rank's options. Returns the header and its block size.
pub(super) fn exchange_blocks<C: Communicator + ?Sized>(
    comm: &C,
    checked: Checked,
    words: &[Announce],
) -> Result<(Vec<u8>, usize)> {
    let size = comm.size();
    let block = header_len(size, WORD)?
        .checked_add(FIELD)
        .ok_or_else(|| ObjectError::InvalidArgument("header size overflows usize".into()))?;
    let mut own = Vec::with_capacity(block);
    own.extend_from_slice(&checked.field);
    for w in words {
        own.extend_from_slice(&w.word());
    }
    let mut header = alloc(header_len(size, block)?)?;
    all_gather_fixed(comm, &own, &mut header)?;
    checked.agree(size, |r| &header[r * block..r * block + FIELD])?;
    Ok((header, block))
}
