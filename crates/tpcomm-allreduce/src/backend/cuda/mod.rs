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
//! - **Caller memory.**
//!   [`CustomAllReduce::all_reduce_device`](crate::CustomAllReduce::all_reduce_device)
//!   takes cudarc views (`DevicePtr` / `DevicePtrMut`): staged eagerly; inside a capture of
//!   the stream, shared zero-copy when legacy IPC can export the input, else with the
//!   staging copy captured.
//! - **Capture.** While the stream is being captured (`cuStreamIsCapturing`),
//!   `CustomAllReduce` gives each new input the next RankData slot and records the launch;
//!   nothing is copied between host and device and no table is written until
//!   [`register_graph_buffers`](crate::CustomAllReduce::register_graph_buffers).
//!   [`capture_graph`](crate::CustomAllReduce::capture_graph) captures and instantiates a
//!   graph; [`replay_graph`](crate::CustomAllReduce::replay_graph) refuses to launch it
//!   while captured inputs are unregistered or the communicator is not Active.
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

mod copies;
mod device;
mod driver_api;
mod graph;
mod launch;
mod probe;
mod signal;

#[cfg(test)]
mod tests;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};
use tpcomm_ipc::{CudaBuffer, CudaMemory, DevicePeerMemory};
use tpcomm_kernels as kernels;
use tpcomm_transport::Communicator;

pub(crate) use copies::shareable_input;
use device::Module;
pub(crate) use driver_api::driver_error;
pub(crate) use graph::SendGraph;
pub use launch::{block_bound, route};
use probe::probe_links;
use signal::NONCE_OFFSET;

use super::{Backend, Launch};
use crate::dispatch::{Algorithm, FallbackReason};
use crate::dtype::DType;
use crate::error::{AllReduceError, Result};
use crate::topology::{self, Link, TopologyCheck, TopologyDecision};

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

/// The CUDA backend of [`CustomAllReduce`](crate::CustomAllReduce): one device, one stream
/// (its own or the caller's), the fatbin loaded, the topology decided.
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
        self.reset_launch_state(signal)
    }

    fn launch(&self, _memory: &M, l: &Launch<'_, Self>) -> Result<()> {
        self.launch_kernel(l)
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
    fn builtin_dispatch(&self) -> crate::dispatch::DispatchTable {
        crate::dispatch::DispatchTable::cuda()
    }

    fn write_table(
        &self,
        _memory: &M,
        table: &CudaBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        self.write_on_stream(table, offset, bytes)
    }

    fn stage(
        &self,
        _memory: &M,
        input: &CudaBuffer,
        staging: &CudaBuffer,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        self.stage_range(input, staging, range)
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
        self.drain(memory, own_signal)
    }
}
