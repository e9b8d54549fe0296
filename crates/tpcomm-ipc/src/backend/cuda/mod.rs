//! The CUDA backend: device memory shared between processes with legacy CUDA IPC.
//!
//! Three levels, in cudarc's shape: cudarc's raw `driver::sys` bindings (the driver library
//! is loaded at run time), the [`result`] module (one checked function per driver call; every
//! `CUresult` becomes [`IpcError::Cuda`] with its raw code, name and description), and RAII
//! types: [`CudaBuffer`] (a `cuMemAlloc` allocation, freed on drop) and [`CudaMapping`] (a
//! peer's allocation opened with `cuIpcOpenMemHandle`, closed on drop).
//!
//! - **Loading.** [`CudaMemory::new`] loads `libcuda` and checks that it has every function
//!   the [`result`] layer calls before calling any of them, so a machine without a driver (or
//!   with one older than those functions) gets [`IpcError::NoDevice`], never a panic from
//!   cudarc's loader. A driver that is present but finds no GPU (`cuInit` fails) or a device
//!   ordinal that does not exist is [`IpcError::NoDevice`] too.
//! - **Handles.** A CUDA IPC handle (64 bytes) names a whole allocation, never a range:
//!   [`CudaHandle`] carries the handle of the allocation's base (`cuMemGetAddressRange`), the
//!   allocation's size, and the exported offset and length. [`CudaMemory::allocate`] rounds
//!   every buffer up to 2 MiB, so no two buffers share an allocation or a handle.
//! - **What can be exported.** Only memory from `cuMemAlloc` / `cudaMalloc` is legacy-IPC
//!   capable. Memory from a stream-ordered pool (`cuMemAllocAsync` / `cudaMallocAsync`) or
//!   mapped with the virtual-memory API (`cuMemCreate` + `cuMemMap`, what the expandable
//!   segments of PyTorch's caching allocator use) is not; neither is managed or host memory.
//!   [`PeerMemory::export`] checks the pointer's attributes and says which case it met in
//!   [`IpcError::NotExportable`].
//! - **Not in the exporting process.** The driver refuses to open a handle in the process that
//!   exported it (`CUDA_ERROR_INVALID_CONTEXT`); [`PeerMemory::open`] refuses a handle carrying
//!   this process's pid with [`IpcError::InvalidHandle`] before asking the driver. The
//!   [`PeerMappings`](crate::PeerMappings) registry never opens its own rank's handles, but
//!   ranks that are threads of one process (a `LocalGroup`) would open each other's: use one
//!   process per rank with this backend, or [`CudaMemory::same_process`], which opens this
//!   process's own handles as aliases of the local allocation (ranks as streams of one GPU). (Processes in different pid namespaces can carry the
//!   same pid; such a handle is refused too.)
//! - **One driver mapping per allocation and process.** Opening the same IPC handle twice in
//!   one context is an error in the driver. A process-wide table keyed by the 64 handle bytes
//!   and the device counts the [`CudaMapping`]s of each opened allocation (two handles of
//!   different ranges of one allocation share it) and closes the driver mapping with the last.
//! - **Addresses.** `cuIpcOpenMemHandle` chooses the address; after a close and a reopen it may
//!   be another one.
//! - **Contexts and copies.** A [`CudaMemory`] retains the device's primary context (the one
//!   the CUDA runtime and PyTorch use) and makes it current on the calling thread before each
//!   driver call. [`PeerMemory::write`] and [`PeerMemory::read`] are synchronous
//!   `cuMemcpyHtoD` / `cuMemcpyDtoH` on the legacy default stream: ordered with this
//!   process's work on that stream, never with other processes' kernels (that takes a
//!   barrier).
//!
//! Requires a driver for CUDA 11.4 or newer (the bindings are cudarc's `cuda-13000`; each
//! driver symbol is resolved on first use, and all those used here exist since 11.4).

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::cuda_driver::context::PrimaryContext;
use super::cuda_region::legacy::{export_table, open_table, Opened};
use super::cuda_region::sealed;
use crate::error::{IpcError, Result};
use crate::memory::{check_range, MemoryRegion, PeerMemory};

