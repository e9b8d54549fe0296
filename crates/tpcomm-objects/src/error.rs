//! The error type of object collectives.

use tpcomm_transport::TransportError;

/// Why a peer's bytes could not be turned into a value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// postcard rejected the bytes.
    #[error("postcard rejected the bytes")]
    Postcard(#[from] postcard::Error),
    /// The value decoded but bytes were left over: the bytes are not one value of this type.
    #[error("{0} bytes left over after the value")]
    TrailingBytes(usize),
    /// The bytes decode as the requested type, but the writer's value had another
    /// [`Shape`](crate::Shape): it was a value of another type.
    #[error("the value was sent with shape {sent:#018x}; the requested type decodes with shape {found:#018x}")]
    ShapeMismatch {
        /// The writer's shape.
        sent: u64,
        /// The shape of the requested type's decode.
        found: u64,
    },
    /// The bytes nest containers deeper than [`Options::max_depth`](crate::Options::max_depth)
    /// allows: decoding stopped there instead of recursing further (a stack overflow).
    #[error("the value nests deeper than {limit} levels (Options::max_depth)")]
    TooDeep {
        /// The limit in force.
        limit: usize,
    },
    /// The value nests within the limit, but its levels take more stack than the decoder
    /// keeps safe: even on the largest fresh segment a decode runs again on (32 KiB a level
    /// for every level the limit allows, and 256 KiB), less than 256 KiB of it was left at
    /// level `level`. Decoding stopped there instead of overflowing the stack.
    #[error("the value nests deeper than the decoder's stack holds (at level {level})")]
    StackShort {
        /// The level reached.
        level: usize,
    },
}

