//! Peer-memory backends. The `unsafe` code of this crate lives here only.

pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
