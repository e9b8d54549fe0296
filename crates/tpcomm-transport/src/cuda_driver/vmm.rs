//! Virtual memory management: physical allocations (`cuMemCreate`), address reservations,
//! mappings and access, and their export and import as POSIX file descriptors, with the
//! `#[repr(C)]` structures they take; what `tpcomm-ipc`'s VMM backend calls.
//!
//! The structures are this module's own, with the layouts of `cuda.h` (CUDA 11.4+), so that
//! they do not depend on the CUDA version cudarc's bindings were generated for; their sizes
//! are checked at compile time against `cuda.h` and cudarc's bindings.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use super::resolve::entry_points;

pub use super::error_strings::GetErrorNameFn as ErrorName;
pub use super::CuResult;

/// `CUmemLocation` (a location type and an id; the id is a union member from CUDA 13.2,
/// the same four bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Location {
    /// `CUmemLocationType` ([`LOCATION_DEVICE`]).
    pub kind: c_uint,
    /// The device ordinal, for a device location.
    pub id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocFlags {
    /// `compressionType`.
    pub compression_type: u8,
    /// `gpuDirectRDMACapable`.
    pub gpu_direct_rdma_capable: u8,
    /// `usage`.
    pub usage: u16,
    /// `reserved`: zero.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AllocationProp {
    /// `CUmemAllocationType` ([`ALLOCATION_PINNED`]).
    pub kind: c_uint,
    /// `CUmemAllocationHandleType` ([`HANDLE_POSIX_FD`]).
    pub requested_handle_types: c_uint,
    /// Where the memory lives.
    pub location: Location,
    /// `win32HandleMetaData`: null on Linux.
    pub win32_handle_meta_data: *mut c_void,
    /// `allocFlags`.
    pub alloc_flags: AllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccessDesc {
    /// The location given access.
    pub location: Location,
    /// `CUmemAccess_flags` ([`ACCESS_READWRITE`]).
    pub flags: c_uint,
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
pub const ALLOCATION_PINNED: c_uint = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub const HANDLE_POSIX_FD: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const LOCATION_DEVICE: c_uint = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const ACCESS_READWRITE: c_uint = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub const GRANULARITY_MINIMUM: c_uint = 0;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub const ATTRIBUTE_VMM: c_int = 102;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
pub const ATTRIBUTE_POSIX_FD: c_int = 103;

/// `cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const
/// CUmemAllocationProp *prop, unsigned long long flags)`.
pub type Create =
    unsafe extern "C" fn(*mut c_ulonglong, usize, *const AllocationProp, c_ulonglong) -> CuResult;
/// `cuMemRelease(CUmemGenericAllocationHandle handle)`.
pub type Release = unsafe extern "C" fn(c_ulonglong) -> CuResult;
/// `cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
/// unsigned long long flags)`.
pub type Reserve =
    unsafe extern "C" fn(*mut c_ulonglong, usize, usize, c_ulonglong, c_ulonglong) -> CuResult;
/// `cuMemAddressFree(CUdeviceptr ptr, size_t size)`.
pub type AddressFree = unsafe extern "C" fn(c_ulonglong, usize) -> CuResult;
/// `cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle
/// handle, unsigned long long flags)`.
pub type Map =
    unsafe extern "C" fn(c_ulonglong, usize, usize, c_ulonglong, c_ulonglong) -> CuResult;
/// `cuMemUnmap(CUdeviceptr ptr, size_t size)`.
pub type Unmap = unsafe extern "C" fn(c_ulonglong, usize) -> CuResult;
/// `cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t
/// count)`.
pub type SetAccess = unsafe extern "C" fn(c_ulonglong, usize, *const AccessDesc, usize) -> CuResult;
/// `cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle
/// handle, CUmemAllocationHandleType handleType, unsigned long long flags)`.
pub type Export = unsafe extern "C" fn(*mut c_void, c_ulonglong, c_uint, c_ulonglong) -> CuResult;
/// `cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void
/// *osHandle, CUmemAllocationHandleType shHandleType)`.
pub type Import = unsafe extern "C" fn(*mut c_ulonglong, *mut c_void, c_uint) -> CuResult;
/// `cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
/// CUmemAllocationGranularity_flags option)`.
pub type Granularity = unsafe extern "C" fn(*mut usize, *const AllocationProp, c_uint) -> CuResult;
/// `cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
pub type Attribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult;
/// `cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes)`.
pub type CopyDtoD = unsafe extern "C" fn(c_ulonglong, c_ulonglong, usize) -> CuResult;

entry_points! {
    purpose: "virtual memory management",
    since: "CUDA 11.4",
    create: Create = "cuMemCreate",
    release: Release = "cuMemRelease",
    reserve: Reserve = "cuMemAddressReserve",
    address_free: AddressFree = "cuMemAddressFree",
    map: Map = "cuMemMap",
    unmap: Unmap = "cuMemUnmap",
    set_access: SetAccess = "cuMemSetAccess",
    export: Export = "cuMemExportToShareableHandle",
    import: Import = "cuMemImportFromShareableHandle",
    granularity: Granularity = "cuMemGetAllocationGranularity",
    attribute: Attribute = "cuDeviceGetAttribute",
    error_name: ErrorName = "cuGetErrorName",
    error_string: ErrorName = "cuGetErrorString",
    copy: CopyDtoD = "cuMemcpyDtoD_v2",
}
