//! postcard encoding into the thread's kept send buffer (with short pieces appended as
//! fixed-size copies), and the public encode and decode building blocks for callers that
//! move bytes themselves.

use serde::{Deserialize, Serialize};
use tpcomm_transport::copy::extend_from_slice;

use super::engine::Mine;
use crate::buffers::Kept;
use crate::error::Result;
use crate::gathered::{decode_exact, decode_exact_shaped};
use crate::header::ENTRY;
use crate::options::Options;
use crate::shape::Shape;

/// A value serialized into the thread's kept send buffer (see `buffers.rs`), which it gives
/// back when dropped.
pub(super) struct Encoded(Vec<u8>);

impl Encoded {
    /// The buffer, which is then not given back.
    pub(super) fn into_vec(mut self) -> Vec<u8> {
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
pub(super) fn serialize<T: Serialize + ?Sized>(
    value: &T,
) -> std::result::Result<Encoded, postcard::Error> {
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

/// postcard's output appended to `buf` (the flavor of [`encode_append`]).
pub(crate) fn append_flavor(buf: Vec<u8>) -> impl postcard::ser_flavors::Flavor<Output = Vec<u8>> {
    Append(buf)
}

/// [`encode_append`].
pub(super) fn append<T: Serialize + ?Sized>(
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
pub(super) const FIXED_PIECES: usize = 16;

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

pub(super) fn mine_of(serialized: &std::result::Result<Encoded, postcard::Error>) -> Mine<'_> {
    match serialized {
        Ok(bytes) => Mine::Bytes(bytes),
        Err(e) => Mine::Failed(e.clone()),
    }
}

/// Serializes `values` back to back into one buffer; returns it and each value's length.
pub(super) fn serialize_all<T: Serialize>(values: &[T]) -> Packed {
    let mut buf = Vec::new();
    let mut lens = Vec::with_capacity(values.len());
    for v in values {
        let before = buf.len();
        buf = append(v, buf)?;
        lens.push(buf.len() - before);
    }
    Ok((buf, lens))
}

/// This rank's serialized values packed in destination order, with the bytes for each
/// destination, or the serialization error.
pub(super) type Packed = std::result::Result<(Vec<u8>, Vec<usize>), postcard::Error>;

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

/// [`decode_from_with`], checking that `T` decodes the value with the [`Shape`] its writer
/// encoded it with ([`encode_append_shaped`](crate::encode_append_shaped)): a value of
/// another type is [`DecodeError::ShapeMismatch`](crate::DecodeError::ShapeMismatch), even
/// when its bytes decode.
pub fn decode_shaped<'a, T: Deserialize<'a>>(
    rank: usize,
    bytes: &'a [u8],
    opts: &Options,
    sent: Shape,
) -> Result<T> {
    opts.validate()?;
    decode_exact_shaped(rank, bytes, opts.max_depth, Some(sent))
}
