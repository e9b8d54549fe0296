//! The CUDA backend: the kernels of `tpcomm-kernels` over CUDA IPC peer memory.
//!
//! - **Memory.** Every buffer (Signal block, staging, temp, both tables) comes from the
//!   backend's peer memory, [`CudaMemory`] (legacy CUDA IPC, the default) or
//!   [`CudaVmmMemory`](tpcomm_ipc::CudaVmmMemory) (virtual memory: peer addresses kept and
//!   the Signal, staging and temp buffers released across a suspend); every rank of a group
//!   uses the same kind (agreed at creation). The RankSignals table and the RankData pool
//!   are device allocations at addresses fixed for the communicator's life. Table entries are written with
//!   `cuMemcpyHtoDAsync` on the backend's stream, so they are ordered after every launch
//!   issued before and before every launch issued after.
//! - **Launches.** The fatbin is loaded once per backend (`cuModuleLoadData`) and all 24
//!   entry points are resolved up front (so no kernel is loaded lazily while a peer's kernel
//!   spins waiting for this rank). A launch passes the addresses of its RankData slot, this
//!   rank's RankSignals table and Signal block, never a peer address: a launch recorded in a
//!   CUDA graph keeps working after a resume rewrites the tables in place.
//! - **Stream.** One stream per backend ([`CudaBackend::stream`]): a fresh non-blocking one
//!   ([`CudaBackend::new`]) or the caller's ([`CudaBackend::with_stream`], an engine's
//!   stream); eager inputs are copied into the staging buffer on it (`cuMemcpyDtoDAsync`),
//!   and NCCL can share it (`DeviceAllReduce` does, feature `nccl`).
//! - **Caller memory.** [`CustomAllReduce::all_reduce_device`] takes cudarc views
//!   (`DevicePtr` / `DevicePtrMut`): staged eagerly; inside a capture of the stream, shared
//!   zero-copy when legacy IPC can export the input, else with the staging copy captured.
//! - **Capture.** While the stream is being captured (`cuStreamIsCapturing`), the driver gives
//!   each new input the next RankData slot and records the launch; nothing is copied between
//!   host and device and no table is written until
//!   [`register_graph_buffers`](crate::CustomAllReduce::register_graph_buffers).
//!   [`CustomAllReduce::capture_graph`] captures and instantiates a graph;
//!   [`CustomAllReduce::replay_graph`] refuses to launch it while captured inputs are
//!   unregistered or the communicator is not Active.
//! - **Errors.** A kernel that waits longer than the configured timeout at a barrier stops
//!   and records which peer never arrived in its Signal block; [`Backend::synchronize`]
//!   reports it as [`AllReduceError::Timeout`] naming the peer.
//! - **Who can run it.** [`CudaBackend::new`] probes the topology on every rank (NVML loaded
//!   at run time, else `cuDeviceCanAccessPeer` for visible devices, devices matched by UUID),
//!   all-gathers it and decides with [`crate::topology::decide`]: 2 ranks over any
//!   peer-to-peer link, more only with every pair on NVLink; otherwise every request gets
//!   [`FallbackReason::NoPeerAccess`] or [`FallbackReason::NotNvLinked`]. World sizes
//!   without a kernel (1, 3, 5, 7) get [`FallbackReason::NoKernel`]. Sizes pick one-stage or
//!   two-stage by vLLM's NVLink cut-offs ([`crate::dispatch::CUDA_ONE_STAGE_MAX_BYTES`]).

use std::ffi::{c_void, CString};
use std::mem::offset_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{
    sys, CudaContext, CudaGraph, CudaStream, DevicePtr, DevicePtrMut, DriverError,
};
use tpcomm_ipc::backend::cuda::result as cu;
use tpcomm_ipc::{CudaBuffer, CudaMemory, DevicePeerMemory, MemoryRegion};
use tpcomm_kernels as kernels;
use tpcomm_transport::Communicator;

use super::nvml::Nvml;
use super::{Backend, Launch, RANK_DATA_BYTES};
use crate::dispatch::{Algorithm, FallbackReason};
use crate::driver::{CaptureGuard, CaptureOwner, CustomAllReduce};
use crate::dtype::{DType, Element};
use crate::error::{AllReduceError, Result};
use crate::topology::{self, Link, TopologyCheck, TopologyDecision};

/// Every driver function this module and the cudarc calls it makes use; checked before the
/// first call so that an old driver is a typed error, never cudarc's loader panic.
const SYMBOLS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamIsCapturing",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDeviceGetUuid_v2",
    "cuCtxGetCurrent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
];

/// Byte offset of the error word in a Signal block.
const ERROR_OFFSET: usize = offset_of!(kernels::Signal, error);
/// Byte offset of the two shape words a shape mismatch records (own, peer's).
const MISMATCH_OFFSET: usize = offset_of!(kernels::Signal, mismatch);
/// Byte offset of the nonce in a Signal block (everything before it is launch state).
const NONCE_OFFSET: usize = offset_of!(kernels::Signal, nonce);

fn driver_error(call: &'static str, e: DriverError) -> AllReduceError {
    cu::error(call, e.0).into()
}

fn check(call: &'static str, code: sys::CUresult) -> Result<()> {
    Ok(cu::check(call, code)?)
}

/// Tuning of a [`CudaBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Upper bound on the thread blocks of one launch (1..=64; default 36). Every rank must
    /// pass the same value: block `b` of one rank synchronizes with block `b` of the others.
    pub max_blocks: u32,
    /// Ranks whose kernels share this device at the same time (default 1). A spinning
    /// kernel needs every peer's blocks resident at once, so with several ranks on one GPU
    /// (ranks as threads of one process, one-GPU tests) each launch takes at most
    /// `multiprocessors / ranks_per_device` blocks.
    pub ranks_per_device: usize,
    /// Inputs captured into a graph are copied into the staging buffer inside the graph,
    /// never shared zero-copy (default false: memory legacy CUDA IPC can export is shared
    /// as it is). What a group checkpointed across processes needs for inputs the caller
    /// allocated with `cudaMalloc`: a legacy IPC mapping of another process cannot be
    /// opened again after a restore (`CustomAllReduce::check_checkpoint` refuses it), the
    /// staging buffer of a `CudaVmmMemory` can. Ranks may differ in it.
    pub stage_captured_inputs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            max_blocks: kernels::DEFAULT_BLOCKS,
            ranks_per_device: 1,
            stage_captured_inputs: false,
        }
    }
}

