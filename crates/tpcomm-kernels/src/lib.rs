//! # tpcomm-kernels
//!
//! The custom all-reduce's CUDA kernels (`kernels/allreduce.cu`) as data for a launcher:
//!
//! - [`FATBIN`]: the fatbin, built by this crate's build script with the shared builder
//!   `tpcomm-kernel-build` (SASS for sm_80, sm_90, sm_100, PTX for compute_80, no register
//!   spills, no local memory; [`RESOURCE_REPORT`] has the ptxas numbers). Load it with
//!   `cuModuleLoadData` and look kernels up by the names in [`KERNELS`].
//! - [`layout`]: `#[repr(C)]` mirrors of the structs the kernels read: the per-rank
//!   [`Signal`] block, the stable [`RankSignals`] table and [`RankData`] slots, checked
//!   against the CUDA compiler's view of them by this crate's tests.
//! - [`launch_config`]: which entry point, how many blocks and threads, how much temp
//!   memory, or a typed [`UnsupportedReason`] - pure Rust, testable without a GPU.
//!
//! ## Kernel arguments
//!
//! Every entry point takes, in this order: `*const RankData` (a stable slot),
//! `*const RankSignals` (this rank's stable table), `*mut Signal` (this rank's own block),
//! `*mut c_void` output, `i32` rank, `i64` element count ([`LaunchConfig::elements`]),
//! `u64` barrier timeout in nanoseconds (0 waits forever; on a timeout the kernel stops
//! and records which peer never arrived in [`Signal::error`], see [`ErrorWord`]).
//! No peer address is ever a kernel argument, so a launch captured in a CUDA graph keeps
//! working after the tables are rewritten in place. `docs/kernels.md` describes the
//! barrier protocol and the algorithms.
//!
//! Building this crate needs nvcc (`cargo xtask setup-cuda` provides one); it never needs
//! a GPU.

mod launch;
pub mod layout;

pub use launch::{
    check_alignment, kernel_name, launch_config, Algorithm, Dtype, LaunchConfig, UnsupportedReason,
    ALGORITHMS, DTYPES, KERNELS, MAX_BYTES, WORLD_SIZES,
};
pub use layout::{
    BarrierKind, BarrierTimeout, ErrorWord, LaunchShape, RankData, RankSignals, ShapeMismatch,
    Signal, DEFAULT_BLOCKS, MAX_BLOCKS, MAX_RANKS, PACK_BYTES, SIGNAL_BYTES, THREADS,
};

/// Keeps the embedded fatbin 16-byte aligned (its headers hold 64-bit fields, and the
/// driver reads it in place).
#[repr(C, align(16))]
struct Aligned<T: ?Sized>(T);

static FATBIN_ALIGNED: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/allreduce.fatbin"
)));

/// The all-reduce fatbin (uncompressed, 16-byte aligned): SASS for sm_80, sm_90 and
/// sm_100, PTX for compute_80.
pub static FATBIN: &[u8] = &FATBIN_ALIGNED.0;

/// The ptxas resource table of [`FATBIN`]: registers per kernel per architecture, and
/// stack / spill / local memory use (always `none`: the build fails otherwise).
pub const RESOURCE_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/resources.txt"));

/// The `nvcc --version` release line of the compiler that built [`FATBIN`].
pub const NVCC_VERSION: &str = env!("TPCOMM_NVCC_VERSION");
