//! # tpcomm-objects
//!
//! Gather / all-gather / broadcast / scatter / all-to-all / all-reduce / reduce / scan /
//! exscan of any `serde` value
//! over any [`Communicator`](tpcomm_transport::Communicator), serialized with postcard: the
//! Rust answer to `torch.distributed.all_gather_object`, mpi4py's pickle collectives and
//! TensorRT-LLM's `safe_allgather`, without executing peer data.
//!
//! ## Protocol (details in `docs/protocol.md`)
//!
//! 1. Every rank serializes its value once.
//! 2. **Length exchange**: one fixed-size all-gather of a 256-byte entry per rank: a 64-bit
//!    little-endian length word (never serialized), the rank's [`Options`] and root (24
//!    bytes), and an inline slot (`small_slot_bytes`, at most 224). A rank that failed to
//!    serialize, or whose options are out of range, still sends its entry, with a sentinel;
//!    a root out of range is sent as it is and refused by every rank. (Scatter and
//!    all-to-all send the same options field and a length word per destination.)
//! 3. **Agreement**: every rank reads the same words, so every rank takes the same decision:
//!    options or roots that differ between ranks ([`ObjectError::OptionsMismatch`],
//!    [`ObjectError::RootMismatch`]), the error naming every failing rank, the cap
//!    violation, or the path.
//! 4. **Small path**: when every value fits its slot, the values already arrived with the
//!    lengths: the whole collective was *one* transport call.
//! 5. **Payload path**: one varcount call when the total fits the transport's `max_count`,
//!    otherwise rounds of at most `max_count` bytes with counts and displacements relative
//!    to each round's window, received straight into the one final buffer.
//! 6. **Decode**: postcard, rejecting trailing bytes, with nesting bounded by
//!    [`Options::max_depth`]; bad bytes are a `Decode { rank }` error, never a panic or a
//!    stack overflow.
//!
//! 7. **Buffers**: each thread keeps its last send and receive buffer (up to 64 MiB each)
//!    for its next collective, so that steady-state collectives allocate only the values
//!    they return; [`release_buffers`] frees them. Values of 2 KiB and more are received 64
//!    bytes further into the receive buffer at each call (modulo 4 KiB), so that the copies of
//!    owned values out of it never stay in a relation that glibc's `memcpy` copies slowly
//!    (`docs/protocol.md`, "A receive window that moves").
//! 8. **Values reused**: [`all_gather_into`], [`gather_into`], [`broadcast_into`] and
//!    [`Gathered::decode_into`] decode over the values of the caller's last call (serde's
//!    `deserialize_in_place`: strings and vectors keep their allocations), so that a loop
//!    gathering per-step state allocates little or nothing once warm (`docs/protocol.md`,
//!    "Decoding into the last call's values").
//!
//! Every collective works on any sub-communicator from `split`, and opens a `tracing` span
//! `object_collective` with the path taken (`small`, `single`, `rounds`), bytes and rounds.

mod buffers;
mod collectives;
mod depth;
mod encode_bound;
mod error;
mod gathered;
mod header;
mod options;
mod rounds;
mod shape;
mod stack;

pub use buffers::release_buffers;
pub use collectives::{
    all_gather, all_gather_borrowed, all_gather_borrowed_with, all_gather_bytes,
    all_gather_bytes_with, all_gather_into, all_gather_into_with, all_gather_with, all_reduce_with,
    all_reduce_with_options, all_to_all, all_to_all_with, broadcast, broadcast_into,
    broadcast_into_with, broadcast_with, decode_from, decode_from_with, decode_shaped,
    encode_append, exscan_with, exscan_with_options, gather, gather_into, gather_into_with,
    gather_with, reduce_with, reduce_with_options, scan_with, scan_with_options, scatter,
    scatter_with, AGREED_RESERVE_BYTES,
};
pub use encode_bound::{encode_append_shaped, encode_shaped_with_flavor, EncodeError};
pub use error::{DecodeError, ObjectError, Result};
pub use gathered::Gathered;
pub use options::Options;
pub use shape::{Shape, SHAPE_CALLS};

/// The round schedule, exposed for the fuzz targets in `fuzz/` only: not part of the API,
/// no stability promise.
#[doc(hidden)]
pub mod fuzzing {
    use std::ops::Range;

    /// One round of a schedule (see `rounds.rs`): the window of the dense layout it fills
    /// and, per rank, the bytes sent, where they land in the window and which of the
    /// rank's own bytes they are.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct ScheduledRound {
        /// The window of the final buffer.
        pub window: Range<usize>,
        /// Bytes per rank.
        pub counts: Vec<usize>,
        /// Displacement per rank, relative to `window.start`.
        pub displs: Vec<usize>,
        /// The part of each rank's own bytes sent.
        pub sources: Vec<Range<usize>>,
    }

    /// Offsets of each rank's bytes in the dense layout (`lens` must sum within `usize`).
    pub fn dense_offsets(lens: &[usize]) -> Vec<usize> {
        crate::rounds::dense_offsets(lens)
    }

    /// Number of rounds for `total` bytes in windows of `limit`.
    pub fn round_count(total: usize, limit: usize) -> usize {
        crate::rounds::round_count(total, limit)
    }

    /// Round `k` of the schedule of `lens` (dense `offsets`) in windows of `limit`.
    pub fn round(lens: &[usize], offsets: &[usize], limit: usize, k: usize) -> ScheduledRound {
        let r = crate::rounds::round(lens, offsets, limit, k);
        ScheduledRound {
            window: r.window,
            counts: r.counts,
            displs: r.displs,
            sources: r.sources,
        }
    }
}
