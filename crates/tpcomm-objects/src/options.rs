//! Options shared by every object collective, their valid ranges, and their wire form.
//!
//! Every option shapes what the ranks do together (the header's inline path, the round
//! schedule, the cap decision) or how a value is decoded, so every rank must pass equal
//! options. That is checked, not assumed: each rank's options travel in the header exchange
//! that every collective already makes (a fixed 24-byte field per rank, see [`WireOptions`]),
//! and every rank compares them all before deciding anything, so a difference is
//! [`ObjectError::OptionsMismatch`] on every rank, and a rank whose options are out of range
//! tells its peers so in the same field ([`ObjectError::PeerInvalidOptions`]).

use crate::error::ObjectError;

/// Tuning and safety limits of an object collective.
///
/// All ranks must pass equal options; a difference is detected in the header exchange and
/// returned as [`ObjectError::OptionsMismatch`] by every rank. Each field documents its valid
/// range: an option out of range is [`ObjectError::InvalidArgument`] on the rank that passed it
/// (its peers get [`ObjectError::PeerInvalidOptions`]); nothing sized by the options is
/// allocated or sent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Largest total number of bytes a rank accepts to receive (the sum of the announced
    /// lengths it would allocate). Checked before allocating; default 8 GiB.
    ///
    /// Valid range: `0..=isize::MAX` (0 accepts only empty values).
    pub max_total_bytes: usize,
    /// Largest number of bytes moved by one transport call in the payload path; the
    /// effective limit is the smaller of this and the communicator's `max_count`.
    /// `None` (the default) means [`Options::DEFAULT_ROUND_BYTES`] (64 MiB).
    ///
    /// The round size also bounds what a transport that stages buffers holds on top of the
    /// final receive buffer (the MPI transport with a timeout copies each call's buffers):
    /// the peak is about the announced bytes plus one round, never twice the announced bytes.
    ///
    /// Valid range: `None` or `Some(1..=isize::MAX)` (a round of 0 bytes moves nothing).
    pub round_bytes: Option<usize>,
    /// Size of the inline slot carried by the length exchange (default and maximum 224, so
    /// that a rank's header entry — the 8-byte length, the 24-byte options field and the
    /// slot — is exactly 256 bytes, the largest message Open MPI's shared-memory path sends
    /// inline). When every rank's value fits, the whole collective is one transport call;
    /// 0 disables the small path. The entry is 256 bytes whatever this value, so that ranks
    /// always agree on the size of the first exchange.
    ///
    /// Valid range: `0..=Options::MAX_SMALL_SLOT_BYTES` (224).
    pub small_slot_bytes: usize,
    /// Deepest nesting accepted when decoding a peer's bytes, counted in containers: every
    /// `Option`, sequence, tuple, map, struct, enum and newtype struct entered takes one level
    /// (so an enum node holding a `Vec` of nodes takes two per node). Deeper bytes are
    /// [`ObjectError::Decode`] with [`DecodeError::TooDeep`](crate::DecodeError::TooDeep),
    /// naming the sender, instead of a stack overflow. Default 256.
    ///
    /// Valid range: `1..=Options::MAX_DEPTH` (512). Decoding takes stack per level: about
    /// 1.2 KiB in a debug build for a small recursive enum (less optimized), so the maximum
    /// stays within a third of a 2 MiB thread stack; a type with large fields per level takes
    /// more, and the default leaves room for that.
    pub max_depth: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_total_bytes: 8 << 30,
            round_bytes: None,
            small_slot_bytes: Self::MAX_SMALL_SLOT_BYTES,
            max_depth: Self::DEFAULT_MAX_DEPTH,
        }
    }
}

impl Options {
    /// The largest (and default) `small_slot_bytes`.
    pub const MAX_SMALL_SLOT_BYTES: usize = 224;
    /// The round size used when `round_bytes` is `None`: 64 MiB.
    pub const DEFAULT_ROUND_BYTES: usize = 64 << 20;
    /// The default `max_depth`.
    pub const DEFAULT_MAX_DEPTH: usize = 256;
    /// The largest `max_depth`.
    pub const MAX_DEPTH: usize = 512;

