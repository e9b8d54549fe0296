//! The soak: 2 (or more) MPI ranks run a mixed loop for a while, checking every result
//! (`cargo xtask soak --minutes N`).
//!
//! The loop mixes object collectives of random sizes, eager custom all-reduces of random
//! sizes and dtypes, replays of a captured plan, bursts of broadcast-queue messages (ten
//! thousand at a time, most a few hundred bytes, some past a chunk), and a suspend/resume of
//! the all-reduce and the queue every few hundred operations. Every rank draws the same random sequence, so all ranks issue the same
//! collectives; rank 0 decides when to stop (broadcast every 64 operations). At the start
//! and the end each rank reports its open descriptors, mappings and resident memory: the
//! descriptor and mapping counts must be flat.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use half::bf16;
use tpcomm::allreduce::{Config, CustomAllReduce, DType, HostBackend};
use tpcomm::ipc::{HostMemory, PeerMemory};
use tpcomm::objects;
use tpcomm::queue::{BroadcastQueue, QueueConfig};
use tpcomm::transport::{Communicator, MpiCommunicator};
use tpcomm_conformance::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Resources {
    fds: usize,
    maps: usize,
    rss_kib: u64,
}

fn resources() -> Resources {
    let fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0);
    let rss_kib = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    Resources { fds, maps, rss_kib }
}

/// Small integers: sums over a few ranks are exact in f32 and bf16.
fn small(seed: u64, rank: usize, i: usize) -> f32 {
    let mut r = Rng::new(seed ^ ((rank as u64) << 40) ^ i as u64);
    (r.below(17) as f32) - 8.0
}

#[derive(Debug, Default)]
struct Tally {
    ops: u64,
    object_ops: u64,
    allreduces: u64,
    replays: u64,
    queue_messages: u64,
    cycles: u64,
    failures: Vec<String>,
}

fn run<C: Communicator>(
    comm: &C,
    seconds: f64,
) -> Result<(Tally, Resources, Resources, f64), String> {
    let (me, n) = (comm.rank(), comm.size());
    let mut ar = CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        Config::default(),
    )
    .map_err(|e| e.to_string())?;
    let mem = ar.memory().map_err(|e| e.to_string())?.clone();
    let plan_in = mem.allocate(256 << 10).map_err(|e| e.to_string())?;
    let plan_out = mem.allocate(256 << 10).map_err(|e| e.to_string())?;
    let plan_count = (256 << 10) / 4;
    let plan = ar
        .capture(|cap| {
            cap.all_reduce(&plan_in, &plan_out, DType::F32, plan_count)
                .map(drop)
        })
        .map_err(|e| e.to_string())?;
    ar.register_graph_buffers(comm).map_err(|e| e.to_string())?;
    let queue_config = QueueConfig {
        depth: 8,
        chunk_bytes: 64 << 10,
        ..QueueConfig::with_writer(n - 1)
    };
    let mut queue = BroadcastQueue::create(comm, queue_config).map_err(|e| e.to_string())?;

    comm.barrier().map_err(|e| e.to_string())?;
    let start = resources();
    let began = Instant::now();
    let deadline = Duration::from_secs_f64(seconds);
    let mut rng = Rng::new(0x50a4);
    let mut t = Tally::default();
    loop {
        if t.ops % 64 == 0 {
            let go = (me == 0).then(|| began.elapsed() < deadline);
            if !objects::broadcast(comm, 0, go.as_ref()).map_err(|e| e.to_string())? {
                break;
            }
        }
        let seed = rng.next_u64();
        let pick = rng.below(100);
        let outcome: Result<(), String> = match pick {
            0..=39 => {
                let len = rng.size(65_536);
                let mine =
                    serde_bytes::ByteBuf::from(tpcomm_conformance::filled(me, seed as usize, len));
                t.object_ops += 1;
                match objects::all_gather(comm, &mine) {
                    Ok(all) => (0..n)
                        .find(|&r| {
                            all[r].as_slice() != tpcomm_conformance::filled(r, seed as usize, len)
                        })
                        .map_or(Ok(()), |r| {
                            Err(format!("all_gather: rank {r}'s value differs"))
                        }),
                    Err(e) => Err(format!("all_gather: {e}")),
                }
            }
            40..=49 => {
                let root = rng.below(n);
                let value = format!("root {root} seed {seed}");
                t.object_ops += 1;
                match objects::broadcast(comm, root, (me == root).then_some(&value)) {
                    Ok(got) if got == value => Ok(()),
                    Ok(got) => Err(format!("broadcast: got {got:?}")),
                    Err(e) => Err(format!("broadcast: {e}")),
                }
            }
            50..=84 => {
                let count = (1 + rng.below(16_384)) * 8; // multiples of 16 bytes for both dtypes
                t.allreduces += 1;
                if rng.below(2) == 0 {
                    let input: Vec<f32> = (0..count).map(|i| small(seed, me, i)).collect();
                    let mut out = vec![f32::NAN; count];
                    ar.all_reduce(&input, &mut out)
                        .map_err(|e| format!("all_reduce f32: {e}"))
                        .and_then(|_| {
                            (0..count)
                                .find(|&i| out[i] != (0..n).map(|r| small(seed, r, i)).sum::<f32>())
                                .map_or(Ok(()), |i| {
                                    Err(format!("all_reduce f32: element {i} wrong"))
                                })
                        })
                } else {
                    let input: Vec<bf16> = (0..count)
                        .map(|i| bf16::from_f32(small(seed, me, i)))
                        .collect();
                    let mut out = vec![bf16::NAN; count];
                    ar.all_reduce(&input, &mut out)
                        .map_err(|e| format!("all_reduce bf16: {e}"))
                        .and_then(|_| {
                            (0..count)
                                .find(|&i| {
                                    out[i].to_f32()
                                        != (0..n).map(|r| small(seed, r, i)).sum::<f32>()
                                })
                                .map_or(Ok(()), |i| {
                                    Err(format!("all_reduce bf16: element {i} wrong"))
                                })
                        })
                }
            }
            95..=99 => queue_burst(&mut queue, &mut rng, seed, &mut t),
            _ => {
                t.replays += 1;
                let input: Vec<f32> = (0..plan_count).map(|i| small(seed, me, i)).collect();
                let fill = mem
                    .write(&plan_in, 0, bytemuck::cast_slice(&input))
                    .map_err(|e| e.to_string());
                fill.and_then(|()| plan.replay(&mut ar).map_err(|e| format!("replay: {e}")))
                    .and_then(|()| {
                        let mut raw = vec![0u8; plan_count * 4];
                        mem.read(&plan_out, 0, &mut raw)
                            .map_err(|e| e.to_string())?;
                        let out: &[f32] = bytemuck::cast_slice(&raw);
                        (0..plan_count)
                            .step_by(61)
                            .find(|&i| out[i] != (0..n).map(|r| small(seed, r, i)).sum::<f32>())
                            .map_or(Ok(()), |i| Err(format!("replay: element {i} wrong")))
                    })
            }
        };
        if let Err(e) = outcome {
            t.failures.push(format!("op {}: {e}", t.ops));
            break;
        }
        t.ops += 1;
        if t.ops % 300 == 0 {
            t.cycles += 1;
            if let Err(e) = ar
                .prepare_for_suspend(comm)
                .and_then(|()| ar.reinit_after_resume(comm))
            {
                t.failures
                    .push(format!("suspend/resume cycle {}: {e}", t.cycles));
                break;
            }
            if let Err(e) = queue.suspend(comm).and_then(|()| queue.resume(comm)) {
                t.failures
                    .push(format!("queue suspend/resume cycle {}: {e}", t.cycles));
                break;
            }
        }
    }
    let elapsed = began.elapsed().as_secs_f64();
    comm.barrier().map_err(|e| e.to_string())?;
    let end = resources();
    queue.close_with(comm).map_err(|e| e.to_string())?;
    Ok((t, start, end, elapsed))
}

