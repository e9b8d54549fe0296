//! The backend trait [`CustomAllReduce`](crate::CustomAllReduce) runs on, and its backends.
//! `unsafe` lives here only.
//!
//! A backend knows its Signal block layout and how to run one launch.
//! [`CustomAllReduce`](crate::CustomAllReduce) owns everything else: allocations, the
//! stable tables, registration, capture and the lifecycle, identical for every backend.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
#[cfg(feature = "cuda")]
mod nvml;

use std::fmt::Debug;
use std::time::Duration;

use tpcomm_ipc::PeerMemory;

use crate::dispatch::{Algorithm, DispatchTable, FallbackReason};
use crate::dtype::DType;
use crate::error::Result;

/// The local buffer type of a backend's peer memory.
pub type Buffer<B> = <<B as Backend>::Memory as PeerMemory>::Buffer;

/// Bytes of a RankSignals table: 8 Signal addresses, then 8 temp-buffer addresses.
pub const RANK_SIGNALS_BYTES: usize = 2 * 8 * 8;
/// Bytes of one RankData slot: 8 input addresses.
pub const RANK_DATA_BYTES: usize = 8 * 8;

/// One launch, as the backend sees it. Peer addresses are *not* here: the backend reads
/// them from the tables when the launch runs, so a recorded launch stays valid when a
/// resume rewrites the tables.
///
/// Only `CustomAllReduce` makes launches (a private field): [`Backend::launch`] is safe
/// because everything a launch names was checked by `CustomAllReduce`, so safe code cannot
/// hand a backend an address of its own choosing. A backend that wraps another hands its launch on with
/// [`Launch::run_on`].
///
/// ```compile_fail
/// # use tpcomm_allreduce::backend::Launch;
/// # use tpcomm_allreduce::{Algorithm, DType, HostBackend};
/// # use tpcomm_ipc::{HostBuffer, HostMemory};
/// fn forge<'a>(tables: &'a HostBuffer) -> Launch<'a, HostBackend<HostMemory>> {
///     Launch {
///         algorithm: Algorithm::OneStage,
///         dtype: DType::F32,
///         count: 64,
///         rank: 0,
///         world: 1,
///         rank_signals: tables,
///         rank_data: tables,
///         slot: 0,
///         own_signal: tables,
///         out: 0x10,
///         own_input: None,
///         timeout: std::time::Duration::from_secs(1),
///     }
/// }
/// ```
#[derive(Debug)]
pub struct Launch<'a, B: Backend + ?Sized> {
    /// One-stage or two-stage.
    pub algorithm: Algorithm,
    /// Element type.
    pub dtype: DType,
    /// Elements to reduce.
    pub count: usize,
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// The RankSignals table (this rank's, stable address).
    pub rank_signals: &'a Buffer<B>,
    /// The RankData pool (stable address).
    pub rank_data: &'a Buffer<B>,
    /// The slot of the pool holding the inputs' addresses. `CustomAllReduce` checked that
    /// every rank's region there, and every rank's temp buffer for two-stage, holds
    /// `count * dtype.size()` bytes.
    pub slot: usize,
    /// This rank's Signal block.
    pub own_signal: &'a Buffer<B>,
    /// Where the result goes: an address of `count * dtype.size()` writable bytes that
    /// `CustomAllReduce` guarantees valid for the launch.
    pub out: u64,
    /// This rank's input when the launch reads it from the caller's memory instead of from
    /// its slot: set by the eager path only when [`Backend::private_part`] named a part that
    /// peers never read (that part was not staged), `count * dtype.size()` readable bytes
    /// valid for the launch. `None`: every rank's input is read from the slot.
    pub own_input: Option<u64>,
    /// Bound on every barrier wait.
    pub timeout: Duration,
    /// What `CustomAllReduce` checked the launch against.
    pub(crate) checked: Checked,
}

/// What `CustomAllReduce` checked a launch against, taken from the backend it launched on:
/// a backend that receives the launch from a wrapper ([`Launch::run_on`]) must need no
/// more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Checked {
    /// Every rank's Signal block holds at least this many bytes.
    pub(crate) signal_bytes: usize,
    /// `out` may be an address of host memory (the backend accepted host slices).
    pub(crate) host_addressable: bool,
    /// With [`Launch::own_input`] set: the part of this rank's input that was not staged.
    pub(crate) private: Option<std::ops::Range<usize>>,
}

