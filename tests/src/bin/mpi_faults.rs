//! Fault injection under MPI: one rank SIGKILLs itself at a chosen phase, the others must
//! fail within the timeout with an error naming it (`cargo xtask faults`).
//!
//! `mpirun --enable-recovery -np N mpi-faults PHASE VICTIM TIMEOUT_MS`. Every rank builds an
//! MPI communicator bounded by the timeout (`MpiCommunicator::with_timeout`) and a host
//! custom all-reduce with the same barrier timeout, runs one round of every operation
//! successfully (an object all-gather, an all-reduce, a suspend/resume), then runs the
//! operation of `PHASE` again, during which rank `VICTIM` kills itself with SIGKILL:
//!
//! - `object-lengths`: at the first transport call of an object all-gather (the length
//!   exchange);
//! - `object-payload`: at its second call (the payload; values are 4 KiB, past the inline
//!   slot, so there is one);
//! - `allreduce-launch`: just before an all-reduce (the others wait in its start barrier);
//! - `suspend`: at the second transport call of `prepare_for_suspend` (its closing
//!   step, a tagged all-gather of one transport call, after the mappings are closed);
//! - `resume`: at the first transport call of `reinit_after_resume` (the handle exchange);
//! - `resume-stable`: the same on memory with stable addresses (`HostMemory::stable`, the
//!   twin of CUDA virtual memory: the suspend released the buffers and detached the peer
//!   mappings, the resume restores, exchanges fresh handles and reattaches);
//! - `queue-writer`: the writer of a broadcast queue (the victim), while its readers wait in
//!   `recv` for a message it never sends (they see its process gone);
//! - `queue-reader`: a reader of a broadcast queue (the victim), before it receives, while
//!   the writer (the next rank) laps the ring and waits for it (the writer sees its process
//!   gone; the other readers are told by the writer, through the ring, whom it blames).
//!
//! Each survivor prints `survivor R: PHASE failed after S s naming rank V: ERROR` when its
//! typed error names the victim first (survivors that already exited may follow it), or `survivor R: PHASE FAILED: ...` otherwise, then
//! checks that its communicator refuses further collectives at once when the MPI wait
//! timed out, and prints `rank R: exiting without MPI_Finalize` at the end (finalizing after
//! a peer died can hang in Open MPI 4.1). The victim prints
//! `victim V: SIGKILL at PHASE` just before it dies. The xtask driver judges these lines,
//! the time bound, and what the job leaves behind.

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tpcomm::allreduce::{AllReduceError, Config, CustomAllReduce, HostBackend};
use tpcomm::ipc::{HostMemory, IpcError};
use tpcomm::objects;
use tpcomm::queue::{BroadcastQueue, QueueConfig};
use tpcomm::transport::testing::hooked::Hooked;
use tpcomm::transport::{Communicator, MpiCommunicator};
use tpcomm::{ObjectError, QueueError, TransportError};

/// The phases a rank can be killed at.
const PHASES: [&str; 8] = [
    "object-lengths",
    "object-payload",
    "allreduce-launch",
    "suspend",
    "resume",
    "resume-stable",
    "queue-writer",
    "queue-reader",
];

/// Kills this process at its `kill_at`-th transport call (1-based) once armed; 0 means
/// never. The communicator the tests use is `comm` wrapped in a [`Hooked`] that counts.
struct Fault {
    rank: usize,
    calls: AtomicUsize,
    kill_at: AtomicUsize,
    phase: &'static str,
}

impl Fault {
    /// Kills this process at the `nth` transport call from now.
    fn arm(&self, nth: usize) {
        self.calls.store(0, Ordering::SeqCst);
        self.kill_at.store(nth, Ordering::SeqCst);
    }

    fn count_call(&self) {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.kill_at.load(Ordering::SeqCst) == call {
            die(self.rank, self.phase);
        }
    }
}

