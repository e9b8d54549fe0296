//! The collectives. Every public function here is a thin typed layer over one of four byte
//! protocols: rank-ordered gathering (`gather_bytes`), rooted broadcast, rooted scatter and
//! all-to-all, each a header exchange followed (when needed) by the payload in rounds.
//!
//! The header exchange is always an all-gather whose size depends on nothing a rank chose
//! (not the options, not the root), so every rank joins it whatever it was passed. It carries
//! each rank's options and root (`options.rs`), and nothing chosen by the root (the root's
//! entry, a rooted payload call) is touched before every rank has agreed on both.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tpcomm_transport::backend::copy::{copy_slice, extend_from_slice};
use tpcomm_transport::{dense_displacements, Communicator, GatherRecv, Layout};
use tracing::field::Empty;

use crate::buffers::{receive_offset, Kept};
use crate::error::{ObjectError, Result};
use crate::gathered::{decode_exact, decode_exact_in_place, Gathered};
use crate::header::{
    agree, agree_words, alloc, entry_field, entry_inline, read_entry, read_word, reserve,
    within_cap, write_entry, Announce, ENTRY, SLOT_AT, WORD,
};
use crate::options::{Checked, Collective, Options, FIELD};
use crate::rounds::{dense_offsets, round, round_count};

/// What this rank contributes: bytes, or why it has none.
enum Mine<'a> {
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

    fn payload(&self) -> Option<&'a [u8]> {
        match self {
            Mine::Bytes(b) => Some(b),
            _ => None,
        }
    }

    fn into_cause(self) -> Option<postcard::Error> {
        match self {
            Mine::Failed(e) => Some(e),
            _ => None,
        }
    }
}