/// The loaded fatbin and its entry points, in [`kernels::KERNELS`] order.
#[derive(Debug)]
struct Module {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread
// once the owning context is current (every use binds it first).
unsafe impl Send for Module {}
// SAFETY: as above; launches only read the handles.
unsafe impl Sync for Module {}

impl Module {
    fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: FATBIN is a complete, 16-byte aligned fatbin image that lives for the
        // whole program; the driver copies what it needs.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, kernels::FATBIN.as_ptr().cast::<c_void>())
        })?;
        let mut loaded = Module {
            ctx: ctx.clone(),
            module,
            functions: Vec::with_capacity(kernels::KERNELS.len()),
        };
        for name in kernels::KERNELS {
            let c_name = CString::new(name).expect("kernel names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `module` was loaded above and is alive; out-pointer to a local.
            check("cuModuleGetFunction", unsafe {
                sys::cuModuleGetFunction(&mut f, loaded.module, c_name.as_ptr())
            })?;
            loaded.functions.push(f);
        }
        Ok(loaded)
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction> {
        kernels::KERNELS
            .iter()
            .position(|k| *k == name)
            .map(|i| self.functions[i])
            .ok_or_else(|| AllReduceError::InvalidArgument(format!("no kernel named {name}")))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let unloaded = self
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e));
        let unloaded = unloaded.and_then(|()| {
            // SAFETY: loaded in `Module::load`, unloaded once; the backend owning it drains
            // its stream when dropped (before its fields), so no launch of it is pending.
            check("cuModuleUnload", unsafe {
                sys::cuModuleUnload(self.module)
            })
        });
        if let Err(e) = unloaded {
            tracing::warn!(error = %e, "unloading the all-reduce kernels failed");
        }
    }
}

/// The CUDA backend of [`CustomAllReduce`]: one device, one stream (its own or the
/// caller's), the fatbin loaded, the topology decided.
pub struct CudaBackend<M: DevicePeerMemory = CudaMemory> {
    memory: M,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Module,
    options: CudaOptions,
    multiprocessors: u32,
    peer_access: std::result::Result<(), FallbackReason>,
    topology: TopologyDecision,
    rank: usize,
    /// The barrier timeout of the latest launch, in nanoseconds (for the error report).
    timeout_ns: AtomicU64,
}

impl<M: DevicePeerMemory> Drop for CudaBackend<M> {
    fn drop(&mut self) {
        // Launches (and graph replays) still queued use the module and the buffers: wait
        // for them (each barrier wait is bounded by the launch timeout) before the fields go.
        if let Err(e) = self.sync_stream() {
            tracing::warn!(error = %e, "draining the all-reduce stream on drop failed");
        }
    }
}

impl<M: DevicePeerMemory> std::fmt::Debug for CudaBackend<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("memory", &self.memory.name())
            .field("device", &self.memory.device_ordinal())
            .field("options", &self.options)
            .field("multiprocessors", &self.multiprocessors)
            .field("peer_access", &self.peer_access)
            .finish()
    }
}

impl<M: DevicePeerMemory> CudaBackend<M> {
    /// Collective: a backend on `memory`'s device with a fresh non-blocking stream and the
    /// kernels loaded; agrees with every rank of `comm` whether all their devices can access
    /// each other's memory.
    ///
    /// Fails with `IpcError::NoDevice` (through [`AllReduceError::Ipc`]) when the driver
    /// lacks a function this backend calls; every driver failure is typed with its code.
    pub fn new<C: Communicator + ?Sized>(
        comm: &C,
        memory: &M,
        options: CudaOptions,
    ) -> Result<Self> {
        Self::build(comm, memory, options, None)
    }

    /// Collective: [`new`](Self::new) on the caller's stream (an engine's `CudaStream`)
    /// instead of a private one. Every launch, staging copy and table write of this backend
    /// is issued on `stream`, in the caller's order with the caller's own work on it, and a
    /// capture the caller begins on `stream` (`cuStreamBeginCapture`) records the
    /// all-reduces issued meanwhile (see `docs/gpu.md`, "Using tpcomm in an engine").
    ///
    /// The stream must belong to the primary context of `memory`'s device (where the
    /// kernels are loaded and the peer mappings opened: `CudaContext::new(ordinal)` gives
    /// it); otherwise every rank fails with [`AllReduceError::ForeignStream`] on this rank
    /// and [`AllReduceError::PeerSetup`] on the others.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use cudarc::driver::CudaContext;
    /// use tpcomm_allreduce::{CudaBackend, CudaOptions, CustomAllReduce, Config};
    /// use tpcomm_ipc::CudaMemory;
    /// # let comm = tpcomm_transport::LocalGroup::new(1).communicators()?.remove(0);
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.new_stream()?; // the engine's stream
    /// let memory = CudaMemory::new(0)?;
    /// let backend = CudaBackend::with_stream(&comm, &memory, CudaOptions::default(), stream.clone())?;
    /// let mut ar = CustomAllReduce::new(backend, memory, &comm, Config::default())?;
    /// let x = stream.alloc_zeros::<f32>(4096)?;
    /// let mut y = stream.alloc_zeros::<f32>(4096)?;
    /// ar.all_reduce_device(&x, &mut y)?; // on `stream`, after what the engine issued there
    /// # Ok(()) }
    /// ```
    pub fn with_stream<C: Communicator + ?Sized>(
        comm: &C,
        memory: &M,
        options: CudaOptions,
        stream: Arc<CudaStream>,
    ) -> Result<Self> {
        Self::build(comm, memory, options, Some(stream))
    }

