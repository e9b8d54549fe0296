//! Delivery: every reader gets every message, whole and in order, whatever the reader count,
//! the sizes, the path (ring or transport) and the pace of the readers.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use tpcomm_queue::{BroadcastQueue, QueueConfig, QueueError, QueuePath};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

mod common;
use common::{run_ok, tiny_ring};

/// A value shaped like a scheduler's step output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StepOutput {
    step: u64,
    request_ids: Vec<String>,
    tokens: Vec<Vec<u32>>,
    block_tables: Vec<Vec<u32>>,
    temperature: Vec<f32>,
}

fn step_output(step: u64, requests: usize) -> StepOutput {
    StepOutput {
        step,
        request_ids: (0..requests).map(|r| format!("req-{step}-{r}")).collect(),
        tokens: (0..requests)
            .map(|r| {
                (0..(r % 7) as u32 + 1)
                    .map(|t| t * 31 + step as u32)
                    .collect()
            })
            .collect(),
        block_tables: (0..requests).map(|r| vec![r as u32; 4]).collect(),
        temperature: (0..requests).map(|r| r as f32 / 10.0).collect(),
    }
}

/// Message `i`'s bytes: lengths around the chunk size and past the ring's size.
fn blob(i: usize, chunk: usize) -> ByteBuf {
    let lens = [0, 1, chunk - 2, chunk, chunk + 1, 3 * chunk + 5, 20 * chunk];
    let len = lens[i % lens.len()];
    ByteBuf::from((0..len).map(|b| (b * 7 + i) as u8).collect::<Vec<u8>>())
}

/// Every wait of these tests.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Four chunks of 256 bytes.
fn small_ring() -> QueueConfig {
    QueueConfig {
        depth: 4,
        chunk_bytes: 256,
        ..tiny_ring(TIMEOUT)
    }
}