mod address_hold;
mod alias;
mod owner_gone;
mod pointer_checks;

pub use super::cuda_region::{
    imported_allocations, BufferView, CudaBuffer, CudaMapping, DevicePeerMemory,
};
pub use address_hold::CudaAddressHold;
pub use alias::{alias_access, AliasAccess};
use owner_gone::owner_gone_or;

/// Granularity of [`CudaMemory::allocate`]: 2 MiB, so that no two buffers share an
/// allocation (and so an IPC handle).
pub const ALLOCATION_GRANULARITY: usize = 2 << 20;

pub use super::cuda_driver::result;

/// The handle of `len` bytes at `offset` in one `cuMemAlloc` allocation of process `pid`.
///
/// Its serde form is stable: the 64 IPC bytes as one byte string, then the integers in field
/// order (postcard: a length byte of 64, the bytes, varints).
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaHandle {
    /// The CUDA IPC handle of the whole allocation (`cuIpcGetMemHandle` of its base).
    #[serde(with = "serde_bytes")]
    pub ipc: [u8; result::IPC_HANDLE_BYTES],
    /// Size of the whole allocation.
    pub base_len: u64,
    /// Start of the exported range in the allocation.
    pub offset: u64,
    /// Length of the exported range.
    pub len: u64,
    /// Ordinal of the exporter's device, in the exporter's numbering (informational:
    /// `CUDA_VISIBLE_DEVICES` may number devices differently in each process).
    pub device: i32,
    /// Pid of the exporting process.
    pub pid: u32,
}

impl fmt::Debug for CudaHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ipc: String = self.ipc[..8].iter().map(|b| format!("{b:02x}")).collect();
        f.debug_struct("CudaHandle")
            .field("ipc", &format_args!("{ipc}.."))
            .field("base_len", &self.base_len)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("device", &self.device)
            .field("pid", &self.pid)
            .finish()
    }
}

/// The CUDA IPC peer-memory backend for one device. Cheap to clone; clones share the
/// retained primary context.
#[derive(Debug, Clone)]
pub struct CudaMemory {
    ctx: Arc<PrimaryContext>,
    same_process: bool,
}

impl CudaMemory {
    /// A backend on device `device_ordinal`: loads the driver, initialises it, and retains
    /// the device's primary context.
    ///
    /// Fails with [`IpcError::NoDevice`] (never a panic) when the driver library is missing
    /// or older than CUDA 11.4, when `cuInit` or `cuDeviceGetCount` fail (no GPU, no kernel
    /// module, a stub library: the message keeps the CUDA error code), and when no device has
    /// this ordinal. Other driver failures are [`IpcError::Cuda`].
    pub fn new(device_ordinal: i32) -> Result<Self> {
        result::load()?;
        let unusable = |e: IpcError| IpcError::NoDevice(format!("no usable CUDA driver: {e}"));
        result::init().map_err(unusable)?;
        let count = result::device_count().map_err(unusable)?;
        if !(0..count).contains(&device_ordinal) {
            return Err(IpcError::NoDevice(format!(
                "CUDA device {device_ordinal} does not exist: the driver sees {count} device(s)"
            )));
        }
        let device = result::device_get(device_ordinal)?;
        let ctx = result::primary_ctx_retain(device)?;
        let ctx = Arc::new(PrimaryContext {
            ctx,
            device,
            ordinal: device_ordinal,
        });
        ctx.make_current()?;
        tracing::debug!(
            device = device_ordinal,
            driver = result::driver_version().unwrap_or(0),
            "CUDA peer-memory backend ready"
        );
        Ok(Self {
            ctx,
            same_process: false,
        })
    }

