//! Hands memory and streams made through this program's own cudarc to tpcomm's public API.
//! It only has to compile (and hold one cudarc): the point is that tpcomm's GPU features
//! coexist with this program's cudarc configuration (see its Cargo.toml). The functions are
//! the same in every downstream program.

include!("../../api.rs");
