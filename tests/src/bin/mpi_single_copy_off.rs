//! MPI without the shared-memory single-copy mechanism: `mpirun -np N mpi-single-copy-off`.
//!
//! Calls `MpiCommunicator::disable_single_copy_before_init` before initializing MPI, then
//! checks that a rank sending more than was agreed gets the root a typed error on the
//! blocking path (which receives into the caller's buffer) instead of overwriting its heap.
//! Launched by `cargo xtask test` (Open MPI only); rank 0 prints `case NAME ... ok` or
//! `case NAME ... FAILED: detail` per case, like `mpi-conformance`.

use std::process::ExitCode;

use tpcomm::transport::MpiCommunicator;
use tpcomm_conformance::mpi_cases::run_single_copy_off_cases;

fn main() -> ExitCode {
    let disabled = MpiCommunicator::disable_single_copy_before_init();
    tpcomm_conformance::mpi_program("mpi-single-copy-off", |comm| {
        let reports = run_single_copy_off_cases(comm, &disabled);
        tpcomm_conformance::print_reports("mpi-single-copy-off", comm, &reports)
    })
}
