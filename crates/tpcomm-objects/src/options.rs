//! Options shared by every object collective, their valid ranges, and their wire form.
//!
//! Every option shapes what the ranks do together (the header's inline path, the round
//! schedule, the cap decision) or how a value is decoded, so every rank must pass equal
//! options. That is checked, not assumed: each rank's options travel in the header exchange
//! that every collective already makes (a fixed 24-byte field per rank, see [`WireOptions`]),
//! and every rank compares them all before deciding anything, so a difference is
//! [`ObjectError::OptionsMismatch`] on every rank, and a rank whose options are out of range
//! tells its peers so in the same field ([`ObjectError::PeerInvalidOptions`]).
//!
//! The same field carries the rank's root (or "no root" for a collective without one), for
//! the same reason: ranks that name different roots would otherwise take different paths
//! (each rank that takes itself for the root returns its own value on the small path; the
//! payload call names different roots on different ranks, an erroneous MPI program). The
//! header exchange is an all-gather whose size depends on no root, so every rank receives
//! every rank's root and returns the same [`ObjectError::RootMismatch`] before anything else
//! is read or sent, at no extra transport call.

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
    /// Valid range: `1..=Options::MAX_DEPTH` (512). Decoding takes stack per level (about
    /// 1.2 KiB in a debug build for a small recursive enum, 10 KiB for a struct of 2 KiB of
    /// fields): every 8th level looks at the stack left and goes on on a fresh 4 MiB segment
    /// when less than 256 KiB is, so that any depth allowed is safe on any thread's stack.
    /// [`encode_append_shaped`](crate::encode_append_shaped) keeps the same limit when
    /// encoding.
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
/// Marks a field of this protocol's version (2: with the root) from a rank with valid
/// options, for the gathering protocol ([`Collective::Gather`]); the other protocols take
/// the next values (see [`Collective::magic`]). Version 1 fields began with `TPO1` / `TPO!`:
/// a rank of either version reads the other's field as [`WireOptions::Unknown`], a mismatch
/// of `"protocol"`.
const MAGIC_VALID: u8 = 0xB2;

/// The byte protocol a collective runs, carried in the magic of its options field.
///
/// Collectives of different protocols can exchange headers of the same size and shape
/// (`broadcast` against `gather`: 256-byte entries, the same root; `all_to_all` against
/// `scan_with`: the same blocks, no root), and would then read each other's lengths as
/// their own: some ranks return values while others fail, or the ranks go on to different
/// payload calls (an erroneous MPI program). Ranks whose protocols differ get
/// [`ObjectError::OptionsMismatch`] with `option == "collective"` on every rank. Collectives
/// of one protocol that differ only by their root (`gather` and `all_gather`, `scatter` and
/// `all_to_all`) are told apart by the root ([`ObjectError::RootMismatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    /// `gather_bytes`: all-gather, gather, reduce and all-reduce.
    Gather,
    /// The rooted broadcast.
    Broadcast,
    /// The block exchange with one length per destination: all-to-all and scatter.
    Blocks,
    /// The inclusive scan (blocks with the scan's pattern).
    Scan,
    /// The exclusive scan.
    Exscan,
}

impl Collective {
    const ALL: [Collective; 5] = [
        Collective::Gather,
        Collective::Broadcast,
        Collective::Blocks,
        Collective::Scan,
        Collective::Exscan,
    ];

    /// The magic of a valid field of this protocol: `0xB2` to `0xB6`.
    fn magic(self) -> u8 {
        MAGIC_VALID
            + match self {
                Collective::Gather => 0,
                Collective::Broadcast => 1,
                Collective::Blocks => 2,
                Collective::Scan => 3,
                Collective::Exscan => 4,
            }
    }

    fn of_magic(magic: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.magic() == magic)
    }
}
/// Marks a field from a rank whose options are out of range.
const MAGIC_INVALID: u8 = 0xBF;
/// The root word of a collective without a root (all-gather, all-to-all, the scans).
const NO_ROOT: u32 = u32::MAX;
/// The root word of a root that does not fit below [`NO_ROOT`]: never a valid root (no
/// communicator has 2^32 - 2 ranks; MPI's are below 2^31), refused on every rank.
const UNREPRESENTABLE_ROOT: u32 = u32::MAX - 1;

