//! Adversarial checks of the transport's safe API: arguments and peers that must give typed
//! errors, never panics or hangs.

use std::time::Duration;

use tpcomm_transport::{Communicator, LocalGroup, TransportError};

/// A timeout too long to add to the clock (`Duration::MAX`, "never time out") is accepted:
/// waits are then bounded by departures and aborts only, and no wait panics.
#[test]
fn an_unbounded_timeout_does_not_panic_a_waiting_rank() {
    let results = LocalGroup::new(2).timeout(Duration::MAX).run(|comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
        }
        comm.barrier()
    });
    for r in results {
        r.unwrap().unwrap();
    }
}

/// As above, with a rank that leaves: its peer is freed with an error naming it.
#[test]
fn an_unbounded_timeout_still_ends_when_a_peer_leaves() {
    let results = LocalGroup::new(2).timeout(Duration::MAX).run(|comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            return Ok(());
        }
        comm.barrier()
    });
    assert!(matches!(
        results[0].as_ref().unwrap(),
        Err(TransportError::Aborted { by: 1, .. })
    ));
}

/// A group too large for memory is a setup error, not a panic or an abort of the process.
#[test]
fn a_group_too_large_for_memory_is_a_setup_error() {
    for size in [usize::MAX, usize::MAX / 64 + 1, 1 << 40] {
        let made = std::panic::catch_unwind(|| LocalGroup::new(size).communicators().map(drop));
        assert!(
            matches!(made, Ok(Err(TransportError::Setup(_)))),
            "size {size}: {made:?}"
        );
    }
}

/// `run` of a group too large for memory returns its setup error instead of panicking.
#[test]
fn running_a_group_too_large_for_memory_returns_the_setup_error() {
    let results = std::panic::catch_unwind(|| LocalGroup::new(usize::MAX).run(|_comm| ()));
    let results = results.expect("no panic");
    assert!(!results.is_empty());
    assert!(results
        .iter()
        .all(|r| matches!(r, Err(TransportError::Setup(_)))));
}

/// The test pair transport: a peer that contributes another length than this rank is an
/// error naming the mismatch, not a panic in the copy.
#[test]
fn the_test_pair_reports_a_peer_of_another_length_instead_of_panicking() {
    use tpcomm_transport::testing::pair::Pair;
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let (r0, r1) = std::thread::scope(|s| {
        let t0 = s.spawn(|| {
            let comm = Pair::new(0, a);
            let mut all = [0u8; 8];
            let gather = comm.all_gather(&[1; 4], &mut all);
            let mut all = [0u8; 5];
            let varcount = comm.all_gather_varcount(&[1; 2], &mut all, &[2, 3], &[0, 2]);
            (gather, varcount)
        });
        let t1 = s.spawn(|| {
            let comm = Pair::new(1, b);
            let mut all = [0u8; 16];
            let gather = comm.all_gather(&[2; 8], &mut all);
            let mut all = [0u8; 5];
            let varcount = comm.all_gather_varcount(&[2; 2], &mut all, &[3, 2], &[0, 3]);
            (gather, varcount)
        });
        (t0.join(), t1.join())
    });
    for (rank, r) in [(0, r0), (1, r1)] {
        let (gather, varcount) = r.unwrap_or_else(|_| panic!("rank {rank} panicked"));
        assert!(gather.is_err(), "rank {rank}: {gather:?}");
        assert!(varcount.is_err(), "rank {rank}: {varcount:?}");
    }
}
