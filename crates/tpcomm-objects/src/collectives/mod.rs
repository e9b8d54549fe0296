//! The collectives. Every public function here is a thin typed layer over one of four byte
//! protocols: rank-ordered gathering (`gather_bytes`), rooted broadcast, rooted scatter and
//! all-to-all, each a header exchange followed (when needed) by the payload in rounds.
//!
//! The header exchange is always an all-gather whose size depends on nothing a rank chose
//! (not the options, not the root), so every rank joins it whatever it was passed. It carries
//! each rank's options and root (`options.rs`), and nothing chosen by the root (the root's
//! entry, a rooted payload call) is touched before every rank has agreed on both.
//!
//! One file per mechanism: `engine.rs` (the header exchange, the payload rounds, the agreed
//! reservation), `codec.rs` (encoding into the kept send buffer; `encode_append`,
//! `decode_from`), then one file per family: `gather.rs` (gather, all-gather),
//! `broadcast.rs`, `scatter.rs`, `all_to_all.rs`, `folds.rs` (all-reduce, reduce, the
//! scans) and `into.rs` (the variants that decode over the last call's values).

mod all_to_all;
mod broadcast;
mod codec;
mod engine;
mod folds;
mod gather;
mod into;
mod scatter;
#[cfg(test)]
mod tests;

pub use all_to_all::{all_to_all, all_to_all_with};
pub use broadcast::{broadcast, broadcast_with};
pub(crate) use codec::append_flavor;
pub use codec::{decode_from, decode_from_with, decode_shaped, encode_append};
pub use engine::AGREED_RESERVE_BYTES;
pub use folds::{
    all_reduce_with, all_reduce_with_options, exscan_with, exscan_with_options, reduce_with,
    reduce_with_options, scan_with, scan_with_options,
};
pub use gather::{
    all_gather, all_gather_borrowed, all_gather_borrowed_with, all_gather_bytes,
    all_gather_bytes_with, all_gather_with, gather, gather_with,
};
pub use into::{
    all_gather_into, all_gather_into_with, broadcast_into, broadcast_into_with, gather_into,
    gather_into_with,
};
pub use scatter::{scatter, scatter_with};