    /// A backend for ranks that are threads of one process sharing device
    /// `device_ordinal` (one-GPU tests and benchmarks of the multi-rank kernels): a handle
    /// exported by this process opens as an *alias* of the exporter's allocation (the same
    /// device address, nothing opened or closed in the driver), since CUDA IPC cannot open a
    /// handle in the process that exported it. Handles of other processes open through CUDA
    /// IPC as with [`new`](Self::new).
    ///
    /// An alias does not keep the allocation alive: the exporting rank must keep its buffer
    /// until every rank has closed its mappings (the all-reduce's lifecycle does). Aliases
    /// never move, so a close and reopen gives the same address.
    pub fn same_process(device_ordinal: i32) -> Result<Self> {
        let mut memory = Self::new(device_ordinal)?;
        memory.same_process = true;
        Ok(memory)
    }

    /// True for a [`same_process`](Self::same_process) backend.
    pub fn is_same_process(&self) -> bool {
        self.same_process
    }

    /// The device ordinal this backend allocates on and opens into.
    pub fn device_ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    /// The retained primary context (shared with `CudaVmmMemory`).
    pub(crate) fn context(&self) -> &Arc<PrimaryContext> {
        &self.ctx
    }

    /// Makes this backend's primary context current on the calling thread (for callers that
    /// mix in their own driver calls; every method here does it by itself).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx.make_current()
    }
}

/// Accepts only this backend's own region types: device memory it allocated or mapped.
fn cuda_region<R: MemoryRegion>(region: &R) -> Result<()> {
    let any = region.as_any();
    if any.is::<CudaBuffer>() || any.is::<CudaMapping>() {
        Ok(())
    } else {
        Err(IpcError::ForeignRegion {
            backend: "cuda",
            region: std::any::type_name::<R>(),
        })
    }
}

