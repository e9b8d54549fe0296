//! One fault across hosts, run by `mpi-multihost fault KIND VICTIM_HOST TIMEOUT_MS` under
//! `mpirun --enable-recovery`; `cargo xtask multihost` injects it from outside and judges the
//! lines every rank prints.
//!
//! Every rank's communicator is bounded by the timeout (`MpiCommunicator::with_timeout`). The
//! ranks of host `VICTIM_HOST` are the victims. The kinds:
//!
//! - `host-kill-object`: the victims stop (SIGSTOP themselves) at the payload call of an
//!   object all-gather of 64 KiB values, and print `victim R: stopped at ...`; the driver
//!   then kills every process of the victim host's PID namespace;
//! - `host-kill-queue-readers`: the same while streaming 256 KiB messages through a broadcast
//!   queue whose writer (rank 0) has ring readers on its host and transport readers elsewhere;
//!   the victims (transport readers) stop after receiving 3 messages;
//! - `host-kill-queue-writer`: the writer's host is the victim: the writer stops after
//!   sending 3 messages, its readers elsewhere wait;
//! - `host-kill-collective`: the victims stop before the fourth of a series of timed
//!   `all_reduce` calls of 1 MiB;
//! - `link-down-short`, `link-down-long`, `freeze`: every rank loops object all-gathers of
//!   16 KiB values; rank 0 prints `inject` once the loop runs, and the driver sets the victim
//!   host's link down (for less, or for more, than the timeout) or stops every process of the
//!   victim host (for more than the timeout), then restores it. The loop runs until rank 0
//!   has looped `STREAM` long (its flag travels in every all-gather).
//!
//! A survivor prints `survivor R: KIND failed after S s naming ranks [..]: ERROR` (the ranks
//! its typed error names), then builds a group of the ranks on its side of the fault (the
//! victim host's, or all others: what an orchestrator that saw the host go would say)
//! (`MPI_Comm_create_group` over `MPI_COMM_WORLD`, collective over those ranks only: MPI
//! without ULFM has no other way past a dead rank) and runs an all-gather on it:
//! `survivor R: new group of ranks [..] works`. Then its leak line, `survivor R: leaks: ...`
//! (descriptors and mappings before the fault and after, and tpcomm's own memfds), and
//! `rank R: exiting without MPI_Finalize` (finalizing after a peer died can hang).
//! `link-down-short` prints `rank R: link-down-short: N all-gathers, the longest S s` on every
//! rank instead; `link-down-long` and `freeze` print for the victims too (`thawed R: ...`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use mpi::topology::{Communicator as _, Group as _, SimpleCommunicator};
use serde_bytes::ByteBuf;
use tpcomm::objects::{self, ObjectError};
use tpcomm::queue::{BroadcastQueue, QueueConfig, QueueError};
use tpcomm::transport::testing::hooked::Hooked;
use tpcomm::transport::{Communicator, MpiCommunicator, ReduceOp, TransportError};

use super::hosts_of;

/// The fault kinds.
pub const KINDS: [&str; 7] = [
    "host-kill-object",
    "host-kill-queue-readers",
    "host-kill-queue-writer",
    "host-kill-collective",
    "link-down-short",
    "link-down-long",
    "freeze",
];

/// How long the streams of the link and freeze kinds run (rank 0's clock).
const STREAM: Duration = Duration::from_secs(12);

