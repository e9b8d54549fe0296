//! The cases of what depends on hosts, run by `mpi-multihost` with ranks on 2 to 4 hosts:
//! object collectives in rounds over TCP with roots on every host, a failing rank on
//! another host, the broadcast queue with ring and transport readers in one queue, the host
//! all-reduce refused across hosts and working on each host's ranks, peer memory refusing a
//! handle from another host, and a checkpoint of ranks on several hosts with the fake
//! driver.

use std::time::{Duration, Instant};

use serde_bytes::ByteBuf;
use tpcomm::allreduce::{AllReduceError, Config, CustomAllReduce, HostBackend};
use tpcomm::checkpoint::fake::{Call, FakeDriver};
use tpcomm::checkpoint::{checkpoint_group, BoxError, CheckpointOptions, Suspendable};
use tpcomm::ipc::{HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory};
use tpcomm::objects::{self, ObjectError, Options};
use tpcomm::queue::{BroadcastQueue, QueueConfig, QueueError, QueuePath};
use tpcomm::transport::hosts::split_by_host;
use tpcomm::transport::{Communicator, MpiCommunicator, ReduceOp};

use super::hosts_of;

/// The hosts of `comm`'s ranks, or the error every rank returns when they are all on one
/// host (these cases are about several).
fn several_hosts(comm: &MpiCommunicator) -> Result<tpcomm::transport::hosts::Hosts, String> {
    let hosts = hosts_of(comm)?;
    if hosts.spans_hosts() {
        Ok(hosts)
    } else {
        Err("every rank is on one host: this case needs several".into())
    }
}
use crate::objects::FailOn;
use crate::queue::{queue, step, Step};
use crate::{expect_bytes, filled, CaseResult};