    fn build<C: Communicator + ?Sized>(
        comm: &C,
        memory: &M,
        options: CudaOptions,
        stream: Option<Arc<CudaStream>>,
    ) -> Result<Self> {
        if options.max_blocks == 0 || options.max_blocks as usize > kernels::MAX_BLOCKS {
            return Err(AllReduceError::InvalidArgument(format!(
                "max_blocks {} is outside 1..={}",
                options.max_blocks,
                kernels::MAX_BLOCKS
            )));
        }
        if options.ranks_per_device == 0 {
            return Err(AllReduceError::InvalidArgument(
                "ranks_per_device must be at least 1".into(),
            ));
        }
        // Every rank learns whether every rank could set up, so none is left waiting in the
        // peer-access exchange below.
        let local = Self::open_device(memory, stream);
        let ready: Vec<Option<String>> =
            tpcomm_objects::all_gather(comm, &local.as_ref().err().map(ToString::to_string))?;
        let (ctx, stream, module, multiprocessors, uuid) = local?;
        if let Some((rank, why)) = ready
            .iter()
            .enumerate()
            .find_map(|(r, e)| e.as_ref().map(|e| (r, e)))
        {
            return Err(AllReduceError::PeerSetup {
                rank,
                reason: why.clone(),
            });
        }
        let uuids: Vec<[u8; 16]> = tpcomm_objects::all_gather(comm, &uuid)?;
        // Never fails (a probe error is an unprobed link), so every rank joins the gather.
        let row: Vec<u8> = probe_links(&ctx, &uuids, comm.rank())
            .into_iter()
            .map(Link::code)
            .collect();
        let rows: Vec<Vec<u8>> = tpcomm_objects::all_gather(comm, &row)?;
        let rows: Vec<Vec<Link>> = rows
            .iter()
            .map(|r| r.iter().map(|&c| Link::from_code(c)).collect())
            .collect();
        // `Config::topology` may override it when the all-reduce is created
        // (`Backend::apply_topology_check`).
        let topology = topology::decide(&topology::merge_rows(&rows), TopologyCheck::Auto);
        let peer_access = topology.verdict.clone();
        tracing::info!(
            rank = comm.rank(),
            device = memory.device_ordinal(),
            multiprocessors,
            ?peer_access,
            reason = %topology.reason,
            "CUDA all-reduce topology decided"
        );
        Ok(Self {
            memory: memory.clone(),
            ctx,
            stream,
            module,
            options,
            multiprocessors,
            peer_access,
            topology,
            rank: comm.rank(),
            timeout_ns: AtomicU64::new(0),
        })
    }

    #[allow(clippy::type_complexity)]
    fn open_device(
        memory: &M,
        stream: Option<Arc<CudaStream>>,
    ) -> Result<(Arc<CudaContext>, Arc<CudaStream>, Module, u32, [u8; 16])> {
        cu::require(SYMBOLS)?;
        let ordinal = memory.device_ordinal() as usize;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: this backend's own CudaContext handle never allocates cudarc CudaSlices,
        // whose synchronization the event tracking manages; turning it off keeps stream
        // creation from synchronizing the whole context (which would wait on other ranks'
        // spinning kernels). A caller's stream keeps its own context handle and settings.
        unsafe { ctx.disable_event_tracking() };
        let stream = match stream {
            Some(stream) => {
                check_stream_context(
                    memory.device_ordinal(),
                    ctx.cu_ctx() as usize,
                    stream.context().cu_ctx() as usize,
                    stream.context().ordinal(),
                )?;
                stream
            }
            None => ctx
                .new_stream()
                .map_err(|e| driver_error("cuStreamCreate", e))?,
        };
        let module = Module::load(&ctx)?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))?;
        let uuid = ctx
            .uuid()
            .map_err(|e| driver_error("cuDeviceGetUuid_v2", e))?;
        Ok((
            ctx,
            stream,
            module,
            multiprocessors.max(1) as u32,
            uuid.bytes.map(|b| b as u8),
        ))
    }

    /// The stream every launch, staging copy and table write of this backend is issued on
    /// (non-blocking: the legacy default stream does not wait for it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cudarc context of the device (for events and graphs).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The options.
    pub fn options(&self) -> &CudaOptions {
        &self.options
    }

    /// Whether the kernels may run on this group's GPUs (decided in [`new`](Self::new) from
    /// the probed topology, the same on every rank); the reason every request falls back
    /// otherwise.
    pub fn peer_access(&self) -> std::result::Result<(), FallbackReason> {
        self.peer_access.clone()
    }

    /// The probed links between every two ranks' GPUs, the verdict and its reason.
    pub fn topology(&self) -> &TopologyDecision {
        &self.topology
    }

    /// The block bound of one launch: the option, and at most an equal share of the
    /// multiprocessors when several ranks share the device.
    pub fn max_blocks(&self) -> u32 {
        block_bound(
            self.options.max_blocks,
            self.multiprocessors,
            self.options.ranks_per_device,
        )
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    fn sync_stream(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    fn refuse_while_capturing(&self, what: &str) -> Result<()> {
        if self.capturing()? {
            return Err(AllReduceError::InvalidArgument(format!(
                "{what} while the stream is being captured: call it before or after the capture"
            )));
        }
        Ok(())
    }

    /// Copies `bytes` from device address `src` to `offset` of the staging buffer on the
    /// backend's stream (recorded into the graph while the stream is being captured). The
    /// caller guarantees that `src` holds `bytes` readable bytes until the copy has run (a
    /// live buffer, or a cudarc view whose `device_ptr` guard is held, ordered on this
    /// stream).
    fn stage_from(
        &self,
        src: u64,
        staging: &CudaBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if offset
            .checked_add(bytes)
            .is_none_or(|end| end > staging.len())
        {
            return Err(AllReduceError::InvalidArgument(format!(
                "{bytes} bytes at offset {offset} do not fit the {}-byte staging buffer",
                staging.len()
            )));
        }
        self.bind()?;
        // SAFETY: the destination lies inside the live staging buffer (checked above); the
        // source holds `bytes` bytes (the caller's contract: a buffer or view it borrows for
        // the call, both checked against the element count); the copy is ordered on this
        // backend's stream with the launch that reads the staging buffer.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                staging.device_ptr() + offset as u64,
                src,
                bytes,
                self.stream.cu_stream(),
            )
        })
    }
}

