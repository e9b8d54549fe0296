//! The attacks of the threat model (`lib.rs`): a writer (or a third party) that writes
//! what no honest writer writes into the ring, and a reader that writes what no honest reader
//! writes into its slot. Each gets a typed error naming the peer, never a panic, an
//! out-of-bounds read or a wrong value.
//!
//! Each test runs a writer and a reader on two threads: the writer sends, then corrupts a
//! word of its own segment, and only then (a barrier later) does the reader receive.

use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

use crate::error::{Corruption, QueueError};
use crate::layout::{header, slot, Field, FIRST, LAST};
use crate::queue::{BroadcastQueue, QueueConfig};
use crate::shm::{JoinError, SharedRing};

/// Settings with small chunks, so that a 100-byte message takes two.
fn config() -> QueueConfig {
    QueueConfig {
        depth: 4,
        chunk_bytes: 64,
        timeout: Duration::from_secs(2),
        ..QueueConfig::default()
    }
}

/// The writer sends `messages`, then `corrupt(ring)` runs on its segment; the reader receives
/// them all after that. Returns the reader's results.
fn corrupted(
    messages: Vec<Vec<u8>>,
    corrupt: impl Fn(&SharedRing) + Sync,
) -> Vec<Result<Vec<u8>, QueueError>> {
    let count = messages.len();
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).expect("the queue is created");
        let mut got = Vec::new();
        if q.is_writer() {
            for m in &messages {
                q.send(&serde_bytes::Bytes::new(m)).unwrap();
            }
            corrupt(q.ring_for_test().expect("a reader maps the ring"));
            comm.barrier().unwrap();
        } else {
            comm.barrier().unwrap();
            for _ in 0..count {
                got.push(q.recv::<serde_bytes::ByteBuf>().map(|b| b.into_vec()));
            }
        }
        comm.barrier().unwrap();
        got
    });
    results.into_iter().nth(1).unwrap().unwrap()
}

/// Chunk slot `slot`'s `field` word in `ring`.
fn chunk_word(ring: &SharedRing, slot: usize, field: Field) -> &std::sync::atomic::AtomicU64 {
    let layout = ring.layout_for_test();
    ring.word_for_test(layout.chunk(slot) + field.offset())
}

/// The corruption the reader reported for its first message, naming the writer.
fn first_corruption(results: &[Result<Vec<u8>, QueueError>]) -> Corruption {
    match &results[0] {
        Err(QueueError::Corrupt {
            peer: 0,
            problem,
            rank: 1,
            message: 0,
        }) => problem.clone(),
        other => panic!("expected a corruption naming the writer, got {other:?}"),
    }
}

#[test]
fn a_chunk_length_past_the_chunk_is_corruption() {
    let r = corrupted(vec![vec![7; 10]], |ring| {
        chunk_word(ring, 0, Field::Len).store(1 << 40, Ordering::SeqCst);
    });
    assert!(matches!(
        first_corruption(&r),
        Corruption::ChunkFraming { len, .. } if len == 1 << 40
    ));
}

#[test]
fn a_total_past_the_cap_is_corruption() {
    let r = corrupted(vec![vec![7; 10]], |ring| {
        chunk_word(ring, 0, Field::Total).store(u64::MAX, Ordering::SeqCst);
    });
    assert!(matches!(first_corruption(&r), Corruption::TooLarge { .. }));
}

#[test]
fn a_total_that_changes_within_a_message_is_corruption() {
    // 100 bytes: two chunks of 64 and 36 (postcard adds one length byte).
    let r = corrupted(vec![vec![7; 100]], |ring| {
        chunk_word(ring, 1, Field::Total).store(1000, Ordering::SeqCst);
    });
    assert!(matches!(
        first_corruption(&r),
        Corruption::ChunkFraming { total: 1000, .. }
    ));
}

#[test]
fn flags_out_of_order_are_corruption() {
    let r = corrupted(vec![vec![7; 100]], |ring| {
        // The second chunk claims to start a message.
        chunk_word(ring, 1, Field::Flags).store(FIRST | LAST, Ordering::SeqCst);
    });
    assert_eq!(
        first_corruption(&r),
        Corruption::Flags {
            chunk: 1,
            found: FIRST | LAST,
            expected: LAST
        }
    );
}

