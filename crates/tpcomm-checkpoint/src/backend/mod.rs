//! The real driver (loaded at run time) and GPU memory figures read by another process.
//! `unsafe` code of this crate lives here only.

pub mod cuda;
pub mod smi;
