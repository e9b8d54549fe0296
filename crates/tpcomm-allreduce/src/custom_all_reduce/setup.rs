//! Creation of a [`CustomAllReduce`]: this rank's allocations, the agreement of the settings
//! in the first collective, the exchange of the Signal, staging and temp buffers, the tables
//! written and, where the backend asks, the new mappings proved, before any rank launches.

use std::collections::HashMap;

use tpcomm_ipc::{MemoryRegion, PeerMappings, PeerMemory, Region};
use tpcomm_transport::Communicator;

use super::config::{check_agreement, first_setup_error, Config};
use super::{CustomAllReduce, Resources, SlotSource};
use crate::backend::{Backend, Buffer, RANK_DATA_BYTES, RANK_SIGNALS_BYTES};
use crate::dispatch::{self, MAX_RANKS};
use crate::error::{AllReduceError, Result};
use crate::lifecycle::Lifecycle;

/// This rank's own buffers, allocated before the agreement of [`CustomAllReduce::new`].
struct Allocations<B: Backend> {
    signal: Buffer<B>,
    staging: Buffer<B>,
    temp: Buffer<B>,
    rank_signals: Buffer<B>,
    rank_data: Buffer<B>,
}

impl<B: Backend> Allocations<B> {
    fn new(backend: &B, memory: &B::Memory, config: &Config) -> Result<Self> {
        if !(1..=Config::MAX_SLOTS).contains(&config.slots)
            || !(16..=Config::MAX_BYTES).contains(&config.max_bytes)
        {
            return Err(AllReduceError::InvalidArgument(format!(
                "slots must be 1..={} and max_bytes 16..={} (got {} and {})",
                Config::MAX_SLOTS,
                Config::MAX_BYTES,
                config.slots,
                config.max_bytes
            )));
        }
        let pool_bytes = config
            .slots
            .checked_mul(RANK_DATA_BYTES)
            .ok_or_else(|| AllReduceError::InvalidArgument("slot pool size overflows".into()))?;
        let signal = memory.allocate(backend.signal_bytes())?;
        let staging = memory.allocate(config.max_bytes)?;
        let temp = memory.allocate(config.max_bytes)?;
        // The tables this rank trusts for every peer address: private memory, which a peer
        // mapping the exported buffers above cannot reach.
        let rank_signals = memory.allocate_private(RANK_SIGNALS_BYTES)?;
        let rank_data = memory.allocate_private(pool_bytes)?;
        backend.reset_signal(memory, &signal)?;
        Ok(Self {
            signal,
            staging,
            temp,
            rank_signals,
            rank_data,
        })
    }
}