/// Messages in one burst of the queue.
const BURST: usize = 10_000;

/// One burst of queue messages from its writer (the last rank): sizes drawn from the shared
/// generator, every 64th past a chunk; every reader checks every byte.
fn queue_burst<C: Communicator>(
    queue: &mut BroadcastQueue<C>,
    rng: &mut Rng,
    seed: u64,
    t: &mut Tally,
) -> Result<(), String> {
    let writer = queue.writer();
    for i in 0..BURST {
        let len = if i % 64 == 63 {
            100_000
        } else {
            rng.size(1024)
        };
        let tag = (seed as usize).wrapping_add(i);
        if queue.is_writer() {
            let value = serde_bytes::ByteBuf::from(tpcomm_conformance::filled(writer, tag, len));
            queue.send(&value).map_err(|e| format!("queue send: {e}"))?;
        } else {
            let got: serde_bytes::ByteBuf = queue.recv().map_err(|e| format!("queue recv: {e}"))?;
            if got.as_slice() != tpcomm_conformance::filled(writer, tag, len) {
                return Err(format!("queue: message {i} of the burst differs"));
            }
        }
        t.queue_messages += 1;
    }
    Ok(())
}

fn main() -> ExitCode {
    tpcomm_conformance::mpi_program("mpi-soak", run_program)
}

/// One rank's part; true when every rank succeeded.
fn run_program(comm: &MpiCommunicator) -> bool {
    let seconds: f64 = std::env::var("TPCOMM_SOAK_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let result = run(comm, seconds);
    let ok = matches!(&result, Ok((t, start, end, _)) if t.failures.is_empty() && start.fds == end.fds && start.maps == end.maps);
    match &result {
        Ok((t, start, end, elapsed)) => {
            println!(
                "rank {}: {} ops in {elapsed:.1} s ({:.0} ops/s): {} object collectives, {} all-reduces, {} plan replays, {} queue messages, {} suspend/resume cycles; \
                 fds {} -> {}, mappings {} -> {}, RSS {} -> {} KiB; {} failures",
                comm.rank(),
                t.ops,
                t.ops as f64 / elapsed,
                t.object_ops,
                t.allreduces,
                t.replays,
                t.queue_messages,
                t.cycles,
                start.fds,
                end.fds,
                start.maps,
                end.maps,
                start.rss_kib,
                end.rss_kib,
                t.failures.len()
            );
            for f in &t.failures {
                println!("rank {}: FAILED {f}", comm.rank());
            }
        }
        Err(e) => println!("rank {}: FAILED to run: {e}", comm.rank()),
    }
    let all_ok = tpcomm_conformance::all_ranks_ok(comm, ok);
    if comm.rank() == 0 {
        if all_ok {
            println!("case soak_every_result_right_and_resources_flat ... ok");
        } else {
            println!("case soak_every_result_right_and_resources_flat ... FAILED");
        }
    }
    all_ok
}
