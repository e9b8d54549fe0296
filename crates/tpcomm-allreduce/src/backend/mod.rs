//! The backend trait the driver runs on, and its backends. `unsafe` lives here only.
//!
//! A backend knows its Signal block layout and how to run one launch. The driver
//! ([`CustomAllReduce`](crate::CustomAllReduce)) owns everything else: allocations, the
//! stable tables, registration, capture and the lifecycle, identical for every backend.

pub mod host;

use std::fmt::Debug;
use std::time::Duration;

use tpcomm_ipc::PeerMemory;

use crate::dispatch::Algorithm;
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
    /// The slot of the pool holding the inputs' addresses.
    pub slot: usize,
    /// This rank's Signal block.
    pub own_signal: &'a Buffer<B>,
    /// Where the result goes: an address of `count * dtype.size()` writable bytes that the
    /// driver guarantees valid for the launch.
    pub out: u64,
    /// Bound on every barrier wait.
    pub timeout: Duration,
}

/// What a device (or the CPU) provides to run the custom all-reduce.
pub trait Backend: Send + Sync + Debug + 'static {
    /// The peer-memory backend its buffers come from.
    type Memory: PeerMemory;

    /// A short name.
    fn name(&self) -> &'static str;

    /// Bytes of a Signal block.
    fn signal_bytes(&self) -> usize;

    /// Offset of the 64-bit nonce word in a Signal block (written by the host after a resume,
    /// never by launches).
    fn nonce_offset(&self) -> usize;

    /// Zeroes the flags and counters of this rank's Signal block.
    fn reset_signal(&self, memory: &Self::Memory, signal: &Buffer<Self>) -> Result<()>;

    /// Runs (or enqueues, for a device) one launch.
    fn launch(&self, memory: &Self::Memory, launch: &Launch<'_, Self>) -> Result<()>;
}
