//! Small-message latency of a communicator, and the CPU a rank burns while it waits.
//!
//! ```text
//! latency [--ranks N] [--iters N] [--bytes N]       threads of this process (LocalGroup)
//! mpirun -np N latency --mpi [--iters N] [--bytes N]  MPI ranks (feature `mpi`)
//! latency --idle SECONDS [--ranks N]                 CPU time while ranks wait for an absent one
//! --spin MICROSECONDS: the local group's spin budget (`LocalGroupConfig::spin`)
//! ```
//!
//! Latency: for `barrier`, `all_gather` and `broadcast` (root 0) of `--bytes` bytes (default
//! 8) per rank, each timed iteration is a barrier then one call; the figure is the median
//! (and the fastest, and the 90th percentile) over iterations of the *slowest* rank's time,
//! as `tpcomm-bench` counts. The three operations are interleaved iteration by iteration, so
//! that a change of machine load hits all of them alike. A last line says where the ranks
//! ran: in how many timed calls every rank was on one CPU (read after each call), and each
//! rank's voluntary context switches over the run (its waits that parked). Ranks that share
//! a CPU, or park, cost microseconds a call, whatever the transport does on its way.
//!
//! Idle: `N - 1` ranks enter a barrier that the last rank never joins (it sleeps past the
//! timeout), with the group's timeout set to `SECONDS`; prints the process CPU time
//! (`CLOCK_PROCESS_CPUTIME_ID`) spent over that wait, per waiting rank, and the error each
//! waiting rank got (it names the absent rank).

use std::time::{Duration, Instant};

use tpcomm_transport::{Communicator, LocalGroup, TransportError};

const OPS: [&str; 3] = ["barrier", "all_gather", "broadcast"];

struct Args {
    ranks: usize,
    iters: usize,
    bytes: usize,
    mpi: bool,
    idle: Option<f64>,
    spin: Option<Duration>,
}

fn parse() -> Args {
    let mut args = Args {
        ranks: 2,
        iters: 5000,
        bytes: 8,
        mpi: false,
        idle: None,
        spin: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| panic!("{flag} needs a value"))
                .clone()
        };
        match flag.as_str() {
            "--ranks" => args.ranks = value().parse().expect("--ranks N"),
            "--iters" => args.iters = value().parse().expect("--iters N"),
            "--bytes" => args.bytes = value().parse().expect("--bytes N"),
            "--idle" => args.idle = Some(value().parse().expect("--idle SECONDS")),
            "--spin" => {
                args.spin = Some(Duration::from_micros(
                    value().parse().expect("--spin MICROSECONDS"),
                ))
            }
            "--mpi" => args.mpi = true,
            other => panic!("unknown argument {other}; see the module docs"),
        }
    }
    args
}

/// Where the ranks ran over the timed calls.
struct Placement {
    calls: usize,
    /// Timed calls after which every rank was on the same CPU.
    same_cpu: usize,
    /// Each rank's voluntary context switches over the run.
    switches: Vec<u64>,
}

/// Per operation, the slowest rank's time of every timed iteration (ns), and where the ranks
/// ran.
fn measure<C: Communicator>(
    comm: &C,
    iters: usize,
    bytes: usize,
) -> Result<(Vec<Vec<u64>>, Placement), TransportError> {
    let size = comm.size();
    let send = vec![comm.rank() as u8; bytes];
    let mut recv = vec![0u8; bytes * size];
    let mut buf = vec![0u8; bytes];
    let warmup = 200;
    let mut local = vec![Vec::with_capacity(iters); OPS.len()];
    let mut cpus = Vec::with_capacity(iters * OPS.len() * 4);
    let switches_before = voluntary_switches();
    for i in 0..warmup + iters {
        for op in 0..OPS.len() {
            comm.barrier()?;
            let start = Instant::now();
            match op {
                0 => comm.barrier()?,
                1 => comm.all_gather(&send, &mut recv)?,
                _ => comm.broadcast(0, &mut buf)?,
            }
            let ns = start.elapsed().as_nanos() as u64;
            if i >= warmup {
                local[op].push(ns);
                cpus.extend_from_slice(&(rustix::thread::sched_getcpu() as u32).to_le_bytes());
            }
        }
    }
    let switches = voluntary_switches().saturating_sub(switches_before);
    let mut all_cpus = vec![0u8; cpus.len() * size];
    comm.all_gather(&cpus, &mut all_cpus)?;
    let mut all_switches = vec![0u8; 8 * size];
    comm.all_gather(&switches.to_le_bytes(), &mut all_switches)?;
    let per_rank: Vec<&[u8]> = all_cpus.chunks_exact(cpus.len().max(1)).collect();
    let calls = cpus.len() / 4;
    let placement = Placement {
        calls,
        same_cpu: (0..calls)
            .filter(|&k| {
                let cpu = |r: usize| &per_rank[r][4 * k..4 * k + 4];
                (1..size).all(|r| cpu(r) == cpu(0))
            })
            .count(),
        switches: all_switches
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect(),
    };
    let mut slowest = Vec::with_capacity(OPS.len());
    for times in &local {
        let send: Vec<u8> = times.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut all = vec![0u8; send.len() * size];
        comm.all_gather(&send, &mut all)?;
        let mut max = vec![0u64; times.len()];
        for block in all.chunks_exact(send.len().max(1)) {
            for (m, w) in max.iter_mut().zip(block.chunks_exact(8)) {
                *m = (*m).max(u64::from_le_bytes(w.try_into().expect("8 bytes")));
            }
        }
        slowest.push(max);
    }
    Ok((slowest, placement))
}

