//! [`PeerMappings`]: exchange handles, open every peer's once, close all, reopen all.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tpcomm_transport::hosts::Hosts;
use tpcomm_transport::process::ProcessIdentity;
use tpcomm_transport::Communicator;

use crate::error::Result;
use crate::memory::{PeerMemory, Region};
use crate::step::{tagged_all_gather_as, Step, StepTag};

mod close;
mod exchange;
mod kept_ranges;
mod lookup;
mod memo;
mod release;
mod reopen;
mod steps;

/// A handle as it travels: tagged with the group that exchanged it and its exporter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope<H> {
    /// The group id agreed by the registry's ranks.
    pub group: u64,
    /// Rank (in that group) of the exporter.
    pub rank: u32,
    /// The backend handle.
    pub handle: H,
}

/// Identifies one exchange of a [`PeerMappings`] (the regions shared in one call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExchangeId(usize);

/// A peer region whose mapping would keep this process from being checkpointed and
/// restored with its peers ([`PeerMappings::checkpoint_blockers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointBlocker {
    /// The exchange that shared it.
    pub exchange: ExchangeId,
    /// The rank that shared it.
    pub rank: usize,
    /// Its index in the exchange.
    pub index: usize,
    /// Its length as the peer announced it.
    pub len: usize,
    /// Why (the backend's [`checkpoint_blocker`](PeerMemory::checkpoint_blocker)).
    pub reason: String,
}

/// Open/close counters, for tests and tracing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Mappings open now.
    pub open: usize,
    /// Mappings opened since creation.
    pub opens: u64,
    /// Mappings closed since creation.
    pub closes: u64,
    /// Reopens in which no rank's handles had changed, so that every rank reopened the
    /// handles it kept (see [`PeerMappings::reopen_all`]).
    pub reopens_in_place: u64,
    /// Reopens in which this rank did not export its regions again: the backend's
    /// [`export_stamp`](crate::PeerMemory::export_stamp) had not changed since they were
    /// last exported (nothing allocated or freed), so its handles were the ones it shared.
    pub exports_skipped: u64,
    /// Mappings a reopen put back at the address they had before the close (backends that
    /// [keep addresses](crate::PeerMemory::keeps_addresses)).
    pub kept_addresses: u64,
    /// Mappings of exchanged regions that a reopen put at another address although the
    /// backend keeps addresses: the fresh handle did not fit the kept range (another size),
    /// or the range was not kept.
    pub moved_addresses: u64,
}

#[derive(Debug)]
struct Exchange<H> {
    /// This rank's regions, re-exported on reopen.
    local: Vec<Region>,
    /// The handles this rank shared for `local` last time, compared with fresh ones on
    /// reopen.
    sent: Vec<H>,
    /// `slots[rank][index]`: the mapping slab index for each peer region (`None` for own).
    slots: Vec<Vec<Option<usize>>>,
    /// The backend's export stamp read before `sent` was last exported or found equal to a
    /// fresh export: while the stamp stays so, exporting `local` again gives `sent`.
    stamp: Option<u64>,
    /// [`PeerMappings::release`] ended it: it shares and maps nothing any more.
    released: bool,
}

/// One opened handle. Slots an exchange refers to keep their handle while closed, so that a
/// reopen whose handles did not change reopens them in place; `close_all` forgets the others
/// (opened by `import` only).
#[derive(Debug)]
struct Slot<B: PeerMemory> {
    handle: B::Handle,
    /// `None` while closed.
    mapping: Option<B::Mapping>,
    /// While closed, for a backend that keeps addresses: the mapping, detached, holding its
    /// address range for the reopen.
    detached: Option<B::Mapping>,
}