fn span<C: Communicator + ?Sized>(comm: &C, op: &'static str) -> tracing::Span {
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

fn record(span: &tracing::Span, path: &'static str, bytes: usize, rounds: usize) {
    span.record("path", path);
    span.record("bytes", bytes);
    span.record("rounds", rounds);
}

fn header_len(entries: usize, entry: usize) -> Result<usize> {
    entries
        .checked_mul(entry)
        .ok_or_else(|| ObjectError::InvalidArgument("header size overflows usize".into()))
}

/// The inline slot this rank uses: its option when valid, 0 otherwise (an invalid rank only
/// flags itself in the header).
fn slot_of(opts: &Options, checked: &Checked) -> usize {
    if checked.invalid.is_some() {
        0
    } else {
        opts.small_slot_bytes
    }
}

/// Fixed-size all-gather of `send` (equal length on every rank), in chunks of at most
/// `max_count` bytes when it is larger (only ever the case with an artificially small
/// `max_count`).
fn all_gather_fixed<C: Communicator + ?Sized>(
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

/// Moves every rank's payload (`lens` agreed) to `root`, or to every rank when `root` is
/// `None`, in the windowed round schedule, straight into `buf` from byte `base` on (on
/// receivers only: a buffer of length `base` and capacity `base + sum(lens)`, grown one
/// window at a time, so that only what arrived is ever written).
fn payload_rounds<C: Communicator + ?Sized>(
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

/// The gathering protocol shared by all-gather (`root == None`) and gather: header with
/// options and inline slots, agreement, then the payload path when any value exceeds its
/// slot.
fn gather_bytes<C: Communicator + ?Sized>(
    comm: &C,
    root: Option<usize>,
    mine: Mine<'_>,
    opts: &Options,
    span: &tracing::Span,
) -> Result<Option<Gathered>> {
    let (me, size) = (comm.rank(), comm.size());
    let checked = Checked::new(opts, root, Collective::Gather);
    let slot = slot_of(opts, &checked);
    let mut own = [0u8; ENTRY];
    write_entry(
        &mut own,
        mine.announce(),
        &checked.field,
        mine.payload(),
        slot,
    );
    let mut header = alloc(header_len(size, ENTRY)?)?;
    all_gather_fixed(comm, &own, &mut header)?;
    checked.agree(size, |r| entry_field(&header, r))?;

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
    record(
        span,
        if rounds == 1 { "single" } else { "rounds" },
        total,
        rounds,
    );
    if !receives {
        return Ok(None);
    }
    let offsets = dense_offsets(&lens);
    let ranges = (0..size)
        .map(|r| base + offsets[r]..base + offsets[r] + lens[r])
        .collect();
    Ok(Some(Gathered::new(buf, base, ranges, opts.max_depth)))
}

/// A value serialized into the thread's kept send buffer (see `buffers.rs`), which it gives
/// back when dropped.
struct Encoded(Vec<u8>);

impl Encoded {
    /// The buffer, which is then not given back.
    fn into_vec(mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

impl std::ops::Deref for Encoded {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Encoded {
    fn drop(&mut self) {
        Kept::Send.give_back(std::mem::take(&mut self.0));
    }
}

/// Serializes `value` straight into the thread's kept send buffer (no allocation once it
/// has the capacity).
fn serialize<T: Serialize + ?Sized>(value: &T) -> std::result::Result<Encoded, postcard::Error> {
    // Room for any value that travels in the header's inline slot, so that a small value
    // (whose buffer is too small to be kept) costs one allocation, not a growing series.
    let buf = Kept::Send.take(ENTRY).unwrap_or_default();
    append(value, buf).map(Encoded)
}

/// Appends `value`'s postcard encoding to `buf` and returns it (the same bytes as
/// `postcard::to_extend`, faster: short pieces are appended as fixed-size copies instead of
/// one `memcpy` call each): the building block for callers that move bytes themselves, as [`decode_from`] is for decoding. `buf` keeps its capacity, so a
/// caller that hands back the same buffer every time allocates nothing once it is large
/// enough.
pub fn encode_append<T: Serialize + ?Sized>(
    value: &T,
    buf: Vec<u8>,
) -> std::result::Result<Vec<u8>, postcard::Error> {
    append(value, buf)
}

/// [`encode_append`].
fn append<T: Serialize + ?Sized>(
    value: &T,
    buf: Vec<u8>,
) -> std::result::Result<Vec<u8>, postcard::Error> {
    postcard::serialize_with_flavor(value, Append(buf))
}

/// postcard's output into a `Vec`. postcard writes a value in small pieces (a varint, a
/// short string); `Extend`, which `postcard::to_extend` uses, appends each through a call to
/// `memcpy` of a length known only at run time, which took about 70% of the encoding time of
/// a `Vec` of small structs (perf, `tpcomm-bench objects` on `records:100000`). Pieces of up
/// to [`FIXED_PIECES`] bytes are appended as arrays of their length instead, copies the
/// compiler writes out inline: encoding 100,000 such records took 1.7 ms instead of 5.4 ms
/// (a standalone loop on an AMD EPYC VM).
struct Append(Vec<u8>);

/// The longest piece appended as a fixed-size array: every varint up to a u64's (10 bytes)
/// and short strings; longer pieces go through one `memcpy` each (through
/// [`extend_from_slice`], which avoids the pairs of addresses that `memcpy` copies slowly:
/// a user's blob and the kept send buffer can form one).
const FIXED_PIECES: usize = 16;

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
fn agree_reserved<C: Communicator + ?Sized>(
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

impl postcard::ser_flavors::Flavor for Append {
    type Output = Vec<u8>;

    #[inline(always)]
    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.0.push(byte);
        Ok(())
    }

    #[inline(always)]
    fn try_extend(&mut self, piece: &[u8]) -> postcard::Result<()> {
        macro_rules! by_length {
            ($($n:literal)*) => {
                match piece.len() {
                    $($n => {
                        if let Ok(fixed) = <&[u8; $n]>::try_from(piece) {
                            self.0.extend_from_slice(fixed);
                        }
                    })*
                    _ => {
                        // The list above is every length from 1 to FIXED_PIECES.
                        debug_assert!(piece.is_empty() || piece.len() > FIXED_PIECES);
                        extend_from_slice(&mut self.0, piece);
                    }
                }
            };
        }
        by_length!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Vec<u8>> {
        Ok(self.0)
    }
}

fn mine_of(serialized: &std::result::Result<Encoded, postcard::Error>) -> Mine<'_> {
    match serialized {
        Ok(bytes) => Mine::Bytes(bytes),
        Err(e) => Mine::Failed(e.clone()),
    }
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
    let span = span(comm, "all_gather");
    let _g = span.enter();
    let serialized = serialize(value);
    Ok(gather_bytes(comm, None, mine_of(&serialized), opts, &span)?.expect("every rank receives"))
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

/// [`all_gather`] into the values of the last call: `out` ends with one value per rank, in
/// rank order, each decoded over the value that was there (see [`Gathered::decode_into`]).
///
/// For a loop that gathers the same kind of value at every step (an engine's per-step
/// state): strings and vectors keep their allocations from one step to the next, so the
/// steady state allocates little or nothing, and `out`'s memory stays warm (a fresh `Vec<T>`
/// per call makes the allocator fetch and fault in new pages for large results, which can
/// take as long as the decode itself). Derived structs are replaced whole unless
/// `serde_derive`'s `deserialize_in_place` feature is on, which makes them reuse their
/// fields too (`docs/protocol.md`, "Decoding into the last call's values").
///
/// Errors as [`all_gather`]. An error decided before decoding (a peer's failure, the cap,
/// the transport) leaves `out` as it was; a decode error leaves it empty.
///
/// ```
/// use tpcomm_objects::all_gather_into;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut all: Vec<Vec<u32>> = Vec::new();
///     for step in 0..4u32 {
///         let mine = vec![step; comm.rank() + 1];
///         all_gather_into(&comm, &mine, &mut all)?; // reuses last step's vectors
///     }
///     Ok::<_, tpcomm_objects::ObjectError>(all)
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![vec![3], vec![3, 3], vec![3, 3, 3]]);
/// }
/// ```
pub fn all_gather_into<C, T>(comm: &C, value: &T, out: &mut Vec<T>) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    all_gather_into_with(comm, value, out, &Options::default())
}

/// [`all_gather_into`] with options.
pub fn all_gather_into_with<C, T>(
    comm: &C,
    value: &T,
    out: &mut Vec<T>,
    opts: &Options,
) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let span = span(comm, "all_gather");
    let _g = span.enter();
    let serialized = serialize(value);
    let gathered =
        gather_bytes(comm, None, mine_of(&serialized), opts, &span)?.expect("every rank receives");
    let decoded = gathered.decode_into(out);
    // Freed only after decoding: releasing the send buffer first hands its memory back to
    // the allocator in the middle of the decode's many small allocations (measured slower).
    drop(serialized);
    decoded
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

/// [`gather`] into the values of the last call: on the root, `out` ends with one value per
/// rank, in rank order, each decoded over the value that was there (as [`all_gather_into`]
/// does); returns `true` there. Elsewhere `out` is not touched and the call returns `false`.
///
/// Errors as [`gather`]. On the root, an error decided before decoding leaves `out` as it
/// was; a decode error leaves it empty.
///
/// ```
/// use tpcomm_objects::gather_into;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut reports: Vec<String> = Vec::new();
///     let mut filled = false;
///     for step in 0..3 {
///         let mine = format!("rank {} step {step}", comm.rank());
///         filled = gather_into(&comm, 0, &mine, &mut reports)?; // reuses last step's strings
///     }
///     Ok::<_, tpcomm_objects::ObjectError>((filled, reports))
/// });
/// let (filled, reports) = results[0].as_ref().unwrap().as_ref().unwrap();
/// assert!(filled);
/// assert_eq!(reports[2], "rank 2 step 2");
/// assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap(), &(false, vec![]));
/// ```
pub fn gather_into<C, T>(comm: &C, root: usize, value: &T, out: &mut Vec<T>) -> Result<bool>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    gather_into_with(comm, root, value, out, &Options::default())
}

/// [`gather_into`] with options.
pub fn gather_into_with<C, T>(
    comm: &C,
    root: usize,
    value: &T,
    out: &mut Vec<T>,
    opts: &Options,
) -> Result<bool>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let span = span(comm, "gather");
    let _g = span.enter();
    let serialized = serialize(value);
    let Some(gathered) = gather_bytes(comm, Some(root), mine_of(&serialized), opts, &span)? else {
        return Ok(false);
    };
    let decoded = gathered.decode_into(out);
    // Freed after decoding, as in `all_gather_into_with`.
    drop(serialized);
    decoded.map(|()| true)
}

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

/// [`broadcast`] into the value of the last call: every rank's `out` ends equal to the root's
/// value, decoded over what `out` held (serde's `Deserialize::deserialize_in_place`: strings
/// and vectors keep their allocations), as [`all_gather_into`] does for an all-gather. The
/// root's `out` is decoded from its own bytes like every other rank's, so that all ranks hold
/// the same value however `T` serializes.
///
/// Errors as [`broadcast`]. An error decided before decoding leaves `out` as it was; after a
/// decode error `out` holds some valid `T` that must not be used as the root's value.
///
/// ```
/// use tpcomm_objects::broadcast_into;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut schedule: Vec<u64> = Vec::new();
///     for step in 0..3u64 {
///         let root_has = (comm.rank() == 0).then(|| vec![step; 4]);
///         broadcast_into(&comm, 0, root_has.as_ref(), &mut schedule)?;
///     }
///     Ok::<_, tpcomm_objects::ObjectError>(schedule)
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![2; 4]);
/// }
/// ```
pub fn broadcast_into<C, T>(comm: &C, root: usize, value: Option<&T>, out: &mut T) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    broadcast_into_with(comm, root, value, out, &Options::default())
}

/// [`broadcast_into`] with options.
pub fn broadcast_into_with<C, T>(
    comm: &C,
    root: usize,
    value: Option<&T>,
    out: &mut T,
    opts: &Options,
) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    broadcast_decode(comm, root, value, opts, |bytes| {
        decode_exact_in_place(root, bytes, opts.max_depth, out)
    })
}

