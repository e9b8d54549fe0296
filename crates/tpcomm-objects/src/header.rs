//! The length exchange: a fixed-width 64-bit length per rank, the rank's options, and an
//! inline slot.
//!
//! Each rank contributes one [`ENTRY`]-byte entry: its length as a little-endian `u64` (or a
//! sentinel), its options field (`options::FIELD` bytes, see `WireOptions`: the options and
//! the root), then its value's bytes when they fit `small_slot_bytes`. The entry size is a
//! constant of the protocol, not an option, so ranks whose options or roots differ still
//! exchange equal sizes and find the difference in the options fields. The header is moved
//! by one fixed-size transport call (in chunks only when it exceeds `max_count`, which no
//! real MPI does). Lengths are never serialized.

use crate::error::{ObjectError, Result};
use crate::options::{Options, FIELD};

/// Width of a length word.
pub(crate) const WORD: usize = 8;
/// Where the inline slot starts in an entry.
pub(crate) const SLOT_AT: usize = WORD + FIELD;
/// Size of one rank's header entry: 256 bytes, the largest message Open MPI's
/// shared-memory path sends inline.
pub(crate) const ENTRY: usize = SLOT_AT + Options::MAX_SMALL_SLOT_BYTES;
/// The rank failed to serialize its value.
const FAILED: u64 = u64::MAX;
/// The rank had no valid value to send (a root without input).
const MISSING: u64 = u64::MAX - 1;

/// What a rank announces in its length word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Announce {
    /// A serialized value of this many bytes.
    Len(u64),
    /// Serialization failed.
    Failed,
    /// No valid input.
    Missing,
}

impl Announce {
    pub(crate) fn word(self) -> [u8; WORD] {
        match self {
            Announce::Len(n) => n.min(MISSING - 1).to_le_bytes(),
            Announce::Failed => FAILED.to_le_bytes(),
            Announce::Missing => MISSING.to_le_bytes(),
        }
    }

    pub(crate) fn parse(word: [u8; WORD]) -> Self {
        match u64::from_le_bytes(word) {
            FAILED => Announce::Failed,
            MISSING => Announce::Missing,
            n => Announce::Len(n),
        }
    }
}

/// Writes one header entry (`word`, this rank's options `field`, inline bytes when they fit
/// `slot`) into `out`, which is at least [`ENTRY`] bytes long.
pub(crate) fn write_entry(
    out: &mut [u8],
    announce: Announce,
    field: &[u8; FIELD],
    payload: Option<&[u8]>,
    slot: usize,
) {
    out[..WORD].copy_from_slice(&announce.word());
    out[WORD..SLOT_AT].copy_from_slice(field);
    if let Some(p) = payload {
        if p.len() <= slot {
            out[SLOT_AT..SLOT_AT + p.len()].copy_from_slice(p);
        }
    }
}

/// Reads the word at byte `at` of a header buffer.
pub(crate) fn read_word(buf: &[u8], at: usize) -> Announce {
    let mut w = [0u8; WORD];
    w.copy_from_slice(&buf[at..at + WORD]);
    Announce::parse(w)
}

/// Reads the announcement of entry `i` of a header buffer made of [`ENTRY`]-byte entries.
pub(crate) fn read_entry(buf: &[u8], i: usize) -> Announce {
    read_word(buf, i * ENTRY)
}

/// The options field of entry `i` of a header buffer made of [`ENTRY`]-byte entries.
pub(crate) fn entry_field(buf: &[u8], i: usize) -> &[u8] {
    &buf[i * ENTRY + WORD..i * ENTRY + SLOT_AT]
}

/// The inline bytes of entry `i` (`len` must be at most the slot).
pub(crate) fn entry_inline(buf: &[u8], i: usize, len: usize) -> &[u8] {
    &buf[i * ENTRY + SLOT_AT..i * ENTRY + SLOT_AT + len]
}

/// Turns the announcements into lengths, or the error every rank returns: the ranks that
/// failed to serialize, else the first rank without input, else a length that does not fit
/// `usize`.
///
/// `announced[i]` came from rank `owners(i)` (the identity for one entry per rank; the root
/// for every entry of a rooted header). `own_cause` is this rank's serialization error,
/// when it failed.
pub(crate) fn agree(
    announced: &[Announce],
    owners: impl Fn(usize) -> usize,
    cap: usize,
    own_cause: Option<postcard::Error>,
) -> Result<Vec<usize>> {
    let mut failed: Vec<usize> = (0..announced.len())
        .filter(|&i| announced[i] == Announce::Failed)
        .map(&owners)
        .collect();
    failed.dedup();
    if !failed.is_empty() {
        return Err(ObjectError::PeerSerialization {
            ranks: failed,
            source: own_cause,
        });
    }
    if let Some(i) = announced.iter().position(|a| *a == Announce::Missing) {
        return Err(ObjectError::MissingInput { rank: owners(i) });
    }
    announced
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let Announce::Len(n) = *a else {
                unreachable!("sentinels handled above")
            };
            usize::try_from(n).map_err(|_| ObjectError::TooLarge {
                announced: u128::from(n),
                cap,
                rank: owners(i),
            })
        })
        .collect()
}

