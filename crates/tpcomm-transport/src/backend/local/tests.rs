use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::abort::Abort;
use super::posts::{Got, Outgoing, Post};
use super::shared::lock;
use super::slots::{op_code, op_of, Slot, INLINE_BYTES, INLINE_META, OPS, RING};
use super::*;
use crate::communicator::Communicator;
use crate::error::{Op, TransportError};

/// The shared posts of rounds every rank is done with leave the ring at their rank's
/// next call: what the group holds stays bounded by the group, not by the number of
/// calls (a root running ahead included). Small posts, inline in the slots, take turns
/// with large ones in the same slots.
#[test]
fn posts_of_finished_rounds_are_given_back() {
    let comms = LocalGroup::new(3).communicators().unwrap();
    let shared = comms[0].shared.clone();
    std::thread::scope(|s| {
        for comm in comms {
            s.spawn(move || {
                for i in 0..500u32 {
                    // Past the inline size every other call.
                    let len = if i % 2 == 0 { 4 } else { 1000 };
                    let mut buf = vec![0u8; len];
                    if comm.rank() == 0 {
                        buf.fill(i as u8);
                    }
                    comm.broadcast(0, &mut buf).unwrap();
                    assert!(buf.iter().all(|&b| b == i as u8));
                    let mut all = [0u8; 3];
                    comm.all_gather(&[comm.rank() as u8], &mut all).unwrap();
                    assert_eq!(all, [0, 1, 2]);
                }
            });
        }
    });
    assert_eq!(shared.slots.len(), 3 * RING as usize);
    for rank in 0..3 {
        let held = (0..RING)
            .filter(|&seq| lock(&shared.slot(rank, seq).post).is_some())
            .count();
        // The last calls' posts, not yet seen done at a later call of their rank.
        assert!(held <= 3, "rank {rank} holds {held} posts after 1000 calls");
    }
}

/// The largest inline post (every inline byte and count in use) reads back whole, with
/// its operation and root; one byte more goes shared, and reads back whole too.
#[test]
fn a_post_at_the_inline_limit_reads_back_whole() {
    let comms = LocalGroup::new(2).communicators().unwrap();
    let (reader, writer) = (&comms[0], &comms[1]);
    let bytes: Vec<u8> = (0..INLINE_BYTES).map(|i| i as u8 ^ 0x5a).collect();
    let meta: Vec<usize> = (0..INLINE_META).map(|i| usize::MAX - i).collect();
    let mut copy = Post::default();
    writer.publish_post(0, Op::GatherVarcount, Some(1), writer.post(&bytes, &meta));
    let got = reader
        .read_post(1, 0, (Op::GatherVarcount, Some(1), 0), &mut copy)
        .unwrap();
    assert!(matches!(got, Got::Copied));
    assert_eq!(
        (copy.bytes.as_slice(), copy.meta.as_slice()),
        (&bytes[..], &meta[..])
    );
    let mut longer = bytes;
    longer.push(1);
    assert!(matches!(
        writer.post_owned(longer.clone()),
        Outgoing::Shared(_)
    ));
    let before = writer.publish_post(1, Op::Broadcast, Some(1), writer.post(&longer, &[]));
    let Got::Shared(post) = reader
        .read_post(1, 1, (Op::Broadcast, Some(1), before), &mut copy)
        .unwrap()
    else {
        panic!("a post past the inline size is shared");
    };
    assert_eq!(post.bytes, longer);
}

/// A reader that finds the slot's round changed across its read (what a peer's reuse of
/// the slot under an overlapping call looks like) aborts the group instead of returning
/// the words it read.
#[test]
fn a_slot_rewritten_under_a_reader_aborts_the_group() {
    let comms = LocalGroup::new(2).communicators().unwrap();
    let (reader, writer) = (&comms[0], &comms[1]);
    let mut copy = Post::default();
    writer.publish_post(0, Op::AllGather, None, writer.post(&[7; 9], &[9]));
    let got = reader
        .read_post(1, 0, (Op::AllGather, None, 0), &mut copy)
        .unwrap();
    assert!(matches!(got, Got::Copied));
    assert_eq!(
        (copy.bytes.as_slice(), copy.meta.as_slice()),
        (&[7u8; 9][..], &[9][..])
    );
    // The round this slot would carry 64 calls later, or the mark of a write under way.
    for round in [RING + 1, 0] {
        writer
            .shared
            .slot(1, 0)
            .round
            .store(round, Ordering::Relaxed);
        let e = reader
            .read_post(1, 0, (Op::AllGather, None, 0), &mut copy)
            .unwrap_err();
        assert!(
            matches!(&e, TransportError::Aborted { reason, .. } if reason.contains("overlapped")),
            "{e:?}"
        );
    }
    // The group stays aborted.
    assert!(matches!(
        reader.barrier(),
        Err(TransportError::Aborted { .. })
    ));
}

/// A peer that called another operation or root is named, with what it called.
#[test]
fn a_post_of_another_operation_or_root_aborts_naming_it() {
    let comms = LocalGroup::new(2).communicators().unwrap();
    let mut copy = Post::default();
    comms[1].publish_post(0, Op::Broadcast, Some(1), comms[1].post(&[], &[]));
    let e = comms[0]
        .read_post(1, 0, (Op::Broadcast, Some(0), 0), &mut copy)
        .unwrap_err();
    let TransportError::Aborted { reason, .. } = e else {
        panic!("{e:?}");
    };
    assert!(
        reason.contains("rank 1 called broadcast (root Some(1))"),
        "{reason}"
    );
}

