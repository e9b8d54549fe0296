//! The conformance suite on MPI: `mpirun -np N mpi-conformance`.
//!
//! Launched by `cargo xtask test` (with 2 and 4 ranks). Rank 0 prints one line per case,
//! `case NAME ... ok` or `case NAME ... FAILED: detail`, then `mpi-conformance: N passed,
//! N failed`; the exit status is non-zero when a case failed on any rank.

use std::process::ExitCode;

use tpcomm::transport::Communicator;
use tpcomm_conformance::run_all;

fn main() -> ExitCode {
    tpcomm_conformance::mpi_program("mpi-conformance", |comm| {
        let mut reports = run_all(comm);
        reports.extend(tpcomm_conformance::mpi_cases::run_mpi_cases(comm));
        let failed = reports.iter().filter(|r| !r.passed).count();
        if comm.rank() == 0 {
            for r in &reports {
                if r.passed {
                    println!("case {} ... ok", r.name);
                } else {
                    println!("case {} ... FAILED: {}", r.name, r.detail);
                }
            }
            println!(
                "mpi-conformance ({} ranks): {} passed, {} failed",
                comm.size(),
                reports.len() - failed,
                failed
            );
        } else {
            for r in reports.iter().filter(|r| !r.passed) {
                eprintln!("rank {}: case {} failed: {}", comm.rank(), r.name, r.detail);
            }
        }
        failed == 0
    })
}