/// Every failure of an object collective.
///
/// Errors decided from exchanged data (`PeerSerialization`, `MissingInput`, `TooLarge`,
/// `PeerInvalidOptions`, `OptionsMismatch`, `RootMismatch`, and `InvalidArgument` for a
/// root out of range) are returned by *every* rank, because every rank decides them from
/// the same exchanged header. `Decode` is local to the rank that decoded the bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectError {
    /// The transport failed (including timeouts naming the ranks that never arrived).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// One or more ranks failed to serialize their value. Every rank returns this error;
    /// on a failing rank, `source` is its own serialization error.
    #[error("ranks {ranks:?} failed to serialize their values")]
    PeerSerialization {
        /// Every rank that failed, ascending.
        ranks: Vec<usize>,
        /// This rank's own cause, when it is one of `ranks`.
        #[source]
        source: Option<postcard::Error>,
    },
    /// A rank did not provide what the collective needs (a root without a value for
    /// `broadcast`, not one value per rank for `scatter` or `all_to_all`). It announced so
    /// in the length exchange, and every rank returns this error.
    #[error("rank {rank} provided no valid input for this collective")]
    MissingInput {
        /// The rank (the root, for rooted collectives).
        rank: usize,
    },
    /// The announced lengths exceed the `max_total_bytes` cap: nothing was allocated. Every
    /// rank returns this error.
    #[error(
        "rank {rank} announced lengths that bring the bytes to receive to {announced}, over \
         the cap of {cap} bytes"
    )]
    TooLarge {
        /// The bytes announced up to and including `rank`'s length: the running total that
        /// crossed the cap (a lower bound of the whole total, which is not summed further).
        /// A `u128`, so that no sum of 64-bit lengths overflows it.
        announced: u128,
        /// The cap in force.
        cap: usize,
        /// The rank whose announced length pushed the total over the cap: the sender in a
        /// gather or all-gather, the root in a broadcast or scatter (which announces every
        /// length).
        rank: usize,
    },
    /// The bytes from `rank` are not a valid value of the requested type.
    #[error("cannot decode the value from rank {rank}")]
    Decode {
        /// The rank the bytes came from.
        rank: usize,
        /// Why.
        #[source]
        source: DecodeError,
    },
    /// The exchanged header disagrees with what this rank sent: bytes were corrupted in
    /// flight (returned by that rank; its peers fail in the transport when it leaves, or
    /// read the lengths it was given as its own on the small path). In a scan, also a
    /// sender whose announced lengths do not fit a scan (bytes for a rank that folds nothing
    /// from it, or different lengths for ranks that fold the same value): decided from the
    /// exchanged header, so every scanning rank returns it before any payload moves.
    #[error("corrupt exchange: {0}")]
    Corrupt(String),
    /// The receive buffer could not be allocated. When the largest receive buffer of the
    /// call is at least [`AGREED_RESERVE_BYTES`](crate::AGREED_RESERVE_BYTES), the ranks
    /// tell each other before any payload moves, and every other rank returns
    /// [`PeerAllocation`](Self::PeerAllocation).
    #[error("cannot allocate {bytes} bytes for the receive buffer")]
    Allocation {
        /// The size requested.
        bytes: usize,
    },
    /// Ranks could not take part in the payload of a call whose largest receive buffer is
    /// at least [`AGREED_RESERVE_BYTES`](crate::AGREED_RESERVE_BYTES): they could not
    /// allocate their receive buffer (their own error is [`Allocation`](Self::Allocation)),
    /// or a broadcast root found its own length lost in the header ([`Corrupt`](Self::Corrupt)).
    /// Nothing was sent. Returned by every other rank.
    #[error("ranks {ranks:?} could not allocate their receive buffers")]
    PeerAllocation {
        /// Every rank that failed, ascending.
        ranks: Vec<usize>,
    },
    /// A caller argument was invalid on this rank (options outside their documented ranges,
    /// a root out of range). For options, the rank still joined the header exchange first,
    /// flagging its options invalid, so that its peers return
    /// [`PeerInvalidOptions`](Self::PeerInvalidOptions) instead of waiting for it. A root is
    /// checked after the header exchange, which carries every rank's root: a root out of
    /// range on every rank is this error on every rank, one that differs between ranks is
    /// [`RootMismatch`](Self::RootMismatch) on every rank.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Some ranks passed options outside their documented ranges (they return
    /// `InvalidArgument` themselves). Every rank with valid options returns this error.
    #[error("ranks {ranks:?} passed invalid options")]
    PeerInvalidOptions {
        /// Every rank whose options are invalid, ascending.
        ranks: Vec<usize>,
    },
    /// Ranks passed different [`Options`](crate::Options) (or speak another version of the
    /// protocol, `option == "protocol"`, or called collectives of different byte protocols
    /// whose headers have the same size, such as `broadcast` against `gather` or `all_to_all`
    /// against `scan_with`, `option == "collective"`): the options travel in the header
    /// exchange and every rank compares them with rank 0's before deciding anything, so every
    /// rank returns this same error and nothing else is sent.
    #[error("ranks {ranks:?} passed a different `{option}` than rank {reference}")]
    OptionsMismatch {
        /// The first option (in field order) that differs.
        option: &'static str,
        /// The rank whose options the others are compared with (rank 0).
        reference: usize,
        /// Every rank whose `option` differs from the reference's, ascending.
        ranks: Vec<usize>,
    },
    /// Ranks passed different roots to a rooted collective (`broadcast`, `gather`,
    /// `scatter`, `reduce_with` and their `_with` / `_into` forms), or some called a rooted
    /// collective while others called one without a root (`all_gather`, `all_to_all`, ...).
    /// Every rank's root travels in the header exchange (inside the options field) that
    /// every collective makes first, whose size does not depend on the root, so every rank
    /// returns this same error and no payload moves.
    #[error("ranks passed different roots (root per rank: {})", roots_text(.roots))]
    RootMismatch {
        /// The root each rank passed, in rank order; `None` for a rank that called a
        /// collective without a root. A root that does not fit the 32-bit field of the
        /// header (never a valid one) reads as `u32::MAX - 1`.
        roots: Vec<Option<usize>>,
    },
}

/// Every rank's root, as [`ObjectError::RootMismatch`] prints it: `0, 1, none`.
fn roots_text(roots: &[Option<usize>]) -> String {
    let text: Vec<String> = roots
        .iter()
        .map(|r| r.map_or_else(|| "none".to_string(), |r| r.to_string()))
        .collect();
    text.join(", ")
}

/// Result of object collectives.
pub type Result<T, E = ObjectError> = std::result::Result<T, E>;
