//! A backend that wraps another hands its launches on with `Launch::run_on`, which refuses
//! an inner backend that needs more than `CustomAllReduce` checked for the wrapper. (Launches
//! themselves are made only by `CustomAllReduce`: a `Launch` literal does not compile outside the
//! crate, see the `compile_fail` example on `Launch`.)

mod common;

use std::time::Duration;

use common::{forward_to_inner, R};
use tpcomm_allreduce::{AllReduceError, Backend, Config, CustomAllReduce, HostBackend, Phase};
use tpcomm_ipc::HostMemory;
use tpcomm_transport::{Communicator, LocalGroup};

/// The host backend behind a wrapper that may misstate what it needs.
#[derive(Debug, Default)]
struct Wrapper {
    inner: HostBackend,
    /// Signal bytes declared to the driver (`None`: the inner backend's).
    signal_bytes: Option<usize>,
    /// The private part it declares (`None`: the inner backend's).
    private_part: Option<Option<std::ops::Range<usize>>>,
}

impl Backend for Wrapper {
    type Memory = HostMemory;

    forward_to_inner!(nonce_offset, reset_signal, launch, stage);

    fn name(&self) -> &'static str {
        "host"
    }
    fn signal_bytes(&self) -> usize {
        self.signal_bytes.unwrap_or(self.inner.signal_bytes())
    }
    fn private_part(
        &self,
        algorithm: tpcomm_allreduce::Algorithm,
        dtype: tpcomm_allreduce::DType,
        count: usize,
        rank: usize,
        world: usize,
    ) -> Option<std::ops::Range<usize>> {
        if let Some(part) = &self.private_part {
            return part.clone();
        }
        self.inner
            .private_part(algorithm, dtype, count, rank, world)
    }
    fn shape_includes_slot(&self) -> bool {
        self.inner.shape_includes_slot()
    }
    fn builtin_dispatch(&self) -> tpcomm_allreduce::dispatch::DispatchTable {
        self.inner.builtin_dispatch()
    }
}

/// Every rank's outcome of an eager all-reduce of `count` f32 through `wrapper(rank)`.
fn reduce_through(wrapper: impl Fn() -> Wrapper + Sync, count: usize) -> Vec<(R<()>, Phase)> {
    LocalGroup::new(2)
        .timeout(Duration::from_secs(60))
        .run(|comm| {
            let config = Config {
                timeout: Duration::from_secs(5),
                ..Config::default()
            };
            let mut ar = CustomAllReduce::new(wrapper(), HostMemory::new(), &comm, config)?;
            let input = vec![comm.rank() as f32 + 1.0; count];
            let mut out = vec![0f32; count];
            let outcome = ar.all_reduce(&input, &mut out).map(|_| {
                assert_eq!(out, vec![3.0f32; count]);
            });
            R::Ok((outcome, ar.phase()))
        })
        .into_iter()
        .map(|r| r.expect("rank thread").expect("setup"))
        .collect()
}

/// `outcome` is the launch refused before it ran: the communicator Failed with an
/// `InvalidArgument` saying `words`.
fn assert_refused_saying(outcome: R<()>, words: &str) {
    match outcome {
        Err(AllReduceError::Failed { cause, .. }) => match &*cause {
            AllReduceError::InvalidArgument(why) => assert!(why.contains(words), "{why}"),
            other => panic!("expected an InvalidArgument, got {other:?}"),
        },
        other => panic!("expected the launch to be refused, got {other:?}"),
    }
}

#[test]
fn a_wrapper_that_hands_its_launch_on_reduces_like_the_backend_it_wraps() {
    // One-stage (64 f32) and two-stage with a private part (64 Ki f32).
    for count in [64, 64 << 10] {
        for (outcome, phase) in reduce_through(Wrapper::default, count) {
            outcome.expect("all-reduce through the wrapper");
            assert_eq!(phase, Phase::Active);
        }
    }
}

#[test]
fn an_inner_backend_reading_larger_signal_blocks_than_were_checked_is_refused() {
    let small = || Wrapper {
        signal_bytes: Some(64),
        ..Wrapper::default()
    };
    for (outcome, _) in reduce_through(small, 64) {
        assert_refused_saying(outcome, "Signal blocks");
    }
}

#[test]
fn an_inner_backend_reading_another_private_part_than_was_left_unstaged_is_refused() {
    let count = 64 << 10;
    // The wrapper claims all of its input as private: nothing is staged, and the inner
    // backend would read its peers' parts from stale staging buffers (a wrong sum).
    let everything = || Wrapper {
        private_part: Some(Some(0..count)),
        ..Wrapper::default()
    };
    for (outcome, phase) in reduce_through(everything, count) {
        assert_refused_saying(outcome, "unstaged");
        assert_eq!(phase, Phase::Failed);
    }
    // A wrapper that stages everything (no private part) makes launches without an own
    // input: the inner backend reads every part from the slot, and the sum is right.
    let staging_all = || Wrapper {
        private_part: Some(None),
        ..Wrapper::default()
    };
    for (outcome, _) in reduce_through(staging_all, count) {
        outcome.expect("everything staged: the inner backend reads every part from the slot");
    }
}
