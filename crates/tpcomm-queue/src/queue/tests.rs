//! The size pass, a streamed value's chunks published mid-encoding, the frames, and the
//! ring of a queue one of whose readers could not map it.

use serde::Serialize;

use super::stream::{encoded_size, SizePass};
use super::transport::{read_frame, write_frame, DATA, FRAME};
use super::{BroadcastQueue, QueueConfig};
use crate::ring::RingMemory;
use serde_bytes::ByteBuf;
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

thread_local! {
    /// Set on a rank's thread before `create`: that reader cannot map the ring.
    pub(super) static REFUSE_MAPPING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[test]
fn the_size_pass_counts_values_of_few_large_pieces_and_gives_up_on_many_small_ones() {
    let blob = ByteBuf::from(vec![5u8; 1 << 20]);
    assert!(matches!(encoded_size(&blob, 8), SizePass::Bytes(Ok((n, _))) if n == (1 << 20) + 3));
    let fields = (1u8, 2u16, "three", [4u32; 8], ByteBuf::from(vec![0; 100]));
    let len = tpcomm_objects::encode_append(&fields, Vec::new())
        .unwrap()
        .len();
    assert!(matches!(encoded_size(&fields, 8), SizePass::Bytes(Ok((n, _))) if n == len));
    // Every element a piece: a Vec<u8> without serde_bytes, a Vec<u32>.
    assert!(matches!(
        encoded_size(&vec![1u8; 1000], 8),
        SizePass::GaveUp
    ));
    assert!(matches!(encoded_size(&vec![1u32; 65], 8), SizePass::GaveUp));
    // Small pieces among large ones: counted while they average 64 bytes.
    // (each byte string is two pieces, its length and its bytes)
    let mixed: Vec<ByteBuf> = (0..200).map(|_| ByteBuf::from(vec![1; 200])).collect();
    assert!(matches!(encoded_size(&mixed, 8), SizePass::Bytes(Ok(_))));
    let mixed: Vec<ByteBuf> = (0..200).map(|_| ByteBuf::from(vec![1; 100])).collect();
    assert!(matches!(encoded_size(&mixed, 8), SizePass::GaveUp));
}

/// Two chunk-sized byte strings; between them, the writer's encoding (its second
/// serialization: the first is the size pass) waits at a barrier with the reader.
struct Pausing<'a> {
    bytes: ByteBuf,
    pause: &'a std::sync::Barrier,
    calls: std::cell::Cell<u32>,
}

impl Serialize for Pausing<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(2)?;
        t.serialize_element(&self.bytes)?;
        self.calls.set(self.calls.get() + 1);
        if self.calls.get() == 2 {
            // The reader looks at the ring here.
            self.pause.wait();
            self.pause.wait();
        }
        t.serialize_element(&self.bytes)?;
        t.end()
    }
}

#[test]
fn a_streamed_value_s_first_chunks_are_published_while_it_is_still_encoded() {
    const CHUNK: usize = 256;
    let pause = std::sync::Barrier::new(2);
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let config = QueueConfig {
            depth: 8,
            chunk_bytes: CHUNK,
            ..QueueConfig::default()
        };
        let mut q = BroadcastQueue::create(&comm, config)?;
        let bytes = ByteBuf::from(vec![3u8; 2 * CHUNK]);
        if q.is_writer() {
            q.send(&Pausing {
                bytes: bytes.clone(),
                pause: &pause,
                calls: std::cell::Cell::new(0),
            })?;
        } else {
            pause.wait();
            let published = q
                .ring_for_test()
                .unwrap()
                .published()
                .load(std::sync::atomic::Ordering::SeqCst);
            pause.wait();
            // The first byte string and its length prefix: two whole chunks.
            assert_eq!(
                published, 2,
                "chunks published in the middle of the encoding"
            );
            let got: (ByteBuf, ByteBuf) = q.recv()?;
            assert_eq!(got, (bytes.clone(), bytes));
        }
        q.close_with(&comm)
    });
    assert!(results.into_iter().all(|r| r.unwrap().is_ok()));
}

