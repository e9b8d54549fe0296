//! The real driver and NVML, loaded at run time. `unsafe` code of this crate lives here only.

pub mod cuda;
pub mod nvml;
