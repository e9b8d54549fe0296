//! The CUDA driver (`libcuda`) as tpcomm reaches it without linking it (feature
//! `cuda-driver`): the one loader, and the one declaration of every driver entry point that
//! tpcomm resolves itself. Without the feature only [`process_checkpoint`]'s declarations
//! (names, argument blocks, function types) and [`ResolveError`] are compiled, for
//! `tpcomm-checkpoint`, which names those entry points in every build.
//!
//! cudarc binds most of the driver, but its lazy loader panics when the library or a
//! function is missing, and its structures follow the CUDA version its bindings were
//! generated for. So tpcomm
//!
//! - loads the library once per process ([`library`], the first of [`LIBRARY_FILES`] that
//!   loads; [`library_file`] says which, or why each failed) and probes it for functions
//!   without calling any ([`missing_symbols`]): a machine without a driver, or with an older
//!   one, gets a typed error from the layer that needed it, never a panic;
//! - probes, before a layer's first cudarc call, the cudarc-bound functions that layer uses:
//!   [`cudarc_probes`] holds one named list per layer ([`cudarc_probes::NCCL_TRANSPORT`],
//!   [`cudarc_probes::LEGACY_IPC`], [`cudarc_probes::ADDRESS_RESERVATION`],
//!   [`cudarc_probes::ALL_REDUCE`]);
//! - declares, with the C signatures of `cuda.h` and `#[repr(C)]` structures of its own
//!   (sizes checked at compile time), the entry points it resolves itself, one module per
//!   purpose, each resolved once per process into a table of function pointers:
//!
//! | module | entry points | table | resolver |
//! |---|---|---|---|
//! | [`vmm`] | `cuMemCreate`, `cuMemRelease`, `cuMemAddressReserve`, `cuMemAddressFree`, `cuMemMap`, `cuMemUnmap`, `cuMemSetAccess`, `cuMemExportToShareableHandle`, `cuMemImportFromShareableHandle`, `cuMemGetAllocationGranularity`, `cuDeviceGetAttribute`, `cuGetErrorName`, `cuGetErrorString`, `cuMemcpyDtoD_v2` | [`vmm::Entries`] | [`vmm::entries`] |
//! | [`process_checkpoint`] | `cuCheckpointProcessLock`, `...Checkpoint`, `...Restore`, `...Unlock`, `...GetState` | [`process_checkpoint::Entries`] | [`process_checkpoint::entries`] |
//! | [`init`] | `cuInit`, `cuDriverGetVersion` | [`init::Entries`] | [`init::entries`] |
//! | [`error_strings`] | `cuGetErrorName`, `cuGetErrorString` | [`error_strings::Entries`] | [`error_strings::entries`] |
//!
//! Each module also exports its entry points' names (`NAMES`, in the table's order), their
//! function pointer types, and the structures and constants they take. A resolver returns
//! `Result<&'static Entries, ResolveError>`, computed once and cached (an error too): the
//! library loaded, every name of `NAMES` present, each read with its type. The error says
//! which step failed: [`ResolveError::NoLibrary`] (the loader's message, naming every file
//! tried), [`ResolveError::Missing`] (the entry points the driver lacks, in `NAMES` order,
//! and the CUDA version that has them), [`ResolveError::Symbol`]. Resolving calls no driver
//! function and never panics. A layer that uses the entry points of a group it finds, each
//! on its own, asks `available()` instead: the table `Available`, each entry point an
//! `Option` (`None` where the library lacks it), [`ResolveError::NoLibrary`] its only error.
//! Calling a table's function pointer is `unsafe` (the caller keeps the C function's
//! contract); the tables of [`init`] and [`error_strings`] also have safe methods
//! (`init::Entries::init`, `init::Entries::driver_version`, `error_strings::Entries::name`,
//! `error_strings::Entries::description`, and the same on their `Available`, `None` where
//! the entry point is missing).
//!
//! ```no_run
//! # #[cfg(feature = "cuda-driver")] {
//! use tpcomm_transport::cuda_driver::{error_strings, vmm, ResolveError};
//!
//! let e: &vmm::Entries = match vmm::entries() {
//!     Ok(e) => e,
//!     Err(ResolveError::Missing { missing, .. }) => panic!("the driver lacks {missing:?}"),
//!     Err(other) => panic!("no virtual memory management: {other}"),
//! };
//! let mut granularity = 0usize;
//! let prop = vmm::AllocationProp {
//!     kind: vmm::ALLOCATION_PINNED,
//!     requested_handle_types: vmm::HANDLE_POSIX_FD,
//!     location: vmm::Location { kind: vmm::LOCATION_DEVICE, id: 0 },
//!     win32_handle_meta_data: std::ptr::null_mut(),
//!     alloc_flags: vmm::AllocFlags::default(),
//! };
//! // SAFETY: out-pointer to a local, a valid property block (after cuInit).
//! let code = unsafe { (e.granularity)(&mut granularity, &prop, vmm::GRANULARITY_MINIMUM) };
//! if code != 0 {
//!     let name = error_strings::entries().ok().and_then(|s| s.name(code));
//!     eprintln!("cuMemGetAllocationGranularity failed: {name:?}");
//! }
//! # }
//! ```

// Without the feature, the links of these docs to the loader and the resolvers have no target.
#![cfg_attr(not(feature = "cuda-driver"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "cuda-driver")]
pub mod cudarc_probes;
#[cfg(feature = "cuda-driver")]
pub mod error_strings;
#[cfg(feature = "cuda-driver")]
pub mod init;
#[cfg(feature = "cuda-driver")]
mod library;
pub mod process_checkpoint;
mod resolve;
#[cfg(feature = "cuda-driver")]
pub mod vmm;

#[cfg(feature = "cuda-driver")]
pub use library::{library, library_file, missing_symbols, LIBRARY_FILES};
pub use resolve::ResolveError;

/// `CUresult`, kept as the raw integer: a code this build does not know is still one.
pub type CuResult = std::ffi::c_int;

#[cfg(all(test, feature = "cuda-driver"))]
mod tests;