/// The registry of every peer mapping of one group of ranks.
///
/// - [`exchange`](Self::exchange) (collective): every rank exports handles for its regions,
///   all-gathers them through `tpcomm-objects` over the caller's communicator and opens every
///   peer's; a memo keyed by handle guarantees a handle is opened once per process. Opening
///   failures are agreed: every rank fails together and the exchange is rolled back.
/// - [`close_all`](Self::close_all) closes every imported mapping and leaves local memory
///   alone; [`reopen_all`](Self::reopen_all) (collective) exports fresh handles of the same
///   regions, exchanges and reopens. Addresses may change: [`peer`](Self::peer) hands out
///   borrows tied to `&self`, so no mapping can be reached after it was closed.
/// - With a backend that [keeps addresses](PeerMemory::keeps_addresses) (`CudaVmmMemory`,
///   `HostMemory::stable`), `close_all` detaches the mappings of exchanged regions instead
///   (their address ranges stay reserved) and `reopen_all` maps each region's fresh handle
///   back into its own range: every peer address is what it was
///   ([`Counters::kept_addresses`]). A fresh handle that does not fit its range (a peer
///   shared a region of another size) opens elsewhere ([`Counters::moved_addresses`]).
/// - Every collective step carries a [`StepTag`] (operation, group id, sequence number of
///   the step in the group): a rank that is in another step (it skipped one, or runs another
///   collective on the same communicator) is reported by every rank as
///   [`IpcError::StepMismatch`] naming it and its step, before anything it sent is decoded.
///   [`agree`](Self::agree) lets the layer above tag its own steps in the same sequence.
/// - Peer memory is shared within one host: creation gathers every rank's process identity
///   ([`hosts`](Self::hosts)), and a handle from a rank on another host (another kernel boot
///   or PID namespace, where its pid and descriptor number mean nothing) is refused with
///   [`IpcError::OtherHost`] before any descriptor is fetched.
///
/// ```
/// use tpcomm_ipc::{HostMemory, MemoryRegion, PeerMappings, PeerMemory, Region};
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<Vec<u8>> {
///     let mem = HostMemory::new();
///     let mine = mem.allocate(4096)?;
///     mem.write(&mine, 0, &[comm.rank() as u8 + 1; 8])?;
///     let mut peers = PeerMappings::new(mem, &comm)?;
///     let id = peers.exchange(&comm, &[Region { addr: mine.addr(), len: 4096 }])?;
///     let other = 1 - comm.rank();
///     let mut got = vec![0u8; 8];
///     peers.backend().read(peers.peer(id, other, 0)?, 0, &mut got)?;
///     peers.close_all()?;
///     Ok(got)
/// });
/// assert_eq!(results[0].as_ref().unwrap().as_ref().unwrap(), &vec![2u8; 8]);
/// ```
///
/// [`IpcError::StepMismatch`]: crate::IpcError::StepMismatch
/// [`IpcError::OtherHost`]: crate::IpcError::OtherHost
#[derive(Debug)]
pub struct PeerMappings<B: PeerMemory> {
    backend: B,
    rank: usize,
    size: usize,
    group: u64,
    /// Every rank's process identity, gathered at creation, grouped by host.
    hosts: Hosts,
    exchanges: Vec<Exchange<B::Handle>>,
    /// Opened handles and their mappings; `None` once released (indices stay stable while
    /// the handles do).
    slab: Vec<Option<Slot<B>>>,
    /// Handle -> slab index, so a handle is opened once per process.
    memo: HashMap<B::Handle, usize>,
    closed: bool,
    counters: Counters,
    /// Tagged collective steps run so far (the next step's sequence number).
    sequence: u64,
}

/// A per-process random-enough id (of a group, a queue): time, pid and a stack address
/// mixed. Not secret: it tells honest peers' objects apart, nothing more.
pub fn fresh_group_id() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let mut z = t ^ (u64::from(std::process::id()) << 32) ^ (&local as *const u8 as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<B: PeerMemory> PeerMappings<B> {
    /// Collective: creates the registry of this group; rank 0's fresh group id is agreed so
    /// that handles from any other group are recognised and refused, and every rank's process
    /// identity is gathered, so that handles from another host are refused too.
    pub fn new<C: Communicator + ?Sized>(backend: B, comm: &C) -> Result<Self> {
        Ok(Self::new_agreeing(backend, comm, &())?.0)
    }

    /// [`new`](Self::new), all-gathering `value` in the same (tagged) collective: a layer
    /// above checks its settings across ranks at no extra round trip. Returns every rank's
    /// value, in rank order; comparing them is the caller's business.
    pub fn new_agreeing<C, T>(backend: B, comm: &C, value: &T) -> Result<(Self, Vec<T>)>
    where
        C: Communicator + ?Sized,
        T: Serialize + DeserializeOwned,
    {
        let tag = StepTag {
            step: Step::Create,
            group: 0,
            sequence: 0,
        };
        let identity = ProcessIdentity::current().encode().to_vec();
        let all: Vec<(u64, Vec<u8>, T)> =
            tagged_all_gather_as(comm, tag, &(fresh_group_id(), identity, value))?;
        let group = all.first().map_or(0, |(group, _, _)| *group);
        let mut identities = Vec::with_capacity(all.len());
        let mut values = Vec::with_capacity(all.len());
        for (_, identity, value) in all {
            // Bytes of another length decode as the unknown identity, on no host.
            identities.push(ProcessIdentity::decode(&identity));
            values.push(value);
        }
        let registry = Self {
            backend,
            rank: comm.rank(),
            size: comm.size(),
            group,
            hosts: Hosts::from_identities(identities),
            exchanges: Vec::new(),
            slab: Vec::new(),
            memo: HashMap::new(),
            closed: false,
            counters: Counters::default(),
            sequence: 1,
        };
        Ok((registry, values))
    }

    /// The backend (for allocations and copies).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// This group's id (carried by every exchanged handle).
    pub fn group(&self) -> u64 {
        self.group
    }

    /// The hosts of this group's ranks, as their process identities said at creation.
    pub fn hosts(&self) -> &Hosts {
        &self.hosts
    }

    /// The counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// True between [`close_all`](Self::close_all) and a successful
    /// [`reopen_all`](Self::reopen_all).
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

impl<B: PeerMemory> Drop for PeerMappings<B> {
    fn drop(&mut self) {
        for slot in 0..self.slab.len() {
            if let Err(e) = self.close_slot(slot) {
                tracing::warn!(error = %e, slot, "closing a peer mapping on drop failed");
            }
        }
    }
}