#[test]
fn a_stamp_out_of_order_is_corruption() {
    let r = corrupted(vec![vec![7; 10]], |ring| {
        chunk_word(ring, 0, Field::Stamp).store(9, Ordering::SeqCst);
    });
    assert_eq!(
        first_corruption(&r),
        Corruption::Stamp {
            chunk: 0,
            found: 9,
            expected: 1,
            previous: 0
        }
    );
}

#[test]
fn a_chunk_of_another_message_is_corruption() {
    let r = corrupted(vec![vec![7; 10]], |ring| {
        chunk_word(ring, 0, Field::Message).store(3, Ordering::SeqCst);
    });
    assert_eq!(
        first_corruption(&r),
        Corruption::ChunkMessage { chunk: 0, found: 3 }
    );
}

#[test]
fn a_writer_state_that_is_no_state_is_corruption() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).unwrap();
        if q.is_writer() {
            q.ring_for_test()
                .unwrap()
                .header_u32(header::STATE)
                .store(77, Ordering::SeqCst);
            comm.barrier().unwrap();
            comm.barrier().unwrap();
            None
        } else {
            comm.barrier().unwrap();
            let got = q.recv::<u32>();
            comm.barrier().unwrap();
            Some(got)
        }
    });
    match results.into_iter().nth(1).unwrap().unwrap() {
        Some(Err(QueueError::Corrupt {
            problem: Corruption::State { found: 77, .. },
            ..
        })) => {}
        other => panic!("expected a corrupt state word, got {other:?}"),
    }
}

#[test]
fn a_culprit_outside_the_group_is_corruption_not_a_rank() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).unwrap();
        if q.is_writer() {
            let ring = q.ring_for_test().unwrap();
            // "Failed, because of rank 1000", in a group of 2.
            ring.header_u32(header::CULPRIT)
                .store(1001, Ordering::SeqCst);
            ring.header_u32(header::STATE).store(4, Ordering::SeqCst);
            comm.barrier().unwrap();
            comm.barrier().unwrap();
            None
        } else {
            comm.barrier().unwrap();
            let got = q.recv::<u32>();
            comm.barrier().unwrap();
            Some(got)
        }
    });
    match results.into_iter().nth(1).unwrap().unwrap() {
        Some(Err(QueueError::Corrupt {
            peer: 0,
            problem:
                Corruption::Rank {
                    which: "culprit",
                    found: 1000,
                    size: 2,
                },
            ..
        })) => {}
        other => panic!("expected a culprit refused as no rank, got {other:?}"),
    }
}

#[test]
fn a_failed_queue_refuses_every_later_call_naming_the_first_error() {
    let r = corrupted(vec![vec![1; 10], vec![2; 10]], |ring| {
        chunk_word(ring, 0, Field::Message).store(3, Ordering::SeqCst);
    });
    assert!(matches!(r[0], Err(QueueError::Corrupt { .. })));
    match &r[1] {
        Err(QueueError::Failed {
            culprit: Some(0),
            reason,
            ..
        }) => assert!(reason.contains("corrupt data from rank 0"), "{reason}"),
        other => panic!("expected Failed, got {other:?}"),
    }
}

#[test]
fn a_wrong_layout_version_is_refused_when_the_reader_maps_the_ring_again() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).unwrap();
        q.suspend(&comm).unwrap();
        if q.is_writer() {
            // Version 3, same header size.
            let word = q.ring_for_test().unwrap().word_for_test(header::VERSION);
            word.store(3 | (512 << 32), Ordering::SeqCst);
        }
        comm.barrier().unwrap();
        q.resume(&comm)
    });
    match &results[1].as_ref().unwrap() {
        Err(QueueError::Corrupt {
            problem:
                Corruption::Version {
                    found: 3,
                    supported: 2,
                },
            ..
        }) => {}
        other => panic!("expected a version refusal on the reader, got {other:?}"),
    }
    match &results[0].as_ref().unwrap() {
        Err(QueueError::PeerFailed { ranks, .. }) => assert_eq!(ranks, &[1]),
        other => panic!("expected the writer to name the reader, got {other:?}"),
    }
}

