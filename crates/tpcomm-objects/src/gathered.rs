//! [`Gathered`]: one receive buffer with a view per rank, from which values borrow.

use std::ops::Range;

use serde::Deserialize;

use crate::buffers::Kept;
use crate::depth::{Bounded, Budget};
use crate::error::{DecodeError, ObjectError, Result};
use crate::shape::Shape;
use crate::stack;

/// The bytes of every rank in one buffer, with a view per rank.
///
/// Values decoded with [`decode`](Self::decode) may borrow from it (`&str`, `&[u8]` with
/// `serde_bytes`), so nothing is copied after the transfer.
///
/// ```
/// use tpcomm_objects::all_gather_borrowed;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(2).run(|comm| {
///     let name = format!("rank-{}", comm.rank());
///     let gathered = all_gather_borrowed(&comm, &name.as_str())?;
///     let names: Vec<&str> = gathered.decode()?; // borrows from `gathered`
///     Ok::<_, tpcomm_objects::ObjectError>(names.join(","))
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), "rank-0,rank-1");
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Gathered {
    buf: Vec<u8>,
    /// Where the received bytes start in `buf` (see `buffers::receive_offset`).
    start: usize,
    ranges: Vec<Range<usize>>,
    /// The nesting bound of the options the collective ran with.
    max_depth: usize,
}

impl Gathered {
    pub(crate) fn new(
        buf: Vec<u8>,
        start: usize,
        ranges: Vec<Range<usize>>,
        max_depth: usize,
    ) -> Self {
        debug_assert!(ranges
            .iter()
            .all(|r| start <= r.start && r.end <= buf.len()));
        Self {
            buf,
            start,
            ranges,
            max_depth,
        }
    }

    /// Number of ranks (views).
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// True when there is no view (never the case for a collective's result).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The bytes of `rank`, or `None` when out of range.
    pub fn bytes(&self, rank: usize) -> Option<&[u8]> {
        self.ranges.get(rank).map(|r| &self.buf[r.clone()])
    }

