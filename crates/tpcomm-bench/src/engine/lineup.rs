//! Ranks lined up more tightly than by a barrier before a timed iteration: an untimed
//! 16-byte custom all-reduce on the host backend, whose flag barrier spins, so that the
//! ranks leave it within about a microsecond. Also the host all-reduce it is built from.

use std::time::Instant;

use tpcomm::allreduce::{Config, CustomAllReduce, HostBackend};
use tpcomm::ipc::HostMemory;
use tpcomm::Communicator;

use crate::engine::error::BenchError;
use crate::engine::timing::{elapsed_ns, time_once};

/// The custom all-reduce on the host backend.
pub(crate) type HostAllReduce = CustomAllReduce<HostBackend>;

/// A new host all-reduce (collective).
pub(crate) fn new_all_reduce<C: Communicator>(
    comm: &C,
    config: Config,
) -> Result<HostAllReduce, BenchError> {
    Ok(CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        config,
    )?)
}

/// A small all-reduce used only to line the ranks up before each timed iteration.
pub(crate) fn new_sync<C: Communicator>(comm: &C) -> Result<HostAllReduce, BenchError> {
    new_all_reduce(
        comm,
        Config {
            max_bytes: 16,
            slots: 1,
            ..Config::default()
        },
    )
}

/// One timed iteration, its ranks lined up more tightly than by [`time_once`]'s barrier
/// alone: the transport's barrier, then an untimed 16-byte all-reduce on `sync` (whose
/// flag barrier spins, so the ranks leave it within about a microsecond), then `work`,
/// timed. Nanoseconds on this rank.
pub(crate) fn time_synced<C: Communicator>(
    comm: &C,
    sync: &mut HostAllReduce,
    work: impl FnOnce() -> Result<(), BenchError>,
) -> Result<u64, BenchError> {
    time_once(comm, |_| {
        let mut out = [0f32; 4];
        sync.all_reduce(&[0f32; 4], &mut out)?;
        let start = Instant::now();
        work()?;
        Ok(elapsed_ns(start))
    })
}