/// Runs `messages` blobs from `writer` over `ranks` ranks (readers whose rank is in
/// `via_transport` read through the transport); every reader checks what it got.
fn deliver(ranks: usize, writer: usize, via_transport: &[usize], messages: usize) {
    let results = LocalGroup::new(ranks).run(|comm: LocalCommunicator| {
        let config = QueueConfig {
            writer,
            via_transport: via_transport.contains(&comm.rank()),
            ..small_ring()
        };
        let mut q = BroadcastQueue::create(&comm, config)?;
        let chunk = 256;
        for i in 0..messages {
            if q.is_writer() {
                q.send(&blob(i, chunk))?;
            } else {
                let got: ByteBuf = q.recv()?;
                assert_eq!(got, blob(i, chunk), "rank {} message {i}", comm.rank());
            }
        }
        let path = q.path();
        q.close_with(&comm)?;
        Ok::<_, QueueError>(path)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let path = r.unwrap().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let expected = if rank == writer {
            QueuePath::Writer
        } else if via_transport.contains(&rank) {
            QueuePath::Transport
        } else {
            QueuePath::SharedMemory
        };
        assert_eq!(path, expected, "rank {rank}");
    }
}

#[test]
fn every_reader_count_from_1_to_7_gets_every_message_whole_and_in_order() {
    for readers in 1..=7 {
        deliver(readers + 1, 0, &[], 30);
    }
}

#[test]
fn any_rank_can_be_the_writer() {
    deliver(4, 2, &[], 20);
}

#[test]
fn readers_through_the_transport_get_the_same_messages_as_the_ring_readers() {
    deliver(4, 1, &[0, 3], 30);
}

#[test]
fn a_transport_reader_gets_messages_of_several_pieces_whole_after_larger_and_smaller_ones() {
    // Past 1 MiB a message arrives in several pieces, each reserved once the one before is
    // in; the sizes go up and down, so that bytes of a larger message before, or a piece
    // placed wrong, would show in the next one.
    let lens = [
        3 << 20,
        (3 << 20) / 2 + 7,
        100,
        5 << 20,
        (1 << 20) + 225,
        0,
        2 << 20,
    ];
    let blob = |i: usize| {
        ByteBuf::from(
            (0..lens[i])
                .map(|b| (b * 13 + i * 7) as u8)
                .collect::<Vec<u8>>(),
        )
    };
    run_ok(2, |comm: LocalCommunicator| {
        let config = QueueConfig {
            via_transport: comm.rank() == 1,
            ..tiny_ring(TIMEOUT)
        };
        let mut q = BroadcastQueue::create(&comm, config)?;
        for i in 0..lens.len() {
            if q.is_writer() {
                q.send(&blob(i))?;
            } else {
                assert_eq!(q.path(), QueuePath::Transport);
                let got: ByteBuf = q.recv()?;
                assert!(got == blob(i), "message {i} of {} bytes differs", lens[i]);
            }
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_queue_whose_readers_all_use_the_transport_needs_no_ring() {
    deliver(3, 0, &[1, 2], 15);
}

#[test]
fn a_message_larger_than_the_whole_ring_streams_through_it() {
    run_ok(3, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, tiny_ring(TIMEOUT))?;
        let big = ByteBuf::from(vec![0xab; 100_000]);
        if q.is_writer() {
            q.send(&big)?;
            q.send(&step_output(1, 3))?;
        } else {
            assert_eq!(q.recv::<ByteBuf>()?, big);
            assert_eq!(q.recv::<StepOutput>()?, step_output(1, 3));
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_writer_that_laps_a_slow_reader_waits_for_it_and_loses_nothing() {
    run_ok(3, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, tiny_ring(TIMEOUT))?;
        for i in 0..40u64 {
            if q.is_writer() {
                q.send(&step_output(i, (i % 5) as usize))?;
            } else {
                if comm.rank() == 2 && i % 8 == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                assert_eq!(q.recv::<StepOutput>()?, step_output(i, (i % 5) as usize));
            }
        }
        q.close_with(&comm)
    });
}

#[test]
fn recv_borrowed_gives_values_that_borrow_from_the_queue() {
    #[derive(Serialize)]
    struct Owned {
        name: String,
        bytes: ByteBuf,
    }
    #[derive(Deserialize)]
    struct Borrowed<'a> {
        name: &'a str,
        #[serde(borrow)]
        bytes: &'a serde_bytes::Bytes,
    }
    run_ok(3, |comm: LocalCommunicator| {
        let config = QueueConfig {
            via_transport: comm.rank() == 2,
            ..small_ring()
        };
        let mut q = BroadcastQueue::create(&comm, config)?;
        for i in 0..5usize {
            if q.is_writer() {
                q.send(&Owned {
                    name: format!("step {i}"),
                    bytes: ByteBuf::from(vec![i as u8; i * 200]),
                })?;
            } else {
                let got: Borrowed<'_> = q.recv_borrowed()?;
                assert_eq!(got.name, format!("step {i}"));
                assert_eq!(&got.bytes[..], &vec![i as u8; i * 200][..]);
            }
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_message_that_does_not_decode_is_an_error_and_the_next_one_arrives() {
    run_ok(2, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, small_ring())?;
        if q.is_writer() {
            q.send("not a number")?;
            q.send(&7u32)?;
        } else {
            match q.recv::<u64>() {
                Err(QueueError::Decode {
                    writer: 0,
                    message: 0,
                    ..
                }) => {}
                other => panic!("expected a decode error, got {other:?}"),
            }
            assert_eq!(q.recv::<u32>()?, 7);
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_value_received_as_another_type_is_a_type_error_and_the_next_one_arrives() {
    run_ok(2, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, small_ring())?;
        if q.is_writer() {
            q.send(&0u64)?;
            q.send(&StepOutput {
                step: 0,
                request_ids: Vec::new(),
                tokens: Vec::new(),
                block_tables: Vec::new(),
                temperature: Vec::new(),
            })?;
            q.send("owned or borrowed: one type")?;
            q.send(&5u64)?;
        } else {
            // `0u64` is one byte, 0: the bytes of an empty string too.
            match q.recv::<String>() {
                Err(QueueError::TypeMismatch {
                    writer: 0,
                    message: 0,
                    ..
                }) => {}
                other => panic!("expected a type mismatch, got {other:?}"),
            }
            // Five empty fields: the bytes of five zeros too.
            match q.recv::<(u8, u8, u8, u8, u8)>() {
                Err(QueueError::TypeMismatch { message: 1, .. }) => {}
                other => panic!("expected a type mismatch, got {other:?}"),
            }
            assert_eq!(q.recv_borrowed::<&str>()?, "owned or borrowed: one type");
            assert_eq!(q.recv::<u64>()?, 5);
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_value_nested_past_the_depth_limit_is_refused_by_the_decoder() {
    #[derive(Debug, Serialize, Deserialize)]
    enum Tree {
        Leaf,
        Node(Vec<Tree>),
    }
    /// Bytes sent as they are (a tuple of bytes: postcard adds nothing), one level deep:
    /// what a writer that does not keep the depth limit could send.
    struct Raw(Vec<u8>);
    impl Serialize for Raw {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeTuple;
            let mut t = s.serialize_tuple(self.0.len())?;
            for b in &self.0 {
                t.serialize_element(b)?;
            }
            t.end()
        }
    }
    run_ok(2, |comm: LocalCommunicator| {
        let mut config = small_ring();
        config.options.max_depth = 16;
        let mut q = BroadcastQueue::create(&comm, config)?;
        if q.is_writer() {
            let mut t = Tree::Leaf;
            for _ in 0..40 {
                t = Tree::Node(vec![t]);
            }
            // The writer keeps the limit too: the tree itself is refused.
            assert!(matches!(
                q.send(&t),
                Err(QueueError::TooDeep { limit: 16, .. })
            ));
            q.send(&Raw(postcard::to_allocvec(&t).unwrap()))?;
        } else {
            match q.recv::<Tree>() {
                Err(QueueError::Decode { source, .. }) => {
                    assert!(format!("{:?}", source).contains("TooDeep"), "{source:?}");
                }
                other => panic!("expected a depth refusal, got {other:?}"),
            }
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_message_over_the_cap_is_refused_by_the_writer_and_nothing_is_sent() {
    run_ok(2, |comm: LocalCommunicator| {
        let mut config = small_ring();
        config.options.max_total_bytes = 1000;
        let mut q = BroadcastQueue::create(&comm, config)?;
        if q.is_writer() {
            match q.send(&ByteBuf::from(vec![0; 2000])) {
                Err(QueueError::MessageTooLarge {
                    bytes: 2002,
                    cap: 1000,
                    message: 0,
                    ..
                }) => {}
                other => panic!("expected MessageTooLarge, got {other:?}"),
            }
            q.send(&ByteBuf::from(vec![1; 900]))?;
        } else {
            assert_eq!(q.recv::<ByteBuf>()?, ByteBuf::from(vec![1; 900]));
        }
        q.close_with(&comm)
    });
}

#[test]
fn roles_are_checked() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, small_ring()).unwrap();
        let wrong = if q.is_writer() {
            q.recv::<u32>().map(drop)
        } else {
            q.send(&1u32)
        };
        q.close_with(&comm).unwrap();
        wrong
    });
    assert!(matches!(
        results[0].as_ref().unwrap(),
        Err(QueueError::NotReader { rank: 0 })
    ));
    assert!(matches!(
        results[1].as_ref().unwrap(),
        Err(QueueError::NotWriter { rank: 1, writer: 0 })
    ));
}

#[test]
fn a_queue_of_one_rank_has_a_writer_and_no_reader() {
    run_ok(1, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, small_ring())?;
        q.send(&step_output(0, 2))?;
        assert_eq!(q.messages(), 1);
        assert!(q.locality().shared_memory.is_empty());
        q.close_with(&comm)
    });
}

/// A value of a few large pieces (byte strings and strings): `send` sizes it and encodes it
/// straight into the ring's chunks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Tensors {
    name: String,
    weights: ByteBuf,
    bias: ByteBuf,
}

fn tensors(i: usize) -> Tensors {
    // Lengths that put chunk boundaries (64 bytes) inside each piece and between pieces.
    Tensors {
        name: format!("layer-{i}"),
        weights: ByteBuf::from(vec![i as u8; 50 + 37 * i]),
        bias: ByteBuf::from((0..(i * 13) % 200).map(|b| b as u8).collect::<Vec<u8>>()),
    }
}

#[test]
fn values_encoded_straight_into_the_ring_arrive_whole_whatever_the_chunk_boundaries() {
    run_ok(3, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, tiny_ring(TIMEOUT))?;
        for i in 0..60 {
            // Interleaved with values of many small pieces, encoded into the writer's buffer.
            if q.is_writer() {
                q.send(&tensors(i))?;
                q.send(&step_output(i as u64, i % 4))?;
            } else {
                assert_eq!(q.recv::<Tensors>()?, tensors(i), "message {i}");
                assert_eq!(q.recv::<StepOutput>()?, step_output(i as u64, i % 4));
            }
        }
        q.close_with(&comm)
    });
}

#[test]
fn an_empty_message_is_one_empty_chunk() {
    run_ok(2, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, tiny_ring(TIMEOUT))?;
        for i in 0..5u32 {
            if q.is_writer() {
                q.send(&())?;
                q.send(&i)?;
            } else {
                q.recv::<()>()?;
                assert_eq!(q.recv::<u32>()?, i);
            }
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_value_of_many_small_pieces_over_the_cap_is_refused_and_nothing_is_sent() {
    run_ok(2, |comm: LocalCommunicator| {
        let mut config = small_ring();
        config.options.max_total_bytes = 1000;
        let mut q = BroadcastQueue::create(&comm, config)?;
        if q.is_writer() {
            match q.send(&vec![1u32; 1500]) {
                Err(QueueError::MessageTooLarge {
                    bytes: 1502,
                    cap: 1000,
                    ..
                }) => {}
                other => panic!("expected MessageTooLarge, got {other:?}"),
            }
            q.send(&vec![2u32; 900])?;
        } else {
            assert_eq!(q.recv::<Vec<u32>>()?, vec![2u32; 900]);
        }
        q.close_with(&comm)
    });
}

/// A byte string one byte shorter each time it is serialized: the size pass and the
/// encoding disagree.
struct Shrinking(std::cell::Cell<usize>);

impl Serialize for Shrinking {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let len = self.0.get();
        self.0.set(len - 1);
        s.serialize_bytes(&vec![9; len])
    }
}

#[test]
fn a_value_that_encodes_shorter_than_sized_is_refused_before_any_chunk_is_published() {
    run_ok(2, |comm: LocalCommunicator| {
        // One chunk that holds the whole value, which is large enough to be streamed.
        let one_chunk = QueueConfig {
            depth: 2,
            chunk_bytes: 64 << 10,
            ..small_ring()
        };
        let mut q = BroadcastQueue::create(&comm, one_chunk)?;
        if q.is_writer() {
            match q.send(&Shrinking(std::cell::Cell::new(20_000))) {
                Err(QueueError::UnstableEncoding {
                    message: 0,
                    sized: 20_003,
                    ..
                }) => {}
                other => panic!("expected UnstableEncoding, got {other:?}"),
            }
            q.send(&7u32)?;
        } else {
            assert_eq!(q.recv::<u32>()?, 7);
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_value_that_encodes_shorter_than_sized_after_a_published_chunk_fails_the_queue() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, tiny_ring(TIMEOUT)).unwrap();
        if q.is_writer() {
            let sent = q.send(&Shrinking(std::cell::Cell::new(200)));
            assert!(
                matches!(sent, Err(QueueError::UnstableEncoding { sized: 202, .. })),
                "{sent:?}"
            );
            assert!(matches!(q.send(&1u32), Err(QueueError::Failed { .. })));
            comm.barrier().unwrap();
        } else {
            let got = q.recv::<ByteBuf>();
            assert!(
                matches!(got, Err(QueueError::WriterFailed { culprit: 0, .. })),
                "{got:?}"
            );
            comm.barrier().unwrap();
        }
    });
    assert!(results.into_iter().all(|r| r.is_ok()));
}

#[test]
fn large_pieces_arrive_whole_through_the_non_temporal_copies() {
    run_ok(3, |comm: LocalCommunicator| {
        let config = QueueConfig {
            depth: 3,
            chunk_bytes: 40_000,
            ..small_ring()
        };
        let mut q = BroadcastQueue::create(&comm, config)?;
        // Lengths past the 16 KiB of a non-temporal copy, chunk boundaries inside pieces,
        // the ring lapped; one value through the writer's buffer (a Vec<u16>).
        for i in 0..12usize {
            let bytes = ByteBuf::from(
                (0..17_000 * i + 5)
                    .map(|b| (b ^ i) as u8)
                    .collect::<Vec<u8>>(),
            );
            let words: Vec<u16> = (0..(30_000 + i) as u16).collect();
            if q.is_writer() {
                q.send(&bytes)?;
                q.send(&words)?;
            } else {
                assert_eq!(q.recv::<ByteBuf>()?, bytes, "message {i}");
                assert_eq!(q.recv::<Vec<u16>>()?, words);
            }
        }
        q.close_with(&comm)
    });
}