/// How this rank's GPU reaches every rank's (by UUID, `uuids[rank]` its own): the same GPU,
/// NVML's answer (NVLink, PCIe, none) where NVML loads, else the driver's
/// `cuDeviceCanAccessPeer` for GPUs visible in this process, else unprobed (one GPU visible
/// per process and no NVML: CUDA IPC and the creation-time P2P data test decide). Never
/// fails: a probe error is traced and the link counts as unprobed.
fn probe_links(ctx: &Arc<CudaContext>, uuids: &[[u8; 16]], rank: usize) -> Vec<Link> {
    // Ranks that all share one GPU need no probe (and no NVML initialization, which takes
    // a while, at every creation).
    if uuids.iter().all(|u| *u == uuids[rank]) {
        return vec![Link::SameDevice; uuids.len()];
    }
    let nvml = match Nvml::shared() {
        Ok(nvml) => Some(nvml),
        Err(why) => {
            tracing::debug!(%why, "NVML not available: the topology probe uses the driver");
            None
        }
    };
    let visible = visible_devices().unwrap_or_else(|e| {
        tracing::debug!(error = %e, "listing the visible devices failed");
        Vec::new()
    });
    let own = ctx.cu_device();
    let mut row = Vec::with_capacity(uuids.len());
    for (peer, uuid) in uuids.iter().enumerate() {
        if peer == rank || *uuid == uuids[rank] {
            row.push(Link::SameDevice);
            continue;
        }
        if let Some(nvml) = &nvml {
            match nvml.link(&uuids[rank], uuid) {
                Ok(link) => {
                    row.push(link);
                    continue;
                }
                Err(why) => tracing::debug!(peer, %why, "NVML could not tell the link"),
            }
        }
        let link = match visible.iter().find(|(u, _)| u == uuid) {
            None => Link::Unknown,
            Some(&(_, dev)) => {
                let mut can = 0;
                // SAFETY: out-pointer to a local; both devices exist.
                let code = unsafe { sys::cuDeviceCanAccessPeer(&mut can, own, dev) };
                match check("cuDeviceCanAccessPeer", code) {
                    Ok(()) if can != 0 => Link::P2p,
                    Ok(()) => Link::NoP2p,
                    Err(e) => {
                        tracing::debug!(peer, error = %e, "cuDeviceCanAccessPeer failed");
                        Link::Unknown
                    }
                }
            }
        };
        row.push(link);
    }
    row
}

/// The devices visible in this process, by UUID.
fn visible_devices() -> Result<Vec<([u8; 16], sys::CUdevice)>> {
    let count = CudaContext::device_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
    let mut visible = Vec::new();
    for ordinal in 0..count {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointer to a local; the ordinal is in range.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, dev)
        })?;
        visible.push((uuid.bytes.map(|b| b as u8), dev));
    }
    Ok(visible)
}

/// Bytes of the packs the kernels move: outputs and zero-copy inputs are aligned to it.
const PACK_BYTES: usize = 16;

