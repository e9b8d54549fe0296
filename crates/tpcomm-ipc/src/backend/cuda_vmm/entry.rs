//! The driver's virtual-memory entry points: their C types and `#[repr(C)]` structures (as
//! `cuda.h` gives them, checked against cudarc's bindings), resolved once in the loaded driver
//! library, and the check that turns a `CUresult` into an error.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::sync::OnceLock;

use super::NAME;
use crate::backend::cuda::result;
use crate::error::{IpcError, Result};

/// `CUresult`, kept as the raw integer (a code this crate does not know is still one).
pub(super) type CuResult = c_int;

/// `CUmemLocation` (a location type and an id; the id is a union member from CUDA 13.2,
/// the same four bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct Location {
    pub(super) kind: c_uint,
    pub(super) id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct AllocFlags {
    pub(super) compression_type: u8,
    pub(super) gpu_direct_rdma_capable: u8,
    pub(super) usage: u16,
    pub(super) reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct AllocationProp {
    pub(super) kind: c_uint,
    pub(super) requested_handle_types: c_uint,
    pub(super) location: Location,
    pub(super) win32_handle_meta_data: *mut c_void,
    pub(super) alloc_flags: AllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct AccessDesc {
    pub(super) location: Location,
    pub(super) flags: c_uint,
}

// The layouts cuda.h gives them (and cudarc's bindings of the version they were built
// for).
const _: () = assert!(std::mem::size_of::<Location>() == 8);
const _: () = assert!(std::mem::size_of::<AllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<AccessDesc>() == 12);
const _: () = assert!(
    std::mem::size_of::<AllocationProp>()
        == std::mem::size_of::<cudarc::driver::sys::CUmemAllocationProp>()
);
const _: () = assert!(
    std::mem::size_of::<AccessDesc>()
        == std::mem::size_of::<cudarc::driver::sys::CUmemAccessDesc>()
);

/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub(super) const ALLOCATION_PINNED: c_uint = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub(super) const HANDLE_POSIX_FD: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(super) const LOCATION_DEVICE: c_uint = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(super) const ACCESS_READWRITE: c_uint = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub(super) const GRANULARITY_MINIMUM: c_uint = 0;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub(super) const ATTRIBUTE_VMM: c_int = 102;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
pub(super) const ATTRIBUTE_POSIX_FD: c_int = 103;

pub(super) type Create =
    unsafe extern "C" fn(*mut c_ulonglong, usize, *const AllocationProp, c_ulonglong) -> CuResult;
pub(super) type Release = unsafe extern "C" fn(c_ulonglong) -> CuResult;
pub(super) type Reserve =
    unsafe extern "C" fn(*mut c_ulonglong, usize, usize, c_ulonglong, c_ulonglong) -> CuResult;
pub(super) type AddressFree = unsafe extern "C" fn(c_ulonglong, usize) -> CuResult;
pub(super) type Map =
    unsafe extern "C" fn(c_ulonglong, usize, usize, c_ulonglong, c_ulonglong) -> CuResult;
pub(super) type Unmap = unsafe extern "C" fn(c_ulonglong, usize) -> CuResult;
pub(super) type SetAccess =
    unsafe extern "C" fn(c_ulonglong, usize, *const AccessDesc, usize) -> CuResult;
pub(super) type Export =
    unsafe extern "C" fn(*mut c_void, c_ulonglong, c_uint, c_ulonglong) -> CuResult;
pub(super) type Import = unsafe extern "C" fn(*mut c_ulonglong, *mut c_void, c_uint) -> CuResult;
pub(super) type Granularity =
    unsafe extern "C" fn(*mut usize, *const AllocationProp, c_uint) -> CuResult;
pub(super) type Attribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult;
pub(super) type ErrorName = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
pub(super) type CopyDtoD = unsafe extern "C" fn(c_ulonglong, c_ulonglong, usize) -> CuResult;

/// The entry points, resolved once.
#[derive(Clone, Copy)]
pub(super) struct Entries {
    pub(super) create: Create,
    pub(super) release: Release,
    pub(super) reserve: Reserve,
    pub(super) address_free: AddressFree,
    pub(super) map: Map,
    pub(super) unmap: Unmap,
    pub(super) set_access: SetAccess,
    pub(super) export: Export,
    pub(super) import: Import,
    pub(super) granularity: Granularity,
    pub(super) attribute: Attribute,
    pub(super) error_name: ErrorName,
    pub(super) error_string: ErrorName,
    pub(super) copy: CopyDtoD,
}

/// Every entry point [`Entries`] holds, by name.
pub(super) const NAMES: [&str; 14] = [
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationGranularity",
    "cuDeviceGetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemcpyDtoD_v2",
];

/// The entry points, or why they cannot be used (resolved once per process).
pub(super) fn entries() -> Result<Entries> {
    static ENTRIES: OnceLock<std::result::Result<Entries, String>> = OnceLock::new();
    ENTRIES
        .get_or_init(|| {
            result::load().map_err(|e| e.to_string())?;
            let lib = tpcomm_transport::cuda_driver::library()?;
            let missing = tpcomm_transport::cuda_driver::missing_symbols(&NAMES)?;
            if !missing.is_empty() {
                return Err(format!(
                    "virtual memory management (the driver lacks {missing:?}: it is older \
                     than CUDA 11.4)"
                ));
            }
            macro_rules! get {
                ($ty:ty, $name:literal) => {
                    // SAFETY: the symbol exists (checked above) and is read with its C
                    // signature from cuda.h; it is only called through this type.
                    *unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }
                        .map_err(|e| format!("{}: {e}", $name))?
                };
            }
            Ok(Entries {
                create: get!(Create, "cuMemCreate"),
                release: get!(Release, "cuMemRelease"),
                reserve: get!(Reserve, "cuMemAddressReserve"),
                address_free: get!(AddressFree, "cuMemAddressFree"),
                map: get!(Map, "cuMemMap"),
                unmap: get!(Unmap, "cuMemUnmap"),
                set_access: get!(SetAccess, "cuMemSetAccess"),
                export: get!(Export, "cuMemExportToShareableHandle"),
                import: get!(Import, "cuMemImportFromShareableHandle"),
                granularity: get!(Granularity, "cuMemGetAllocationGranularity"),
                attribute: get!(Attribute, "cuDeviceGetAttribute"),
                error_name: get!(ErrorName, "cuGetErrorName"),
                error_string: get!(ErrorName, "cuGetErrorString"),
                copy: get!(CopyDtoD, "cuMemcpyDtoD_v2"),
            })
        })
        .clone()
        .map_err(|what| IpcError::Unsupported {
            backend: NAME,
            what,
        })
}

fn c_text(p: *const c_char) -> Option<String> {
    // SAFETY: the driver hands out pointers to static NUL-terminated strings.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// `Ok` for `CUDA_SUCCESS` (0), else [`IpcError::Cuda`] of `call` with the driver's name and
/// description of `code`.
pub(super) fn check(e: &Entries, call: &'static str, code: CuResult) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let (mut name, mut message): (*const c_char, *const c_char) =
        (std::ptr::null(), std::ptr::null());
    // SAFETY: out-pointers to locals; the driver stores pointers to static strings or fails
    // for a code it does not know.
    let (n, m) = unsafe {
        (
            (e.error_name)(code, &mut name),
            (e.error_string)(code, &mut message),
        )
    };
    Err(IpcError::Cuda {
        call,
        code,
        name: (n == 0)
            .then(|| c_text(name))
            .flatten()
            .unwrap_or_else(|| format!("CUresult {code}")),
        message: (m == 0)
            .then(|| c_text(message))
            .flatten()
            .unwrap_or_else(|| "no description from the driver".into()),
    })
}