/// [`agree`] over `n` announcements read by `word(i)` (from the header in place): the usual
/// case, every announcement a length, allocates only the lengths; any other goes through
/// [`agree`] for its error.
pub(crate) fn agree_words(
    n: usize,
    word: impl Fn(usize) -> Announce,
    owners: impl Fn(usize) -> usize,
    cap: usize,
    own_cause: Option<postcard::Error>,
) -> Result<Vec<usize>> {
    let mut lens = Vec::with_capacity(n);
    for i in 0..n {
        match word(i) {
            Announce::Len(len) => match usize::try_from(len) {
                Ok(len) => lens.push(len),
                Err(_) => break,
            },
            Announce::Failed | Announce::Missing => break,
        }
    }
    if lens.len() == n {
        return Ok(lens);
    }
    let announced: Vec<Announce> = (0..n).map(word).collect();
    agree(&announced, owners, cap, own_cause)
}

/// Checks that the bytes one rank would receive, `lens` (entry `i` from rank `owners(i)`),
/// sum to at most `cap` without overflowing; returns the sum.
pub(crate) fn within_cap(
    lens: impl IntoIterator<Item = usize>,
    owners: impl Fn(usize) -> usize,
    cap: usize,
) -> Result<usize> {
    let mut total: u128 = 0;
    for (i, n) in lens.into_iter().enumerate() {
        // A usize always fits u128, and fewer than 2^64 lengths cannot overflow it.
        total += n as u128;
        if total > cap as u128 {
            return Err(ObjectError::TooLarge {
                announced: total,
                cap,
                rank: owners(i),
            });
        }
    }
    Ok(usize::try_from(total).expect("at most cap, a usize"))
}

/// Allocates a zeroed buffer of `bytes` without aborting on failure.
pub(crate) fn alloc(bytes: usize) -> Result<Vec<u8>> {
    let mut v = reserve(bytes)?;
    v.resize(bytes, 0);
    Ok(v)
}

/// Reserves an empty buffer of capacity `bytes` without aborting on failure; the payload
/// path then grows it one round at a time (`Vec::resize` within the capacity), so that only
/// the rounds that arrived are ever written.
pub(crate) fn reserve(bytes: usize) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes)
        .map_err(|_| ObjectError::Allocation { bytes })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_including_sentinels_and_zero() {
        for a in [
            Announce::Len(0),
            Announce::Len(1),
            Announce::Len(1 << 40),
            Announce::Failed,
            Announce::Missing,
        ] {
            assert_eq!(Announce::parse(a.word()), a);
        }
    }

    #[test]
    fn zero_is_a_valid_length() {
        let lens = agree(&[Announce::Len(0), Announce::Len(0)], |i| i, 10, None).unwrap();
        assert_eq!(lens, vec![0, 0]);
        assert_eq!(within_cap(lens, |i| i, 0).unwrap(), 0);
    }

    /// `agree_words` decides as `agree` does, whatever the announcements.
    #[test]
    fn agreeing_in_place_gives_agrees_lengths_and_errors() {
        let kinds = [
            Announce::Len(0),
            Announce::Len(7),
            Announce::Len(u64::MAX - 2),
            Announce::Failed,
            Announce::Missing,
        ];
        for a in kinds {
            for b in kinds {
                for c in kinds {
                    let announced = [a, b, c];
                    let want = agree(&announced, |i| i, 10, None);
                    let got = agree_words(3, |i| announced[i], |i| i, 10, None);
                    assert_eq!(format!("{got:?}"), format!("{want:?}"), "{announced:?}");
                }
            }
        }
    }

    #[test]
    fn every_failing_rank_is_named() {
        let announced = [Announce::Failed, Announce::Len(3), Announce::Failed];
        let e = agree(&announced, |i| i, 10, None).unwrap_err();
        assert!(matches!(e, ObjectError::PeerSerialization { ranks, .. } if ranks == vec![0, 2]));
    }

    #[test]
    fn failures_outrank_missing_input() {
        let announced = [Announce::Missing, Announce::Failed];
        let e = agree(&announced, |i| i, 10, None).unwrap_err();
        assert!(matches!(e, ObjectError::PeerSerialization { ranks, .. } if ranks == vec![1]));
    }

    #[test]
    fn a_sum_over_the_cap_names_the_rank_that_crossed_it() {
        let e = within_cap([6, 5], |i| i, 10).unwrap_err();
        assert!(matches!(
            e,
            ObjectError::TooLarge {
                rank: 1,
                cap: 10,
                ..
            }
        ));
    }

    #[test]
    fn an_overflowing_sum_is_rejected() {
        let e = within_cap([usize::MAX - 2, usize::MAX - 2], |i| i, usize::MAX).unwrap_err();
        assert!(matches!(e, ObjectError::TooLarge { rank: 1, .. }), "{e}");
    }

    #[test]
    fn the_announced_total_is_the_running_sum_that_crossed_the_cap() {
        let e = within_cap([usize::MAX, usize::MAX, 3], |i| i + 10, usize::MAX).unwrap_err();
        match e {
            ObjectError::TooLarge {
                announced,
                cap,
                rank,
            } => {
                assert_eq!(announced, 2 * u128::from(u64::MAX));
                assert_eq!(cap, usize::MAX);
                assert_eq!(rank, 11);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
}
