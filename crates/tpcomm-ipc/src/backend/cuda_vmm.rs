//! The CUDA virtual-memory backend: device memory shared between processes as POSIX file
//! descriptors, mapped by peers at addresses they keep.
//!
//! [`CudaVmmMemory`] allocates with the driver's virtual-memory API: physical memory
//! (`cuMemCreate`, pinned device memory that may be exported as a POSIX descriptor), a
//! range of device addresses reserved for it (`cuMemAddressReserve`), mapped there
//! (`cuMemMap`) with read/write access for its device (`cuMemSetAccess`). An allocation is
//! exported as a descriptor at its first export (`cuMemExportToShareableHandle`), held for
//! peers to fetch until the registry that shared it closes its mappings
//! ([`PeerMemory::close_exports`]), and exported afresh at the next export.
//!
//! - **Handles.** A [`CudaVmmHandle`] names the owner's pid, the descriptor's number in the
//!   owner and its identity (device, inode, the character device it is), the allocation's
//!   size and the exported range. A peer fetches the descriptor with `pidfd_getfd` (as the
//!   host backend fetches memfds; `/proc/<pid>/fd` cannot serve: reopening a device file
//!   opens the device anew), checks it before the driver sees it, imports it
//!   (`cuMemImportFromShareableHandle`), closes it, reserves a range of its own, maps the
//!   allocation there and gives its device access. The checks, in an order that never waits
//!   on a file system server (a forged handle may name a FUSE file): the identity from the
//!   kernel's cached attributes (`statx` with `AT_STATX_DONT_SYNC`) must be the handle's,
//!   or the handle is [`IpcError::StaleHandle`]; the file must be a character device of the
//!   NVIDIA driver (a major number `/proc/devices` lists under a name starting with
//!   `nvidia`), or it is [`IpcError::NotAnAllocation`] and is closed again (on a thread of
//!   its own unless it is shmem, as the host backend closes refused files). The size is the
//!   driver's: `cuMemMap` of the announced size fails on a smaller allocation, and the
//!   handle is refused. A range must lie inside the announced size.
//! - **Stable addresses.** A mapping [`detach`](PeerMemory::detach)es by unmapping and
//!   releasing its import while its range stays reserved; [`reattach`](PeerMemory::reattach)
//!   imports a fresh handle of the same size and maps it into the same range. The registry
//!   does both across a suspend and resume, so peer addresses (and every table holding them)
//!   stay as they were.
//! - **Memory that goes at a suspend.** [`release_backing`](PeerMemory::release_backing)
//!   unmaps and releases a buffer's physical memory and closes its descriptor, keeping its
//!   range; [`restore_backing`](PeerMemory::restore_backing) creates fresh memory (zeroed),
//!   maps it at the same address and exports it anew. A process checkpoint moves live
//!   exported memory with difficulty (the driver documents shareable-handle memory as
//!   unsupported during a checkpoint, and a natively restored allocation may refuse to be
//!   exported again), so the all-reduce releases its own buffers before and creates them
//!   afresh after.
//! - **Memory users allocate.** Memory the caller allocated with `cuMemAlloc` / `cudaMalloc`
//!   (an engine's tensors, registered as graph buffers) is shared through legacy CUDA IPC,
//!   as [`CudaMemory`] shares it: [`CudaPeerHandle::Legacy`]. Such a mapping cannot keep its
//!   address (the driver chooses it at every open) and, between processes, cannot be opened
//!   again after a process checkpoint (measured on driver 580: `CUDA_ERROR_NOT_PERMITTED`),
//!   which [`checkpoint_blocker`](PeerMemory::checkpoint_blocker) reports.
//! - **Tables.** [`allocate_private`](PeerMemory::allocate_private) allocates with
//!   `cuMemAlloc` (through [`CudaMemory`]): never exported, restored by a checkpoint with its
//!   contents at its address.
//! - **One process, several ranks.** [`CudaVmmMemory::same_process`] opens handles of this
//!   process as aliases of the local allocation (ranks as threads on one GPU), which keep
//!   their address through a release and restore of the allocation by construction.
//!
//! The entry points are resolved at run time in the driver library tpcomm's probe loaded,
//! with the C signatures of `cuda.h` (CUDA 11.4+) and this module's own `#[repr(C)]`
//! structures, so that the layout does not depend on the CUDA version cudarc's bindings were
//! generated for. A driver that lacks them, or a device without virtual memory management or
//! POSIX descriptor handles, is [`IpcError::Unsupported`] naming what is missing.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::CUdeviceptr;
use rustix::fs::FileType;
use serde::{Deserialize, Serialize};

use super::cuda::{result, CudaBuffer, CudaHandle, CudaMapping, CudaMemory, PrimaryContext};
use super::descriptor::{self, Got, Identity, IfStatxRefused, Pidfd};
use crate::error::{IpcError, Result};
use crate::memory::{check_range, MemoryRegion, PeerMemory, Region};

/// The backend's name in errors.
const NAME: &str = "cuda-vmm";

/// The driver's virtual-memory entry points and their C types.
mod entry {
    use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

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

    pub(super) type Create = unsafe extern "C" fn(
        *mut c_ulonglong,
        usize,
        *const AllocationProp,
        c_ulonglong,
    ) -> CuResult;
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
    pub(super) type Import =
        unsafe extern "C" fn(*mut c_ulonglong, *mut c_void, c_uint) -> CuResult;
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
}

use entry::{AccessDesc, AllocFlags, AllocationProp, Entries, Location};