/// A named case of this file.
type Case = (&'static str, fn(&MpiCommunicator) -> CaseResult);

/// Every case, in the order `run_suites` runs them.
pub(crate) const CASES: [Case; 8] = [
    (
        "multihost_every_object_collective_in_rounds_over_tcp_with_roots_on_every_host",
        objects_in_rounds_with_roots_on_every_host,
    ),
    (
        "multihost_a_rank_on_another_host_failing_to_serialize_fails_every_object_collective_on_every_rank",
        failing_rank_on_another_host,
    ),
    (
        "multihost_queue_readers_on_the_writers_host_read_the_ring_and_the_others_the_transport_every_message_checked",
        queue_ring_and_transport_readers,
    ),
    (
        "multihost_host_all_reduce_on_a_group_spanning_hosts_is_refused_naming_every_host_and_its_ranks",
        host_all_reduce_across_hosts_is_refused,
    ),
    (
        "multihost_host_all_reduce_on_each_hosts_split_then_the_transport_across_hosts_matches_the_sum",
        host_all_reduce_per_host,
    ),
    (
        "multihost_peer_mappings_refuse_a_handle_from_another_host_and_open_those_of_their_own",
        peer_mappings_across_hosts,
    ),
    (
        "multihost_a_checkpoint_of_ranks_on_several_hosts_with_the_fake_driver_suspends_and_resumes_their_objects",
        checkpoint_across_hosts,
    ),
    (
        "multihost_split_by_host_gives_each_host_its_ranks_and_sibling_hosts_run_side_by_side",
        split_by_host_groups,
    ),
];

fn obj<T>(what: &str, r: Result<T, ObjectError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> CaseResult {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, expected {want:?}"))
    }
}

/// Rank `rank`'s blob of tag `tag`: tens of kilobytes, larger on later ranks (the last host's
/// ranks send the most).
fn blob(rank: usize, tag: usize) -> ByteBuf {
    ByteBuf::from(filled(rank, tag, 20_000 + 9_000 * rank + 131 * tag))
}

/// Rounds of 4 KiB, a 16-byte inline slot: every payload moves in many rounds, the path a
/// value past the 32-bit count of one MPI call takes (`max_count` is `i32::MAX` under MPI;
/// rounds of 4 KiB exercise the same windows with kilobytes instead of gigabytes).
fn rounds() -> Options {
    Options {
        round_bytes: Some(4096),
        small_slot_bytes: 16,
        ..Options::default()
    }
}

/// Every object collective, each root in turn (one per host and more), in rounds.
fn objects_in_rounds_with_roots_on_every_host(comm: &MpiCommunicator) -> CaseResult {
    several_hosts(comm)?;
    let (me, n) = (comm.rank(), comm.size());
    let opts = rounds();
    for root in 0..n {
        let tag = root * 10;
        let all: Vec<ByteBuf> = (0..n).map(|r| blob(r, tag)).collect();
        let got = obj(
            "all_gather",
            objects::all_gather_with(comm, &all[me], &opts),
        )?;
        same("all_gather", &got, &all)?;
        let mut into = Vec::new();
        obj(
            "all_gather_into",
            objects::all_gather_into_with(comm, &all[me], &mut into, &opts),
        )?;
        same("all_gather_into", &into, &all)?;
        let got = obj("gather", objects::gather_with(comm, root, &all[me], &opts))?;
        same("gather", got, (me == root).then(|| all.clone()))?;
        let mut gathered = Vec::new();
        let filled_in = obj(
            "gather_into",
            objects::gather_into_with(comm, root, &all[me], &mut gathered, &opts),
        )?;
        same("gather_into", filled_in, me == root)?;
        if me == root {
            same("gather_into values", &gathered, &all)?;
        }
        let value = (me == root).then_some(&all[root]);
        let got = obj(
            "broadcast",
            objects::broadcast_with(comm, root, value, &opts),
        )?;
        same("broadcast", &got, &all[root])?;
        let mut one = blob(me, tag + 1);
        obj(
            "broadcast_into",
            objects::broadcast_into_with(comm, root, value, &mut one, &opts),
        )?;
        same("broadcast_into", &one, &all[root])?;
        let got = obj(
            "scatter",
            objects::scatter_with(comm, root, (me == root).then_some(&all[..]), &opts),
        )?;
        same("scatter", &got, &all[me])?;
        let outgoing: Vec<ByteBuf> = (0..n).map(|d| blob(me * 16 + d, tag)).collect();
        let got = obj(
            "all_to_all",
            objects::all_to_all_with(comm, &outgoing, &opts),
        )?;
        let want: Vec<ByteBuf> = (0..n).map(|s| blob(s * 16 + me, tag)).collect();
        same("all_to_all", &got, &want)?;
    }
    // The folds, in rank order across hosts: concatenations show the order.
    let mine = vec![me as u32; 3000];
    let cat = |mut a: Vec<u32>, b: Vec<u32>| {
        a.extend(b);
        a
    };
    let upto = |k: usize| -> Vec<u32> { (0..k).flat_map(|r| vec![r as u32; 3000]).collect() };
    let got = obj(
        "all_reduce_with",
        objects::all_reduce_with_options(comm, &mine, &opts, cat),
    )?;
    same("all_reduce_with", got, upto(n))?;
    let got = obj(
        "reduce_with",
        objects::reduce_with_options(comm, n - 1, &mine, &opts, cat),
    )?;
    same("reduce_with", got, (me == n - 1).then(|| upto(n)))?;
    let got = obj(
        "scan_with",
        objects::scan_with_options(comm, &mine, &opts, cat),
    )?;
    same("scan_with", got, upto(me + 1))?;
    let got = obj(
        "exscan_with",
        objects::exscan_with_options(comm, &mine, &opts, cat),
    )?;
    same("exscan_with", got, (me > 0).then(|| upto(me)))
}

/// The last rank (on the last host) fails to serialize in every collective where it sends:
/// every rank, on every host, gets `PeerSerialization` naming it, and the group stays in
/// step.
fn failing_rank_on_another_host(comm: &MpiCommunicator) -> CaseResult {
    several_hosts(comm)?;
    let (me, n) = (comm.rank(), comm.size());
    let failing = n - 1;
    let value = FailOn(me == failing);
    let values = vec![value.clone(); n];
    let opts = rounds();
    let expect = |what: &str, r: Result<(), ObjectError>| -> CaseResult {
        match r {
            Err(ObjectError::PeerSerialization { ranks, source })
                if ranks == [failing] && source.is_some() == (me == failing) =>
            {
                Ok(())
            }
            other => Err(format!(
                "{what}: expected PeerSerialization naming rank {failing}, got {other:?}"
            )),
        }
    };
    expect(
        "all_gather",
        objects::all_gather_with(comm, &value, &opts).map(drop),
    )?;
    expect(
        "gather to rank 0",
        objects::gather_with(comm, 0, &value, &opts).map(drop),
    )?;
    expect(
        "broadcast from the failing rank",
        objects::broadcast_with(comm, failing, (me == failing).then_some(&value), &opts).map(drop),
    )?;
    expect(
        "scatter from the failing rank",
        objects::scatter_with(comm, failing, (me == failing).then_some(&values[..]), &opts)
            .map(drop),
    )?;
    expect(
        "all_to_all",
        objects::all_to_all_with(comm, &values, &opts).map(drop),
    )?;
    crate::still_in_step(comm, "all_gather after the failures")
}

/// Message `i` of writer `writer`: a step, or a blob around a chunk, past the ring, or large.
fn message(writer: usize, i: usize) -> Result<Step, ByteBuf> {
    const LENS: [usize; 8] = [0, 1, 511, 512, 513, 5_000, 70_000, 600_000];
    if i % 3 == 2 {
        Ok(step(i))
    } else {
        Err(ByteBuf::from(filled(writer, i, LENS[i % LENS.len()])))
    }
}

/// One queue per writer, the writer on the first host and then on the last one: the readers
/// on its host map the ring, the others read the transport, in the same queue; 120 messages
/// each checked on every reader, a suspend and resume with messages in flight, then the
/// writer's close, which every reader sees after the last message.
fn queue_ring_and_transport_readers(comm: &MpiCommunicator) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let hosts = several_hosts(comm)?;
    for writer in [0, n - 1] {
        let config = QueueConfig {
            depth: 4,
            chunk_bytes: 512,
            timeout: Duration::from_secs(60),
            ..QueueConfig::with_writer(writer)
        };
        let mut q = queue("create", BroadcastQueue::create(comm, config))?;
        let here = |r: usize| hosts.host_of(r) == hosts.host_of(writer);
        let ring: Vec<usize> = (0..n).filter(|&r| r != writer && here(r)).collect();
        let transport: Vec<usize> = (0..n).filter(|&r| !here(r)).collect();
        same("ring readers", &q.locality().shared_memory, &ring)?;
        same("transport readers", &q.locality().transport, &transport)?;
        let path = match me {
            m if m == writer => QueuePath::Writer,
            m if here(m) => QueuePath::SharedMemory,
            _ => QueuePath::Transport,
        };
        same("path", q.path(), path)?;
        for i in 0..120 {
            if i == 60 {
                // Messages sent and not received yet cross the suspend.
                queue("suspend", q.suspend(comm))?;
                queue("resume", q.resume(comm))?;
            }
            match (q.is_writer(), message(writer, i)) {
                (true, Ok(s)) => queue("send", q.send(&s))?,
                (true, Err(b)) => queue("send", q.send(&b))?,
                (false, Ok(s)) => same(&format!("message {i}"), queue("recv", q.recv())?, s)?,
                (false, Err(b)) => {
                    let got: ByteBuf = queue("recv", q.recv())?;
                    expect_bytes(&format!("message {i}"), &got, &b)?;
                }
            }
        }
        // The writer closes its side alone; every reader, ring or transport, receives the
        // close after the last message, then closes its own side.
        if !q.is_writer() {
            match q.recv::<u32>() {
                Err(QueueError::Closed { messages: 120, .. }) => {}
                other => return Err(format!("after the last message: {other:?}")),
            }
        }
        queue("close", q.close())?;
        comm.barrier()
            .map_err(|e| format!("barrier after the close: {e}"))?;
    }
    Ok(())
}