/// SIGKILLs this process (through kill(1): no unsafe code in this program).
fn die(rank: usize, phase: &str) -> ! {
    println!("victim {rank}: SIGKILL at {phase}");
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status();
    // kill(1) returns after the signal is queued; wait for it to land.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The ranks a typed error blames (empty when it blames nobody).
fn blamed_by_transport(e: &TransportError) -> Vec<usize> {
    match e {
        TransportError::Unresponsive { gone, silent, .. } => {
            gone.iter().chain(silent.iter()).copied().collect()
        }
        TransportError::Timeout { missing, .. } => missing.clone(),
        other => other.culprit().into_iter().collect(),
    }
}

fn blamed_by_allreduce(e: &AllReduceError) -> Vec<usize> {
    match e {
        AllReduceError::Timeout { peer, .. } => vec![*peer],
        AllReduceError::Transport(t) => blamed_by_transport(t),
        AllReduceError::Failed { cause, .. } => blamed_by_allreduce(cause),
        AllReduceError::Ipc(ipc) => match &**ipc {
            IpcError::Exchange(o) => blamed_by_objects(o),
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

fn blamed_by_objects(e: &ObjectError) -> Vec<usize> {
    match e {
        ObjectError::Transport(t) => blamed_by_transport(t),
        _ => Vec::new(),
    }
}

fn queue_failure(e: QueueError) -> Failure {
    Failure {
        blamed: e.culprit().into_iter().collect(),
        mpi_timed_out: false,
        text: e.to_string(),
    }
}

/// A phase's failure: the ranks it blames, its text, and whether the MPI wait timed out
/// (so that the communicator must now refuse further collectives).
struct Failure {
    blamed: Vec<usize>,
    text: String,
    mpi_timed_out: bool,
}

fn from_transport(e: &TransportError) -> bool {
    matches!(e, TransportError::Unresponsive { .. })
}

fn object_failure(e: ObjectError) -> Failure {
    Failure {
        blamed: blamed_by_objects(&e),
        mpi_timed_out: matches!(&e, ObjectError::Transport(t) if from_transport(t)),
        text: e.to_string(),
    }
}

fn allreduce_failure(e: AllReduceError) -> Failure {
    fn timed_out(e: &AllReduceError) -> bool {
        match e {
            AllReduceError::Transport(t) => from_transport(t),
            AllReduceError::Failed { cause, .. } => timed_out(cause),
            AllReduceError::Ipc(ipc) => {
                matches!(&**ipc, IpcError::Exchange(ObjectError::Transport(t)) if from_transport(t))
            }
            _ => false,
        }
    }
    Failure {
        blamed: blamed_by_allreduce(&e),
        mpi_timed_out: timed_out(&e),
        text: e.to_string(),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [phase, victim, ms] => PHASES
            .iter()
            .find(|p| *p == phase)
            .and_then(|p| Some((*p, victim.parse().ok()?, ms.parse().ok()?))),
        _ => None,
    };
    let Some((phase, victim, timeout_ms)) = parsed else {
        eprintln!(
            "usage: mpi-faults PHASE VICTIM TIMEOUT_MS (phases: {})",
            PHASES.join(", ")
        );
        return ExitCode::FAILURE;
    };
    let timeout = Duration::from_millis(timeout_ms);
    let Some(universe) = mpi::initialize() else {
        eprintln!("mpi-faults: MPI was already initialized");
        return ExitCode::FAILURE;
    };
    let comm = MpiCommunicator::world(&universe).and_then(|c| c.with_timeout(timeout));
    let (rank, ok) = match comm {
        Ok(comm) => {
            let rank = comm.rank();
            let ok = run(&comm, phase, victim, timeout);
            drop(comm);
            (rank, ok)
        }
        Err(e) => {
            eprintln!("mpi-faults: cannot create the communicator: {e}");
            (usize::MAX, false)
        }
    };
    tpcomm_conformance::exit_without_finalize(universe, rank, ok)
}

/// One rank's part; true when it behaved as expected.
fn run(comm: &MpiCommunicator, phase: &'static str, victim: usize, timeout: Duration) -> bool {
    let me = comm.rank();
    if victim >= comm.size() {
        eprintln!("rank {me}: victim {victim} is not a rank");
        return false;
    }
    let fault = Fault {
        rank: me,
        calls: AtomicUsize::new(0),
        kill_at: AtomicUsize::new(0),
        phase,
    };
    let faulty = Hooked::new(comm, |_op| {
        fault.count_call();
        Ok(())
    });
    let config = Config {
        max_bytes: 64 << 10,
        slots: 8,
        timeout,
        ..Config::default()
    };
    let memory = if phase.ends_with("-stable") {
        HostMemory::stable()
    } else {
        HostMemory::new()
    };
    let mut ar = match CustomAllReduce::new(HostBackend::new(), memory, &faulty, config) {
        Ok(ar) => ar,
        Err(e) => {
            println!("rank {me}: setup FAILED: {e}");
            return false;
        }
    };
    let value = vec![me as u8; 4096];
    let input = vec![1.0f32; 1024];
    let mut output = vec![0.0f32; 1024];
    // One healthy round of everything, so the fault hits a working job.
    let warm = objects::all_gather(&faulty, &value)
        .map_err(|e| e.to_string())
        .and_then(|_| {
            ar.all_reduce(&input, &mut output)
                .map_err(|e| e.to_string())
        })
        .and_then(|_| ar.prepare_for_suspend(&faulty).map_err(|e| e.to_string()))
        .and_then(|_| ar.reinit_after_resume(&faulty).map_err(|e| e.to_string()));
    if let Err(e) = warm {
        println!("rank {me}: warm-up FAILED: {e}");
        return false;
    }
    if output.iter().any(|&x| x != comm.size() as f32) {
        println!("rank {me}: warm-up all-reduce gave a wrong sum");
        return false;
    }
    // The queue phases' queue: the victim writes in `queue-writer`, the next rank in
    // `queue-reader`; a healthy round of messages first.
    let mut queue = None;
    if phase.starts_with("queue") {
        let writer = if phase == "queue-writer" {
            victim
        } else {
            (victim + 1) % comm.size()
        };
        let config = QueueConfig {
            depth: 4,
            chunk_bytes: 1024,
            timeout,
            ..QueueConfig::with_writer(writer)
        };
        let warm = BroadcastQueue::create(comm, config).and_then(|mut q| {
            for i in 0..3u32 {
                if q.is_writer() {
                    q.send(&i)?;
                } else if q.recv::<u32>()? != i {
                    println!("rank {me}: warm-up queue message {i} is wrong");
                }
            }
            Ok(q)
        });
        match warm {
            Ok(q) => queue = Some(q),
            Err(e) => {
                println!("rank {me}: warm-up queue FAILED: {e}");
                return false;
            }
        }
        // Everyone is past the warm-up before the victim dies.
        if let Err(e) = comm.barrier() {
            println!("rank {me}: barrier after the queue warm-up FAILED: {e}");
            return false;
        }
    }

    let is_victim = me == victim;
    let started = Instant::now();
    let outcome: Result<(), Failure> = match phase {
        "object-lengths" | "object-payload" => {
            if is_victim {
                fault.arm(if phase == "object-lengths" { 1 } else { 2 });
            }
            objects::all_gather(&faulty, &value)
                .map(drop)
                .map_err(object_failure)
        }
        "allreduce-launch" => {
            if is_victim {
                die(me, phase);
            }
            ar.all_reduce(&input, &mut output)
                .map(drop)
                .map_err(allreduce_failure)
        }
        "suspend" => {
            if is_victim {
                fault.arm(2);
            }
            ar.prepare_for_suspend(&faulty).map_err(allreduce_failure)
        }
        "queue-writer" | "queue-reader" => {
            let q = queue.as_mut().expect("made above for the queue phases");
            if is_victim {
                die(me, phase);
            }
            if q.is_writer() {
                // Far past the ring: the dead reader never frees a chunk.
                (0..64u32)
                    .try_for_each(|i| q.send(&vec![i; 256]))
                    .map_err(queue_failure)
            } else {
                // The writer's 64 messages (or fewer, up to its failure), then the error.
                (0..65)
                    .try_for_each(|_| q.recv::<Vec<u32>>().map(drop))
                    .map_err(queue_failure)
            }
        }
        _ => {
            // resume, resume-stable
            let suspended = ar.prepare_for_suspend(&faulty);
            if let Err(e) = suspended {
                println!("rank {me}: suspend before the resume FAILED: {e}");
                return false;
            }
            if is_victim {
                fault.arm(1);
            }
            ar.reinit_after_resume(&faulty).map_err(allreduce_failure)
        }
    };
    let waited = started.elapsed();
    let failure = match outcome {
        Ok(()) => {
            println!("survivor {me}: {phase} FAILED: it succeeded although rank {victim} died");
            return false;
        }
        Err(f) => f,
    };
    // Survivors that timed out first may have exited before this one's deadline: they are
    // gone too, and rightly listed, but after the victim, which died first.
    if failure.blamed.first() != Some(&victim) {
        println!(
            "survivor {me}: {phase} FAILED: the error blames {:?}, not {victim} first, after {:.2} s: {}",
            failure.blamed,
            waited.as_secs_f64(),
            failure.text
        );
        return false;
    }
    println!(
        "survivor {me}: {phase} failed after {:.2} s naming rank {victim}: {}",
        waited.as_secs_f64(),
        failure.text
    );
    if failure.mpi_timed_out {
        // The abandoned collective broke the communicator: the next call must fail at once.
        let refused_at = Instant::now();
        let next = comm.barrier();
        let ok =
            matches!(next, Err(TransportError::Aborted { .. })) && refused_at.elapsed() < timeout;
        if !ok {
            println!("survivor {me}: FAILED: a collective after the timeout gave {next:?}");
            return false;
        }
    }
    if let Err(e) = ar.close() {
        println!("survivor {me}: FAILED: close after the fault: {e}");
        return false;
    }
    if let Some(Err(e)) = queue.map(BroadcastQueue::close) {
        println!("survivor {me}: FAILED: queue close after the fault: {e}");
        return false;
    }
    true
}