    /// Checks every field against its documented range; the error says which field and why.
    pub fn validate(&self) -> Result<(), ObjectError> {
        let invalid = |msg: String| Err(ObjectError::InvalidArgument(msg));
        if self.max_total_bytes > isize::MAX as usize {
            return invalid(format!(
                "Options::max_total_bytes = {} is over isize::MAX",
                self.max_total_bytes
            ));
        }
        match self.round_bytes {
            Some(0) => {
                return invalid(
                    "Options::round_bytes = Some(0): a round must move at least one byte".into(),
                )
            }
            Some(r) if r > isize::MAX as usize => {
                return invalid(format!(
                    "Options::round_bytes = Some({r}) is over isize::MAX"
                ))
            }
            _ => {}
        }
        if self.small_slot_bytes > Self::MAX_SMALL_SLOT_BYTES {
            return invalid(format!(
                "Options::small_slot_bytes = {} is over the maximum of {}",
                self.small_slot_bytes,
                Self::MAX_SMALL_SLOT_BYTES
            ));
        }
        if !(1..=Self::MAX_DEPTH).contains(&self.max_depth) {
            return invalid(format!(
                "Options::max_depth = {} is outside 1..={}",
                self.max_depth,
                Self::MAX_DEPTH
            ));
        }
        Ok(())
    }

    /// The bytes one transport call may move, given the communicator's `max_count`.
    pub(crate) fn round_limit(&self, max_count: usize) -> usize {
        self.round_bytes
            .unwrap_or(Self::DEFAULT_ROUND_BYTES)
            .min(max_count)
            .max(1)
    }
}

/// Width of the options field of a header entry.
pub(crate) const FIELD: usize = 24;
/// Marks a field of this protocol's version from a rank with valid options.
const MAGIC_VALID: [u8; 4] = *b"TPO1";
/// Marks a field from a rank whose options are out of range.
const MAGIC_INVALID: [u8; 4] = *b"TPO!";

/// The options as they travel in the header: `[magic: 4][small_slot_bytes: u16]
/// [max_depth: u16][round_bytes: u64, 0 for None][max_total_bytes: u64]`, little-endian.
/// Every field of a valid [`Options`] fits exactly (the ranges are checked first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireOptions {
    /// A rank with valid options.
    Valid {
        small_slot_bytes: u16,
        max_depth: u16,
        round_bytes: u64,
        max_total_bytes: u64,
    },
    /// A rank whose options are out of range.
    Invalid,
    /// Bytes that are neither: another protocol version, or damage.
    Unknown,
}

impl WireOptions {
    /// Encodes `opts`, or the invalid marker when they failed validation.
    pub(crate) fn encode(opts: &Options, valid: bool) -> [u8; FIELD] {
        let mut out = [0u8; FIELD];
        if !valid {
            out[..4].copy_from_slice(&MAGIC_INVALID);
            return out;
        }
        let narrow16 = |v: usize| u16::try_from(v).unwrap_or(u16::MAX);
        let wide = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        out[..4].copy_from_slice(&MAGIC_VALID);
        out[4..6].copy_from_slice(&narrow16(opts.small_slot_bytes).to_le_bytes());
        out[6..8].copy_from_slice(&narrow16(opts.max_depth).to_le_bytes());
        out[8..16].copy_from_slice(&wide(opts.round_bytes.unwrap_or(0)).to_le_bytes());
        out[16..24].copy_from_slice(&wide(opts.max_total_bytes).to_le_bytes());
        out
    }

    pub(crate) fn decode(field: &[u8]) -> Self {
        let u16_at = |i: usize| u16::from_le_bytes([field[i], field[i + 1]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&field[i..i + 8]);
            u64::from_le_bytes(w)
        };
        match &field[..4] {
            m if m == MAGIC_VALID => WireOptions::Valid {
                small_slot_bytes: u16_at(4),
                max_depth: u16_at(6),
                round_bytes: u64_at(8),
                max_total_bytes: u64_at(16),
            },
            m if m == MAGIC_INVALID => WireOptions::Invalid,
            _ => WireOptions::Unknown,
        }
    }