#[test]
fn a_header_field_changed_under_a_suspended_reader_is_refused_at_resume() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).unwrap();
        q.suspend(&comm).unwrap();
        if q.is_writer() {
            let word = q.ring_for_test().unwrap().word_for_test(header::CHUNKS_AT);
            word.store(1 << 40, Ordering::SeqCst);
        }
        comm.barrier().unwrap();
        q.resume(&comm)
    });
    assert!(matches!(
        results[1].as_ref().unwrap(),
        Err(QueueError::Corrupt {
            problem: Corruption::Header {
                field: "chunk offset",
                ..
            },
            ..
        })
    ));
}

#[test]
fn a_reader_claiming_chunks_never_published_is_corruption_for_the_writer() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).unwrap();
        if q.is_writer() {
            let ring = q.ring_for_test().unwrap();
            let layout = ring.layout_for_test();
            ring.word_for_test(layout.reader(0) + slot::CONSUMED)
                .store(1000, Ordering::SeqCst);
            // The writer reads its readers' progress when the ring may be full: at the
            // latest for the chunk after the first lap (depth 4).
            let sent = (0..5u32).try_for_each(|i| q.send(&i));
            comm.barrier().unwrap();
            Some(sent)
        } else {
            comm.barrier().unwrap();
            None
        }
    });
    match results.into_iter().next().unwrap().unwrap() {
        Some(Err(QueueError::Corrupt {
            peer: 1,
            problem: Corruption::ReaderProgress { consumed: 1000, .. },
            ..
        })) => {}
        other => panic!("expected the writer to refuse the reader's progress, got {other:?}"),
    }
}

#[test]
fn a_reader_that_joins_late_is_refused() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config()).unwrap();
        if q.is_writer() {
            q.send(&1u32).unwrap();
            comm.barrier().unwrap();
            comm.barrier().unwrap();
            None
        } else {
            comm.barrier().unwrap();
            // A second reader in this process, mapping the ring from the same handle after
            // the writer sent: it would have missed a message.
            let (handle, layout, id) = q.join_args_for_test();
            let memory = tpcomm_ipc::HostMemory::new();
            let late = SharedRing::join(&memory, &handle, layout, (id, 0), (0, 1));
            comm.barrier().unwrap();
            Some(late.map(drop))
        }
    });
    match results.into_iter().nth(1).unwrap().unwrap() {
        Some(Err(JoinError::Late { messages: 1 })) => {}
        other => panic!("expected a late join to be refused, got {other:?}"),
    }
}

/// The reader's first `recv` while the writer sends only after a pause (so that the reader
/// parks), with `meddle(ring, stop, first)` running meanwhile on a third mapping of the
/// segment, until `stop` is set; the reader starts once `meddle` has passed `first` (after
/// its first write). Returns the reader's result.
fn parked_reader(
    meddle: impl Fn(&SharedRing, &std::sync::atomic::AtomicBool, &std::sync::Barrier) + Sync,
) -> Result<u32, QueueError> {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let config = QueueConfig {
            timeout: Duration::from_secs(5),
            ..config()
        };
        let mut q = BroadcastQueue::create(&comm, config).unwrap();
        if q.is_writer() {
            comm.barrier().unwrap();
            std::thread::sleep(Duration::from_millis(300));
            q.send(&7u32).unwrap();
            comm.barrier().unwrap();
            return None;
        }
        let (handle, layout, _) = q.join_args_for_test();
        let memory = tpcomm_ipc::HostMemory::new();
        let view = SharedRing::map_for_test(&memory, &handle, layout);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let first = std::sync::Barrier::new(2);
        let got = std::thread::scope(|s| {
            s.spawn(|| meddle(&view, &stop, &first));
            first.wait();
            comm.barrier().unwrap();
            let got = q.recv::<u32>();
            stop.store(true, Ordering::SeqCst);
            got
        });
        comm.barrier().unwrap();
        Some(got)
    });
    results.into_iter().nth(1).unwrap().unwrap().unwrap()
}

