//! The queue's life: creation agreement, back-pressure and timeouts naming the peer, peers
//! that leave, suspend/resume, and closes.

use std::time::{Duration, Instant};

use tpcomm_queue::{BroadcastQueue, Departure, QueueConfig, QueueError};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

mod common;
use common::{run_ok, tiny_ring};

fn config(timeout_ms: u64) -> QueueConfig {
    tiny_ring(Duration::from_millis(timeout_ms))
}

#[test]
fn settings_that_differ_fail_creation_on_every_rank_naming_the_setting() {
    let results = LocalGroup::new(3).run(|comm: LocalCommunicator| {
        let mut c = config(5000);
        if comm.rank() == 2 {
            c.chunk_bytes = 128;
        }
        BroadcastQueue::create(&comm, c).map(drop)
    });
    for r in results {
        match r.unwrap() {
            Err(QueueError::ConfigMismatch {
                setting: "chunk_bytes",
                reference: 0,
                ranks,
                ..
            }) => assert_eq!(ranks, [2]),
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn an_invalid_configuration_fails_its_rank_and_is_named_to_the_others() {
    let results = LocalGroup::new(3).run(|comm: LocalCommunicator| {
        let mut c = config(5000);
        if comm.rank() == 1 {
            c.depth = 0;
        }
        BroadcastQueue::create(&comm, c).map(drop)
    });
    for (rank, r) in results.into_iter().enumerate() {
        match (rank, r.unwrap()) {
            (1, Err(QueueError::InvalidConfig { reason, .. })) => {
                assert!(reason.contains("depth 0"), "{reason}")
            }
            (_, Err(QueueError::PeerInvalidConfig { ranks, .. })) => assert_eq!(ranks, [1]),
            (rank, other) => panic!("rank {rank}: got {other:?}"),
        }
    }
}

#[test]
fn a_writer_out_of_range_is_an_invalid_configuration() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        BroadcastQueue::create(&comm, QueueConfig::with_writer(5)).map(drop)
    });
    for r in results {
        assert!(matches!(r.unwrap(), Err(QueueError::InvalidConfig { .. })));
    }
}

#[test]
fn a_reader_waiting_on_an_absent_writer_times_out_naming_it_and_can_wait_again() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config(100)).unwrap();
        if q.is_writer() {
            comm.barrier().unwrap();
            q.send(&42u32).unwrap();
            q.close_with(&comm).unwrap();
            return None;
        }
        let started = Instant::now();
        let timed_out = q.recv::<u32>();
        let waited = started.elapsed();
        comm.barrier().unwrap();
        let again = q.recv::<u32>();
        q.close_with(&comm).unwrap();
        Some((timed_out, waited, again))
    });
    let (timed_out, waited, again) = results.into_iter().nth(1).unwrap().unwrap().unwrap();
    match timed_out {
        Err(
            e @ QueueError::WriterTimeout {
                writer: 0,
                message: 0,
                ..
            },
        ) => {
            assert_eq!(e.culprit(), Some(0))
        }
        other => panic!("expected a timeout naming the writer, got {other:?}"),
    }
    assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(10));
    assert_eq!(again.unwrap(), 42);
}

#[test]
fn a_transport_reader_waits_no_longer_than_the_queue_timeout_and_names_the_writer() {
    let done = std::sync::Barrier::new(2);
    // The transport's own timeout is far longer than the queue's.
    let results =
        LocalGroup::new(2)
            .timeout(Duration::from_secs(20))
            .run(|comm: LocalCommunicator| {
                let mut config = config(300);
                config.via_transport = true;
                let mut q = BroadcastQueue::create(&comm, config).unwrap();
                if q.is_writer() {
                    // Absent until the reader has given up.
                    done.wait();
                    return None;
                }
                let started = Instant::now();
                let got = q.recv::<u32>();
                let waited = started.elapsed();
                done.wait();
                Some((got, waited))
            });
    let (got, waited) = results.into_iter().nth(1).unwrap().unwrap().unwrap();
    match got {
        Err(QueueError::WriterTimeout {
            writer: 0,
            message: 0,
            ..
        }) => {}
        other => panic!("expected a timeout naming the writer, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
}

#[test]
fn a_writer_names_the_transport_reader_that_does_not_take_its_messages_by_its_queue_rank() {
    // The writer is the last rank: on the transport path's split (the writer first, then
    // the transport readers) rank 0 of the queue is rank 1, and rank 1 is rank 2.
    let writer_done = std::sync::Barrier::new(2);
    let results =
        LocalGroup::new(3)
            .timeout(Duration::from_secs(20))
            .run(|comm: LocalCommunicator| {
                let config = QueueConfig {
                    writer: 2,
                    via_transport: comm.rank() != 2,
                    ..config(300)
                };
                let mut q = BroadcastQueue::create(&comm, config).unwrap();
                match comm.rank() {
                    // Far past the rounds a broadcast root may run ahead of a reader.
                    2 => {
                        let sent = (0..200u32).try_for_each(|i| q.send(&i));
                        writer_done.wait();
                        Some(sent)
                    }
                    // Rank 0 never takes a message (its queue lives until the writer gave up).
                    0 => {
                        writer_done.wait();
                        None
                    }
                    _ => {
                        let _ = (0..200).try_for_each(|_| q.recv::<u32>().map(drop));
                        None
                    }
                }
            });
    let writer = results.into_iter().nth(2).unwrap().unwrap().unwrap();
    match writer {
        Err(e @ QueueError::TransportTimeout { .. }) => {
            assert_eq!(e.culprit(), Some(0), "{e}");
            assert!(
                matches!(&e, QueueError::TransportTimeout { readers, .. } if readers == &[0]),
                "{e:?}"
            );
        }
        other => panic!("expected a timeout naming rank 0, got {other:?}"),
    }
}

#[test]
fn a_writer_waits_no_longer_than_the_timeout_for_a_stalled_reader_and_names_it_to_everyone() {
    let results = LocalGroup::new(3).run(|comm: LocalCommunicator| {
        // The timeout is each rank's own: the reader that reads waits longer than the writer.
        let timeout = if comm.rank() == 0 { 200 } else { 20_000 };
        let mut q = BroadcastQueue::create(&comm, config(timeout)).unwrap();
        let outcome = match comm.rank() {
            // The writer laps the ring: rank 2 never reads.
            0 => (0..10u32).try_for_each(|i| q.send(&i)).map(|()| 0),
            1 => (0..10u32).try_fold(0, |_, _| q.recv::<u32>()),
            _ => Ok(0),
        };
        comm.barrier().unwrap();
        outcome
    });
    let writer = results[0].as_ref().unwrap();
    assert!(
        matches!(writer, Err(QueueError::ReaderTimeout { reader: 2, .. })),
        "{writer:?}"
    );
    let reader = results[1].as_ref().unwrap();
    assert!(
        matches!(
            reader,
            Err(QueueError::WriterFailed {
                culprit: 2,
                writer: 0,
                ..
            })
        ),
        "{reader:?}"
    );
}

#[test]
fn a_writer_that_drops_its_queue_is_reported_to_a_waiting_reader() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config(20_000)).unwrap();
        if q.is_writer() {
            q.send(&1u32).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            drop(q);
            None
        } else {
            let first = q.recv::<u32>().unwrap();
            let started = Instant::now();
            Some((first, q.recv::<u32>(), started.elapsed()))
        }
    });
    let (first, second, waited) = results.into_iter().nth(1).unwrap().unwrap().unwrap();
    assert_eq!(first, 1);
    assert!(
        matches!(
            second,
            Err(QueueError::WriterGone {
                writer: 0,
                message: 1,
                how: Departure::Dropped,
                ..
            })
        ),
        "{second:?}"
    );
    assert!(waited < Duration::from_secs(10), "woken, not timed out");
}

