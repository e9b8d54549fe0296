//! Broadcast-queue cases of the conformance suite: the ring between the ranks of any
//! communicator (threads of the local group, or processes under MPI, where the readers map the
//! writer's segment from another process), and the transport path beside it.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use tpcomm::queue::{BroadcastQueue, QueueConfig, QueueError, QueuePath};
use tpcomm::transport::Communicator;

use crate::{filled, CaseResult};

/// A queue call's error as a case's failure, prefixed with what was called.
pub(crate) fn queue<T>(what: &str, r: Result<T, QueueError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// A scheduler's step output, in miniature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Step {
    step: u64,
    requests: Vec<(String, Vec<u32>)>,
}

/// Step `i`: `i % 9` requests of growing sizes.
pub(crate) fn step(i: usize) -> Step {
    Step {
        step: i as u64,
        requests: (0..i % 9)
            .map(|r| (format!("req-{i}-{r}"), vec![r as u32; r * 3]))
            .collect(),
    }
}

/// Small chunks, so that sizes around and past a chunk and the ring show up in few bytes.
fn small(writer: usize, via_transport: bool) -> QueueConfig {
    QueueConfig {
        writer,
        depth: 4,
        chunk_bytes: 512,
        via_transport,
        ..QueueConfig::default()
    }
}

/// The last rank writes; rank 1 (of 3 or more) reads through the transport, the others the
/// ring (those on the writer's host; the others the transport too); blobs of every size around a chunk and past the ring, and step structs, alternate.
pub(crate) fn delivers_every_message_on_the_ring_and_the_transport<C: Communicator>(
    comm: &C,
) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let writer = n - 1;
    let via_transport = n > 2 && me == 1;
    let mut q = queue(
        "create",
        BroadcastQueue::create(comm, small(writer, via_transport)),
    )?;
    // Readers on the writer's host map the ring unless they ask for the transport; the
    // others (other hosts) read the transport.
    let hosts = tpcomm::transport::hosts::hosts(comm).map_err(|e| format!("hosts: {e}"))?;
    let expected = if me == writer {
        QueuePath::Writer
    } else if via_transport || hosts.host_of(me) != hosts.host_of(writer) {
        QueuePath::Transport
    } else {
        QueuePath::SharedMemory
    };
    if q.path() != expected {
        return Err(format!(
            "rank {me} reads by {:?}, not {expected:?}",
            q.path()
        ));
    }
    let lens = [0usize, 1, 511, 512, 513, 2048, 5000, 70_000];
    for i in 0..48 {
        let len = lens[i % lens.len()];
        if i % 3 == 2 {
            if q.is_writer() {
                queue("send", q.send(&step(i)))?;
            } else {
                let got: Step = queue("recv", q.recv())?;
                if got != step(i) {
                    return Err(format!("message {i}: another step arrived"));
                }
            }
        } else if q.is_writer() {
            queue("send", q.send(&ByteBuf::from(filled(writer, i, len))))?;
        } else {
            let got: ByteBuf = queue("recv", q.recv())?;
            crate::expect_bytes(&format!("message {i}"), &got, &filled(writer, i, len))?;
        }
    }
    queue("close_with", q.close_with(comm))
}

/// Messages sent before a suspend and not received yet arrive after the resume, on both
/// paths; a reader that received everything before it waits for the next one.
pub(crate) fn keeps_messages_across_suspend_and_resume<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let via_transport = n > 2 && me == n - 1;
    let mut q = queue(
        "create",
        BroadcastQueue::create(comm, small(0, via_transport)),
    )?;
    for round in 0..3 {
        if q.is_writer() {
            for k in 0..3 {
                queue("send", q.send(&step(round * 10 + k)))?;
            }
        } else {
            let got: Step = queue("recv", q.recv())?;
            if got != step(round * 10) {
                return Err(format!("round {round}: the first message differs"));
            }
        }
        queue("suspend", q.suspend(comm))?;
        queue("resume", q.resume(comm))?;
        if !q.is_writer() {
            for k in 1..3 {
                let got: Step = queue("recv", q.recv())?;
                if got != step(round * 10 + k) {
                    return Err(format!(
                        "round {round}: message {k} after the resume differs"
                    ));
                }
            }
        }
    }
    queue("close_with", q.close_with(comm))
}

/// Two queues at once, one per half of a split: each delivers its own writer's messages.
pub(crate) fn queues_on_split_sub_groups_run_side_by_side<C: Communicator>(comm: &C) -> CaseResult {
    let half = comm.rank() % 2;
    let sub = comm
        .split(Some(half as u32), comm.rank() as i32)
        .map_err(|e| format!("split: {e}"))?
        .ok_or("split gave no group")?;
    let mut q = queue("create", BroadcastQueue::create(&sub, small(0, false)))?;
    for i in 0..20 {
        if q.is_writer() {
            queue("send", q.send(&(half, i)))?;
        } else {
            let got: (usize, usize) = queue("recv", q.recv())?;
            if got != (half, i) {
                return Err(format!("got {got:?}, expected {:?}", (half, i)));
            }
        }
    }
    queue("close_with", q.close_with(&sub))
}

/// Rank 1 reads through the transport and the writer (rank 0) is absent until rank 1 gave
/// up: rank 1's `recv` returns `WriterTimeout` naming the writer within the queue's timeout
/// (300 ms), however long the communicator's own waits are (under MPI without
/// `with_timeout`, for ever); then the writer's message completes the broadcast rank 1
/// abandoned, and the ring readers (ranks 2 and up) receive it.
pub(crate) fn a_transport_reader_waits_no_longer_than_the_queue_timeout<C: Communicator>(
    comm: &C,
) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Ok(());
    }
    let config = QueueConfig {
        timeout: std::time::Duration::from_millis(300),
        ..small(0, me == 1)
    };
    let mut q = queue("create", BroadcastQueue::create(comm, config))?;
    if me == 1 {
        let begun = std::time::Instant::now();
        match q.recv::<u32>() {
            Err(QueueError::WriterTimeout { writer: 0, .. }) => {}
            other => {
                return Err(format!(
                    "expected a timeout naming the writer, got {other:?}"
                ))
            }
        }
        let waited = begun.elapsed();
        if waited > std::time::Duration::from_secs(20) {
            return Err(format!("the transport reader waited {waited:?}"));
        }
    }
    comm.barrier().map_err(|e| format!("barrier: {e}"))?;
    if me == 0 {
        // The transport reader's split is aborted (threads) or its broadcast abandoned
        // (MPI): the send reaches the ring and completes that broadcast, and may fail on
        // the transport.
        let _ = q.send(&1u32);
    } else if me != 1 {
        let got: u32 = queue("recv", q.recv())?;
        if got != 1 {
            return Err(format!("got {got}, expected 1"));
        }
    }
    queue("close_with", q.close_with(comm))
}