/// The host all-reduce over every rank: every rank gets `SpansHosts` naming each host and
/// its ranks (as the ranks' identities say), at once, and the group stays in step.
fn host_all_reduce_across_hosts_is_refused(comm: &MpiCommunicator) -> CaseResult {
    let hosts = several_hosts(comm)?;
    let begun = Instant::now();
    let created = CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        Config::default(),
    );
    let took = begun.elapsed();
    match created {
        Err(AllReduceError::SpansHosts { rank, hosts: named })
            if rank == comm.rank() && named == hosts.layout() =>
        {
            if took > Duration::from_secs(10) {
                return Err(format!("the refusal took {took:?}"));
            }
        }
        Err(other) => return Err(format!("creation failed with {other}")),
        Ok(_) => return Err("a host all-reduce was created across hosts".into()),
    }
    crate::still_in_step(comm, "all_gather after the refusal")
}

/// Rank `rank`'s input at `i`: small integers, so that every sum is exact in f32.
fn input(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 3) % 17) as f32 - 8.0
}

/// The host all-reduce on each host's ranks (`split_by_host`), then the transport's
/// all-reduce of the host sums across hosts (one rank per host): every rank ends with the sum
/// over every rank, as the transport's own all-reduce over every rank computes it.
fn host_all_reduce_per_host(comm: &MpiCommunicator) -> CaseResult {
    several_hosts(comm)?;
    let (me, n) = (comm.rank(), comm.size());
    let host = split_by_host(comm).map_err(|e| format!("split_by_host: {e}"))?;
    let mut ar = CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        &host,
        Config::default(),
    )
    .map_err(|e| format!("the host all-reduce on the host's ranks: {e}"))?;
    let count = 50_000;
    let mine: Vec<f32> = (0..count).map(|i| input(me, i)).collect();
    let mut host_sum = vec![0f32; count];
    ar.all_reduce(&mine, &mut host_sum)
        .map_err(|e| format!("all_reduce on the host: {e}"))?;
    // One rank per host carries its host's sum across hosts, then hands the total back.
    let leaders = comm
        .split((host.rank() == 0).then_some(0), me as i32)
        .map_err(|e| format!("the split of one rank per host: {e}"))?;
    let mut total = host_sum.clone();
    if let Some(leaders) = &leaders {
        leaders
            .all_reduce_in_place(&mut total, ReduceOp::Sum)
            .map_err(|e| format!("all_reduce across hosts: {e}"))?;
    }
    host.broadcast(0, bytemuck::cast_slice_mut(&mut total))
        .map_err(|e| format!("broadcast on the host: {e}"))?;
    let want: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|r| input(r, i)).sum())
        .collect();
    let mut reference = mine.clone();
    comm.all_reduce_in_place(&mut reference, ReduceOp::Sum)
        .map_err(|e| format!("the transport's all-reduce: {e}"))?;
    same("the transport's sum", &reference, &want)?;
    if total != want {
        let at = total.iter().zip(&want).position(|(a, b)| a != b);
        return Err(format!("the two-level sum differs at element {at:?}"));
    }
    ar.close().map_err(|e| format!("close: {e}"))
}