#[test]
fn a_reader_that_drops_its_queue_is_named_by_the_writer_that_laps_it() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config(20_000)).unwrap();
        if q.is_writer() {
            comm.barrier().unwrap();
            Some((0..10u32).try_for_each(|i| q.send(&i)))
        } else {
            drop(q);
            comm.barrier().unwrap();
            None
        }
    });
    match results.into_iter().next().unwrap().unwrap() {
        Some(Err(QueueError::ReaderGone {
            reader: 1,
            how: Departure::Dropped,
            ..
        })) => {}
        other => panic!("expected the writer to name the reader, got {other:?}"),
    }
}

#[test]
fn the_writer_closing_ends_every_readers_stream_after_its_last_message() {
    let results = LocalGroup::new(4).run(|comm: LocalCommunicator| {
        let c = QueueConfig {
            via_transport: comm.rank() == 3,
            ..config(20_000)
        };
        let mut q = BroadcastQueue::create(&comm, c).unwrap();
        if q.is_writer() {
            for i in 0..5u32 {
                q.send(&i).unwrap();
            }
            q.close().unwrap();
            return Ok(Vec::new());
        }
        let mut got = Vec::new();
        loop {
            match q.recv::<u32>() {
                Ok(v) => got.push(v),
                Err(QueueError::Closed {
                    writer: 0,
                    messages: 5,
                    ..
                }) => break,
                Err(e) => return Err(e),
            }
        }
        // Closed stays closed.
        assert!(matches!(q.recv::<u32>(), Err(QueueError::Closed { .. })));
        Ok(got)
    });
    for r in results.into_iter().skip(1) {
        assert_eq!(r.unwrap().unwrap(), [0, 1, 2, 3, 4]);
    }
}

#[test]
fn suspend_and_resume_keep_the_messages_not_received_yet() {
    run_ok(3, |comm: LocalCommunicator| {
        let c = QueueConfig {
            depth: 8,
            via_transport: comm.rank() == 2,
            ..config(20_000)
        };
        let mut q = BroadcastQueue::create(&comm, c)?;
        if q.is_writer() {
            q.send(&1u32)?;
            q.send(&2u32)?;
        } else {
            assert_eq!(q.recv::<u32>()?, 1);
        }
        q.suspend(&comm)?;
        assert!(q.is_suspended());
        let refused = if q.is_writer() {
            q.send(&3u32)
        } else {
            q.recv::<u32>().map(drop)
        };
        assert!(
            matches!(refused, Err(QueueError::Suspended { .. })),
            "{refused:?}"
        );
        // Twice is a no-op, as is resuming an active queue.
        q.suspend(&comm)?;
        q.resume(&comm)?;
        q.resume(&comm)?;
        if q.is_writer() {
            q.send(&3u32)?;
        } else {
            assert_eq!(q.recv::<u32>()?, 2);
            assert_eq!(q.recv::<u32>()?, 3);
        }
        q.close_with(&comm)
    });
}

#[test]
fn a_suspended_queue_closes_on_every_rank() {
    run_ok(3, |comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config(20_000))?;
        q.suspend(&comm)?;
        q.close_with(&comm)
    });
}

#[test]
fn a_collective_call_with_another_communicator_is_refused() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, config(20_000)).unwrap();
        let lone = comm.split(Some(comm.rank() as u32), 0).unwrap().unwrap();
        let refused = q.suspend(&lone);
        q.close_with(&comm).unwrap();
        refused
    });
    for r in results {
        assert!(matches!(
            r.unwrap(),
            Err(QueueError::WrongCommunicator { comm_size: 1, .. })
        ));
    }
}