/// The broadcast of `root`'s value, its bytes handed to `decode` on every rank.
fn broadcast_decode<C, T, R>(
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
    let (me, size) = (comm.rank(), comm.size());
    let is_root = me == root;
    let checked = Checked::new(opts, Some(root), Collective::Broadcast);
    let slot = slot_of(opts, &checked);
    let mut serialized = match (is_root && checked.invalid.is_none(), value) {
        (true, Some(v)) => Some(serialize(v)),
        _ => None,
    };
    // Every rank sends an entry (the root's with its length and inline bytes, the others'
    // with their options only), so that every rank sees every rank's options.
    let mut own = [0u8; ENTRY];
    if is_root {
        let mine = serialized.as_ref().map_or(Mine::Missing, mine_of);
        write_entry(
            &mut own,
            mine.announce(),
            &checked.field,
            mine.payload(),
            slot,
        );
    } else {
        write_entry(&mut own, Announce::Len(0), &checked.field, None, 0);
    }
    let mut header = alloc(header_len(size, ENTRY)?)?;
    all_gather_fixed(comm, &own, &mut header)?;
    checked.agree(size, |r| entry_field(&header, r))?;
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
    record(
        &span,
        if rounds == 1 { "single" } else { "rounds" },
        len,
        rounds,
    );
    let value = decode(&buf[base..]);
    kept.give_back(buf);
    value
}