/// Whether a caller's input can be shared with peers zero-copy: 16-byte aligned and
/// exportable by legacy CUDA IPC; `false` (the staging copy is captured instead) for memory
/// legacy IPC cannot export, with the reason traced.
fn shareable_input<M: DevicePeerMemory>(memory: &M, addr: u64, bytes: usize) -> Result<bool> {
    if !addr.is_multiple_of(PACK_BYTES as u64) {
        tracing::debug!(
            addr,
            "captured input is not 16-byte aligned: its staging copy is captured"
        );
        return Ok(false);
    }
    match memory.check_shareable(addr, bytes) {
        Ok(()) => Ok(true),
        Err(tpcomm_ipc::IpcError::NotExportable { reason, .. }) => {
            tracing::debug!(addr, %reason, "captured input is not exportable: its staging copy is captured");
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// Fails unless a caller's stream (in context `found_ctx` of device `found_device`) can
/// carry the work of an all-reduce on `device`, whose primary context is `primary`.
fn check_stream_context(
    device: i32,
    primary: usize,
    found_ctx: usize,
    found_device: usize,
) -> Result<()> {
    if found_ctx == primary {
        return Ok(());
    }
    let found = if found_device as i64 == i64::from(device) {
        format!("another context of device {found_device} (not its primary context)")
    } else {
        format!("device {found_device}")
    };
    Err(AllReduceError::ForeignStream { device, found })
}

/// Blocks one launch may use: `max_blocks`, and at most an equal share of the
/// `multiprocessors` among `ranks_per_device` ranks (at least 1).
pub fn block_bound(max_blocks: u32, multiprocessors: u32, ranks_per_device: usize) -> u32 {
    let ranks = u32::try_from(ranks_per_device.max(1)).unwrap_or(u32::MAX);
    max_blocks.min((multiprocessors / ranks).max(1))
}

/// Whether the kernels serve a request: the agreed peer access first, then a kernel for
/// the element type, world size and size. Pure: the same on every rank given the same
/// arguments, so every rank takes the same path.
pub fn route(
    peer_access: &std::result::Result<(), FallbackReason>,
    world: usize,
    dtype: DType,
    bytes: usize,
    algorithm: Algorithm,
    max_blocks: u32,
) -> std::result::Result<(), FallbackReason> {
    peer_access.clone()?;
    kernels::launch_config(
        kernel_dtype(dtype),
        world,
        bytes as u64,
        kernel_algorithm(algorithm),
        max_blocks,
    )
    .map(drop)
    .map_err(|e| FallbackReason::NoKernel {
        reason: e.to_string(),
    })
}

fn kernel_dtype(dtype: DType) -> kernels::Dtype {
    match dtype {
        DType::F32 => kernels::Dtype::F32,
        DType::F16 => kernels::Dtype::F16,
        DType::Bf16 => kernels::Dtype::Bf16,
    }
}

fn kernel_algorithm(algorithm: Algorithm) -> kernels::Algorithm {
    match algorithm {
        Algorithm::OneStage => kernels::Algorithm::OneStage,
        Algorithm::TwoStage => kernels::Algorithm::TwoStage,
    }
}

fn timeout_ns(timeout: Duration) -> u64 {
    // 0 would mean "wait forever" to the kernels: a zero timeout waits 1 ns instead.
    u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// The error a kernel recorded in an error word, as the driver reports it; `shapes` are the
/// Signal block's mismatch words (this rank's launch shape, the peer's), read only for a
/// shape mismatch.
fn device_error(
    word: u32,
    shapes: [u32; 2],
    rank: usize,
    timeout: Duration,
) -> Option<AllReduceError> {
    match kernels::ErrorWord::decode(word) {
        kernels::ErrorWord::Clear => None,
        kernels::ErrorWord::ShapeMismatch(m) => {
            let mine = kernels::LaunchShape::decode(shapes[0]);
            let theirs = kernels::LaunchShape::decode(shapes[1]);
            Some(AllReduceError::LaunchMismatch {
                rank,
                bytes: mine.bytes,
                dtype: mine.dtype,
                slot: None,
                peer: m.peer,
                peer_bytes: theirs.bytes,
                peer_dtype: theirs.dtype,
                peer_slot: None,
            })
        }
        kernels::ErrorWord::Timeout(t) => Some(AllReduceError::Timeout {
            rank,
            peer: t.peer,
            barrier: match t.barrier {
                kernels::BarrierKind::Start => "start",
                kernels::BarrierKind::End => "end",
                kernels::BarrierKind::Mid => "mid",
            },
            waited: timeout,
        }),
        kernels::ErrorWord::Unknown(w) => Some(AllReduceError::InvalidArgument(format!(
            "the kernel recorded an unknown error word {w:#x}"
        ))),
    }
}

impl<M: DevicePeerMemory> Backend for CudaBackend<M> {
    type Memory = M;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Block `b` of one rank's launch synchronizes with block `b` of every peer's: every
    /// rank must launch with the same bound (it depends on `max_blocks`, the device's
    /// multiprocessors and `ranks_per_device`). Every rank shares its buffers through the
    /// same kind of peer memory (a legacy IPC rank cannot open a virtual-memory handle, nor
    /// the other way round).
    fn agreed_shape(&self) -> Vec<(&'static str, String)> {
        vec![
            ("max_blocks", self.max_blocks().to_string()),
            ("memory", self.memory.name().to_string()),
        ]
    }

    fn signal_bytes(&self) -> usize {
        kernels::SIGNAL_BYTES
    }

    fn nonce_offset(&self) -> usize {
        NONCE_OFFSET
    }

    /// Decides again from the links probed in `new`, with `Config::topology`.
    fn apply_topology_check(&mut self, check: TopologyCheck) {
        if check == TopologyCheck::Auto {
            return;
        }
        self.topology = topology::decide(&self.topology.links, check);
        self.peer_access = self.topology.verdict.clone();
        tracing::info!(
            rank = self.rank,
            ?check,
            reason = %self.topology.reason,
            "CUDA all-reduce topology overridden"
        );
    }

    /// Every CUDA communicator proves its mappings once at creation (vLLM's P2P check): each
    /// rank reads every peer's nonce through its peer-to-peer mapping.
    fn prove_at_creation(&self) -> bool {
        true
    }

    fn reset_signal(&self, _memory: &M, signal: &CudaBuffer) -> Result<()> {
        self.refuse_while_capturing("resetting the Signal block")?;
        self.bind()?;
        // SAFETY: this rank's own Signal block (a live CudaBuffer of at least SIGNAL_BYTES,
        // checked by the allocation), written on this backend's stream.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(
                signal.device_ptr(),
                0,
                NONCE_OFFSET,
                self.stream.cu_stream(),
            )
        })?;
        self.sync_stream()
    }

    fn launch(&self, _memory: &M, l: &Launch<'_, Self>) -> Result<()> {
        let bytes = l.count * l.dtype.size();
        let config = kernels::launch_config(
            kernel_dtype(l.dtype),
            l.world,
            bytes as u64,
            kernel_algorithm(l.algorithm),
            self.max_blocks(),
        )
        .map_err(|e| AllReduceError::InvalidArgument(e.to_string()))?;
        kernels::check_alignment(l.out)
            .map_err(|e| AllReduceError::InvalidArgument(e.to_string()))?;
        let function = self.module.function(config.kernel)?;
        let mut data = l.rank_data.device_ptr() + (l.slot * RANK_DATA_BYTES) as u64;
        let mut peers = l.rank_signals.device_ptr();
        let mut own = l.own_signal.device_ptr();
        let mut out = l.out;
        let mut rank = l.rank as i32;
        let mut elements = config.elements as i64;
        let mut timeout = timeout_ns(l.timeout);
        self.timeout_ns.store(timeout, Ordering::Relaxed);
        let mut params: [*mut c_void; 7] = [
            (&mut data as *mut u64).cast(),
            (&mut peers as *mut u64).cast(),
            (&mut own as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
            (&mut rank as *mut i32).cast(),
            (&mut elements as *mut i64).cast(),
            (&mut timeout as *mut u64).cast(),
        ];
        self.bind()?;
        // SAFETY: `function` belongs to the loaded module and takes exactly these seven
        // arguments (kernels/allreduce.cu: RankData*, RankSignals*, Signal*, void*, int,
        // long long, unsigned long long), each pointed to by `params` for the call; the
        // pointers name this rank's stable tables, own Signal block and an output of
        // `bytes` bytes that the driver checked; grid and block come from launch_config.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                config.blocks,
                1,
                1,
                config.threads,
                1,
                1,
                config.shared_mem_bytes,
                self.stream.cu_stream(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    fn supports(
        &self,
        world: usize,
        dtype: DType,
        bytes: usize,
        algorithm: Algorithm,
    ) -> std::result::Result<(), FallbackReason> {
        route(
            &self.peer_access,
            world,
            dtype,
            bytes,
            algorithm,
            self.max_blocks(),
        )
    }

    fn host_addressable(&self) -> bool {
        false
    }

    /// vLLM's cut-offs measured on NVLink ([`crate::dispatch::CUDA_ONE_STAGE_MAX_BYTES`]).
    fn one_stage_table(&self) -> &'static [usize; crate::dispatch::MAX_RANKS + 1] {
        &crate::dispatch::CUDA_ONE_STAGE_MAX_BYTES
    }

    fn write_table(
        &self,
        _memory: &M,
        table: &CudaBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        if offset
            .checked_add(bytes.len())
            .is_none_or(|end| end > table.len())
        {
            return Err(AllReduceError::InvalidArgument(format!(
                "{} bytes at offset {offset} do not fit the {}-byte table",
                bytes.len(),
                table.len()
            )));
        }
        self.refuse_while_capturing("writing a table")?;
        self.bind()?;
        // SAFETY: the range lies inside a live CudaBuffer (checked above); the source is
        // pageable host memory, which the driver stages before the call returns.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                table.device_ptr() + offset as u64,
                bytes.as_ptr().cast::<c_void>(),
                bytes.len(),
                self.stream.cu_stream(),
            )
        })?;
        self.sync_stream()
    }

    fn stage(
        &self,
        _memory: &M,
        input: &CudaBuffer,
        staging: &CudaBuffer,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        if range.start > range.end || range.end > input.len() {
            return Err(AllReduceError::InvalidArgument(format!(
                "bytes {range:?} do not fit the {}-byte input",
                input.len(),
            )));
        }
        // The input is a live CudaBuffer holding `range` (checked above).
        self.stage_from(
            input.device_ptr() + range.start as u64,
            staging,
            range.start,
            range.len(),
        )
    }

    fn capturing(&self) -> Result<bool> {
        use sys::CUstreamCaptureStatus as S;
        match self
            .stream
            .capture_status()
            .map_err(|e| driver_error("cuStreamIsCapturing", e))?
        {
            S::CU_STREAM_CAPTURE_STATUS_NONE => Ok(false),
            S::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(true),
            S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => Err(AllReduceError::InvalidArgument(
                "the stream's capture was invalidated by an earlier error".into(),
            )),
        }
    }

    fn synchronize(&self, memory: &M, own_signal: &CudaBuffer) -> Result<()> {
        self.refuse_while_capturing("synchronizing")?;
        self.sync_stream()?;
        let mut word = [0u8; 4];
        memory.read(own_signal, ERROR_OFFSET, &mut word)?;
        let word = u32::from_le_bytes(word);
        let mut shapes = [0u32; 2];
        if matches!(
            kernels::ErrorWord::decode(word),
            kernels::ErrorWord::ShapeMismatch(_)
        ) {
            let mut raw = [0u8; 8];
            memory.read(own_signal, MISMATCH_OFFSET, &mut raw)?;
            shapes = [
                u32::from_le_bytes(raw[..4].try_into().expect("4 bytes")),
                u32::from_le_bytes(raw[4..].try_into().expect("4 bytes")),
            ];
        }
        let waited = Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed));
        match device_error(word, shapes, self.rank, waited) {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// A CUDA graph of all-reduce launches captured by [`CustomAllReduce::capture_graph`], or
/// an engine's own graph adopted with [`CustomAllReduce::adopt_graph`].
pub struct DeviceGraph {
    graph: CudaGraph,
    launches: usize,
    owner: u64,
    /// The RankData slots its launches read.
    slots: Vec<usize>,
    /// For a graph from `capture_graph`: its inputs are shared while it lives (see
    /// `CaptureOwner`); an adopted graph's inputs must live as long as their slots.
    _alive: Option<CaptureOwner>,
}

// SAFETY: a DeviceGraph owns its CUgraph / CUgraphExec exclusively (cudarc's CudaGraph,
// which is not Send only because it holds raw driver handles) and an Arc of the stream
// (Send + Sync). CUDA graph objects are not tied to a thread: the driver only requires that
// calls on one graph object are serialized, which ownership gives (no `&self` method is
// shared across threads: DeviceGraph is deliberately not Sync), and every call binds the
// stream's context to the calling thread first (cudarc's `launch`, `Drop`).
unsafe impl Send for DeviceGraph {}

/// Where a caller's capture starts, in the communicator's record of captured launches
/// ([`CustomAllReduce::capture_mark`]); [`CustomAllReduce::adopt_graph`] takes it back to
/// know which launches (and so which RankData slots) the graph holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureMark {
    owner: u64,
    recorded: usize,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGraph")
            .field("launches", &self.launches)
            .finish()
    }
}