/// Runs fault `kind` on this rank; true when it behaved as expected (the driver judges the
/// lines).
pub fn run(
    world: &SimpleCommunicator,
    comm: &MpiCommunicator,
    kind: &str,
    victim_host: usize,
    timeout: Duration,
) -> bool {
    let me = comm.rank();
    let hosts = match hosts_of(comm) {
        Ok(h) => h,
        Err(e) => {
            println!("rank {me}: FAILED: {e}");
            return false;
        }
    };
    let victims = hosts.ranks_on(victim_host);
    if victims.is_empty() {
        println!("rank {me}: FAILED: host {victim_host} holds no rank");
        return false;
    }
    let host = hosts.host_of(me).unwrap_or(0);
    println!(
        "rank {me} on host {host} ({}) pid {}",
        hosts.name(host),
        std::process::id()
    );
    let is_victim = victims.contains(&me);
    let before = Resources::now();
    let outcome = match kind {
        "host-kill-object" => object_all_gather(comm, is_victim),
        "host-kill-queue-readers" | "host-kill-queue-writer" => {
            queue_stream(comm, kind, is_victim, timeout)
        }
        "host-kill-collective" => timed_collective(comm, is_victim),
        "link-down-short" => return link_down_short(comm, kind),
        _ => stream(comm),
    };
    let failure = match outcome {
        Ok(()) => {
            println!("survivor {me}: {kind} FAILED: it succeeded although host {victim_host} was cut off");
            return false;
        }
        Err(f) => f,
    };
    // A frozen victim reports once it runs again; across a link both sides survive.
    let tag = if is_victim && kind == "freeze" {
        "thawed"
    } else {
        "survivor"
    };
    println!(
        "{tag} {me}: {kind} failed after {:.2} s naming ranks {:?}: {}",
        failure.waited.as_secs_f64(),
        failure.named,
        failure.text
    );
    // The new group: the ranks of this rank's side of the fault (the victim host's ranks,
    // or every other rank), as an orchestrator that saw the host go would say; what each
    // rank's error names is judged by the driver.
    let group: Vec<usize> = (0..comm.size())
        .filter(|r| victims.contains(r) == is_victim)
        .collect();
    let mut ok = new_group_works(world, &group, timeout, tag, me);
    if kind == "link-down-long" {
        // Once the link is back (this waits for it), every rank again.
        let every: Vec<usize> = (0..comm.size()).collect();
        ok &= new_group_works(world, &every, timeout, tag, me);
    }
    let after = Resources::now();
    println!(
        "{tag} {me}: leaks: descriptors {} -> {}, mappings {} -> {}, tpcomm memfds {} -> {}",
        before.fds, after.fds, before.maps, after.maps, before.memfds, after.memfds
    );
    ok
}

/// What a failed step reports: the ranks its typed error names, the time it took, its text.
struct Failure {
    named: Vec<usize>,
    waited: Duration,
    text: String,
}

impl Failure {
    fn new(named: Vec<usize>, waited: Duration, text: String) -> Self {
        let mut named = named;
        named.sort_unstable();
        named.dedup();
        Self {
            named,
            waited,
            text,
        }
    }
}

/// The ranks a transport error names.
fn named_by_transport(e: &TransportError) -> Vec<usize> {
    match e {
        TransportError::Unresponsive { gone, silent, .. } => {
            gone.iter().chain(silent.iter()).copied().collect()
        }
        TransportError::Timeout { missing, .. } => missing.clone(),
        other => other.culprit().into_iter().collect(),
    }
}

fn named_by_objects(e: &ObjectError) -> Vec<usize> {
    match e {
        ObjectError::Transport(t) => named_by_transport(t),
        _ => Vec::new(),
    }
}

fn named_by_queue(e: &QueueError) -> Vec<usize> {
    match e {
        QueueError::TransportTimeout { readers, .. } => readers.clone(),
        other => other.culprit().into_iter().collect(),
    }
}

/// Stops this process (SIGSTOP, through kill(1): no unsafe code here) after saying so; the
/// driver kills its host, or it resumes once its host is thawed.
fn stop_here(rank: usize, phase: &str) {
    println!("victim {rank}: stopped at {phase}");
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status();
}