    /// The bytes of every rank, in rank order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        self.ranges.iter().map(|r| &self.buf[r.clone()])
    }

    /// The whole receive buffer (views may not cover all of it).
    pub fn buffer(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    /// Decodes the value of every rank; values may borrow from `self`.
    ///
    /// Fails with [`ObjectError::Decode`] naming the first rank whose bytes are not exactly
    /// one `T` (trailing bytes included) or nest deeper than the collective's
    /// `Options::max_depth`. Never panics or overflows the stack, whatever the bytes.
    pub fn decode<'a, T: Deserialize<'a>>(&'a self) -> Result<Vec<T>> {
        (0..self.len()).map(|rank| self.decode_rank(rank)).collect()
    }

    /// Decodes the value of every rank into `out`, reusing the values already there: the
    /// steady-state form of [`decode`](Self::decode) for a loop that gathers the same kind of
    /// value at every step.
    ///
    /// Rank `r`'s value is decoded over `out[r]` with serde's `Deserialize::deserialize_in_place`
    /// (a `String` or `Vec` keeps its allocation; a type without in-place support is
    /// replaced: the new value is decoded, then the old one dropped, whose freed blocks the
    /// allocator hands to the next value's allocations, warm); `out` is truncated or extended
    /// to one value per rank. After it, `out` holds exactly what [`decode`](Self::decode) would return.
    ///
    /// Fails as [`decode`](Self::decode) does; on failure `out` is left empty (values
    /// already overwritten cannot be given back, and a half-written vector must not pass
    /// for a result), its capacity kept.
    ///
    /// ```
    /// use tpcomm_objects::all_gather_borrowed;
    /// use tpcomm_transport::{Communicator, LocalGroup};
    ///
    /// let results = LocalGroup::new(2).run(|comm| {
    ///     let mut names: Vec<String> = Vec::new();
    ///     for step in 0..3 {
    ///         let gathered = all_gather_borrowed(&comm, &format!("step {step} rank {}", comm.rank()))?;
    ///         gathered.decode_into(&mut names)?; // the strings of the last step are reused
    ///     }
    ///     Ok::<_, tpcomm_objects::ObjectError>(names)
    /// });
    /// for r in results {
    ///     assert_eq!(r.unwrap().unwrap(), ["step 2 rank 0", "step 2 rank 1"]);
    /// }
    /// ```
    pub fn decode_into<'a, T: Deserialize<'a>>(&'a self, out: &mut Vec<T>) -> Result<()> {
        out.truncate(self.len());
        for (rank, range) in self.ranges.iter().enumerate() {
            let bytes = &self.buf[range.clone()];
            let decoded = match out.get_mut(rank) {
                Some(place) => decode_exact_in_place(rank, bytes, self.max_depth, place),
                None => decode_exact(rank, bytes, self.max_depth).map(|v| out.push(v)),
            };
            if let Err(e) = decoded {
                out.clear();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Decodes the value of one rank.
    pub fn decode_rank<'a, T: Deserialize<'a>>(&'a self, rank: usize) -> Result<T> {
        let bytes = self.bytes(rank).ok_or_else(|| {
            ObjectError::InvalidArgument(format!("no rank {rank} in {} views", self.len()))
        })?;
        decode_exact(rank, bytes, self.max_depth)
    }
}

/// The receive buffer goes back to the dropping thread's kept buffers (`buffers.rs`), for
/// its next collective.
impl Drop for Gathered {
    fn drop(&mut self) {
        Kept::Recv.give_back(std::mem::take(&mut self.buf));
    }
}

/// Decodes exactly one `T` from `bytes` (from `rank`), rejecting trailing bytes and nesting
/// deeper than `max_depth` containers (see `depth.rs`).
pub(crate) fn decode_exact<'a, T: Deserialize<'a>>(
    rank: usize,
    bytes: &'a [u8],
    max_depth: usize,
) -> Result<T> {
    decode_with(rank, bytes, max_depth, None, |de| T::deserialize(de))
}

/// [`decode_exact`], and when `sent` is the writer's [`Shape`], the value's shape as `T`
/// decodes it must be that one ([`DecodeError::ShapeMismatch`] otherwise).
pub(crate) fn decode_exact_shaped<'a, T: Deserialize<'a>>(
    rank: usize,
    bytes: &'a [u8],
    max_depth: usize,
    sent: Option<Shape>,
) -> Result<T> {
    decode_with(rank, bytes, max_depth, sent, |de| T::deserialize(de))
}

/// [`decode_exact`] over `place` (`Deserialize::deserialize_in_place`): on success `place`
/// holds the decoded value; on failure it holds some valid `T` the caller must not use as
/// the result.
pub(crate) fn decode_exact_in_place<'a, T: Deserialize<'a>>(
    rank: usize,
    bytes: &'a [u8],
    max_depth: usize,
    place: &mut T,
) -> Result<()> {
    decode_with(rank, bytes, max_depth, None, |de| {
        T::deserialize_in_place(de, place)
    })
}

/// The checks around one decode of `bytes` (from `rank`) by `decode`: the depth budget,
/// then exactly the bytes consumed, then the shape when `sent` gives the writer's. Where a
/// deep value runs the thread's stack short, `decode` runs again from the first byte on a
/// fresh stack segment ([`Job::again`]).
#[inline]
fn decode_with<'a, R>(
    rank: usize,
    bytes: &'a [u8],
    max_depth: usize,
    sent: Option<Shape>,
    mut decode: impl FnMut(Input<'_, 'a>) -> postcard::Result<R>,
) -> Result<R> {
    let job = Job {
        rank,
        bytes,
        max_depth,
        sent,
    };
    let mut short = None;
    let decoded = job.once(&mut decode, &mut short);
    match short {
        None => decoded,
        Some(first) => job.again(decode, first, decoded),
    }
}

/// What a decode reads: postcard's deserializer of the bytes, bounded.
type Input<'b, 'a> =
    Bounded<'b, &'b mut postcard::Deserializer<'a, postcard::de_flavors::Slice<'a>>, true>;

/// The bytes of one [`decode_with`] and what their decode is checked against.
#[derive(Clone, Copy)]
struct Job<'a> {
    rank: usize,
    bytes: &'a [u8],
    max_depth: usize,
    sent: Option<Shape>,
}

impl<'a> Job<'a> {
    /// One decode, from the first byte, with `short` set to where the stack ran short if it
    /// did (whatever the outcome). Inlined at both its calls, so that the usual one is
    /// [`decode_with`]'s own code.
    #[inline(always)]
    fn once<R>(
        self,
        decode: &mut impl FnMut(Input<'_, 'a>) -> postcard::Result<R>,
        short: &mut Option<stack::Shortage>,
    ) -> Result<R> {
        let Job {
            rank,
            bytes,
            max_depth,
            sent,
        } = self;
        let budget = match sent {
            Some(_) => Budget::recording(max_depth, bytes.len()),
            None => Budget::new(max_depth, bytes.len()),
        };
        let mut de = postcard::Deserializer::from_bytes(bytes);
        let decoded = decode(Bounded {
            inner: &mut de,
            budget: &budget,
        });
        *short = budget.shortage();
        let source = match decoded {
            Ok(value) => match de.finalize() {
                Ok([]) => match sent {
                    Some(sent) if sent != budget.shape.shape() => DecodeError::ShapeMismatch {
                        sent: sent.bits(),
                        found: budget.shape.shape().bits(),
                    },
                    _ => return Ok(value),
                },
                Ok(rest) => DecodeError::TrailingBytes(rest.len()),
                Err(e) => DecodeError::Postcard(e),
            },
            Err(_) if budget.exceeded() => DecodeError::TooDeep { limit: max_depth },
            Err(e) => DecodeError::Postcard(e),
        };
        Err(ObjectError::Decode { rank, source })
    }

    /// The decode of a value that ran the stack short at `first` (`decoded`, the first
    /// attempt, is dropped), again on fresh segments: out of line and cold, so that
    /// [`decode_with`] is hardly larger than the decode itself and inlines into its caller as
    /// it does.
    #[cold]
    #[inline(never)]
    fn again<R>(
        self,
        mut decode: impl FnMut(Input<'_, 'a>) -> postcard::Result<R>,
        first: stack::Shortage,
        decoded: Result<R>,
    ) -> Result<R> {
        drop(decoded);
        let mut held = None;
        let last = stack::again(self.max_depth, first, &mut || {
            let mut short = None;
            let decoded = self.once(&mut decode, &mut short);
            if short.is_none() {
                held = Some(decoded);
            }
            short
        });
        held.unwrap_or_else(|| {
            Err(ObjectError::Decode {
                rank: self.rank,
                source: DecodeError::StackShort {
                    level: last.unwrap_or(first).level,
                },
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::*;

    /// About 2 KiB of fields a level (about 10 KiB of a debug build's stack to decode).
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Wide {
        fields: [[u64; 32]; 8],
        next: Option<Box<Wide>>,
    }

    /// `links` links; each is a struct and an option: two levels of nesting, and its
    /// arrays of arrays one more below the option's.
    fn chain(links: usize) -> Wide {
        (0..links as u64)
            .fold(None, |next, i| {
                Some(Box::new(Wide {
                    fields: [[i; 32]; 8],
                    next,
                }))
            })
            .map(|w| *w)
            .expect("at least one link")
    }

    /// Decodes `links` links of [`Wide`] with a depth limit of 512 on a thread of `stack`
    /// bytes: the value, and how many times the decode ran.
    fn decode_on(stack: usize, links: usize) -> (Result<Wide>, usize) {
        let bytes = postcard::to_allocvec(&chain(links)).unwrap();
        std::thread::Builder::new()
            .stack_size(stack)
            .spawn(move || {
                let mut runs = 0;
                let decoded = decode_with(0, &bytes, 512, None, |de| {
                    runs += 1;
                    Wide::deserialize(de)
                });
                (decoded, runs)
            })
            .unwrap()
            .join()
            .unwrap()
    }

    #[test]
    fn a_value_the_thread_s_stack_holds_decodes_once() {
        let (decoded, runs) = decode_on(2 << 20, 8);
        assert!(decoded.unwrap() == chain(8));
        assert_eq!(runs, 1);
    }

    #[test]
    fn a_value_deeper_than_a_small_stack_holds_decodes_again_on_a_segment_sized_for_it() {
        // 255 links: 511 of the 512 levels the limit allows (the innermost arrays), on a
        // 256 KiB stack, short at level 8.
        let (decoded, runs) = decode_on(256 << 10, 255);
        assert!(decoded.unwrap() == chain(255), "the value decodes whole");
        assert_eq!(
            runs, 2,
            "once on the thread's stack, once on the measured segment"
        );
    }
}
