//! Settings that differ across ranks are refused by `CustomAllReduce::new` on every rank,
//! naming the field and every rank's value; a rank that cannot set up fails every rank.

mod common;

use std::time::Duration;

use common::{forward_to_inner, group, R};
use tpcomm_allreduce::dispatch::{DispatchTable, Reproducibility};
use tpcomm_allreduce::{
    Algorithm, AllReduceError, Backend, Config, CustomAllReduce, DType, FallbackReason,
    HostBackend, TopologyCheck,
};
use tpcomm_ipc::HostMemory;
use tpcomm_transport::{Communicator, LocalCommunicator};

/// Runs `new` on two ranks with `config(rank)` and returns each rank's outcome.
fn new_with(config: impl Fn(usize) -> Config + Sync) -> Vec<R<()>> {
    group(2)
        .run(|comm| {
            CustomAllReduce::new(
                HostBackend::new(),
                HostMemory::new(),
                &comm,
                config(comm.rank()),
            )
            .map(drop)
        })
        .into_iter()
        .map(|r| r.expect("no rank panicked"))
        .collect()
}

fn assert_mismatch(outcomes: &[R<()>], field: &str, values: &[&str]) {
    for (rank, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Err(AllReduceError::ConfigMismatch {
                field: f,
                values: v,
            }) => {
                assert_eq!(f, field, "rank {rank}");
                let expected: Vec<(usize, String)> = values
                    .iter()
                    .enumerate()
                    .map(|(r, s)| (r, s.to_string()))
                    .collect();
                assert_eq!(v, &expected, "rank {rank}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// The attack of the issue: with 4 KiB on rank 1 and 8 MiB on rank 0, rank 0's all-reduce of
/// 1 MiB read past rank 1's staging mapping (SIGSEGV). Now `new` refuses on both ranks.
#[test]
fn different_max_bytes_are_refused_on_every_rank_naming_the_field_and_values() {
    let outcomes = new_with(|rank| Config {
        max_bytes: if rank == 0 { 8 << 20 } else { 4096 },
        ..Config::default()
    });
    assert_mismatch(&outcomes, "max_bytes", &["8388608", "4096"]);
    let message = outcomes[0].as_ref().unwrap_err().to_string();
    assert_eq!(
        message,
        "ranks disagree on max_bytes: rank 0 has 8388608, rank 1 has 4096"
    );
}

#[test]
fn different_slot_pools_are_refused_on_every_rank() {
    let outcomes = new_with(|rank| Config {
        slots: 16 + rank,
        ..Config::default()
    });
    assert_mismatch(&outcomes, "slots", &["16", "17"]);
}

/// Rank 0 forced to one-stage and rank 1 to two-stage would run different barrier
/// sequences and read different peer buffers.
#[test]
fn different_forced_algorithms_are_refused_on_every_rank() {
    let outcomes = new_with(|rank| Config {
        algorithm: (rank == 1).then_some(Algorithm::TwoStage),
        ..Config::default()
    });
    assert_mismatch(&outcomes, "algorithm", &["by size", "2stage"]);
}

#[test]
fn different_topology_checks_are_refused_on_every_rank() {
    let outcomes = new_with(|rank| Config {
        topology: if rank == 1 {
            TopologyCheck::Assume
        } else {
            TopologyCheck::Auto
        },
        ..Config::default()
    });
    assert_mismatch(&outcomes, "topology", &["auto", "assume"]);
}

/// Rank 1 reading a tuned table that sends 8 KiB eager calls to one-stage, rank 0 the
/// built-in one (two-stage there): they would run different algorithms for one call.
#[test]
fn different_dispatch_tables_are_refused_on_every_rank_naming_both_digests() {
    let tuned = DispatchTable::parse(
        "tpcomm-dispatch 1\nbackend host\n2 * * 0 inf 1stage\n",
        "tuned.txt",
    )
    .expect("valid");
    let builtin = DispatchTable::host().for_ranks(2).digest();
    let file = tuned.over(&DispatchTable::host()).for_ranks(2).digest();
    assert_ne!(builtin, file);
    let outcomes = new_with(|rank| Config {
        dispatch: (rank == 1).then(|| tuned.clone()),
        ..Config::default()
    });
    let digest = |d: u64| format!("host rows, digest {d:016x}");
    assert_mismatch(
        &outcomes,
        "dispatch_table",
        &[&digest(builtin), &digest(file)],
    );
    // The same rows from two files that differ in comments and spacing agree.
    let spaced = DispatchTable::parse(
        "# measured elsewhere\ntpcomm-dispatch 1\nbackend  host\n2 * *   0 inf 1stage # all\n",
        "other.txt",
    )
    .expect("valid");
    for outcome in new_with(|rank| Config {
        dispatch: Some(if rank == 0 {
            tuned.clone()
        } else {
            spaced.clone()
        }),
        ..Config::default()
    }) {
        outcome.expect("equal rows agree");
    }
}

#[test]
fn different_reproducibility_settings_are_refused_on_every_rank() {
    let outcomes = new_with(|rank| Config {
        reproducibility: if rank == 1 {
            Reproducibility::AnyOrder
        } else {
            Reproducibility::BitStable
        },
        ..Config::default()
    });
    assert_mismatch(&outcomes, "reproducibility", &["bit-stable", "any-order"]);
}

/// The timeout only bounds a rank's own waits: it may differ.
#[test]
fn different_timeouts_are_accepted_and_reduce_correctly() {
    let results = group(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = CustomAllReduce::new(
            HostBackend::new(),
            HostMemory::new(),
            &comm,
            Config {
                timeout: Duration::from_secs(10 + comm.rank() as u64),
                ..Config::default()
            },
        )?;
        let mut out = vec![0f32; 64];
        ar.all_reduce(&[comm.rank() as f32 + 1.0; 64], &mut out)?;
        ar.close_with(&comm)?;
        Ok(out)
    });
    for r in results {
        assert_eq!(r.unwrap().unwrap(), vec![3f32; 64]);
    }
}

/// A host backend that calls itself something else on rank 1 (a backend of another build or
/// version), to check that the backend's shape is agreed.
#[derive(Debug)]
struct Renamed {
    inner: HostBackend,
    name: &'static str,
    shape: &'static str,
}

impl Backend for Renamed {
    type Memory = HostMemory;

    forward_to_inner!(signal_bytes, nonce_offset, reset_signal, launch, stage);

    fn name(&self) -> &'static str {
        self.name
    }
    fn agreed_shape(&self) -> Vec<(&'static str, String)> {
        vec![("layout", self.shape.to_string())]
    }
    fn supports(
        &self,
        world: usize,
        dtype: DType,
        bytes: usize,
        algorithm: Algorithm,
    ) -> Result<(), FallbackReason> {
        self.inner.supports(world, dtype, bytes, algorithm)
    }
}

fn new_renamed(comm: &LocalCommunicator, name: &'static str, shape: &'static str) -> R<()> {
    let backend = Renamed {
        inner: HostBackend::new(),
        name,
        shape,
    };
    CustomAllReduce::new(backend, HostMemory::new(), comm, Config::default()).map(drop)
}

#[test]
fn backends_of_another_name_or_shape_are_refused_on_every_rank() {
    let names = group(2).run(|comm| {
        new_renamed(
            &comm,
            if comm.rank() == 0 { "host" } else { "host-v2" },
            "a",
        )
    });
    let names: Vec<R<()>> = names.into_iter().map(Result::unwrap).collect();
    assert_mismatch(&names, "backend", &["host", "host-v2"]);

    let shapes =
        group(2).run(|comm| new_renamed(&comm, "host", if comm.rank() == 0 { "a" } else { "b" }));
    let shapes: Vec<R<()>> = shapes.into_iter().map(Result::unwrap).collect();
    assert_mismatch(&shapes, "layout", &["a", "b"]);

    // The same shape on every rank is accepted (the wrapper is a working backend).
    for r in group(2).run(|comm| new_renamed(&comm, "host", "a")) {
        r.unwrap().unwrap();
    }
}

/// Before: rank 1 returned its argument error before the first collective and rank 0 waited
/// in the group-id broadcast until the transport timeout. Now the failure rides on the
/// agreement: rank 1 gets its own error, rank 0 `PeerSetup` naming rank 1.
#[test]
fn a_slot_pool_or_buffer_size_past_the_limits_is_refused_on_every_rank() {
    // Slot numbers and byte counts travel in the host backend's shape words, in 20 and 40
    // bits: past those, launches that differ could look alike.
    for config in [
        Config {
            slots: Config::MAX_SLOTS + 1,
            ..Config::default()
        },
        Config {
            max_bytes: Config::MAX_BYTES + 1,
            ..Config::default()
        },
    ] {
        let outcomes = new_with(|_| config.clone());
        for outcome in &outcomes {
            assert!(
                matches!(outcome, Err(AllReduceError::InvalidArgument(_))),
                "{outcome:?}"
            );
        }
    }
}

#[test]
fn a_rank_that_cannot_set_up_fails_every_rank_instead_of_leaving_them_waiting() {
    let outcomes = new_with(|rank| Config {
        slots: if rank == 1 { 0 } else { 1024 },
        ..Config::default()
    });
    assert!(
        matches!(&outcomes[1], Err(AllReduceError::InvalidArgument(_))),
        "{:?}",
        outcomes[1]
    );
    match &outcomes[0] {
        Err(AllReduceError::PeerSetup { rank: 1, reason }) => {
            assert!(reason.contains("slot"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}