/// The entry points, or why they cannot be used (resolved once per process).
fn entries() -> Result<Entries> {
    static ENTRIES: OnceLock<std::result::Result<Entries, String>> = OnceLock::new();
    ENTRIES
        .get_or_init(|| {
            result::load().map_err(|e| e.to_string())?;
            let lib = tpcomm_transport::backend::cuda_driver::library()?;
            let missing = tpcomm_transport::backend::cuda_driver::missing_symbols(&entry::NAMES)?;
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
                create: get!(entry::Create, "cuMemCreate"),
                release: get!(entry::Release, "cuMemRelease"),
                reserve: get!(entry::Reserve, "cuMemAddressReserve"),
                address_free: get!(entry::AddressFree, "cuMemAddressFree"),
                map: get!(entry::Map, "cuMemMap"),
                unmap: get!(entry::Unmap, "cuMemUnmap"),
                set_access: get!(entry::SetAccess, "cuMemSetAccess"),
                export: get!(entry::Export, "cuMemExportToShareableHandle"),
                import: get!(entry::Import, "cuMemImportFromShareableHandle"),
                granularity: get!(entry::Granularity, "cuMemGetAllocationGranularity"),
                attribute: get!(entry::Attribute, "cuDeviceGetAttribute"),
                error_name: get!(entry::ErrorName, "cuGetErrorName"),
                error_string: get!(entry::ErrorName, "cuGetErrorString"),
                copy: get!(entry::CopyDtoD, "cuMemcpyDtoD_v2"),
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
fn check(e: &Entries, call: &'static str, code: entry::CuResult) -> Result<()> {
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

/// The properties of every allocation of this backend on device `ordinal`.
fn allocation_prop(ordinal: i32) -> AllocationProp {
    AllocationProp {
        kind: entry::ALLOCATION_PINNED,
        requested_handle_types: entry::HANDLE_POSIX_FD,
        location: Location {
            kind: entry::LOCATION_DEVICE,
            id: ordinal,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: AllocFlags::default(),
    }
}

/// Read/write access for device `ordinal`.
fn access(ordinal: i32) -> AccessDesc {
    AccessDesc {
        location: Location {
            kind: entry::LOCATION_DEVICE,
            id: ordinal,
        },
        flags: entry::ACCESS_READWRITE,
    }
}

/// The handle of `len` bytes at `offset` in one virtual-memory allocation of process `pid`,
/// exported as descriptor `fd` there.
///
/// Its serde form is stable: the fields in order (postcard: varints).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaVmmHandle {
    /// Pid of the exporting process.
    pub pid: u32,
    /// The exported descriptor's number in the exporter.
    pub fd: i32,
    /// Device of the descriptor's inode.
    pub dev: u64,
    /// Inode of the descriptor: its identity.
    pub inode: u64,
    /// The character device the descriptor is (`st_rdev`).
    pub rdev: u64,
    /// Size of the whole allocation.
    pub base_len: u64,
    /// Start of the exported range in the allocation.
    pub offset: u64,
    /// Length of the exported range.
    pub len: u64,
    /// Ordinal of the exporter's device, in the exporter's numbering (informational).
    pub device: i32,
}

/// A handle of [`CudaVmmMemory`]: a virtual-memory allocation's descriptor, or legacy CUDA
/// IPC for memory the caller allocated with `cuMemAlloc` / `cudaMalloc`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CudaPeerHandle {
    /// Memory of `cuMemAlloc` (see [`CudaMemory`]).
    Legacy(CudaHandle),
    /// Memory of `cuMemCreate` exported as a POSIX descriptor.
    Vmm(CudaVmmHandle),
}

/// How a mapping of [`CudaVmmMemory`] maps its peer's virtual-memory allocation.
#[derive(Debug)]
pub(crate) enum VmmMapping {
    /// Imported and mapped over the whole reserved range at the mapping's base: `phys` is the
    /// imported allocation handle, `None` while detached.
    Imported { phys: Option<u64>, size: usize },
    /// This process's own allocation, seen at its own address (ranks as threads).
    Alias { detached: bool, size: usize },
}

/// One allocation of this process, mapped now.
struct Owned {
    size: usize,
    phys: u64,
    device: i32,
    /// The descriptor exported for peers to fetch, and what it is; made by the first export
    /// and closed by [`PeerMemory::close_exports`] (every peer has imported by then).
    exported: Option<(OwnedFd, Identity)>,
}

/// The allocations of this process that are mapped now, by base address (for `export`, and
/// for same-process opens). A buffer whose backing is released has no entry.
fn owned() -> MutexGuard<'static, BTreeMap<u64, Owned>> {
    static TABLE: Mutex<BTreeMap<u64, Owned>> = Mutex::new(BTreeMap::new());
    // Nothing panics while holding the lock.
    TABLE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Peer allocations imported and mapped now, over every backend of this process.
static IMPORTED: AtomicUsize = AtomicUsize::new(0);

/// Peer allocations this process imports and maps now (detached ones hold only addresses).
pub(crate) fn imported_now() -> usize {
    IMPORTED.load(Ordering::SeqCst)
}

/// The major numbers of the character devices `/proc/devices` text lists under a name
/// starting with `nvidia` (`nvidia`, `nvidiactl`, `nvidia-uvm`, `nvidia-frontend`, ...).
pub fn nvidia_majors(proc_devices: &str) -> Vec<u32> {
    let mut majors = Vec::new();
    let mut in_chars = false;
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_chars = line == "Character devices:";
            continue;
        }
        if !in_chars {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(number), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if let (Ok(major), true) = (number.parse::<u32>(), name.starts_with("nvidia")) {
            if !majors.contains(&major) {
                majors.push(major);
            }
        }
    }
    majors
}

/// The NVIDIA majors of this machine (read once).
fn machine_majors() -> &'static [u32] {
    static MAJORS: OnceLock<Vec<u32>> = OnceLock::new();
    MAJORS.get_or_init(|| {
        std::fs::read_to_string("/proc/devices")
            .map(|t| nvidia_majors(&t))
            .unwrap_or_default()
    })
}

/// Whether a descriptor fetched for `h`, of identity `id`, is what `h` names and an
/// allocation handle of the NVIDIA driver: `Err(Stale)` when it is another file than the
/// handle's, `Err(Foreign(what))` when it is the handle's but not a device file of one of
/// `majors`.
fn check_descriptor(
    h: &CudaVmmHandle,
    id: &Identity,
    majors: &[u32],
) -> std::result::Result<(), DescriptorProblem> {
    if !id.is(h.dev, h.inode) {
        return Err(DescriptorProblem::Stale);
    }
    let kind = FileType::from_raw_mode(id.mode);
    if kind != FileType::CharacterDevice {
        return Err(DescriptorProblem::Foreign(format!(
            "a {kind:?}, not a character device"
        )));
    }
    let major = rustix::fs::major(id.rdev);
    let minor = rustix::fs::minor(id.rdev);
    if !majors.contains(&major) {
        return Err(DescriptorProblem::Foreign(format!(
            "character device {major}:{minor}, not one of the NVIDIA driver's (majors \
             {majors:?} in /proc/devices)"
        )));
    }
    if id.rdev != h.rdev {
        return Err(DescriptorProblem::Foreign(format!(
            "character device {major}:{minor}, the handle says {}:{}",
            rustix::fs::major(h.rdev),
            rustix::fs::minor(h.rdev)
        )));
    }
    Ok(())
}

/// Why a fetched descriptor is refused ([`check_descriptor`]).
#[derive(Debug, PartialEq, Eq)]
enum DescriptorProblem {
    Stale,
    Foreign(String),
}

/// The fields of a handle checkable without its descriptor: a non-empty range inside the
/// allocation, a descriptor number, an allocation size that is a whole number of
/// `granularity` and addressable here. Returns the allocation's size.
fn check_fields(h: &CudaVmmHandle, granularity: usize) -> Result<usize> {
    if h.len == 0 || h.offset.checked_add(h.len).is_none_or(|e| e > h.base_len) {
        return Err(IpcError::InvalidHandle(format!(
            "range {}+{} outside a {}-byte allocation (or empty)",
            h.offset, h.len, h.base_len
        )));
    }
    if h.fd < 0 {
        return Err(IpcError::InvalidHandle(format!(
            "negative descriptor {}",
            h.fd
        )));
    }
    let size = usize::try_from(h.base_len)
        .map_err(|_| IpcError::InvalidHandle("allocation size out of range".into()))?;
    if size % granularity != 0 {
        return Err(IpcError::InvalidHandle(format!(
            "a {size}-byte allocation is not a whole number of {granularity}-byte granules"
        )));
    }
    Ok(size)
}

/// Fetches descriptor `fd` of process `pid` with `pidfd_getfd`.
fn fetch(pid: u32, fd: i32) -> Result<OwnedFd> {
    let owner = descriptor::process(pid)
        .map_err(|_| IpcError::InvalidHandle(format!("pid {pid} is not a process id")))?;
    let pidfd = match descriptor::open_pidfd(owner, pid)? {
        Pidfd::Open(p) => p,
        Pidfd::Refused(source) => {
            return Err(IpcError::Os {
                call: "pidfd_open",
                source,
            })
        }
    };
    match descriptor::get_fd(&pidfd, pid, fd)? {
        Got::Fd(got) => Ok(got),
        Got::Refused => Err(IpcError::Unsupported {
            backend: NAME,
            what: format!(
                "fetching descriptor {fd} of pid {pid}: pidfd_getfd is not allowed here \
                 (ptrace restrictions, or a kernel before 5.6)"
            ),
        }),
    }
}

/// The CUDA virtual-memory peer-memory backend for one device (see the module
/// documentation). Cheap to clone; clones share the retained primary context.
#[derive(Debug, Clone)]
pub struct CudaVmmMemory {
    legacy: CudaMemory,
    granularity: usize,
}

impl CudaVmmMemory {
    /// A backend on device `device_ordinal`: loads the driver, initialises it, retains the
    /// device's primary context, and checks that the device supports virtual memory
    /// management with POSIX descriptor handles.
    ///
    /// Fails with [`IpcError::NoDevice`] as [`CudaMemory::new`] does, and with
    /// [`IpcError::Unsupported`] naming what is missing: the driver's virtual-memory entry
    /// points, `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` or
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
    pub fn new(device_ordinal: i32) -> Result<Self> {
        Self::with(CudaMemory::new(device_ordinal)?)
    }

    /// [`new`](Self::new) for ranks that are threads of one process sharing the device:
    /// handles of this process open as aliases of the local allocation (see
    /// [`CudaMemory::same_process`]).
    pub fn same_process(device_ordinal: i32) -> Result<Self> {
        Self::with(CudaMemory::same_process(device_ordinal)?)
    }

    fn with(legacy: CudaMemory) -> Result<Self> {
        let e = entries()?;
        let ctx = legacy.context();
        let attribute = |attribute: c_int, what: &str| -> Result<()> {
            let mut value: c_int = 0;
            // SAFETY: out-pointer to a local; the driver validates the attribute and device.
            let code = unsafe { (e.attribute)(&mut value, attribute, ctx.device) };
            // A driver that does not know the attribute cannot provide what it names.
            check(&e, "cuDeviceGetAttribute", code).map_err(|err| IpcError::Unsupported {
                backend: NAME,
                what: format!("{what} (the driver cannot tell: {err})"),
            })?;
            if value == 0 {
                return Err(IpcError::Unsupported {
                    backend: NAME,
                    what: format!("{what} on device {}", ctx.ordinal),
                });
            }
            Ok(())
        };
        attribute(entry::ATTRIBUTE_VMM, "virtual memory management")?;
        attribute(
            entry::ATTRIBUTE_POSIX_FD,
            "POSIX file descriptor handles of allocations",
        )?;
        let prop = allocation_prop(ctx.ordinal);
        let mut granularity = 0usize;
        ctx.make_current()?;
        // SAFETY: out-pointer to a local; `prop` is a valid property block for the call.
        let code = unsafe { (e.granularity)(&mut granularity, &prop, entry::GRANULARITY_MINIMUM) };
        check(&e, "cuMemGetAllocationGranularity", code)?;
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(IpcError::Unsupported {
                backend: NAME,
                what: format!("an allocation granularity of {granularity} bytes"),
            });
        }
        tracing::debug!(
            device = ctx.ordinal,
            granularity,
            "CUDA virtual-memory peer-memory backend ready"
        );
        Ok(Self {
            legacy,
            granularity,
        })
    }

    /// The granularity allocations are rounded to (the driver's minimum for pinned device
    /// memory with POSIX descriptor handles; 2 MiB on current GPUs).
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The legacy CUDA IPC backend this one shares memory the caller allocated through.
    pub fn legacy(&self) -> &CudaMemory {
        &self.legacy
    }

    /// The device ordinal this backend allocates on and maps into.
    pub fn device_ordinal(&self) -> i32 {
        self.legacy.device_ordinal()
    }

    /// Makes this backend's primary context current on the calling thread.
    pub fn bind_to_thread(&self) -> Result<()> {
        self.legacy.bind_to_thread()
    }

    /// True for a [`same_process`](Self::same_process) backend.
    pub fn is_same_process(&self) -> bool {
        self.legacy.is_same_process()
    }

    /// Whether `len` bytes at `addr` can be exported: inside an allocation of this backend
    /// (mapped now), or memory legacy CUDA IPC exports ([`CudaMemory::check_exportable`]).
    pub fn check_exportable(&self, addr: u64, len: usize) -> Result<()> {
        if owned_range(&owned(), addr, len).is_some() {
            return Ok(());
        }
        self.legacy.check_exportable(addr, len).map(drop)
    }

    fn ctx(&self) -> &Arc<PrimaryContext> {
        self.legacy.context()
    }

    /// Creates physical memory of `size` bytes and maps it at `va` (a reservation of this
    /// backend of `size` bytes with nothing mapped in it) with access for this device, zeroed
    /// when `zero`; its handle. On failure, whatever was made is undone and `va` stays
    /// reserved.
    fn create_mapped(&self, e: &Entries, va: CUdeviceptr, size: usize, zero: bool) -> Result<u64> {
        let ordinal = self.device_ordinal();
        let prop = allocation_prop(ordinal);
        self.ctx().make_current()?;
        let mut phys = 0u64;
        // SAFETY: out-pointer to a local; `prop` is valid for the call.
        let code = unsafe { (e.create)(&mut phys, size, &prop, 0) };
        check(e, "cuMemCreate", code)?;
        let release = |e: &Entries| {
            // SAFETY: `phys` was created above and is released once, here, on failure.
            let code = unsafe { (e.release)(phys) };
            if let Err(err) = check(e, "cuMemRelease", code) {
                tracing::warn!(error = %err, "releasing a refused allocation failed");
            }
        };
        // SAFETY: `va..va + size` is a reservation of this backend with nothing mapped in
        // it (the caller's contract); `phys` holds `size` bytes.
        let code = unsafe { (e.map)(va, size, 0, phys, 0) };
        if let Err(err) = check(e, "cuMemMap", code) {
            release(e);
            return Err(err);
        }
        let unmap = |e: &Entries| {
            // SAFETY: mapped above, unmapped once on failure; nothing else uses it yet.
            let code = unsafe { (e.unmap)(va, size) };
            if let Err(err) = check(e, "cuMemUnmap", code) {
                tracing::warn!(error = %err, "unmapping a refused allocation failed");
            }
            release(e);
        };
        let desc = access(ordinal);
        // SAFETY: the range was just mapped; one access descriptor.
        let granted = unsafe { (e.set_access)(va, size, &desc, 1) };
        let made = check(e, "cuMemSetAccess", granted).and_then(|()| {
            if !zero {
                return Ok(());
            }
            // SAFETY: the fresh mapping, readable and writable by this device, not shared.
            unsafe { result::memset_d8(va, 0, size) }?;
            result::legacy_stream_synchronize()
        });
        if let Err(err) = made {
            unmap(e);
            return Err(err);
        }
        Ok(phys)
    }

    /// Fresh zeroed physical memory of `size` bytes mapped at `va` (a reservation of this
    /// backend with nothing mapped in it), recorded as an allocation of this process.
    fn back(&self, e: &Entries, va: CUdeviceptr, size: usize) -> Result<()> {
        let phys = self.create_mapped(e, va, size, true)?;
        owned().insert(
            va,
            Owned {
                size,
                phys,
                device: self.device_ordinal(),
                exported: None,
            },
        );
        Ok(())
    }

    /// Exports the allocation at `base` (made before or now); its descriptor's number and
    /// identity. A restored allocation that the driver refuses to export again is renewed
    /// first ([`Self::renew`]): fresh physical memory with its contents, at its address.
    fn exported(&self, e: &Entries, base: CUdeviceptr, o: &mut Owned) -> Result<(i32, Identity)> {
        if let Some((fd, id)) = &o.exported {
            return Ok((fd.as_raw_fd(), *id));
        }
        let made = match export_descriptor(e, o.phys) {
            Ok(made) => made,
            Err(IpcError::Cuda { code, name, .. }) => {
                tracing::debug!(
                    base,
                    code,
                    %name,
                    "the driver refuses to export an allocation again: renewing it"
                );
                self.renew(e, base, o)?;
                export_descriptor(e, o.phys)?
            }
            Err(err) => return Err(err),
        };
        let out = (made.0.as_raw_fd(), made.1);
        o.exported = Some(made);
        Ok(out)
    }

    /// Replaces the physical memory under the allocation at `base` with fresh memory holding
    /// the same bytes, mapped at the same address: what a natively restored allocation
    /// needs when the driver refuses to export it again. The bytes go through a second,
    /// temporary mapping of the fresh memory (a device-to-device copy); the old memory is
    /// released.
    fn renew(&self, e: &Entries, base: CUdeviceptr, o: &mut Owned) -> Result<()> {
        let size = o.size;
        let temp = self.reserve(e, size)?;
        let fresh = match self.create_mapped(e, temp, size, false) {
            Ok(phys) => phys,
            Err(err) => {
                free_range(e, temp, size);
                return Err(err);
            }
        };
        // SAFETY: both ranges are mapped, `size` bytes each, readable and writable by this
        // device; the copy is synchronous.
        let code = unsafe { (e.copy)(temp, base, size) };
        let copied = check(e, "cuMemcpyDtoD_v2", code);
        // SAFETY: the temporary mapping made above, unmapped once; `fresh` keeps the memory.
        let code = unsafe { (e.unmap)(temp, size) };
        let unmapped = check(e, "cuMemUnmap", code);
        free_range(e, temp, size);
        if let Err(err) = copied.and(unmapped) {
            // SAFETY: `fresh` is mapped nowhere now, released once.
            let _ = unsafe { (e.release)(fresh) };
            return Err(err);
        }
        // SAFETY: the allocation's own mapping at `base`, replaced below; nobody uses the
        // buffer during a resume.
        let code = unsafe { (e.unmap)(base, size) };
        check(e, "cuMemUnmap", code)?;
        // SAFETY: the old memory, mapped nowhere now, released once.
        let code = unsafe { (e.release)(o.phys) };
        if let Err(err) = check(e, "cuMemRelease", code) {
            tracing::warn!(error = %err, "releasing renewed memory failed");
        }
        o.phys = fresh;
        // SAFETY: `base..base + size` is the allocation's reservation, empty since the
        // unmap above; `fresh` holds `size` bytes.
        let code = unsafe { (e.map)(base, size, 0, fresh, 0) };
        check(e, "cuMemMap", code)?;
        let desc = access(self.device_ordinal());
        // SAFETY: the range was just mapped; one access descriptor.
        let code = unsafe { (e.set_access)(base, size, &desc, 1) };
        check(e, "cuMemSetAccess", code)?;
        tracing::debug!(base, size, "allocation renewed with its contents");
        Ok(())
    }

    /// Fetches, checks and imports the allocation `h` names (`size` bytes, checked by
    /// [`check_fields`]); its allocation handle.
    fn import(&self, e: &Entries, h: &CudaVmmHandle) -> Result<u64> {
        let fd = descriptor::checked(fetch(h.pid, h.fd)?, |fd| {
            let id = descriptor::cached_identity(fd.as_fd(), IfStatxRefused::Fail)?;
            check_descriptor(h, &id, machine_majors()).map_err(|problem| match problem {
                DescriptorProblem::Stale => IpcError::StaleHandle(format!(
                    "descriptor {} of pid {} names inode {} now, not inode {}",
                    h.fd, h.pid, id.inode, h.inode
                )),
                DescriptorProblem::Foreign(found) => IpcError::NotAnAllocation {
                    pid: h.pid,
                    fd: h.fd,
                    found,
                },
            })
        })?;
        self.ctx().make_current()?;
        let mut phys = 0u64;
        // SAFETY: out-pointer to a local; for a POSIX descriptor handle the driver takes the
        // descriptor's number as the pointer value, and `fd` stays open for the call.
        let code = unsafe {
            (e.import)(
                &mut phys,
                fd.as_raw_fd() as usize as *mut c_void,
                entry::HANDLE_POSIX_FD,
            )
        };
        // The import holds the allocation; the descriptor is not needed any more.
        drop(fd);
        check(e, "cuMemImportFromShareableHandle", code)?;
        Ok(phys)
    }

    /// Maps the imported allocation `phys` over `va..va + size` with access for this device;
    /// releases `phys` on failure (the range stays reserved).
    fn map_import(&self, e: &Entries, va: CUdeviceptr, size: usize, phys: u64) -> Result<()> {
        let release = || {
            // SAFETY: `phys` is the caller's import, released once here on failure.
            let code = unsafe { (e.release)(phys) };
            if let Err(err) = check(e, "cuMemRelease", code) {
                tracing::warn!(error = %err, "releasing a refused import failed");
            }
        };
        // SAFETY: `va..va + size` is this mapping's reservation with nothing mapped in it;
        // the driver refuses a size larger than the allocation.
        let code = unsafe { (e.map)(va, size, 0, phys, 0) };
        let mapped = check(e, "cuMemMap", code);
        if let Err(err) = mapped {
            release();
            return Err(match err {
                IpcError::Cuda { code, name, .. } => IpcError::InvalidHandle(format!(
                    "the allocation cannot be mapped with the {size} bytes the handle \
                     announces ({name}, code {code}): it is smaller, or not this device's"
                )),
                other => other,
            });
        }
        let desc = access(self.device_ordinal());
        // SAFETY: the range was just mapped; one access descriptor.
        let code = unsafe { (e.set_access)(va, size, &desc, 1) };
        let granted = check(e, "cuMemSetAccess", code);
        if let Err(err) = granted {
            // SAFETY: mapped above, unmapped once on failure.
            let _ = unsafe { (e.unmap)(va, size) };
            release();
            return Err(err);
        }
        IMPORTED.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Reserves `size` bytes of device addresses aligned to the granularity.
    fn reserve(&self, e: &Entries, size: usize) -> Result<CUdeviceptr> {
        self.ctx().make_current()?;
        let mut va = 0u64;
        // SAFETY: out-pointer to a local; a reservation maps nothing.
        let code = unsafe { (e.reserve)(&mut va, size, self.granularity, 0, 0) };
        check(e, "cuMemAddressReserve", code)?;
        Ok(va)
    }

    fn open_vmm(&self, h: &CudaVmmHandle) -> Result<CudaMapping> {
        let e = entries()?;
        let size = check_fields(h, self.granularity)?;
        let len = h.len as usize;
        if h.pid == std::process::id() {
            return self.open_alias(h, size, len);
        }
        let phys = self.import(&e, h)?;
        let va = match self.reserve(&e, size) {
            Ok(va) => va,
            Err(err) => {
                // SAFETY: imported above, released once on failure.
                let _ = unsafe { (e.release)(phys) };
                return Err(err);
            }
        };
        if let Err(err) = self.map_import(&e, va, size, phys) {
            free_range(&e, va, size);
            return Err(err);
        }
        tracing::trace!(
            va,
            size,
            pid = h.pid,
            "CUDA virtual-memory allocation imported"
        );
        Ok(self.mapping(
            va,
            h.offset,
            len,
            VmmMapping::Imported {
                phys: Some(phys),
                size,
            },
        ))
    }

    fn mapping(&self, base: CUdeviceptr, offset: u64, len: usize, vmm: VmmMapping) -> CudaMapping {
        CudaMapping {
            key: ([0; result::IPC_HANDLE_BYTES], self.device_ordinal()),
            base,
            offset,
            len,
            ctx: self.ctx().clone(),
            released: false,
            alias: false,
            vmm: Some(vmm),
        }
    }

    /// A handle of this process: the local allocation, seen at its own address, for a
    /// [`same_process`](Self::same_process) backend; refused otherwise, as legacy IPC
    /// refuses it.
    fn open_alias(&self, h: &CudaVmmHandle, size: usize, len: usize) -> Result<CudaMapping> {
        if !self.is_same_process() {
            return Err(IpcError::InvalidHandle(format!(
                "the handle was exported by this process (pid {}): use the local buffer (or \
                 CudaVmmMemory::same_process for ranks that are threads of one process)",
                h.pid
            )));
        }
        let base = own_allocation(h, size)?;
        Ok(self.mapping(
            base,
            h.offset,
            len,
            VmmMapping::Alias {
                detached: false,
                size,
            },
        ))
    }

    /// Whether `region` (one of this crate's CUDA types) is backed now.
    fn check_backed<R: MemoryRegion>(&self, region: &R) -> Result<()> {
        let any = region.as_any();
        let unbacked = |what| IpcError::Unbacked {
            addr: region.addr(),
            len: region.len(),
            what,
        };
        if let Some(b) = any.downcast_ref::<CudaBuffer>() {
            if b.vmm && !owned().contains_key(&b.ptr) {
                return Err(unbacked("a released buffer"));
            }
            return Ok(());
        }
        if let Some(m) = any.downcast_ref::<CudaMapping>() {
            return match &m.vmm {
                Some(VmmMapping::Imported { phys: None, .. })
                | Some(VmmMapping::Alias { detached: true, .. }) => {
                    Err(unbacked("a detached mapping"))
                }
                _ => Ok(()),
            };
        }
        Err(IpcError::ForeignRegion {
            backend: NAME,
            region: std::any::type_name::<R>(),
        })
    }
}

/// Exports allocation handle `phys` as a POSIX descriptor: the descriptor and its identity.
fn export_descriptor(e: &Entries, phys: u64) -> Result<(OwnedFd, Identity)> {
    let mut raw: c_int = -1;
    let out = (&mut raw as *mut c_int).cast::<c_void>();
    // SAFETY: for a POSIX descriptor handle the driver writes an `int` at `out`.
    let code = unsafe { (e.export)(out, phys, entry::HANDLE_POSIX_FD, 0) };
    check(e, "cuMemExportToShareableHandle", code)?;
    if raw < 0 {
        return Err(IpcError::InvalidAllocation(format!(
            "cuMemExportToShareableHandle gave descriptor {raw}"
        )));
    }
    // SAFETY: the driver made this descriptor for this process and gave it to us; nothing
    // else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let id = descriptor::cached_identity(fd.as_fd(), IfStatxRefused::Fail)?;
    Ok((fd, id))
}

/// The allocation of this process that `h` names (by descriptor and identity), mapped now at
/// its base with `size` bytes; its base.
fn own_allocation(h: &CudaVmmHandle, size: usize) -> Result<CUdeviceptr> {
    let table = owned();
    let found = table.iter().find(|(_, o)| {
        o.exported.as_ref().is_some_and(|(fd, id)| {
            fd.as_raw_fd() == h.fd && id.inode == h.inode && id.dev == h.dev
        })
    });
    match found {
        Some((&base, o)) if o.size == size => Ok(base),
        Some((_, o)) => Err(IpcError::InvalidHandle(format!(
            "the allocation is {} bytes, the handle says {size}",
            o.size
        ))),
        None => Err(IpcError::StaleHandle(format!(
            "no allocation of this process is exported as descriptor {} (inode {})",
            h.fd, h.inode
        ))),
    }
}

/// The allocation of `table` that holds `addr..addr + len`: its base and entry.
fn owned_range(table: &BTreeMap<u64, Owned>, addr: u64, len: usize) -> Option<(u64, &Owned)> {
    let (&base, o) = table.range(..=addr).next_back()?;
    let end = addr.checked_add(len as u64)?;
    (len > 0 && end <= base + o.size as u64).then_some((base, o))
}

/// Frees a reservation (logging a failure).
fn free_range(e: &Entries, va: CUdeviceptr, size: usize) {
    // SAFETY: a reservation of this backend with nothing mapped in it, freed once.
    let code = unsafe { (e.address_free)(va, size) };
    if let Err(err) = check(e, "cuMemAddressFree", code) {
        tracing::warn!(error = %err, "freeing a device address reservation failed");
    }
}

/// Unmaps and releases an allocation of this process that was mapped at `va` (its entry
/// was just removed from the table).
fn unback(e: &Entries, va: CUdeviceptr, o: Owned) -> Result<()> {
    // SAFETY: the allocation's mapping made by `back`, unmapped once (its entry is gone);
    // peers that imported it keep their own reference to the memory.
    let code = unsafe { (e.unmap)(va, o.size) };
    let unmapped = check(e, "cuMemUnmap", code);
    // SAFETY: the allocation handle made by `back`, released once.
    let code = unsafe { (e.release)(o.phys) };
    let released = check(e, "cuMemRelease", code);
    drop(o.exported);
    unmapped.and(released)
}

/// `Drop` of a [`CudaBuffer`] of this backend: unmaps and releases its memory (if backed) and
/// frees its range.
pub(crate) fn free_buffer(ptr: CUdeviceptr, len: usize, ctx: &PrimaryContext) {
    let Ok(e) = entries() else {
        return;
    };
    let entry = owned().remove(&ptr);
    let freed = ctx.make_current().and_then(|()| {
        if let Some(o) = entry {
            unback(&e, ptr, o)?;
        }
        free_range(&e, ptr, len);
        Ok(())
    });
    if let Err(err) = freed {
        tracing::warn!(error = %err, "freeing a CUDA virtual-memory buffer failed");
    }
}

/// [`CudaMapping`]'s release for a mapping of this backend: unmaps and releases the import
/// (if mapped) and frees the range (an alias owns neither).
pub(crate) fn release_mapping(
    base: CUdeviceptr,
    vmm: VmmMapping,
    ctx: &PrimaryContext,
) -> Result<()> {
    let VmmMapping::Imported { phys, size } = vmm else {
        return Ok(());
    };
    let e = entries()?;
    ctx.make_current()?;
    let mut outcome = Ok(());
    if let Some(phys) = phys {
        // SAFETY: the import's mapping over the mapping's own range, unmapped once.
        let code = unsafe { (e.unmap)(base, size) };
        outcome = check(&e, "cuMemUnmap", code);
        // SAFETY: the import's handle, released once.
        let code = unsafe { (e.release)(phys) };
        outcome = outcome.and(check(&e, "cuMemRelease", code));
        IMPORTED.fetch_sub(1, Ordering::SeqCst);
    }
    free_range(&e, base, size);
    outcome
}

impl PeerMemory for CudaVmmMemory {
    type Handle = CudaPeerHandle;
    type Buffer = CudaBuffer;
    type Mapping = CudaMapping;

    fn name(&self) -> &'static str {
        NAME
    }

    fn allocate(&self, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return Err(IpcError::InvalidAllocation("zero bytes".into()));
        }
        let size = bytes
            .checked_next_multiple_of(self.granularity)
            .ok_or_else(|| {
                IpcError::InvalidAllocation(format!(
                    "{bytes} bytes overflow when rounded to {} bytes",
                    self.granularity
                ))
            })?;
        let e = entries()?;
        let va = self.reserve(&e, size)?;
        if let Err(err) = self.back(&e, va, size) {
            free_range(&e, va, size);
            return Err(err);
        }
        tracing::trace!(size, va, "CUDA virtual-memory buffer allocated");
        Ok(CudaBuffer {
            ptr: va,
            len: size,
            ctx: self.ctx().clone(),
            vmm: true,
        })
    }

    /// `cuMemAlloc` memory (through [`CudaMemory`]): never exported by the all-reduce, and
    /// brought back by a process checkpoint with its contents at its address.
    fn allocate_private(&self, bytes: usize) -> Result<CudaBuffer> {
        self.legacy.allocate(bytes)
    }

    fn export(&self, addr: u64, len: usize) -> Result<CudaPeerHandle> {
        let mut table = owned();
        let Some((base, _)) = owned_range(&table, addr, len) else {
            drop(table);
            return self.legacy.export(addr, len).map(CudaPeerHandle::Legacy);
        };
        let e = entries()?;
        self.ctx().make_current()?;
        let o = table.get_mut(&base).expect("found just above");
        let (fd, id) = self.exported(&e, base, o)?;
        Ok(CudaPeerHandle::Vmm(CudaVmmHandle {
            pid: std::process::id(),
            fd,
            dev: id.dev,
            inode: id.inode,
            rdev: id.rdev,
            base_len: o.size as u64,
            offset: addr - base,
            len: len as u64,
            device: o.device,
        }))
    }

    /// Closes the exported descriptors of the allocations holding `regions`: peers that
    /// imported keep their imports, handles exported before go stale, and the next export
    /// makes a fresh descriptor. A process checkpoint then finds no descriptor of them open.
    fn close_exports(&self, regions: &mut dyn Iterator<Item = Region>) {
        let mut table = owned();
        for r in regions {
            let base = owned_range(&table, r.addr, r.len).map(|(base, _)| base);
            if let Some(o) = base.and_then(|b| table.get_mut(&b)) {
                o.exported = None;
            }
        }
    }

    fn export_all(&self, regions: &[Region]) -> Result<Vec<CudaPeerHandle>> {
        regions.iter().map(|r| self.export(r.addr, r.len)).collect()
    }

    fn open(&self, handle: &CudaPeerHandle) -> Result<CudaMapping> {
        match handle {
            CudaPeerHandle::Legacy(h) => self.legacy.open(h),
            CudaPeerHandle::Vmm(h) => self.open_vmm(h),
        }
    }

    fn close(&self, mapping: CudaMapping) -> Result<()> {
        self.legacy.close(mapping)
    }

    fn keeps_addresses(&self) -> bool {
        true
    }

    fn detach(&self, mapping: &mut CudaMapping) -> Result<()> {
        let addr = mapping.addr();
        match &mut mapping.vmm {
            None => Err(IpcError::Unsupported {
                backend: NAME,
                what: "keeping the address of a legacy CUDA IPC mapping".into(),
            }),
            Some(VmmMapping::Alias { detached, .. }) => {
                *detached = true;
                Ok(())
            }
            Some(VmmMapping::Imported { phys, size }) => {
                let Some(p) = *phys else {
                    return Ok(());
                };
                let e = entries()?;
                self.ctx().make_current()?;
                // SAFETY: the import's mapping over this mapping's own range; callers
                // (the registry, after the all-reduce drained its launches) no longer use
                // it; copies through it are refused from here on.
                let code = unsafe { (e.unmap)(mapping.base, *size) };
                check(&e, "cuMemUnmap", code)?;
                *phys = None;
                IMPORTED.fetch_sub(1, Ordering::SeqCst);
                // SAFETY: the import's handle, released once (its mapping is gone).
                let code = unsafe { (e.release)(p) };
                let released = check(&e, "cuMemRelease", code);
                if let Err(err) = released {
                    tracing::warn!(error = %err, addr, "releasing a detached import failed");
                }
                tracing::trace!(addr, "CUDA virtual-memory mapping detached");
                Ok(())
            }
        }
    }

    fn reattach(&self, mapping: &mut CudaMapping, handle: &CudaPeerHandle) -> Result<()> {
        let addr = mapping.addr();
        let not_kept = |reason: String| IpcError::AddressNotKept { addr, reason };
        let CudaPeerHandle::Vmm(h) = handle else {
            return Err(not_kept(
                "a legacy CUDA IPC handle opens where the driver chooses".into(),
            ));
        };
        let size = check_fields(h, self.granularity)?;
        let (kept_size, detached) = match &mapping.vmm {
            Some(VmmMapping::Imported { phys, size }) => (*size, phys.is_none()),
            Some(VmmMapping::Alias { detached, size }) => (*size, *detached),
            None => return Err(not_kept("a legacy CUDA IPC mapping keeps no range".into())),
        };
        if !detached {
            return Err(not_kept("the mapping is not detached".into()));
        }
        if size != kept_size || h.offset != mapping.offset || h.len as usize != mapping.len {
            return Err(not_kept(format!(
                "the handle names {} bytes at offset {} of a {size}-byte allocation; the kept \
                 range is {} bytes at offset {} of {kept_size}",
                h.len, h.offset, mapping.len, mapping.offset
            )));
        }
        if let Some(VmmMapping::Alias { detached, .. }) = &mut mapping.vmm {
            if h.pid != std::process::id() {
                return Err(not_kept("an alias keeps its own process's address".into()));
            }
            if own_allocation(h, size)? != mapping.base {
                return Err(not_kept("the handle names another allocation".into()));
            }
            *detached = false;
            return Ok(());
        }
        if h.pid == std::process::id() {
            return Err(not_kept("a handle of this process maps as an alias".into()));
        }
        let e = entries()?;
        let phys = self.import(&e, h)?;
        self.map_import(&e, mapping.base, size, phys)?;
        if let Some(VmmMapping::Imported { phys: kept, .. }) = &mut mapping.vmm {
            *kept = Some(phys);
        }
        tracing::trace!(addr, pid = h.pid, "CUDA virtual-memory mapping reattached");
        Ok(())
    }

    fn releases_backing(&self) -> bool {
        true
    }

    fn release_backing(&self, buffer: &mut CudaBuffer) -> Result<usize> {
        if !buffer.vmm {
            return Err(IpcError::Unsupported {
                backend: NAME,
                what: "releasing the memory of a cuMemAlloc buffer".into(),
            });
        }
        let Some(o) = owned().remove(&buffer.ptr) else {
            return Ok(0);
        };
        let e = entries()?;
        self.ctx().make_current()?;
        let size = o.size;
        unback(&e, buffer.ptr, o)?;
        tracing::trace!(va = buffer.ptr, size, "CUDA virtual-memory buffer released");
        Ok(size)
    }

    fn restore_backing(&self, buffer: &mut CudaBuffer) -> Result<()> {
        if !buffer.vmm {
            return Err(IpcError::Unsupported {
                backend: NAME,
                what: "restoring the memory of a cuMemAlloc buffer".into(),
            });
        }
        if owned().contains_key(&buffer.ptr) {
            return Ok(());
        }
        let e = entries()?;
        self.back(&e, buffer.ptr, buffer.len)?;
        tracing::trace!(va = buffer.ptr, "CUDA virtual-memory buffer restored");
        Ok(())
    }

    fn checkpoint_blocker(&self, handle: &CudaPeerHandle) -> Option<String> {
        match handle {
            CudaPeerHandle::Legacy(h) => legacy_checkpoint_blocker(h.pid, std::process::id()),
            CudaPeerHandle::Vmm(_) => None,
        }
    }

    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()> {
        self.check_backed(region)?;
        check_range(offset, src.len(), region.len())?;
        self.legacy.write(region, offset, src)
    }

    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_backed(region)?;
        check_range(offset, dst.len(), region.len())?;
        self.legacy.read(region, offset, dst)
    }
}