/// `root` as it travels in the options field.
fn root_word(root: Option<usize>) -> u32 {
    match root {
        None => NO_ROOT,
        Some(r) => u32::try_from(r)
            .unwrap_or(UNREPRESENTABLE_ROOT)
            .min(UNREPRESENTABLE_ROOT),
    }
}

/// A root word as [`ObjectError::RootMismatch`] reports it.
fn root_of_word(word: u32) -> Option<usize> {
    (word != NO_ROOT).then(|| usize::try_from(word).unwrap_or(usize::MAX))
}

/// The options, the root and the protocol as they travel in the header: `[magic: u8]
/// [small_slot_bytes: u8][max_depth: u16][root: u32, u32::MAX for none][round_bytes: u64, 0
/// for None][max_total_bytes: u64]`, little-endian, where the magic names the collective's
/// protocol ([`Collective::magic`]) or marks invalid options. Every field of a valid
/// [`Options`] fits exactly (the ranges are checked first: `small_slot_bytes` is at most
/// 224).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireOptions {
    /// A rank with valid options.
    Valid {
        collective: Collective,
        small_slot_bytes: u8,
        max_depth: u16,
        root: u32,
        round_bytes: u64,
        max_total_bytes: u64,
    },
    /// A rank whose options are out of range.
    Invalid,
    /// Bytes that are neither: another protocol version, or damage.
    Unknown,
}

impl WireOptions {
    /// Encodes `opts`, `root` (`None` for a collective without one) and the protocol, or
    /// the invalid marker when the options failed validation (the root and the protocol do
    /// not matter then: every rank returns an options error).
    pub(crate) fn encode(
        opts: &Options,
        valid: bool,
        root: Option<usize>,
        collective: Collective,
    ) -> [u8; FIELD] {
        let mut out = [0u8; FIELD];
        if !valid {
            out[0] = MAGIC_INVALID;
            return out;
        }
        let narrow8 = |v: usize| u8::try_from(v).unwrap_or(u8::MAX);
        let narrow16 = |v: usize| u16::try_from(v).unwrap_or(u16::MAX);
        let wide = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        out[0] = collective.magic();
        out[1] = narrow8(opts.small_slot_bytes);
        out[2..4].copy_from_slice(&narrow16(opts.max_depth).to_le_bytes());
        out[4..8].copy_from_slice(&root_word(root).to_le_bytes());
        out[8..16].copy_from_slice(&wide(opts.round_bytes.unwrap_or(0)).to_le_bytes());
        out[16..24].copy_from_slice(&wide(opts.max_total_bytes).to_le_bytes());
        out
    }

