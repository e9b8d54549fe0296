//! # tpcomm-kernel-build
//!
//! The one piece of code that turns `kernels/*.cu` into the fatbin tpcomm launches. Both
//! `cargo xtask kernels` and the build script of `tpcomm-kernels` call it, so the compiler
//! flags, the targets and the resource checks exist exactly once.
//!
//! - [`Nvcc::locate`] finds the CUDA compiler: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `nvcc` on
//!   `PATH`, then the wheels that `cargo xtask setup-cuda` unpacks into
//!   `<workspace>/target/cuda`. When none is there the error says to run
//!   `cargo xtask setup-cuda`.
//! - [`build_fatbin`] compiles one translation unit into an uncompressed fatbin with SASS
//!   for every [`TARGETS`] entry and PTX for the oldest, parses the ptxas report into one
//!   [`KernelResources`] per kernel and architecture, and fails when any kernel spills
//!   registers or uses a stack frame or local memory.
//! - [`fatbin`] reads a fatbin back: its cubins (ELF) and PTX per architecture, the kernel
//!   entry points of each, and the initial bytes of a device global (how the tests read
//!   the CUDA compiler's view of the shared struct layout).
//!
//! This crate has no dependencies and never needs a GPU.

mod build;
mod elf;
mod error;
pub mod fatbin;
mod nvcc;
mod report;

pub use build::{build_fatbin, fatbin_args, FatbinBuild, GpuTarget, TARGETS};
pub use error::BuildError;
pub use nvcc::{Nvcc, NvccOrigin, WHEELS_DIR, WHEELS_NVCC};
pub use report::{check_resources, format_table, parse_ptxas_report, KernelResources};