/// A registry over every rank: each rank exports a buffer with its pattern, and imports every
/// peer's handle. A handle from a rank on this host opens and shows the pattern; one from
/// another host is refused with `OtherHost` naming the rank and both hosts, and opens nothing.
fn peer_mappings_across_hosts(comm: &MpiCommunicator) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let hosts = several_hosts(comm)?;
    let ipc = |what: &str, e: IpcError| format!("{what}: {e}");
    let mem = HostMemory::new();
    let buf = mem.allocate(8192).map_err(|e| ipc("allocate", e))?;
    mem.write(&buf, 0, &filled(me, 5, 8192))
        .map_err(|e| ipc("write", e))?;
    let mut peers = PeerMappings::new(mem.clone(), comm).map_err(|e| ipc("new", e))?;
    same("the registry's hosts", peers.hosts(), &hosts)?;
    let handle = mem.export(buf.addr(), 8192).map_err(|e| ipc("export", e))?;
    let envelopes = obj(
        "all_gather",
        objects::all_gather(comm, &peers.envelope(handle)),
    )?;
    let mut opened = 0;
    for r in (0..n).filter(|&r| r != me) {
        let local = hosts.host_of(r) == hosts.host_of(me);
        match peers.import(r, &envelopes[r]) {
            Ok(mapping) if local => {
                let mut got = vec![0u8; 8192];
                mem.read(mapping, 0, &mut got).map_err(|e| ipc("read", e))?;
                expect_bytes(&format!("rank {r}'s buffer"), &got, &filled(r, 5, 8192))?;
                opened += 1;
            }
            Err(IpcError::OtherHost {
                rank,
                ref host,
                ref this_host,
            }) if !local && rank == r => {
                let theirs = hosts.name(hosts.host_of(r).unwrap_or(0));
                let mine = hosts.name(hosts.host_of(me).unwrap_or(0));
                if !host.contains(&theirs) || !this_host.contains(&mine) {
                    return Err(format!(
                        "rank {r}'s refusal names {host} and {this_host}, not {theirs} and {mine}"
                    ));
                }
            }
            other => {
                return Err(format!(
                    "rank {r}'s handle ({}) gave {:?}",
                    if local { "this host" } else { "another host" },
                    other.map(|m| m.len())
                ))
            }
        }
    }
    same("mappings opened", peers.counters().opens, opened)?;
    peers.close_all().map_err(|e| ipc("close_all", e))?;
    crate::ok("barrier", comm.barrier())
}

/// The host all-reduce of this host's ranks, registered with a checkpoint of every rank:
/// its transitions run on the host's communicator.
struct HostAllReduce<'a> {
    ar: CustomAllReduce<HostBackend>,
    host: &'a MpiCommunicator,
}

impl Suspendable<MpiCommunicator> for HostAllReduce<'_> {
    fn name(&self) -> String {
        "host all-reduce of each host's ranks".into()
    }

    fn suspend_support(&self) -> Result<(), String> {
        self.ar.check_suspend().map_err(|e| e.to_string())
    }

    fn prepare_for_suspend(&mut self, _: &MpiCommunicator) -> Result<(), BoxError> {
        Ok(self.ar.prepare_for_suspend(self.host)?)
    }

    fn reinit_after_resume(&mut self, _: &MpiCommunicator) -> Result<(), BoxError> {
        Ok(self.ar.reinit_after_resume(self.host)?)
    }
}

