//! The conformance suite on MPI: `mpirun -np N mpi-conformance`.
//!
//! Launched by `cargo xtask test` (with 2 and 4 ranks). Rank 0 prints one line per case,
//! `case NAME ... ok` or `case NAME ... FAILED: detail`, then `mpi-conformance: N passed,
//! N failed`; the exit status is non-zero when a case failed on any rank.

use std::process::ExitCode;

use tpcomm_conformance::run_all;

fn main() -> ExitCode {
    tpcomm_conformance::mpi_program("mpi-conformance", |comm| {
        let mut reports = run_all(comm);
        reports.extend(tpcomm_conformance::mpi_cases::run_mpi_cases(comm));
        tpcomm_conformance::print_reports("mpi-conformance", comm, &reports)
    })
}