impl<B: Backend + ?Sized> Launch<'_, B> {
    /// Runs this launch on `inner`, a backend over the same memory that the backend it was
    /// made for (a wrapper, such as a test's recording backend) delegates to. Refused with
    /// [`AllReduceError::InvalidArgument`](crate::AllReduceError::InvalidArgument) before
    /// anything runs when `inner` needs more than `CustomAllReduce` checked: larger Signal
    /// blocks than every rank's holds, device addresses where the output may be host
    /// memory, or another private part of this rank's input than the one left unstaged.
    pub fn run_on<C>(&self, inner: &C, memory: &C::Memory) -> Result<()>
    where
        C: Backend<Memory = B::Memory> + ?Sized,
    {
        let refuse = |why: String| Err(crate::AllReduceError::InvalidArgument(why));
        if inner.signal_bytes() > self.checked.signal_bytes {
            return refuse(format!(
                "the {} backend reads {}-byte Signal blocks; the launch was checked for {} bytes",
                inner.name(),
                inner.signal_bytes(),
                self.checked.signal_bytes
            ));
        }
        if self.checked.host_addressable && !inner.host_addressable() {
            return refuse(format!(
                "the {} backend cannot address the output of a launch made for host memory",
                inner.name()
            ));
        }
        if self.own_input.is_some() {
            let private = inner.private_part(
                self.algorithm,
                self.dtype,
                self.count,
                self.rank,
                self.world,
            );
            if private != self.checked.private {
                return refuse(format!(
                    "the {} backend reads elements {private:?} of this rank's input privately; \
                     the launch left {:?} unstaged",
                    inner.name(),
                    self.checked.private
                ));
            }
        }
        let launch = Launch::<C> {
            algorithm: self.algorithm,
            dtype: self.dtype,
            count: self.count,
            rank: self.rank,
            world: self.world,
            rank_signals: self.rank_signals,
            rank_data: self.rank_data,
            slot: self.slot,
            own_signal: self.own_signal,
            out: self.out,
            own_input: self.own_input,
            timeout: self.timeout,
            checked: self.checked.clone(),
        };
        inner.launch(memory, &launch)
    }
}