fn report(
    what: &str,
    ranks: usize,
    bytes: usize,
    (slowest, placement): &(Vec<Vec<u64>>, Placement),
) {
    println!(
        "# {what}, {ranks} ranks, {bytes} B per rank; slowest rank per iteration, {} iterations",
        slowest[0].len()
    );
    println!(
        "# {:>12} {:>12} {:>12} {:>12}",
        "op", "median(us)", "min(us)", "p90(us)"
    );
    for (op, times) in OPS.iter().zip(slowest) {
        let mut t = times.clone();
        t.sort_unstable();
        let at = |q: f64| t[((t.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
        println!(
            "  {op:>12} {:>12.3} {:>12.3} {:>12.3}",
            at(0.5),
            at(0.0),
            at(0.9)
        );
    }
    println!(
        "# every rank on one CPU after {} of {} timed calls; voluntary context switches per \
         rank: {:?}",
        placement.same_cpu, placement.calls, placement.switches
    );
}

/// This thread's voluntary context switches so far (0 where `/proc` does not say).
fn voluntary_switches() -> u64 {
    std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn idle(ranks: usize, seconds: f64, spin: Option<Duration>) {
    let ranks = ranks.max(2);
    let timeout = Duration::from_secs_f64(seconds);
    let absent = ranks - 1;
    let before = cpu_time();
    let wall = Instant::now();
    let mut group = LocalGroup::new(ranks).timeout(timeout);
    if let Some(spin) = spin {
        group = group.spin(spin);
    }
    let results = group.run(|comm| {
        if comm.rank() == absent {
            std::thread::sleep(timeout + Duration::from_millis(200));
            return None;
        }
        let before = thread_cpu_time();
        let result = comm.barrier();
        Some((result, thread_cpu_time() - before))
    });
    let cpu = cpu_time() - before;
    let wall = wall.elapsed();
    println!(
        "# idle: {} ranks wait {seconds} s in a barrier for absent rank {absent}",
        ranks - 1
    );
    println!(
        "  cpu {:.3} ms in {:.3} s of wall time: {:.3} ms per waiting rank",
        cpu.as_secs_f64() * 1e3,
        wall.as_secs_f64(),
        cpu.as_secs_f64() * 1e3 / (ranks - 1) as f64
    );
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Some((Err(e), cpu))) => println!(
                "  rank {rank}: {:.3} ms of CPU in the wait; {e}",
                cpu.as_secs_f64() * 1e3
            ),
            Ok(Some((Ok(()), _))) => println!("  rank {rank}: unexpectedly completed"),
            Ok(None) => {}
            Err(e) => println!("  rank {rank}: {e}"),
        }
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &Args) {
    let universe = mpi::initialize().expect("MPI initializes once");
    let comm = tpcomm_transport::MpiCommunicator::world(&universe).expect("world communicator");
    let slowest = measure(&comm, args.iters, args.bytes).expect("MPI collectives");
    if comm.rank() == 0 {
        report("mpi", comm.size(), args.bytes, &slowest);
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Args) {
    eprintln!("--mpi needs the example built with `--features mpi`");
    std::process::exit(2);
}

fn main() {
    let args = parse();
    if let Some(seconds) = args.idle {
        idle(args.ranks, seconds, args.spin);
        return;
    }
    if args.mpi {
        run_mpi(&args);
        return;
    }
    let (iters, bytes) = (args.iters, args.bytes);
    let mut group = LocalGroup::new(args.ranks);
    if let Some(spin) = args.spin {
        group = group.spin(spin);
    }
    let results = group.run(|comm| measure(&comm, iters, bytes));
    let slowest = results
        .into_iter()
        .next()
        .expect("rank 0")
        .expect("rank 0 did not panic")
        .expect("local collectives");
    report("local (threads)", args.ranks, bytes, &slowest);
}
