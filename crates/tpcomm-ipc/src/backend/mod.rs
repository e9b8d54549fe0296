//! Peer-memory backends. The `unsafe` code of this crate lives here only.

pub mod host;