/// The round, head, root, counts and first two words of inline bytes on the slot's
/// first 64-byte line, the shared post on the second, and nothing past the pair.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
#[test]
fn a_slot_is_two_cache_lines_with_small_posts_on_the_first() {
    assert_eq!(std::mem::offset_of!(Slot, bytes), 48);
    assert!(std::mem::offset_of!(Slot, post) >= 64);
    assert_eq!(std::mem::size_of::<Slot>(), 128);
}

#[test]
fn op_codes_go_both_ways() {
    for (i, &op) in OPS.iter().enumerate() {
        assert_eq!(op_code(op), i as u64);
        assert_eq!(op_of(i as u64), Some(op));
    }
    assert_eq!(op_of(OPS.len() as u64), None);
    assert_eq!(op_of(u64::MAX), None);
}

/// The communicators of a group of `size` whose waits park at once (no spin), so that a
/// test can act while a rank is parked; bounded by a 5 s timeout.
fn parking_group(size: usize) -> Vec<LocalCommunicator> {
    LocalGroup::new(size)
        .timeout(Duration::from_secs(5))
        .spin(Duration::ZERO)
        .communicators()
        .unwrap()
}

/// A root parked at the ring, waiting for its reader to be done with the oldest round,
/// wakes when the reader finishes that round (what the end of `exchange` does), not
/// only at the reader's next post or its own timeout.
#[test]
fn a_reader_finishing_a_round_wakes_a_root_parked_at_the_ring() {
    let comms = parking_group(2);
    let (root, reader) = (&comms[0], &comms[1]);
    for _ in 0..RING {
        root.broadcast(0, &mut [0u8; 8]).unwrap();
    }
    std::thread::scope(|s| {
        let parked = s.spawn(|| {
            let begun = Instant::now();
            root.broadcast(0, &mut [0u8; 8]).map(|()| begun.elapsed())
        });
        // The reader's first round, done by hand: its post, then (the root parked by
        // then) its done count.
        std::thread::sleep(Duration::from_millis(100));
        reader.seq.store(1, Ordering::Relaxed);
        reader.publish_post(0, Op::Broadcast, Some(0), reader.post(&[], &[8]));
        std::thread::sleep(Duration::from_millis(100));
        reader.finish_round(0);
        let waited = parked.join().unwrap().unwrap();
        assert!(
            waited < Duration::from_secs(2),
            "the root waited {waited:?}, past the reader's done count"
        );
    });
}

/// A rank parked in a call whose posts all arrived returns their data when it wakes to
/// an abort raised since (a peer that completed the call and left, seen by a rank a
/// call ahead): the call completed on the other ranks too. Its next call fails.
#[test]
fn a_call_whose_posts_all_arrived_completes_despite_a_later_abort() {
    let comms = parking_group(3);
    let (root, reader) = (&comms[0], &comms[1]);
    std::thread::scope(|s| {
        let parked = s.spawn(|| {
            let mut buf = [0u8; 8];
            reader.broadcast(0, &mut buf).map(|()| buf)
        });
        std::thread::sleep(Duration::from_millis(100));
        // Under the lock the parked reader needs to look: it sees the root's post and
        // the abort together.
        let shared = &*root.shared;
        let mut state = shared.lock();
        root.seq.store(1, Ordering::Relaxed);
        root.publish_post(0, Op::Broadcast, Some(0), root.post(&[7; 8], &[]));
        state.abort = Some(Abort {
            by: 0,
            reason: "rank 0 dropped its communicator before joining broadcast".into(),
            timed_out: false,
        });
        shared.publish(&state);
        drop(state);
        assert_eq!(parked.join().unwrap().unwrap(), [7; 8]);
    });
    assert!(matches!(
        reader.broadcast(0, &mut [0u8; 8]),
        Err(TransportError::Aborted { by: 0, .. })
    ));
}

/// A rank that needs nobody's post runs at most `RING` rounds ahead of a rank that has
/// not read its posts, then waits for it; nothing is lost.
#[test]
fn a_root_runs_at_most_the_ring_ahead_of_its_readers() {
    let ahead = AtomicUsize::new(0);
    let calls = 2 * RING as usize;
    let results = LocalGroup::new(2).run(|comm| {
        let mut got = Vec::new();
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
            let seen = ahead.load(Ordering::SeqCst);
            for _ in 0..calls {
                let mut buf = [0u8; 8];
                comm.broadcast(0, &mut buf)?;
                got.push(u64::from_le_bytes(buf));
            }
            return Ok((seen, got));
        }
        for i in 0..calls as u64 {
            comm.broadcast(0, &mut i.to_le_bytes())?;
            ahead.fetch_add(1, Ordering::SeqCst);
        }
        Ok::<_, TransportError>((0, got))
    });
    let (seen, got) = results[1].as_ref().unwrap().as_ref().unwrap().clone();
    assert_eq!(
        seen, RING as usize,
        "rounds the root ran ahead of a sleeping reader"
    );
    assert_eq!(got, (0..calls as u64).collect::<Vec<_>>());
    assert!(results[0].as_ref().unwrap().is_ok());
}

/// A communicator whose waits `bound_waits` bounded times out at its own bound, naming the
/// rank that did not come, however long the group's timeout.
#[test]
fn bound_waits_bounds_this_rank_s_waits_by_its_own_timeout() {
    let mut comms = LocalGroup::new(2)
        .timeout(Duration::from_secs(60))
        .communicators()
        .unwrap();
    let mut reader = comms.pop().unwrap();
    assert!(reader.bound_waits(Duration::from_millis(200)).unwrap());
    let begun = Instant::now();
    match reader.broadcast(0, &mut [0u8; 8]) {
        Err(TransportError::Timeout { missing, .. }) => assert_eq!(missing, [0]),
        other => panic!("expected a timeout naming the root, got {other:?}"),
    }
    let waited = begun.elapsed();
    assert!(waited < Duration::from_secs(30), "waited {waited:?}");
}