/// Why a legacy CUDA IPC mapping of process `pid`'s memory, opened in process `own`, keeps
/// the two from being checkpointed and restored together; `None` for this process's own
/// memory (a same-process alias).
pub fn legacy_checkpoint_blocker(pid: u32, own: u32) -> Option<String> {
    (pid != own).then(|| {
        format!(
            "it is legacy CUDA IPC memory of process {pid}: after both processes are \
             checkpointed and restored, the driver refuses to open fresh legacy IPC handles \
             (cuIpcOpenMemHandle: CUDA_ERROR_NOT_PERMITTED, measured on driver 580); share \
             memory of CudaVmmMemory instead, or capture with the staging copy \
             (CudaOptions::stage_captured_inputs)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC_DEVICES: &str = "Character devices:\n  1 mem\n  4 tty\n195 nvidia-frontend\n\
        195 nvidia\n234 nvidia-uvm\n237 nvidia-caps\n510 nvidia-nvswitch\n\nBlock devices:\n\
        259 blkext\n195 nvidia-not-a-char-device\n";

    fn handle() -> CudaVmmHandle {
        CudaVmmHandle {
            pid: 4242,
            fd: 7,
            dev: 5,
            inode: 99,
            rdev: rustix::fs::makedev(195, 255),
            base_len: 2 << 20,
            offset: 0,
            len: 4096,
            device: 0,
        }
    }

    fn char_device(rdev: u64) -> Identity {
        Identity {
            dev: 5,
            inode: 99,
            rdev,
            mode: 0o020_600,
        }
    }

    #[test]
    fn nvidia_majors_are_the_character_devices_named_nvidia() {
        assert_eq!(nvidia_majors(PROC_DEVICES), vec![195, 234, 237, 510]);
        assert!(nvidia_majors("Character devices:\n  1 mem\n").is_empty());
    }

    #[test]
    fn a_descriptor_of_the_nvidia_driver_with_the_handles_identity_is_accepted() {
        let h = handle();
        assert_eq!(
            check_descriptor(&h, &char_device(h.rdev), &[195, 234]),
            Ok(())
        );
    }

    #[test]
    fn another_file_at_the_handles_number_is_stale() {
        let h = handle();
        let other = Identity {
            inode: 100,
            ..char_device(h.rdev)
        };
        assert_eq!(
            check_descriptor(&h, &other, &[195]),
            Err(DescriptorProblem::Stale)
        );
    }

    #[test]
    fn an_ordinary_file_or_memfd_with_the_handles_identity_is_not_an_allocation() {
        let h = handle();
        let file = Identity {
            mode: 0o100_600,
            ..char_device(h.rdev)
        };
        match check_descriptor(&h, &file, &[195]) {
            Err(DescriptorProblem::Foreign(why)) => {
                assert!(why.contains("not a character"), "{why}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_character_device_of_another_driver_is_not_an_allocation() {
        let h = CudaVmmHandle {
            rdev: rustix::fs::makedev(4, 1),
            ..handle()
        };
        match check_descriptor(&h, &char_device(h.rdev), &[195, 234]) {
            Err(DescriptorProblem::Foreign(why)) => assert!(why.contains("4:1"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn handle_fields_outside_the_allocation_or_off_its_granules_are_refused() {
        let g = 2 << 20;
        assert_eq!(check_fields(&handle(), g).unwrap(), 2 << 20);
        for bad in [
            CudaVmmHandle { len: 0, ..handle() },
            CudaVmmHandle {
                offset: (2 << 20) - 16,
                len: 32,
                ..handle()
            },
            CudaVmmHandle {
                offset: u64::MAX,
                ..handle()
            },
            CudaVmmHandle { fd: -1, ..handle() },
            CudaVmmHandle {
                base_len: (2 << 20) + 4096,
                ..handle()
            },
        ] {
            assert!(
                matches!(check_fields(&bad, g), Err(IpcError::InvalidHandle(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn ranges_are_found_inside_owned_allocations_only() {
        // The lookup on a table of two allocations (no driver: the entries are made up).
        let mut table = BTreeMap::new();
        let memfd = || rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let (a, b) = (memfd(), memfd());
        let id = char_device(0);
        for (base, fd) in [(0x1000_0000u64, a), (0x2000_0000u64, b)] {
            table.insert(
                base,
                Owned {
                    size: 2 << 20,
                    phys: 1,
                    device: 0,
                    exported: Some((fd, id)),
                },
            );
        }
        assert_eq!(
            owned_range(&table, 0x1000_0000, 16).map(|r| r.0),
            Some(0x1000_0000)
        );
        assert_eq!(
            owned_range(&table, 0x2000_0000 + (2 << 20) - 16, 16).map(|r| r.0),
            Some(0x2000_0000)
        );
        assert!(owned_range(&table, 0x2000_0000 + (2 << 20) - 16, 32).is_none());
        assert!(owned_range(&table, 0x0fff_ffff, 1).is_none());
        assert!(owned_range(&table, 0x1000_0000, 0).is_none());
        assert!(owned_range(&table, u64::MAX, 2).is_none());
    }

    #[test]
    fn legacy_memory_of_another_process_blocks_a_checkpoint_and_says_why() {
        assert!(legacy_checkpoint_blocker(7, 7).is_none());
        let why = legacy_checkpoint_blocker(7, 8).unwrap();
        assert!(
            why.contains("process 7") && why.contains("NOT_PERMITTED"),
            "{why}"
        );
    }
}