#[test]
fn a_parked_count_set_to_wrap_is_corruption_not_a_lost_wake_up() {
    let got = parked_reader(|ring, _, first| {
        // The reader's own count brings it to 0: the writer would see nobody parked.
        ring.header_u32(header::SLEEPERS)
            .store(u32::MAX, Ordering::SeqCst);
        first.wait();
    });
    match got {
        Err(QueueError::Corrupt {
            peer: 0,
            problem:
                Corruption::Parked {
                    which: "readers parked",
                    found: u32::MAX,
                    ..
                },
            ..
        }) => {}
        other => panic!("expected a parked count refused, got {other:?}"),
    }
}

#[test]
fn a_parked_count_held_at_zero_is_corruption_not_a_lost_wake_up() {
    let got = parked_reader(|ring, stop, first| {
        ring.header_u32(header::SLEEPERS).store(0, Ordering::SeqCst);
        first.wait();
        while !stop.load(Ordering::SeqCst) {
            ring.header_u32(header::SLEEPERS).store(0, Ordering::SeqCst);
            std::thread::yield_now();
        }
    });
    match got {
        Err(QueueError::Corrupt {
            peer: 0,
            problem:
                Corruption::Parked {
                    which: "readers parked",
                    ..
                },
            ..
        }) => {}
        other => panic!("expected a parked count refused, got {other:?}"),
    }
}

#[test]
fn a_frame_announcing_a_large_message_makes_a_transport_reader_reserve_only_what_arrives() {
    let done = std::sync::Barrier::new(2);
    let results =
        LocalGroup::new(2)
            .timeout(Duration::from_secs(10))
            .run(|comm: LocalCommunicator| {
                let mut config = config();
                config.via_transport = true;
                config.timeout = Duration::from_millis(500);
                config.options.max_total_bytes = 1 << 30;
                let mut q = BroadcastQueue::create(&comm, config).unwrap();
                if q.is_writer() {
                    // A frame announcing 1 GiB, and nothing after it.
                    let mut frame = [0u8; crate::queue::FRAME_FOR_TEST];
                    crate::queue::write_frame_for_test(&mut frame, 0, 1 << 30);
                    q.remote_for_test()
                        .unwrap()
                        .broadcast(0, &mut frame)
                        .unwrap();
                    done.wait();
                    None
                } else {
                    let got = q.recv::<serde_bytes::ByteBuf>().map(drop);
                    let reserved = q.buf_capacity_for_test();
                    done.wait();
                    Some((got, reserved))
                }
            });
    let (got, reserved) = results.into_iter().nth(1).unwrap().unwrap().unwrap();
    assert!(got.is_err(), "the rest never came: {got:?}");
    assert!(
        reserved <= 4 << 20,
        "a reader reserved {reserved} bytes for a message of which 256 bytes arrived"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any word of a published chunk's header set to any value: the reader returns the
    /// message the writer sent or a typed error, never another value and never a panic.
    #[test]
    fn any_corrupted_chunk_word_is_refused_or_harmless(
        field in prop_oneof![
            Just(Field::Stamp), Just(Field::Message), Just(Field::Total),
            Just(Field::Offset), Just(Field::Len), Just(Field::Flags),
            Just(Field::Shape),
        ],
        chunk in 0usize..2,
        value in prop_oneof![any::<u64>(), 0u64..200],
    ) {
        let sent = vec![vec![0x5a; 100]];
        let r = corrupted(sent.clone(), |ring| {
            chunk_word(ring, chunk, field).store(value, Ordering::SeqCst);
        });
        match &r[0] {
            Ok(bytes) => prop_assert_eq!(bytes, &sent[0]),
            Err(QueueError::Corrupt { peer: 0, .. }) => {}
            // A stamp set back to the slot's previous one: the chunk looks unwritten.
            Err(QueueError::WriterTimeout { writer: 0, .. }) if field == Field::Stamp => {}
            // The first chunk's shape word is the message's: another shape is another type.
            Err(QueueError::TypeMismatch { writer: 0, .. })
                if field == Field::Shape && chunk == 0 => {}
            Err(other) => prop_assert!(false, "unexpected error {other:?}"),
        }
    }
}