/// An object all-gather of 64 KiB values; the victims stop at its payload call.
fn object_all_gather(comm: &MpiCommunicator, is_victim: bool) -> Result<(), Failure> {
    let me = comm.rank();
    let calls = AtomicUsize::new(0);
    let stop_at = AtomicUsize::new(0);
    let hooked = Hooked::new(comm, |_op| {
        let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
        if stop_at.load(Ordering::SeqCst) == call {
            stop_here(me, "the payload of an object all-gather");
        }
        Ok(())
    });
    let value = ByteBuf::from(vec![me as u8; 64 << 10]);
    for _ in 0..3 {
        objects::all_gather(&hooked, &value).map_err(|e| warm_up(me, e))?;
    }
    if is_victim {
        calls.store(0, Ordering::SeqCst);
        stop_at.store(2, Ordering::SeqCst);
    }
    let begun = Instant::now();
    match objects::all_gather(&hooked, &value) {
        Ok(_) => Ok(()),
        Err(e) => Err(Failure::new(
            named_by_objects(&e),
            begun.elapsed(),
            e.to_string(),
        )),
    }
}

fn warm_up(me: usize, e: impl std::fmt::Display) -> Failure {
    Failure::new(
        Vec::new(),
        Duration::ZERO,
        format!("rank {me}: the warm-up failed: {e}"),
    )
}

/// A broadcast queue from rank 0: the victims stop after 3 messages (their writer after
/// sending them, or each reader after receiving them); 256 KiB messages, past what one TCP
/// send carries eagerly, so that a broadcast waits for its readers.
fn queue_stream(
    comm: &MpiCommunicator,
    kind: &str,
    is_victim: bool,
    timeout: Duration,
) -> Result<(), Failure> {
    let me = comm.rank();
    let config = QueueConfig {
        depth: 8,
        chunk_bytes: 64 << 10,
        timeout,
        ..QueueConfig::with_writer(0)
    };
    let mut q = BroadcastQueue::create(comm, config).map_err(|e| warm_up(me, e))?;
    comm.barrier().map_err(|e| warm_up(me, e))?;
    let begun = Instant::now();
    let fail = |e: QueueError| Failure::new(named_by_queue(&e), begun.elapsed(), e.to_string());
    let writer_dies = kind == "host-kill-queue-writer";
    let result = (0..64u32).try_for_each(|i| {
        if is_victim && i == 3 && (writer_dies == q.is_writer()) {
            stop_here(me, "message 3 of a queue stream");
        }
        let value = ByteBuf::from(vec![i as u8; 256 << 10]);
        if q.is_writer() {
            q.send(&value)
        } else {
            match q.recv::<ByteBuf>() {
                Ok(got) if got == value => Ok(()),
                Ok(_) => Err(QueueError::Failed {
                    rank: me,
                    op: "recv",
                    culprit: None,
                    reason: format!("message {i} arrived wrong"),
                }),
                Err(e) => Err(e),
            }
        }
    });
    let result = result.map_err(fail);
    if let Err(e) = q.close() {
        println!("rank {me}: closing the queue after the fault: {e}");
    }
    result
}

/// Timed `all_reduce` calls of 1 MiB on every rank; the victims stop before the fourth.
fn timed_collective(comm: &MpiCommunicator, is_victim: bool) -> Result<(), Failure> {
    let me = comm.rank();
    let mut data = vec![1f32; 1 << 18];
    for i in 0..8 {
        if is_victim && i == 3 {
            stop_here(me, "the fourth timed all-reduce");
        }
        let started = Instant::now();
        data.fill(1.0);
        if let Err(e) = comm.all_reduce_in_place(&mut data, ReduceOp::Sum) {
            return Err(Failure::new(
                named_by_transport(&e),
                started.elapsed(),
                e.to_string(),
            ));
        }
        if data.iter().any(|&x| x != comm.size() as f32) {
            return Err(Failure::new(
                Vec::new(),
                started.elapsed(),
                format!("all-reduce {i} gave a wrong sum"),
            ));
        }
    }
    Ok(())
}

/// One all-gather of the stream: every rank's 16 KiB value and rank 0's flag (whether to go
/// on); checks every value; returns the flag.
fn stream_step(comm: &MpiCommunicator, i: u64, go_on: bool) -> Result<bool, ObjectError> {
    let me = comm.rank();
    let value = (
        go_on,
        i,
        ByteBuf::from(vec![(me as u64 ^ i) as u8; 16 << 10]),
    );
    let all = objects::all_gather(comm, &value)?;
    for (r, (_, j, bytes)) in all.iter().enumerate() {
        if *j != i || bytes.iter().any(|&b| b != (r as u64 ^ i) as u8) {
            return Err(ObjectError::Transport(TransportError::Setup(format!(
                "all-gather {i}: rank {r}'s value is wrong"
            ))));
        }
    }
    Ok(all[0].0)
}

