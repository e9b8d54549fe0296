//! The suites and faults `mpi-multihost` runs across hosts (`cargo xtask multihost`): ranks
//! on 2 to 4 hosts of one machine (network, PID, UTS and mount namespaces of their own), Open
//! MPI moving their bytes over TCP between hosts and through shared memory inside one.
//!
//! - [`run_suites`]: the conformance suite (`run_all`, whose cases that share memory run on
//!   each host's ranks), the MPI-only cases, and the cases of what depends on hosts
//!   ([`cases`]): object collectives in rounds over TCP, a failing rank on another host, the
//!   broadcast queue with readers on the ring and on the transport in one queue, the host
//!   all-reduce refused across hosts and working on the per-host split, peer memory refusing
//!   a handle from another host, a checkpoint coordinated across hosts.
//! - [`faults`]: one run of a fault that `cargo xtask multihost` injects from outside (a host
//!   killed, a link down, a host frozen), the survivors' verdict lines.

pub mod cases;
pub mod faults;

use tpcomm::transport::hosts::{self, Hosts};
use tpcomm::transport::{Communicator, MpiCommunicator};

use crate::{agree, CaseReport, CaseResult};

/// Every case of the multi-host suite, run collectively on `comm`; `expected_hosts` is how
/// many hosts the launcher made (the first case checks the ranks see as many).
pub fn run_suites(comm: &MpiCommunicator, expected_hosts: usize) -> Vec<CaseReport> {
    let mut reports = vec![agree(
        comm,
        "multihost_ranks_see_the_hosts_the_launcher_made",
        ranks_see_the_hosts(comm, expected_hosts),
    )];
    // `TPCOMM_MULTIHOST_ONLY=a,b`: the cases of this file whose names contain `a` or `b`,
    // without the conformance suite (to rerun one case by hand).
    let only: Option<Vec<String>> = std::env::var("TPCOMM_MULTIHOST_ONLY")
        .ok()
        .map(|v| v.split(',').map(str::to_string).collect());
    if only.is_none() {
        reports.extend(crate::run_all(comm));
        reports.extend(crate::mpi_cases::run_mpi_cases(comm));
    }
    for (name, case) in cases::CASES {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|part| name.contains(part.as_str())))
        {
            continue;
        }
        let mine = case(comm);
        if let Err(e) = &mine {
            // Said at once: a case that fails on one rank may leave the others waiting.
            eprintln!("rank {}: case {name} failed: {e}", comm.rank());
        }
        reports.push(agree(comm, name, mine));
    }
    reports
}

/// The hosts of `comm`'s ranks (collective).
pub(crate) fn hosts_of<C: Communicator + ?Sized>(comm: &C) -> Result<Hosts, String> {
    hosts::hosts(comm).map_err(|e| format!("gathering the hosts: {e}"))
}

/// The launcher placed the ranks by slot (the first host's ranks first): the ranks see
/// `expected` hosts of equal size, in that order, each with its own name, PID namespace and
/// host name (UTS).
fn ranks_see_the_hosts(comm: &MpiCommunicator, expected: usize) -> CaseResult {
    let hosts = hosts_of(comm)?;
    let n = comm.size();
    if hosts.count() != expected || !n.is_multiple_of(expected) {
        return Err(format!(
            "{} hosts seen for {n} ranks, {expected} made: {:?}",
            hosts.count(),
            hosts.layout()
        ));
    }
    let per_host = n / expected;
    let mut names = Vec::new();
    for h in 0..expected {
        let want: Vec<usize> = (h * per_host..(h + 1) * per_host).collect();
        if hosts.ranks_on(h) != want {
            return Err(format!("host {h} holds ranks {:?}", hosts.ranks_on(h)));
        }
        let name = hosts.name(h);
        if name.is_empty() || names.contains(&name) {
            return Err(format!("host {h} is named `{name}`, after {names:?}"));
        }
        names.push(name);
    }
    Ok(())
}
