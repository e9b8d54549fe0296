use std::time::Duration;

use super::device::check_stream_context;
use super::launch::timeout_ns;
use super::signal::device_error;
use super::*;
use crate::DeviceGraph;

#[test]
fn ranks_sharing_a_device_split_its_multiprocessors() {
    // H200: 132 multiprocessors.
    assert_eq!(block_bound(36, 132, 1), 36);
    assert_eq!(block_bound(36, 132, 4), 33);
    assert_eq!(block_bound(36, 132, 8), 16);
    assert_eq!(block_bound(64, 132, 2), 64);
    // Never zero, whatever the split.
    assert_eq!(block_bound(36, 4, 8), 1);
    assert_eq!(block_bound(36, 132, 0), 36);
}

#[test]
fn requests_route_to_the_kernels_or_name_why_not() {
    let ok = Ok(());
    let one = Algorithm::OneStage;
    assert_eq!(route(&ok, 2, DType::Bf16, 4096, one, 36), Ok(()));
    assert_eq!(
        route(&ok, 8, DType::F32, 8 << 20, Algorithm::TwoStage, 16),
        Ok(())
    );
    for world in [1, 3, 5, 7] {
        match route(&ok, world, DType::F32, 4096, one, 36) {
            Err(FallbackReason::NoKernel { reason }) => {
                assert!(reason.contains(&format!("world size {world}")), "{reason}")
            }
            other => panic!("world {world}: {other:?}"),
        }
    }
    // Peer access is checked first: no P2P means NCCL whatever the size.
    let no_p2p = Err(FallbackReason::NoPeerAccess { rank: 1, peer: 3 });
    assert_eq!(
        route(&no_p2p, 4, DType::F16, 4096, one, 36),
        Err(FallbackReason::NoPeerAccess { rank: 1, peer: 3 })
    );
}

#[test]
fn shape_mismatch_words_name_both_ranks_and_sizes() {
    // error_word(kShape, block 0, peer 1); launch_shape<float>(1024) and <float>(2048).
    let word = 0x8000_0000 | (4 << 16) | 1;
    match device_error(word, [(1 << 28) | 256, (1 << 28) | 512], 0, Duration::ZERO) {
        Some(AllReduceError::LaunchMismatch {
            rank: 0,
            bytes: 4096,
            dtype: "f32",
            slot: None,
            peer: 1,
            peer_bytes: 8192,
            peer_dtype: "f32",
            peer_slot: None,
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn error_words_become_timeouts_naming_the_peer_and_barrier() {
    assert!(device_error(0, [0; 2], 0, Duration::ZERO).is_none());
    let word = 0x8000_0000 | (3 << 16) | (7 << 8) | 2;
    match device_error(word, [0; 2], 5, Duration::from_millis(40)) {
        Some(AllReduceError::Timeout {
            rank: 5,
            peer: 2,
            barrier: "mid",
            waited,
        }) => assert_eq!(waited, Duration::from_millis(40)),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        device_error(0x1234, [0; 2], 0, Duration::ZERO),
        Some(AllReduceError::InvalidArgument(_))
    ));
}

#[test]
fn device_graphs_can_move_to_another_thread() {
    fn send<T: Send>() {}
    send::<DeviceGraph>();
}

#[test]
fn a_callers_stream_must_be_in_the_devices_primary_context() {
    assert!(check_stream_context(1, 0x10, 0x10, 1).is_ok());
    match check_stream_context(1, 0x10, 0x20, 1) {
        Err(AllReduceError::ForeignStream { device: 1, found }) => {
            assert!(found.contains("not its primary context"), "{found}")
        }
        other => panic!("{other:?}"),
    }
    match check_stream_context(1, 0x10, 0x20, 3) {
        Err(AllReduceError::ForeignStream { device: 1, found }) => {
            assert_eq!(found, "device 3")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_zero_timeout_never_means_wait_forever() {
    assert_eq!(timeout_ns(Duration::ZERO), 1);
    assert_eq!(timeout_ns(Duration::from_secs(30)), 30_000_000_000);
    assert_eq!(timeout_ns(Duration::MAX), u64::MAX);
}
