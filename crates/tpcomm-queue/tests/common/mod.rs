//! What more than one test binary of this crate uses: the small ring most tests run on, and
//! a run of a local group in which every rank must succeed.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::fmt::Debug;
use std::time::Duration;

use tpcomm_queue::{QueueConfig, QueueError};
use tpcomm_transport::{LocalCommunicator, LocalGroup};

/// Two chunks of 64 bytes, so that most messages lap the ring; every wait bounded by
/// `timeout`.
pub(crate) fn tiny_ring(timeout: Duration) -> QueueConfig {
    QueueConfig {
        depth: 2,
        chunk_bytes: 64,
        timeout,
        ..QueueConfig::default()
    }
}

/// Runs `f` on every rank of a local group of `ranks` and asserts that every rank returned
/// `Ok` (no rank panicked, no queue call failed).
pub(crate) fn run_ok<T: Send + Debug>(
    ranks: usize,
    f: impl Fn(LocalCommunicator) -> Result<T, QueueError> + Sync,
) {
    for (rank, r) in LocalGroup::new(ranks).run(f).into_iter().enumerate() {
        assert!(matches!(r, Ok(Ok(_))), "rank {rank}: {r:?}");
    }
}
