//! The multi-host suites and faults (`cargo xtask multihost`), with ranks on 2 to 4 hosts
//! of one machine and Open MPI between them over TCP (`tpcomm_conformance::multihost`).
//! Every rank turns off Open MPI's single copy and TCP RDMA before `MPI_Init`
//! (`MpiCommunicator::disable_single_copy_before_init`), which a peer's oversized message
//! over TCP needs.
//!
//! - `mpi-multihost suites HOSTS`: every case of the multi-host suite; rank 0 prints one
//!   `case NAME ... ok` / `case NAME ... FAILED: detail` line per case and a summary, the
//!   exit status is non-zero when a case failed on any rank. `HOSTS` is how many hosts the
//!   launcher made.
//! - `mpi-multihost fault KIND VICTIM_HOST TIMEOUT_MS`: one fault (under `mpirun
//!   --enable-recovery`), its lines judged by the driver (see the `faults` module).

use std::process::ExitCode;
use std::time::Duration;

use tpcomm::transport::{Communicator, MpiCommunicator};
use tpcomm_conformance::multihost::{self, faults};

fn usage() -> ExitCode {
    eprintln!(
        "usage: mpi-multihost suites HOSTS | mpi-multihost fault KIND VICTIM_HOST TIMEOUT_MS \
         (kinds: {})",
        faults::KINDS.join(", ")
    );
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Across hosts a peer's oversized message must be truncated, not written past the
    // receive buffer: no RDMA over TCP and no single copy inside a host (every rank).
    if let Err(e) = MpiCommunicator::disable_single_copy_before_init() {
        eprintln!("mpi-multihost: cannot turn off single copy and RDMA before MPI_Init: {e}");
        return ExitCode::FAILURE;
    }
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["suites", hosts] => {
            let Ok(hosts) = hosts.parse::<usize>() else {
                return usage();
            };
            tpcomm_conformance::mpi_program("mpi-multihost", |comm| {
                let reports = multihost::run_suites(comm, hosts);
                tpcomm_conformance::print_reports("mpi-multihost", comm, &reports)
            })
        }
        ["fault", kind, victim, ms] if faults::KINDS.contains(kind) => {
            let (Ok(victim), Ok(ms)) = (victim.parse::<usize>(), ms.parse::<u64>()) else {
                return usage();
            };
            fault(kind, victim, Duration::from_millis(ms))
        }
        _ => usage(),
    }
}

/// One fault run: every rank's communicator bounded by `timeout`; the process exits without
/// `MPI_Finalize`, which can hang in Open MPI 4.1 once a peer died.
fn fault(kind: &str, victim_host: usize, timeout: Duration) -> ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("mpi-multihost: MPI was already initialized");
        return ExitCode::FAILURE;
    };
    let world = universe.world();
    let comm = MpiCommunicator::duplicate(&world).and_then(|c| c.with_timeout(timeout));
    let (rank, ok) = match comm {
        Ok(comm) => {
            let rank = comm.rank();
            let ok = faults::run(&world, &comm, kind, victim_host, timeout);
            // A communicator broken by the fault is leaked by its drop, as designed.
            drop(comm);
            (rank, ok)
        }
        Err(e) => {
            eprintln!("mpi-multihost: cannot create the communicator: {e}");
            (usize::MAX, false)
        }
    };
    tpcomm_conformance::exit_without_finalize(universe, rank, ok)
}