impl DeviceGraph {
    /// The all-reduces recorded.
    pub fn launches(&self) -> usize {
        self.launches
    }
}

impl<M: DevicePeerMemory> CustomAllReduce<CudaBackend<M>> {
    /// Captures the all-reduces `f` issues (through
    /// [`all_reduce_buffer`](Self::all_reduce_buffer)) on the backend's stream into a CUDA
    /// graph (thread-local capture mode) and instantiates it. Inputs not registered yet take
    /// the next RankData slots: call [`register_graph_buffers`](Self::register_graph_buffers)
    /// (collective) before the first [`replay_graph`](Self::replay_graph).
    pub fn capture_graph<F>(&mut self, f: F) -> Result<DeviceGraph>
    where
        F: FnOnce(&mut Self) -> Result<()>,
    {
        self.check_operation("capture_graph")?;
        let before = self.recorded_launches();
        let stream = self.backend().stream().clone();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_error("cuStreamBeginCapture_v2", e))?;
        // A capture that ends without a graph gives back the slots its calls took.
        let alive = CaptureOwner::default();
        let mut guard = CaptureGuard::new(self, &alive);
        let recorded = f(&mut guard);
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded?;
        let launches = guard.recorded_launches() - before;
        let graph = ended
            .map_err(|e| driver_error("cuStreamEndCapture", e))?
            .ok_or_else(|| {
                AllReduceError::InvalidArgument("the capture recorded nothing".into())
            })?;
        let graph = DeviceGraph {
            graph,
            launches,
            owner: guard.id(),
            slots: guard.recorded_slots(before),
            _alive: Some(alive),
        };
        guard.keep();
        Ok(graph)
    }

    /// Marks the start of a capture the caller runs on the backend's stream (an engine
    /// capturing its whole step, [`CudaBackend::with_stream`]): call it before
    /// `cuStreamBeginCapture` and hand it to [`adopt_graph`](Self::adopt_graph) with the
    /// graph the capture made.
    pub fn capture_mark(&self) -> CaptureMark {
        CaptureMark {
            owner: self.id(),
            recorded: self.recorded_launches(),
        }
    }

    /// Takes an engine's own graph (captured on the backend's stream after `mark`) under the
    /// communicator's replay checks: [`replay_graph`](Self::replay_graph) then refuses to
    /// launch it while captured inputs are unregistered, while the communicator is not
    /// Active, or once a registered buffer it reads was unregistered. An engine that keeps
    /// and launches its `CudaGraph` itself must call [`check_replay`](Self::check_replay)
    /// before every launch instead.
    ///
    /// Fails with [`AllReduceError::ForeignToken`] for a mark of another communicator.
    pub fn adopt_graph(&self, graph: CudaGraph, mark: CaptureMark) -> Result<DeviceGraph> {
        if mark.owner != self.id() {
            return Err(AllReduceError::ForeignToken {
                what: "a capture mark",
                owner: mark.owner,
                communicator: self.id(),
            });
        }
        Ok(DeviceGraph {
            graph,
            launches: self.recorded_launches().saturating_sub(mark.recorded),
            owner: self.id(),
            slots: self.recorded_slots(mark.recorded),
            _alive: None,
        })
    }

    /// All-reduce (sum) of a caller's device memory, vLLM's `custom_all_reduce(tensor)`:
    /// `input` and `output` are any cudarc views ([`CudaSlice`](cudarc::driver::CudaSlice),
    /// [`CudaView`](cudarc::driver::CudaView), [`CudaBuffer::view`](tpcomm_ipc::CudaBuffer::view))
    /// of `f32`, `f16` or `bf16`; the whole input (`input.len()` elements) is reduced into
    /// the first `input.len()` elements of `output`. Everything is issued on the backend's
    /// stream ([`CudaBackend::with_stream`]: the caller's), asynchronously.
    ///
    /// - **Eager**: the input is copied into the registered staging buffer
    ///   (stream-ordered), the kernel writes straight into `output`. A registered input
    ///   ([`register_buffer`](Self::register_buffer), passed as its
    ///   [`view`](tpcomm_ipc::CudaBuffer::view)) is reduced without the copy.
    /// - **During a capture of the stream** (the caller's own `cuStreamBeginCapture`, or
    ///   [`capture_graph`](Self::capture_graph)): the call takes the next RankData slot (one
    ///   per call), filled by [`register_graph_buffers`](Self::register_graph_buffers) after
    ///   the capture. Memory that legacy CUDA IPC can export (`cuMemAlloc`, e.g.
    ///   [`CudaMemory::allocate`](tpcomm_ipc::PeerMemory::allocate)) and is 16-byte
    ///   aligned is shared zero-copy; anything else (cudarc's own allocations come from the
    ///   stream-ordered pool, which legacy IPC cannot export) has its staging copy captured
    ///   into the graph, so the graph is correct either way.
    ///
    /// Errors, before anything runs on this rank: [`AllReduceError::BufferTooSmall`]
    /// (output shorter than the input), then [`AllReduceError::Fallback`] (empty, a size
    /// not a multiple of 16 bytes, above `max_bytes`, no kernel or no peer access: every
    /// rank of a same-shaped call gets the same reason, decided before this rank's phase or
    /// output alignment is looked at, so that a rank whose communicator failed or whose
    /// output is misaligned still joins its peers in the fallback), then the phase, then
    /// [`AllReduceError::Misaligned`] (output not 16-byte aligned, for a call the kernels
    /// serve). The checks of every launch (shape word at the start barrier, region limits
    /// of every slot) apply as for [`all_reduce_buffer`](Self::all_reduce_buffer).
    pub fn all_reduce_device<T, I, O>(&mut self, input: &I, output: &mut O) -> Result<Algorithm>
    where
        T: Element,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let count = input.len();
        if output.len() < count {
            return Err(AllReduceError::BufferTooSmall {
                buffer: "output",
                len: output.len(),
                count,
            });
        }
        let memory = self.memory()?.clone();
        let stream = self.backend().stream().clone();
        // cudarc's protocol: the stream waits for earlier writes of the input and for earlier
        // reads and writes of the output (where the caller's context tracks events); the
        // guards record this call's use when they drop, after everything is issued.
        let (input_addr, _input_guard) = input.device_ptr(&stream);
        let (out, _output_guard) = output.device_ptr_mut(&stream);
        let bytes = count.saturating_mul(T::DTYPE.size());
        let stage_captured = self.backend().options().stage_captured_inputs;
        let shareable = || Ok(!stage_captured && shareable_input(&memory, input_addr, bytes)?);
        let stage = |backend: &CudaBackend<M>, staging: &CudaBuffer, bytes: usize| {
            // The input view holds `count` elements, `bytes` bytes, and its guard is held
            // until the copy is issued.
            backend.stage_from(input_addr, staging, 0, bytes)
        };
        self.all_reduce_external(
            "all_reduce_device",
            input_addr,
            shareable,
            stage,
            out,
            T::DTYPE,
            count,
        )
    }

    /// Launches a captured graph on the backend's stream (asynchronously; see
    /// [`synchronize`](Self::synchronize)). Refused while captured inputs are unregistered
    /// or the communicator is not Active, since the graph's launches would read unwritten
    /// table slots or closed mappings, for a graph another communicator captured
    /// ([`AllReduceError::ForeignToken`]), and for a graph reading a registered buffer
    /// unregistered since ([`AllReduceError::UnregisteredInput`]).
    ///
    /// The graph writes the outputs (and reads the zero-copy inputs) its calls named when
    /// they were captured: a `DeviceGraph` borrows no buffer, as a cudarc `CudaGraph` does
    /// not, so they must still be allocated when it replays. This is not checked.
    pub fn replay_graph(&mut self, graph: &DeviceGraph) -> Result<()> {
        if graph.owner != self.id() {
            return Err(AllReduceError::ForeignToken {
                what: "a device graph",
                owner: graph.owner,
                communicator: self.id(),
            });
        }
        self.check_replay()?;
        self.check_slots_live(&graph.slots)?;
        graph
            .graph
            .launch()
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_sharing_a_device_split_its_multiprocessors() {
        // H200: 132 multiprocessors.
        assert_eq!(block_bound(36, 132, 1), 36);
        assert_eq!(block_bound(36, 132, 4), 33);
        assert_eq!(block_bound(36, 132, 8), 16);
        assert_eq!(block_bound(64, 132, 2), 64);
        // Never zero, whatever the split.
        assert_eq!(block_bound(36, 4, 8), 1);
        assert_eq!(block_bound(36, 132, 0), 36);
    }

    #[test]
    fn requests_route_to_the_kernels_or_name_why_not() {
        let ok = Ok(());
        let one = Algorithm::OneStage;
        assert_eq!(route(&ok, 2, DType::Bf16, 4096, one, 36), Ok(()));
        assert_eq!(
            route(&ok, 8, DType::F32, 8 << 20, Algorithm::TwoStage, 16),
            Ok(())
        );
        for world in [1, 3, 5, 7] {
            match route(&ok, world, DType::F32, 4096, one, 36) {
                Err(FallbackReason::NoKernel { reason }) => {
                    assert!(reason.contains(&format!("world size {world}")), "{reason}")
                }
                other => panic!("world {world}: {other:?}"),
            }
        }
        // Peer access is checked first: no P2P means NCCL whatever the size.
        let no_p2p = Err(FallbackReason::NoPeerAccess { rank: 1, peer: 3 });
        assert_eq!(
            route(&no_p2p, 4, DType::F16, 4096, one, 36),
            Err(FallbackReason::NoPeerAccess { rank: 1, peer: 3 })
        );
    }

    #[test]
    fn shape_mismatch_words_name_both_ranks_and_sizes() {
        // error_word(kShape, block 0, peer 1); launch_shape<float>(1024) and <float>(2048).
        let word = 0x8000_0000 | (4 << 16) | 1;
        match device_error(word, [(1 << 28) | 256, (1 << 28) | 512], 0, Duration::ZERO) {
            Some(AllReduceError::LaunchMismatch {
                rank: 0,
                bytes: 4096,
                dtype: "f32",
                slot: None,
                peer: 1,
                peer_bytes: 8192,
                peer_dtype: "f32",
                peer_slot: None,
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn error_words_become_timeouts_naming_the_peer_and_barrier() {
        assert!(device_error(0, [0; 2], 0, Duration::ZERO).is_none());
        let word = 0x8000_0000 | (3 << 16) | (7 << 8) | 2;
        match device_error(word, [0; 2], 5, Duration::from_millis(40)) {
            Some(AllReduceError::Timeout {
                rank: 5,
                peer: 2,
                barrier: "mid",
                waited,
            }) => assert_eq!(waited, Duration::from_millis(40)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            device_error(0x1234, [0; 2], 0, Duration::ZERO),
            Some(AllReduceError::InvalidArgument(_))
        ));
    }

    #[test]
    fn device_graphs_can_move_to_another_thread() {
        fn send<T: Send>() {}
        send::<DeviceGraph>();
    }

    #[test]
    fn a_callers_stream_must_be_in_the_devices_primary_context() {
        assert!(check_stream_context(1, 0x10, 0x10, 1).is_ok());
        match check_stream_context(1, 0x10, 0x20, 1) {
            Err(AllReduceError::ForeignStream { device: 1, found }) => {
                assert!(found.contains("not its primary context"), "{found}")
            }
            other => panic!("{other:?}"),
        }
        match check_stream_context(1, 0x10, 0x20, 3) {
            Err(AllReduceError::ForeignStream { device: 1, found }) => {
                assert_eq!(found, "device 3")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_zero_timeout_never_means_wait_forever() {
        assert_eq!(timeout_ns(Duration::ZERO), 1);
        assert_eq!(timeout_ns(Duration::from_secs(30)), 30_000_000_000);
        assert_eq!(timeout_ns(Duration::MAX), u64::MAX);
    }
}