/// Serializes `values` back to back into one buffer; returns it and each value's length.
fn serialize_all<T: Serialize>(values: &[T]) -> Packed {
    let mut buf = Vec::new();
    let mut lens = Vec::with_capacity(values.len());
    for v in values {
        let before = buf.len();
        buf = append(v, buf)?;
        lens.push(buf.len() - before);
    }
    Ok((buf, lens))
}

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
    record(
        &span,
        if rounds == 1 { "single" } else { "rounds" },
        lens[me],
        rounds,
    );
    decode_exact(root, &mine, opts.max_depth)
}

/// The header of `scatter` and `all_to_all`: every rank all-gathers a block of its options
/// field followed by one length word per destination (`words`), and every rank checks every
/// rank's options. Returns the header and its block size.
fn exchange_blocks<C: Communicator + ?Sized>(
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

/// This rank's serialized values packed in destination order, with the bytes for each
/// destination, or the serialization error.
type Packed = std::result::Result<(Vec<u8>, Vec<usize>), postcard::Error>;

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
fn all_to_all_bytes<C: Communicator + ?Sized>(
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
    Ok(values
        .into_iter()
        .reduce(f)
        .expect("a communicator has at least one rank"))
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
    let span = span(comm, "reduce");
    let _g = span.enter();
    let serialized = serialize(value);
    let Some(gathered) = gather_bytes(comm, Some(root), mine_of(&serialized), opts, &span)? else {
        return Ok(None);
    };
    let values: Vec<T> = gathered.decode()?;
    Ok(Some(
        values
            .into_iter()
            .reduce(f)
            .expect("a communicator has at least one rank"),
    ))
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

/// Decodes a borrowed value from `bytes` sent by `rank`: the building block for callers that
/// move bytes themselves. Rejects trailing bytes and nesting deeper than
/// [`Options::DEFAULT_MAX_DEPTH`] ([`DecodeError::TooDeep`](crate::DecodeError::TooDeep));
/// never panics, never overflows the stack.
pub fn decode_from<'a, T: Deserialize<'a>>(rank: usize, bytes: &'a [u8]) -> Result<T> {
    decode_exact(rank, bytes, Options::DEFAULT_MAX_DEPTH)
}

/// [`decode_from`] with the nesting bound of `opts` (`opts.max_depth`, validated).
pub fn decode_from_with<'a, T: Deserialize<'a>>(
    rank: usize,
    bytes: &'a [u8],
    opts: &Options,
) -> Result<T> {
    opts.validate()?;
    decode_exact(rank, bytes, opts.max_depth)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Serialize)]
    struct Mixed {
        id: u64,
        name: String,
        tokens: Vec<u32>,
        bytes: serde_bytes::ByteBuf,
        score: f64,
        tag: Option<i128>,
        map: BTreeMap<String, Vec<i16>>,
    }

    proptest! {
        /// Appending gives exactly postcard's bytes after whatever the buffer held, for
        /// pieces on both sides of `FIXED_PIECES` (strings and byte strings of every length
        /// up to 100, varints of every width).
        #[test]
        fn append_writes_postcards_bytes_after_the_prefix(
            prefix in proptest::collection::vec(any::<u8>(), 0..40),
            id in any::<u64>(),
            name in "\\PC{0,100}",
            tokens in proptest::collection::vec(any::<u32>(), 0..40),
            bytes in proptest::collection::vec(any::<u8>(), 0..100),
            score in any::<f64>(),
            tag in any::<Option<i128>>(),
            map in proptest::collection::btree_map("[a-z]{0,40}", proptest::collection::vec(any::<i16>(), 0..8), 0..4),
        ) {
            let value = Mixed { id, name, tokens, bytes: serde_bytes::ByteBuf::from(bytes), score, tag, map };
            let got = append(&value, prefix.clone()).unwrap();
            let mut want = prefix;
            want.extend(postcard::to_stdvec(&value).unwrap());
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn append_handles_pieces_of_every_length_around_the_fixed_ones() {
        for len in 0..=4 * FIXED_PIECES {
            let s: String = "é".repeat(len / 2) + &"x".repeat(len % 2);
            assert_eq!(s.len(), len);
            assert_eq!(
                append(&s, vec![7]).unwrap(),
                [vec![7], postcard::to_stdvec(&s).unwrap()].concat(),
                "string of {len} bytes"
            );
        }
    }
}