    /// The name of the first option in which `self` and `other` (both valid) differ.
    fn first_difference(&self, other: &Self) -> Option<&'static str> {
        match (self, other) {
            (
                WireOptions::Valid {
                    small_slot_bytes: s1,
                    max_depth: d1,
                    round_bytes: r1,
                    max_total_bytes: c1,
                },
                WireOptions::Valid {
                    small_slot_bytes: s2,
                    max_depth: d2,
                    round_bytes: r2,
                    max_total_bytes: c2,
                },
            ) => [
                (s1 != s2, "small_slot_bytes"),
                (r1 != r2, "round_bytes"),
                (c1 != c2, "max_total_bytes"),
                (d1 != d2, "max_depth"),
            ]
            .into_iter()
            .find_map(|(differ, name)| differ.then_some(name)),
            (a, b) if a == b => None,
            _ => Some("protocol"),
        }
    }
}

/// This rank's options, validated: the field it sends, and its own error when they are
/// invalid (returned after it has joined the header exchange, so that no peer is left
/// waiting).
pub(crate) struct Checked {
    pub(crate) field: [u8; FIELD],
    pub(crate) invalid: Option<ObjectError>,
}

impl Checked {
    pub(crate) fn new(opts: &Options) -> Self {
        let invalid = opts.validate().err();
        Self {
            field: WireOptions::encode(opts, invalid.is_none()),
            invalid,
        }
    }

    /// The decision every rank takes from every rank's field (`fields(r)` is rank `r`'s, for
    /// `r` in `0..size`): this rank's own `InvalidArgument` when its options are invalid,
    /// else the ranks with invalid options, else the ranks whose options differ from rank 0's.
    /// Every rank with valid options reads the same fields and returns the same error.
    pub(crate) fn agree<'h>(
        self,
        size: usize,
        fields: impl Fn(usize) -> &'h [u8],
    ) -> Result<(), ObjectError> {
        if let Some(own) = self.invalid {
            return Err(own);
        }
        // The usual case, without allocating: every field equals this rank's.
        if (0..size).all(|r| fields(r) == self.field) {
            return Ok(());
        }
        let wire: Vec<WireOptions> = (0..size).map(|r| WireOptions::decode(fields(r))).collect();
        let invalid: Vec<usize> = (0..size)
            .filter(|&r| wire[r] == WireOptions::Invalid)
            .collect();
        if !invalid.is_empty() {
            return Err(ObjectError::PeerInvalidOptions { ranks: invalid });
        }
        let reference = wire[0];
        let Some(option) = wire.iter().find_map(|w| reference.first_difference(w)) else {
            return Ok(());
        };
        let ranks = (1..size)
            .filter(|&r| reference.first_difference(&wire[r]) == Some(option))
            .collect();
        Err(ObjectError::OptionsMismatch {
            option,
            reference: 0,
            ranks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_round_trips_every_valid_field() {
        let opts = Options {
            max_total_bytes: 12345,
            round_bytes: Some(777),
            small_slot_bytes: 17,
            max_depth: 500,
        };
        assert_eq!(
            WireOptions::decode(&WireOptions::encode(&opts, true)),
            WireOptions::Valid {
                small_slot_bytes: 17,
                max_depth: 500,
                round_bytes: 777,
                max_total_bytes: 12345
            }
        );
        assert_eq!(
            WireOptions::decode(&WireOptions::encode(&opts, false)),
            WireOptions::Invalid
        );
        assert_eq!(WireOptions::decode(&[0u8; FIELD]), WireOptions::Unknown);
    }

    #[test]
    fn the_default_is_valid_and_each_range_end_is_checked() {
        assert!(Options::default().validate().is_ok());
        let bad = [
            Options {
                round_bytes: Some(0),
                ..Options::default()
            },
            Options {
                small_slot_bytes: Options::MAX_SMALL_SLOT_BYTES + 1,
                ..Options::default()
            },
            Options {
                max_depth: 0,
                ..Options::default()
            },
            Options {
                max_depth: Options::MAX_DEPTH + 1,
                ..Options::default()
            },
            Options {
                max_total_bytes: usize::MAX,
                ..Options::default()
            },
        ];
        for o in bad {
            assert!(
                matches!(o.validate(), Err(ObjectError::InvalidArgument(_))),
                "{o:?}"
            );
        }
        let edges = Options {
            round_bytes: Some(1),
            small_slot_bytes: 0,
            max_depth: Options::MAX_DEPTH,
            max_total_bytes: 0,
        };
        assert!(edges.validate().is_ok());
    }
}
