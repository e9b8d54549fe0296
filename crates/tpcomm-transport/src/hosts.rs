//! Which ranks of a group share a host: the grouping of ranks by their process identity's
//! host (a kernel boot and a PID namespace, see [`crate::process`]), and the split of a group
//! into one sub-group per host.
//!
//! Engines run tensor parallelism inside a host and pipeline or data parallelism across
//! hosts; what shares memory (peer memory, the host all-reduce, the queue's ring) works inside
//! a host only. [`split_by_host`] gives each host's ranks a communicator of their own:
//!
//! ```
//! use tpcomm_transport::{hosts, Communicator, LocalGroup};
//!
//! let sizes = LocalGroup::new(3).run(|comm| {
//!     let here = hosts::split_by_host(&comm)?;
//!     Ok::<_, tpcomm_transport::TransportError>(here.size())
//! });
//! // Threads of one process are on one host.
//! assert!(sizes.into_iter().all(|s| s.unwrap().unwrap() == 3));
//! ```

use crate::communicator::Communicator;
use crate::error::{Result, TransportError};
use crate::process::ProcessIdentity;

/// The hosts of a group's ranks: every rank's [`ProcessIdentity`] and, for each, the index of
/// its host. Hosts are numbered in the order of their lowest rank; a rank whose host is not
/// known (`/proc` unreadable) is a host of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    identities: Vec<ProcessIdentity>,
    host: Vec<usize>,
    count: usize,
}

impl Hosts {
    /// Groups `identities` (one per rank, in rank order) by host.
    pub fn from_identities(identities: Vec<ProcessIdentity>) -> Self {
        let mut host = Vec::with_capacity(identities.len());
        let mut firsts: Vec<usize> = Vec::new();
        for (rank, id) in identities.iter().enumerate() {
            let found = firsts
                .iter()
                .position(|&first| identities[first].same_host(id));
            match found {
                Some(h) => host.push(h),
                None => {
                    host.push(firsts.len());
                    firsts.push(rank);
                }
            }
        }
        Self {
            identities,
            count: firsts.len(),
            host,
        }
    }

    /// The number of hosts.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.host.len()
    }

    /// Whether the ranks are on more than one host.
    pub fn spans_hosts(&self) -> bool {
        self.count > 1
    }

    /// The host index of `rank` (`None` past the group).
    pub fn host_of(&self, rank: usize) -> Option<usize> {
        self.host.get(rank).copied()
    }

    /// The ranks on host `host`, ascending.
    pub fn ranks_on(&self, host: usize) -> Vec<usize> {
        (0..self.host.len())
            .filter(|&r| self.host[r] == host)
            .collect()
    }

    /// The identity of `rank`'s process (`None` past the group).
    pub fn identity(&self, rank: usize) -> Option<&ProcessIdentity> {
        self.identities.get(rank)
    }

    /// Host `host`'s name as its lowest rank reported it (empty where unknown or past the
    /// hosts).
    pub fn name(&self, host: usize) -> String {
        self.ranks_on(host)
            .first()
            .map(|&r| self.identities[r].host_name())
            .unwrap_or_default()
    }

    /// Every host as `(name, ranks)`, in host order: what an error about a group that spans
    /// hosts reports.
    pub fn layout(&self) -> Vec<(String, Vec<usize>)> {
        (0..self.count)
            .map(|h| (self.name(h), self.ranks_on(h)))
            .collect()
    }
}

/// Collective: every rank's process identity, all-gathered over `comm`, grouped by host.
pub fn hosts<C: Communicator + ?Sized>(comm: &C) -> Result<Hosts> {
    let mine = ProcessIdentity::current().encode();
    let mut all = vec![0u8; comm.size() * ProcessIdentity::LEN];
    comm.all_gather(&mine, &mut all)?;
    Ok(Hosts::from_identities(
        all.chunks_exact(ProcessIdentity::LEN)
            .map(ProcessIdentity::decode)
            .collect(),
    ))
}

/// Collective: splits `comm` into one sub-group per host (ranks ordered as in `comm`).
/// Every rank gets its host's group.
pub fn split_by_host<C: Communicator>(comm: &C) -> Result<C> {
    let hosts = hosts(comm)?;
    let me = comm.rank();
    let host = hosts.host_of(me).unwrap_or(0);
    let color = u32::try_from(host).map_err(|_| {
        TransportError::Setup(format!("host index {host} does not fit a split color"))
    })?;
    let key = i32::try_from(me).unwrap_or(i32::MAX);
    comm.split(Some(color), key)?
        .ok_or_else(|| TransportError::Setup("a split with a color returned no sub-group".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(ns: u64, base: &ProcessIdentity) -> ProcessIdentity {
        let mut bytes = base.encode();
        bytes[40..48].copy_from_slice(&ns.to_le_bytes());
        ProcessIdentity::decode(&bytes)
    }

    #[test]
    fn ranks_are_grouped_by_host_in_the_order_of_their_lowest_rank() {
        let me = ProcessIdentity::current();
        let ids = vec![on(7, &me), on(9, &me), on(7, &me), on(9, &me), on(11, &me)];
        let hosts = Hosts::from_identities(ids);
        assert_eq!(hosts.count(), 3);
        assert!(hosts.spans_hosts());
        assert_eq!(hosts.ranks_on(0), [0, 2]);
        assert_eq!(hosts.ranks_on(1), [1, 3]);
        assert_eq!(hosts.ranks_on(2), [4]);
        assert_eq!(hosts.host_of(3), Some(1));
        assert_eq!(hosts.layout()[1], (me.host_name(), vec![1, 3]));
    }

    #[test]
    fn a_rank_of_unknown_host_is_a_host_of_its_own() {
        let me = ProcessIdentity::current();
        let unknown = ProcessIdentity::decode(&[]);
        let hosts = Hosts::from_identities(vec![me, unknown, me, unknown]);
        assert_eq!(hosts.count(), 3);
        assert_eq!(hosts.ranks_on(0), [0, 2]);
        assert_eq!(hosts.ranks_on(1), [1]);
        assert_eq!(hosts.ranks_on(2), [3]);
    }
}