impl<B: Backend> CustomAllReduce<B> {
    /// Collective: allocates this rank's Signal, staging and temp buffers and the tables,
    /// agrees the settings with every rank, exchanges the buffers with every peer and fills
    /// the tables.
    ///
    /// Every rank returns [`AllReduceError::SpansHosts`] when the ranks are on more than one
    /// host (another kernel boot or PID namespace), naming each host and its ranks.
    ///
    /// Every rank returns the same error when ranks differ in `max_bytes`, `slots`,
    /// `algorithm`, `topology`, `reproducibility`, the dispatch table in use (field
    /// `dispatch_table`: its digest, [`DispatchTable::digest`](crate::dispatch::DispatchTable::digest))
    /// or the backend's shape ([`AllReduceError::ConfigMismatch`] naming the field and every
    /// rank's value), or when a rank could not set up (its own error there, a table it could
    /// not load or use included; [`AllReduceError::PeerSetup`] naming it elsewhere): the
    /// agreement rides on the first collective, and whatever was allocated is freed before
    /// returning. So ranks never choose different algorithms for one call.
    pub fn new<C: Communicator + ?Sized>(
        mut backend: B,
        memory: B::Memory,
        comm: &C,
        config: Config,
    ) -> Result<Self> {
        backend.apply_topology_check(config.topology);
        let world = comm.size();
        if world > MAX_RANKS {
            // Decided from the group size alone: every rank returns it, nobody is left waiting.
            return Err(AllReduceError::Fallback(
                dispatch::FallbackReason::UnsupportedWorldSize { world },
            ));
        }
        let _span = tracing::debug_span!(
            "allreduce_new",
            rank = comm.rank(),
            world,
            backend = backend.name()
        )
        .entered();
        // A local failure (invalid settings, allocation) still joins the agreement below, so
        // that every rank fails together instead of waiting for this one.
        let local = Allocations::new(&backend, &memory, &config);
        let table = config.dispatch_table(&backend, world);
        let mut fields = config.agreed_fields();
        fields.push((
            "dispatch_table".into(),
            match &table {
                Ok(t) => format!("{} rows, digest {:016x}", t.backend(), t.digest()),
                Err(_) => "none (it could not be used)".into(),
            },
        ));
        fields.push(("backend".into(), backend.name().into()));
        fields.push(("signal_bytes".into(), backend.signal_bytes().to_string()));
        fields.push(("nonce_offset".into(), backend.nonce_offset().to_string()));
        fields.extend(
            backend
                .agreed_shape()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        let setup_error = match (&local, &table) {
            (Err(e), _) => Some(e.to_string()),
            (Ok(_), Err(e)) => Some(e.to_string()),
            _ => None,
        };
        let mine = (setup_error, fields);
        let (mut peers, all) = PeerMappings::new_agreeing(memory, comm, &mine)?;
        // Every rank saw the same identities: every rank refuses a group on several hosts.
        if peers.hosts().spans_hosts() {
            return Err(AllReduceError::SpansHosts {
                rank: comm.rank(),
                hosts: peers.hosts().layout(),
            });
        }
        let allocations = local?;
        let dispatch = table?;
        check_agreement(&all)?;
        let Allocations {
            signal,
            staging,
            temp,
            rank_signals,
            rank_data,
        } = allocations;
        let regions = [
            Region {
                addr: signal.addr(),
                len: backend.signal_bytes(),
            },
            Region {
                addr: staging.addr(),
                len: config.max_bytes,
            },
            Region {
                addr: temp.addr(),
                len: config.max_bytes,
            },
        ];
        let base = peers.exchange(comm, &regions)?;
        let mut slots = vec![None; config.slots];
        slots[0] = Some(SlotSource::Eager);
        let slot_limits = vec![(0, comm.rank()); config.slots];
        let captured = vec![false; config.slots];
        let graph_owners = vec![None; config.slots];
        let mut ar = Self {
            backend,
            rank: comm.rank(),
            world,
            config,
            dispatch,
            lifecycle: Lifecycle::new(),
            res: Some(Resources {
                peers,
                signal,
                staging,
                temp,
                rank_signals,
                rank_data,
                base,
            }),
            slots,
            slot_limits,
            temp_limit: (0, comm.rank()),
            pending: Vec::new(),
            buffers: HashMap::new(),
            captured,
            graph_owners,
            capture_owner: None,
            recorded: Vec::new(),
            retired: Vec::new(),
            id: {
                use std::sync::atomic::{AtomicU64, Ordering};
                static NEXT: AtomicU64 = AtomicU64::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            released: 0,
            written: None,
            table_writes: 0,
        };
        // Nobody launches before every rank's tables are written; a rank that could not
        // write them still joins, and every rank fails together.
        let written = ar.write_tables();
        let written = if ar.backend.prove_at_creation() {
            ar.prove_at_creation(comm, written)?
        } else {
            written
        };
        let res = ar.res.as_mut().expect("just created");
        let ready: Vec<Option<String>> = res.peers.agree(
            comm,
            tpcomm_ipc::Step::Ready,
            &written.as_ref().err().map(ToString::to_string),
        )?;
        written?;
        if let Some((rank, reason)) = first_setup_error(&ready) {
            return Err(AllReduceError::PeerSetup { rank, reason });
        }
        Ok(ar)
    }
}