    pub(crate) fn decode(field: &[u8]) -> Self {
        let u16_at = |i: usize| u16::from_le_bytes([field[i], field[i + 1]]);
        let u32_at =
            |i: usize| u32::from_le_bytes([field[i], field[i + 1], field[i + 2], field[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&field[i..i + 8]);
            u64::from_le_bytes(w)
        };
        if let Some(collective) = Collective::of_magic(field[0]) {
            return WireOptions::Valid {
                collective,
                small_slot_bytes: field[1],
                max_depth: u16_at(2),
                root: u32_at(4),
                round_bytes: u64_at(8),
                max_total_bytes: u64_at(16),
            };
        }
        match field[0] {
            MAGIC_INVALID => WireOptions::Invalid,
            _ => WireOptions::Unknown,
        }
    }

    /// The root word of a valid field.
    fn root(&self) -> Option<u32> {
        match self {
            WireOptions::Valid { root, .. } => Some(*root),
            _ => None,
        }
    }

    /// The protocol of a valid field.
    fn collective(&self) -> Option<Collective> {
        match self {
            WireOptions::Valid { collective, .. } => Some(*collective),
            _ => None,
        }
    }

    /// The name of the first option in which `self` and `other` differ (`"protocol"` when
    /// they are not both valid fields of this version). The roots and the collectives are
    /// not options: they are compared on their own, after the options.
    fn first_difference(&self, other: &Self) -> Option<&'static str> {
        match (self, other) {
            (
                WireOptions::Valid {
                    small_slot_bytes: s1,
                    max_depth: d1,
                    round_bytes: r1,
                    max_total_bytes: c1,
                    root: _,
                    collective: _,
                },
                WireOptions::Valid {
                    small_slot_bytes: s2,
                    max_depth: d2,
                    round_bytes: r2,
                    max_total_bytes: c2,
                    root: _,
                    collective: _,
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

/// This rank's options, validated, and its root: the field it sends, and its own error when
/// the options are invalid (returned after it has joined the header exchange, so that no
/// peer is left waiting).
pub(crate) struct Checked {
    pub(crate) field: [u8; FIELD],
    pub(crate) invalid: Option<ObjectError>,
    root: Option<usize>,
}

impl Checked {
    /// `root` is the root this rank passed to a rooted collective, `None` for a collective
    /// without one. It is not checked against the communicator's size here: a rank whose
    /// root is out of range still joins the header exchange, and every rank decides after it.
    /// `collective` is the byte protocol the caller runs.
    pub(crate) fn new(opts: &Options, root: Option<usize>, collective: Collective) -> Self {
        let invalid = opts.validate().err();
        Self {
            field: WireOptions::encode(opts, invalid.is_none(), root, collective),
            invalid,
            root,
        }
    }

    /// The decision every rank takes from every rank's field (`fields(r)` is rank `r`'s, for
    /// `r` in `0..size`): this rank's own `InvalidArgument` when its options are invalid,
    /// else the ranks with invalid options, else the ranks whose options differ from rank 0's,
    /// else [`ObjectError::RootMismatch`] when the roots differ, else the ranks whose
    /// protocol differs from rank 0's (`OptionsMismatch` of `"collective"`), else
    /// `InvalidArgument` when the root (then the same on every rank) is out of range. Every
    /// rank with valid options reads the same fields and returns the same error; only then
    /// may a collective read an entry chosen by the root.
    pub(crate) fn agree<'h>(
        self,
        size: usize,
        fields: impl Fn(usize) -> &'h [u8],
    ) -> Result<(), ObjectError> {
        if let Some(own) = self.invalid {
            return Err(own);
        }
        // The usual case, without allocating: every field (options and root) equals this
        // rank's.
        if !(0..size).all(|r| fields(r) == self.field) {
            Self::disagreement(size, &fields)?;
            // Every field agrees with every other, but not with this rank's own: the
            // exchange lost what this rank sent (its peers decided on fields it did not
            // send). Going on would act on options or a root nobody agreed to.
            return Err(ObjectError::Corrupt(
                "this rank's options field arrived changed in the header exchange".into(),
            ));
        }
        self.root_in_range(size)
    }

    /// The error for fields that are not all equal: invalid options, then differing options,
    /// then differing roots, then differing protocols (`Ok` for fields that differ in none
    /// of them).
    fn disagreement<'h>(
        size: usize,
        fields: &impl Fn(usize) -> &'h [u8],
    ) -> Result<(), ObjectError> {
        let wire: Vec<WireOptions> = (0..size).map(|r| WireOptions::decode(fields(r))).collect();
        let invalid: Vec<usize> = (0..size)
            .filter(|&r| wire[r] == WireOptions::Invalid)
            .collect();
        if !invalid.is_empty() {
            return Err(ObjectError::PeerInvalidOptions { ranks: invalid });
        }
        let reference = wire[0];
        if let Some(option) = wire.iter().find_map(|w| reference.first_difference(w)) {
            let ranks = (1..size)
                .filter(|&r| reference.first_difference(&wire[r]) == Some(option))
                .collect();
            return Err(ObjectError::OptionsMismatch {
                option,
                reference: 0,
                ranks,
            });
        }
        // Every field is now a valid one of this version, like this rank's.
        let roots: Vec<Option<u32>> = wire.iter().map(WireOptions::root).collect();
        if roots.iter().any(|r| *r != roots[0]) {
            return Err(ObjectError::RootMismatch {
                roots: roots
                    .into_iter()
                    .map(|w| w.and_then(root_of_word))
                    .collect(),
            });
        }
        let collectives: Vec<Option<Collective>> =
            wire.iter().map(WireOptions::collective).collect();
        let ranks: Vec<usize> = (1..size)
            .filter(|&r| collectives[r] != collectives[0])
            .collect();
        if !ranks.is_empty() {
            return Err(ObjectError::OptionsMismatch {
                option: "collective",
                reference: 0,
                ranks,
            });
        }
        Ok(())
    }

    /// The root, agreed by every rank (so that every rank takes the same decision here), is
    /// a rank of the communicator.
    fn root_in_range(&self, size: usize) -> Result<(), ObjectError> {
        match self.root {
            Some(root) if root >= size => Err(ObjectError::InvalidArgument(format!(
                "root {root} is out of range for a communicator of size {size}"
            ))),
            Some(root) if root_word(Some(root)) == UNREPRESENTABLE_ROOT => {
                Err(ObjectError::InvalidArgument(format!(
                    "root {root} does not fit the header's root field (at most {})",
                    UNREPRESENTABLE_ROOT - 1
                )))
            }
            _ => Ok(()),
        }
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
            WireOptions::decode(&WireOptions::encode(
                &opts,
                true,
                Some(3),
                Collective::Gather
            )),
            WireOptions::Valid {
                collective: Collective::Gather,
                small_slot_bytes: 17,
                max_depth: 500,
                root: 3,
                round_bytes: 777,
                max_total_bytes: 12345
            }
        );
        assert_eq!(
            WireOptions::decode(&WireOptions::encode(
                &opts,
                false,
                Some(3),
                Collective::Gather
            )),
            WireOptions::Invalid
        );
        assert_eq!(WireOptions::decode(&[0u8; FIELD]), WireOptions::Unknown);
    }

    /// The extremes of every valid option, with every kind of root, come back exactly.
    #[test]
    fn the_wire_form_holds_every_valid_extreme_and_every_root() {
        let opts = Options {
            max_total_bytes: isize::MAX as usize,
            round_bytes: Some(isize::MAX as usize),
            small_slot_bytes: Options::MAX_SMALL_SLOT_BYTES,
            max_depth: Options::MAX_DEPTH,
        };
        for (root, word) in [
            (None, NO_ROOT),
            (Some(0), 0),
            (Some(1 << 31), 1 << 31),
            (Some(u32::MAX as usize - 2), u32::MAX - 2),
            (Some(u32::MAX as usize - 1), UNREPRESENTABLE_ROOT),
            (Some(usize::MAX), UNREPRESENTABLE_ROOT),
        ] {
            assert_eq!(
                WireOptions::decode(&WireOptions::encode(&opts, true, root, Collective::Gather)),
                WireOptions::Valid {
                    collective: Collective::Gather,
                    small_slot_bytes: 224,
                    max_depth: 512,
                    root: word,
                    round_bytes: isize::MAX as u64,
                    max_total_bytes: isize::MAX as u64,
                },
                "{root:?}"
            );
        }
    }

    /// A field of the first version of the protocol (`TPO1`, no root) is a mismatch of
    /// `"protocol"`, never read as options of this one.
    #[test]
    fn a_field_of_the_first_protocol_version_is_a_protocol_mismatch() {
        let mut v1 = [0u8; FIELD];
        v1[..4].copy_from_slice(b"TPO1");
        assert_eq!(WireOptions::decode(&v1), WireOptions::Unknown);
        let own = Checked::new(&Options::default(), Some(0), Collective::Gather);
        let fields = [v1, own.field];
        let e = own.agree(2, |r| &fields[r][..]).unwrap_err();
        assert!(
            matches!(e, ObjectError::OptionsMismatch { option: "protocol", ref ranks, .. } if ranks == &[1]),
            "{e:?}"
        );
    }

    /// Roots are compared only once the options agree, and name every rank's root.
    #[test]
    fn differing_roots_are_a_root_mismatch_after_the_options() {
        let opts = Options::default();
        let fields: Vec<[u8; FIELD]> = [Some(1), Some(0), None]
            .into_iter()
            .map(|root| WireOptions::encode(&opts, true, root, Collective::Gather))
            .collect();
        let e = Checked::new(&opts, Some(0), Collective::Gather)
            .agree(3, |r| &fields[r][..])
            .unwrap_err();
        assert!(
            matches!(e, ObjectError::RootMismatch { ref roots } if roots == &[Some(1), Some(0), None]),
            "{e:?}"
        );
        let mut other = fields.clone();
        other[2] = WireOptions::encode(
            &Options {
                max_depth: 3,
                ..opts
            },
            true,
            Some(0),
            Collective::Gather,
        );
        let e = Checked::new(&opts, Some(0), Collective::Gather)
            .agree(3, |r| &other[r][..])
            .unwrap_err();
        assert!(
            matches!(
                e,
                ObjectError::OptionsMismatch {
                    option: "max_depth",
                    ..
                }
            ),
            "{e:?}"
        );
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