impl PeerMemory for CudaMemory {
    type Handle = CudaHandle;
    type Buffer = CudaBuffer;
    type Mapping = CudaMapping;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn allocate(&self, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return Err(IpcError::InvalidAllocation("zero bytes".into()));
        }
        let len = bytes
            .checked_next_multiple_of(ALLOCATION_GRANULARITY)
            .ok_or_else(|| {
                IpcError::InvalidAllocation(format!("{bytes} bytes overflow when rounded to 2 MiB"))
            })?;
        self.ctx.make_current()?;
        let buffer = CudaBuffer {
            ptr: result::mem_alloc(len)?,
            len,
            ctx: self.ctx.clone(),
            vmm: false,
        };
        // SAFETY: the whole fresh allocation, not yet shared with anyone.
        unsafe { result::memset_d8(buffer.ptr, 0, len) }?;
        // Zeroed before anyone can export it. The memset ran on the legacy default stream;
        // waiting for that stream alone (not the whole context) never waits on kernels of
        // other ranks that share this context (ranks as threads, `same_process`).
        result::legacy_stream_synchronize()?;
        tracing::trace!(len, ptr = buffer.ptr, "CUDA buffer allocated");
        Ok(buffer)
    }

    fn export(&self, addr: u64, len: usize) -> Result<CudaHandle> {
        let (base, size) = self.check_exportable(addr, len)?;
        let offset = addr - base;
        let device = result::pointer_device_ordinal(addr)?;
        let ipc = result::ipc_get_mem_handle(base)?;
        export_table().insert(ipc, base);
        Ok(CudaHandle {
            ipc,
            base_len: size as u64,
            offset,
            len: len as u64,
            device,
            pid: std::process::id(),
        })
    }

    fn open(&self, h: &CudaHandle) -> Result<CudaMapping> {
        if h.len == 0 || h.offset.checked_add(h.len).is_none_or(|e| e > h.base_len) {
            return Err(IpcError::InvalidHandle(format!(
                "range {}+{} outside a {}-byte allocation (or empty)",
                h.offset, h.len, h.base_len
            )));
        }
        let len = usize::try_from(h.len)
            .map_err(|_| IpcError::InvalidHandle("length out of range".into()))?;
        if h.pid == std::process::id() && self.same_process {
            if h.ipc.iter().all(|&b| b == 0) {
                return Err(IpcError::InvalidHandle("all-zero CUDA IPC handle".into()));
            }
            return self.open_alias(h, len);
        }
        if h.pid == std::process::id() {
            return Err(IpcError::InvalidHandle(format!(
                "the handle was exported by this process (pid {}): CUDA IPC cannot open a \
                 handle in the exporting process; use the local buffer (or \
                 CudaMemory::same_process for ranks that are threads of one process)",
                h.pid
            )));
        }
        if h.ipc.iter().all(|&b| b == 0) {
            return Err(IpcError::InvalidHandle("all-zero CUDA IPC handle".into()));
        }
        let key = (h.ipc, self.ctx.ordinal);
        let mut table = open_table();
        let base = if let Some(entry) = table.get_mut(&key) {
            if entry.size != h.base_len {
                return Err(IpcError::InvalidHandle(format!(
                    "the allocation is {} bytes, the handle says {}",
                    entry.size, h.base_len
                )));
            }
            entry.refs += 1;
            entry.base
        } else {
            self.ctx.make_current()?;
            let base = result::ipc_open_mem_handle(&h.ipc).map_err(|e| owner_gone_or(e, h.pid))?;
            let close = || {
                // SAFETY: opened just above in this context, not handed out.
                if let Err(e) = unsafe { result::ipc_close_mem_handle(base) } {
                    tracing::warn!(error = %e, "closing a refused CUDA IPC mapping failed");
                }
            };
            match result::mem_get_address_range(base) {
                Ok((b, size)) if b == base && size as u64 == h.base_len => {}
                Ok((_, size)) => {
                    close();
                    return Err(IpcError::InvalidHandle(format!(
                        "the allocation is {size} bytes, the handle says {}",
                        h.base_len
                    )));
                }
                Err(e) => {
                    close();
                    return Err(e);
                }
            }
            table.insert(
                key,
                Opened {
                    base,
                    size: h.base_len,
                    refs: 1,
                },
            );
            tracing::trace!(
                base,
                size = h.base_len,
                pid = h.pid,
                "CUDA IPC handle opened"
            );
            base
        };
        Ok(CudaMapping {
            key,
            base,
            offset: h.offset,
            len,
            ctx: self.ctx.clone(),
            released: false,
            alias: false,
            vmm: None,
        })
    }

    fn close(&self, mut mapping: CudaMapping) -> Result<()> {
        mapping.release()
    }

    /// A mapping of another process's memory: after both processes are checkpointed and
    /// restored, the driver refuses to open fresh legacy IPC handles.
    fn checkpoint_blocker(&self, handle: &CudaHandle) -> Option<String> {
        legacy_checkpoint_blocker(handle.pid, std::process::id())
    }

    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()> {
        cuda_region(region)?;
        check_range(offset, src.len(), region.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.make_current()?;
        self.check_device_memory(region.addr(), region.len())?;
        // SAFETY: `region` is device memory (checked above) that stays mapped while the
        // borrow lives (a CudaBuffer or CudaMapping, checked above), and the range was
        // checked against its length.
        unsafe { result::memcpy_htod(region.addr() + offset as u64, src) }
    }

    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        cuda_region(region)?;
        check_range(offset, dst.len(), region.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.make_current()?;
        self.check_device_memory(region.addr(), region.len())?;
        // SAFETY: as in `write`.
        unsafe { result::memcpy_dtoh(dst, region.addr() + offset as u64) }
    }
}

impl sealed::Sealed for CudaMemory {}

impl DevicePeerMemory for CudaMemory {
    fn device_ordinal(&self) -> i32 {
        CudaMemory::device_ordinal(self)
    }
    fn bind_to_thread(&self) -> Result<()> {
        CudaMemory::bind_to_thread(self)
    }
    fn check_shareable(&self, addr: u64, len: usize) -> Result<()> {
        self.check_exportable(addr, len).map(drop)
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
mod tests;