/// All-gathers until rank 0 says stop, `inject` printed by rank 0 after the first 20.
fn stream(comm: &MpiCommunicator) -> Result<(), Failure> {
    let me = comm.rank();
    let begun = Instant::now();
    for i in 0.. {
        if me == 0 && i == 20 {
            println!("inject");
        }
        let started = Instant::now();
        let go_on = begun.elapsed() < STREAM;
        match stream_step(comm, i, go_on) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                return Err(Failure::new(
                    named_by_objects(&e),
                    started.elapsed(),
                    e.to_string(),
                ))
            }
        }
    }
    Ok(())
}

/// The stream across a short outage: every all-gather completes; the longest one is the
/// figure.
fn link_down_short(comm: &MpiCommunicator, kind: &str) -> bool {
    let me = comm.rank();
    let begun = Instant::now();
    let mut longest = Duration::ZERO;
    for i in 0.. {
        if me == 0 && i == 20 {
            println!("inject");
        }
        let started = Instant::now();
        match stream_step(comm, i, begun.elapsed() < STREAM) {
            Ok(go_on) => {
                longest = longest.max(started.elapsed());
                if !go_on {
                    println!(
                        "rank {me}: {kind}: {} all-gathers, the longest {:.2} s",
                        i + 1,
                        longest.as_secs_f64()
                    );
                    return true;
                }
            }
            Err(e) => {
                println!("rank {me}: {kind} FAILED at all-gather {i}: {e}");
                return false;
            }
        }
    }
    false
}

/// Builds a communicator of `group` (ranks of `MPI_COMM_WORLD`) with `MPI_Comm_create_group`
/// (collective over them only), bounds it by `timeout` and all-gathers every member's rank;
/// prints the verdict line.
fn new_group_works(
    world: &SimpleCommunicator,
    group: &[usize],
    timeout: Duration,
    tag: &str,
    me: usize,
) -> bool {
    let begun = Instant::now();
    let ranks: Vec<i32> = group.iter().map(|&r| r as i32).collect();
    let members = world.group().include(&ranks);
    let Some(raw) = world.split_by_subgroup_with_tag(&members, 7) else {
        println!("{tag} {me}: FAILED: MPI_Comm_create_group gave no communicator");
        return false;
    };
    let checked = MpiCommunicator::duplicate(&raw)
        .and_then(|c| c.with_timeout(timeout))
        .map_err(ObjectError::Transport)
        .and_then(|c| {
            let all = objects::all_gather(&c, &me)?;
            Ok((all, c))
        });
    match checked {
        Ok((all, c)) if all == group => {
            drop(c);
            println!(
                "{tag} {me}: new group of ranks {group:?} works ({:.2} s)",
                begun.elapsed().as_secs_f64()
            );
            true
        }
        Ok((all, _)) => {
            println!("{tag} {me}: FAILED: the new group gathered {all:?}, not {group:?}");
            false
        }
        Err(e) => {
            println!("{tag} {me}: FAILED: the new group of ranks {group:?}: {e}");
            false
        }
    }
}

/// What this process holds: open descriptors, mappings, and descriptors of tpcomm's
/// memfds (its peer memory and queue rings).
struct Resources {
    fds: usize,
    maps: usize,
    memfds: usize,
}

impl Resources {
    fn now() -> Self {
        let links: Vec<String> = std::fs::read_dir("/proc/self/fd")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::read_link(e.path()).ok())
                    .map(|p| p.to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        Self {
            fds: links.len(),
            maps: std::fs::read_to_string("/proc/self/maps")
                .map(|m| m.lines().count())
                .unwrap_or(0),
            memfds: links.iter().filter(|l| l.contains("memfd:tpcomm")).count(),
        }
    }
}