/// What a device (or the CPU) provides to run the custom all-reduce.
pub trait Backend: Send + Sync + Debug + 'static {
    /// The peer-memory backend its buffers come from.
    type Memory: PeerMemory;

    /// A short name.
    fn name(&self) -> &'static str;

    /// Bytes of a Signal block.
    fn signal_bytes(&self) -> usize;

    /// Settings of this backend that every rank's must equal, as (name, value) pairs, on
    /// top of [`name`](Self::name), [`signal_bytes`](Self::signal_bytes) and
    /// [`nonce_offset`](Self::nonce_offset) (which `CustomAllReduce` always compares): a
    /// launch reads its peers' Signal blocks with this rank's layout and synchronizes with
    /// their launches step for step. [`CustomAllReduce::new`](crate::CustomAllReduce::new)
    /// compares them across ranks and refuses a mismatch on every rank.
    fn agreed_shape(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// Offset of the 64-bit nonce word in a Signal block (written by the host after a resume,
    /// never by launches).
    fn nonce_offset(&self) -> usize;

    /// Zeroes the flags and counters of this rank's Signal block.
    fn reset_signal(&self, memory: &Self::Memory, signal: &Buffer<Self>) -> Result<()>;

    /// Runs (or enqueues, for a device) one launch.
    fn launch(&self, memory: &Self::Memory, launch: &Launch<'_, Self>) -> Result<()>;

    /// Whether this backend has a launch for `bytes` of `dtype` on `world` ranks with
    /// `algorithm`; the reason otherwise. Asked before anything runs, so a refusal is a
    /// [`Fallback`](crate::AllReduceError::Fallback) that leaves the communicator usable.
    fn supports(
        &self,
        world: usize,
        dtype: DType,
        bytes: usize,
        algorithm: Algorithm,
    ) -> std::result::Result<(), FallbackReason> {
        let _ = (world, dtype, bytes, algorithm);
        Ok(())
    }

    /// The backend's built-in dispatch table: which algorithm serves which size when no
    /// table file says otherwise. By default [`DispatchTable::host_same_inputs`] (the same
    /// rows for staged and registered inputs, as a backend whose shapes leave the slot out
    /// needs); the host backend's [`DispatchTable::host`], the CUDA backend's
    /// [`DispatchTable::cuda`]. Every rank of a group uses the same table (its digest is
    /// agreed in `new`).
    fn builtin_dispatch(&self) -> DispatchTable {
        DispatchTable::host_same_inputs()
    }

    /// The algorithms this backend has launches for (a dispatch table naming another is
    /// refused at creation): both by default.
    fn algorithms(&self) -> &'static [Algorithm] {
        &Algorithm::ALL
    }

    /// Whether the launch shapes this backend compares across ranks include the RankData
    /// slot, so that ranks launching from different slots (one from its staging buffer, one
    /// from a registered input) fail with a mismatch instead of running different
    /// algorithms: then a dispatch table may give staged and registered inputs different
    /// rows. False by default (both must take the same rows); the host backend's shapes
    /// include it.
    fn shape_includes_slot(&self) -> bool {
        false
    }

    /// Applies [`Config::topology`](crate::Config::topology) (called once by
    /// `CustomAllReduce::new`, before anything is decided): a backend that probes the
    /// topology decides again from its probe with `check`. The host backend has nothing to
    /// decide.
    fn apply_topology_check(&mut self, check: crate::topology::TopologyCheck) {
        let _ = check;
    }

    /// Whether `CustomAllReduce::new` runs a one-time data test of the peer mappings before
    /// first use (each rank writes a nonce into its Signal block, every peer reads it
    /// through its mapping; a mismatch fails creation on every rank). The CUDA backend does
    /// (P2P can be reported and still not carry data); the host backend's mappings are
    /// proved by every resume already.
    fn prove_at_creation(&self) -> bool {
        false
    }

    /// True when the eager and registered entry points that take host slices
    /// ([`all_reduce`](crate::CustomAllReduce::all_reduce),
    /// [`all_reduce_registered`](crate::CustomAllReduce::all_reduce_registered)) can write
    /// their output: the backend's launches address host memory. A device backend returns
    /// false and serves [`all_reduce_buffer`](crate::CustomAllReduce::all_reduce_buffer).
    fn host_addressable(&self) -> bool {
        true
    }

    /// Writes `bytes` at `offset` of one of this rank's own buffers that launches read (a
    /// stable table, or the nonce of its Signal block), ordered after every launch issued
    /// before and before every launch issued after.
    fn write_table(
        &self,
        memory: &Self::Memory,
        table: &Buffer<Self>,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        Ok(memory.write(table, offset, bytes)?)
    }

    /// The elements of this rank's input that no peer reads in a launch of `algorithm` (its
    /// own part of a two-stage reduction), or `None` when peers read all of it (the
    /// default). The eager path stages only the rest and passes the caller's input as
    /// [`Launch::own_input`]; a backend that returns `Some` must read this rank's input from
    /// there when it is set.
    fn private_part(
        &self,
        algorithm: Algorithm,
        dtype: DType,
        count: usize,
        rank: usize,
        world: usize,
    ) -> Option<std::ops::Range<usize>> {
        let _ = (algorithm, dtype, count, rank, world);
        None
    }

    /// Copies the bytes `range` of `input` to the same bytes of `staging` (the eager path:
    /// all of the input, or what is left of it around [`private_part`](Self::private_part)),
    /// ordered like a launch.
    fn stage(
        &self,
        memory: &Self::Memory,
        input: &Buffer<Self>,
        staging: &Buffer<Self>,
        range: std::ops::Range<usize>,
    ) -> Result<()>;

    /// True while this backend's launches are being recorded into a device graph (CUDA
    /// stream capture) instead of running: inputs then take RankData slots filled later by
    /// [`register_graph_buffers`](crate::CustomAllReduce::register_graph_buffers), and
    /// nothing may copy between host and device.
    fn capturing(&self) -> Result<bool> {
        Ok(false)
    }

    /// Waits until every launch issued so far has finished, and reports a barrier timeout
    /// that a device launch recorded in this rank's Signal block. The host backend runs
    /// launches to completion on the calling thread, so it has nothing to wait for.
    fn synchronize(&self, memory: &Self::Memory, own_signal: &Buffer<Self>) -> Result<()> {
        let _ = (memory, own_signal);
        Ok(())
    }
}

/// Whether the `bytes`-byte ranges at `a` and `b` overlap.
pub(crate) fn overlap(a: u64, b: u64, bytes: usize) -> bool {
    let bytes = bytes as u64;
    a < b.saturating_add(bytes) && b < a.saturating_add(bytes)
}

/// The splitmix64 finalizer: spreads every input bit over the whole word (nonces, shape
/// digests).
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