/// A broadcast queue over every rank (ring and transport readers), registered with a
/// checkpoint.
struct Queue(BroadcastQueue<MpiCommunicator>);

impl Suspendable<MpiCommunicator> for Queue {
    fn name(&self) -> String {
        "broadcast queue over every rank".into()
    }

    fn suspend_support(&self) -> Result<(), String> {
        Ok(())
    }

    fn prepare_for_suspend(&mut self, comm: &MpiCommunicator) -> Result<(), BoxError> {
        Ok(self.0.suspend(comm)?)
    }

    fn reinit_after_resume(&mut self, comm: &MpiCommunicator) -> Result<(), BoxError> {
        Ok(self.0.resume(comm)?)
    }
}

/// A checkpoint of every rank's process (each its own process, on several hosts, where pids
/// repeat: each host numbers its processes from 1) through the fake driver: every rank is its
/// process's driver rank, its own driver sees lock, checkpoint, restore and unlock of its own
/// pid, and the host all-reduce and the queue registered with it work afterwards (a message
/// sent before the checkpoint arrives after it).
fn checkpoint_across_hosts(comm: &MpiCommunicator) -> CaseResult {
    several_hosts(comm)?;
    let me = comm.rank();
    let host = split_by_host(comm).map_err(|e| format!("split_by_host: {e}"))?;
    let ar = CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        &host,
        Config::default(),
    )
    .map_err(|e| format!("the host all-reduce: {e}"))?;
    let mut ar = HostAllReduce { ar, host: &host };
    let config = QueueConfig {
        timeout: Duration::from_secs(60),
        ..QueueConfig::with_writer(0)
    };
    let mut q = Queue(queue("create", BroadcastQueue::create(comm, config))?);
    if q.0.is_writer() {
        queue("send", q.0.send(&"before the checkpoint".to_string()))?;
    }
    let driver = FakeDriver::new();
    let report = checkpoint_group(
        comm,
        &driver,
        &mut [&mut ar, &mut q],
        &CheckpointOptions::default(),
        |_| Ok(()),
    )
    .map_err(|e| format!("checkpoint_group: {e}"))?;
    if !report.driver_rank {
        return Err(format!(
            "rank {me} is not its process's driver rank (pids {:?})",
            report.pids
        ));
    }
    let pid = std::process::id();
    let calls: Vec<(Call, u32, i32)> = driver
        .log()
        .iter()
        .map(|e| (e.call, e.pid, e.code))
        .collect();
    let want = [Call::Lock, Call::Checkpoint, Call::Restore, Call::Unlock].map(|c| (c, pid, 0));
    same("this process's driver calls", calls.as_slice(), &want[..])?;
    let mut out = vec![0f32; 1024];
    ar.ar
        .all_reduce(&vec![1f32; 1024], &mut out)
        .map_err(|e| format!("all_reduce after the checkpoint: {e}"))?;
    if out.iter().any(|&v| v != host.size() as f32) {
        return Err("the host all-reduce gives a wrong sum after the checkpoint".into());
    }
    if !q.0.is_writer() {
        let got: String = queue("recv", q.0.recv())?;
        same(
            "the message sent before",
            got.as_str(),
            "before the checkpoint",
        )?;
    }
    queue("close_with", q.0.close_with(comm))?;
    ar.ar.close().map_err(|e| format!("close: {e}"))
}

/// `split_by_host`: each host's ranks, in order, in a group of their own; the host groups run
/// different numbers of collectives at once without seeing each other's bytes.
fn split_by_host_groups(comm: &MpiCommunicator) -> CaseResult {
    let me = comm.rank();
    let hosts = several_hosts(comm)?;
    let h = hosts.host_of(me).unwrap_or(0);
    let host = split_by_host(comm).map_err(|e| format!("split_by_host: {e}"))?;
    let members = hosts.ranks_on(h);
    same("the host group's size", host.size(), members.len())?;
    same(
        "this rank in its host group",
        Some(host.rank()),
        members.iter().position(|&r| r == me),
    )?;
    for round in 0..(3 + 2 * h) {
        let got = obj(
            "all_gather on the host",
            objects::all_gather(&host, &(h, me, round)),
        )?;
        let want: Vec<(usize, usize, usize)> = members.iter().map(|&r| (h, r, round)).collect();
        same("the host group's values", got, want)?;
    }
    crate::ok("barrier", comm.barrier())
}