/// A byte string whose serializations are counted (the size pass is one).
struct Counted {
    bytes: ByteBuf,
    calls: std::cell::Cell<u32>,
}

impl Counted {
    fn new(len: usize) -> Self {
        Self {
            bytes: ByteBuf::from(vec![len as u8; len]),
            calls: std::cell::Cell::new(0),
        }
    }
}

impl Serialize for Counted {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.calls.set(self.calls.get() + 1);
        self.bytes.serialize(s)
    }
}

#[test]
fn the_size_pass_runs_after_a_large_message_and_is_skipped_after_a_small_one() {
    // (length, serializations: 2 when sized first, 1 when encoded straight into the buffer)
    const SENDS: [(usize, u32); 6] = [
        (64, 2),     // the first message is sized
        (64, 1),     // after a small one: straight into the buffer
        (40_000, 1), // a large one after a small one: buffered, whole
        (40_000, 2), // after a large one: sized, streamed
        (100, 2),    // after a large one: sized (and buffered, it is small)
        (50_000, 1), // after a small one again
    ];
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, QueueConfig::default())?;
        for (len, serializations) in SENDS {
            if q.is_writer() {
                let value = Counted::new(len);
                q.send(&value)?;
                assert_eq!(value.calls.get(), serializations, "{len} bytes");
            } else {
                let got: ByteBuf = q.recv()?;
                assert_eq!(got.len(), len);
                assert!(got.iter().all(|&b| b == len as u8));
            }
        }
        q.close_with(&comm)
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(matches!(r, Ok(Ok(()))), "rank {rank}: {r:?}");
    }
}

#[test]
fn frames_round_trip_and_garbage_is_refused() {
    let mut frame = [0u8; FRAME];
    write_frame(&mut frame, DATA, 7, (1000, 0xfeed));
    assert_eq!(read_frame(&frame), Ok((DATA, 7, (1000, 0xfeed))));
    let mut bad = frame;
    bad[0] = b'x';
    assert!(read_frame(&bad).is_err());
    let mut bad = frame;
    bad[6] = 9;
    assert!(read_frame(&bad).is_err());
    let mut bad = frame;
    bad[4] = 1;
    assert!(read_frame(&bad).is_err());
}

#[test]
fn a_reader_that_could_not_map_the_ring_leaves_the_others_able_to_resume() {
    let results = LocalGroup::new(3).run(|comm: LocalCommunicator| {
        // Rank 2 is on the writer's host but cannot map the ring: it reads through the
        // transport, and the ring keeps its slot.
        REFUSE_MAPPING.with(|r| r.set(comm.rank() == 2));
        let mut q = BroadcastQueue::create(&comm, QueueConfig::default())?;
        assert_eq!(q.locality().shared_memory, [1]);
        assert_eq!(q.locality().transport, [2]);
        q.suspend(&comm)?;
        q.resume(&comm)?;
        if q.is_writer() {
            q.send(&7u32)?;
        } else {
            assert_eq!(q.recv::<u32>()?, 7);
        }
        q.close_with(&comm)
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(matches!(r, Ok(Ok(()))), "rank {rank}: {r:?}");
    }
}

#[test]
fn the_pieces_after_a_frame_grow_with_what_arrived_and_cover_the_message() {
    use super::transport::next_piece;
    for (total, max_count) in [
        (300, 1 << 30),
        (5 << 20, 1 << 30),
        (3 << 30, 1 << 30),
        (100, 7),
    ] {
        let mut received = 100.min(total);
        let mut pieces = 0;
        while received < total {
            let n = next_piece(received, total, max_count);
            assert!(n > 0 && n <= received.max(1 << 20) && n <= max_count);
            received += n;
            pieces += 1;
        }
        assert_eq!(received, total);
        assert!(pieces <= 64, "{pieces} pieces for {total} bytes");
    }
}
