//! [`Config`], the settings of a [`CustomAllReduce`](super::CustomAllReduce), and their
//! agreement across ranks: every rank's setup outcome and the settings that must be equal,
//! all-gathered by `new` and compared here, so that every rank returns the same verdict.

use std::time::Duration;

use crate::backend::Backend;
use crate::dispatch::{Algorithm, DispatchTable, Reproducibility};
use crate::error::{AllReduceError, Result};
use crate::topology::TopologyCheck;

/// Settings of a [`CustomAllReduce`](super::CustomAllReduce).
///
/// [`CustomAllReduce::new`](super::CustomAllReduce::new) checks across ranks that
/// `max_bytes`, `slots`, `algorithm`, `topology`, `reproducibility` and the dispatch table
/// in use (its digest) are equal (and the backend's shape, [`Backend::agreed_shape`]): a
/// launch on one rank reads up to its own `max_bytes` from every peer's staging and temp
/// buffers, every rank must take the same algorithm for a call (the two-stage one has an
/// extra barrier and reads temp buffers), and slots are handed out in lockstep, so a
/// smaller pool would fail one rank alone. A mismatch is
/// [`AllReduceError::ConfigMismatch`] on every rank. `timeout` may differ: it only bounds
/// this rank's own waits.
#[derive(Debug, Clone)]
pub struct Config {
    /// Largest all-reduce served, in bytes (sizes the staging and temp buffers; default
    /// 8 MiB). Larger inputs get [`FallbackReason::TooLarge`](crate::FallbackReason).
    pub max_bytes: usize,
    /// RankData slots (slot 0 serves eager inputs; default 1024, at most
    /// [`MAX_SLOTS`](Self::MAX_SLOTS)).
    pub slots: usize,
    /// Bound on every barrier wait inside a launch (default 30 s).
    pub timeout: Duration,
    /// Forces one algorithm for every size it can serve (benchmarks, tests); `None` (the
    /// default) chooses by the dispatch table.
    pub algorithm: Option<Algorithm>,
    /// The dispatch table: which algorithm serves which size, per world size, element type
    /// and input ([`DispatchTable`]; `tpcomm-bench tune` writes one for the machine it runs
    /// on, [`DispatchTable::load`] reads it). Its rows replace the backend's built-in ones
    /// for the keys it names. `None` (the default): the file named by the environment
    /// variable [`DISPATCH_TABLE_ENV`](crate::dispatch::DISPATCH_TABLE_ENV) when it is set,
    /// else the backend's built-in table. Checked at creation against the backend and
    /// `reproducibility` ([`AllReduceError::DispatchTable`], naming the line).
    pub dispatch: Option<DispatchTable>,
    /// What the choice of algorithm may change ([`Reproducibility`]): by default
    /// ([`BitStable`](Reproducibility::BitStable)) nothing, so a value's all-reduce has the
    /// same bits whatever the size of the call it is part of; `AnyOrder` lets the table
    /// choose the transport's all-reduce and sends inputs one launch cannot take there.
    pub reproducibility: Reproducibility,
    /// How a backend that probes the topology (CUDA) decides whether its kernels run:
    /// [`TopologyCheck::Auto`] (the default: vLLM's rule, more than 2 ranks only with every
    /// pair of GPUs on NVLink), `Assume` (run whatever the probe says), `Off` (always fall
    /// back). Agreed across ranks. See `crate::topology`.
    pub topology: TopologyCheck,
}

impl Config {
    /// The most RankData slots: launch shape words carry the slot in 20 bits.
    pub const MAX_SLOTS: usize = 1 << 20;
    /// The largest `max_bytes`: launch shape words carry the byte count in 40 bits.
    pub const MAX_BYTES: usize = (1 << 40) - 1;
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_bytes: 8 << 20,
            slots: 1024,
            timeout: Duration::from_secs(30),
            algorithm: None,
            dispatch: None,
            reproducibility: Reproducibility::BitStable,
            topology: TopologyCheck::Auto,
        }
    }
}

impl Config {
    /// The settings every rank must share, as (field, value) pairs (see the type's doc).
    pub(super) fn agreed_fields(&self) -> Vec<(String, String)> {
        vec![
            ("max_bytes".into(), self.max_bytes.to_string()),
            ("slots".into(), self.slots.to_string()),
            (
                "algorithm".into(),
                self.algorithm.map_or("by size", Algorithm::name).into(),
            ),
            ("topology".into(), self.topology.name().into()),
            ("reproducibility".into(), self.reproducibility.name().into()),
        ]
    }

    /// The dispatch table a communicator of `world` ranks on `backend` uses: the table of
    /// [`dispatch`](Self::dispatch) or of the environment's file (which must be for this
    /// backend) over the backend's built-in one, restricted to `world`, checked against the
    /// backend and [`reproducibility`](Self::reproducibility).
    pub(super) fn dispatch_table<B: Backend>(
        &self,
        backend: &B,
        world: usize,
    ) -> Result<DispatchTable> {
        let builtin = backend.builtin_dispatch();
        let chosen = match &self.dispatch {
            Some(table) => Some(table.clone()),
            None => DispatchTable::from_env()?,
        };
        let table = match chosen {
            Some(table) => {
                table.check_backend(backend.name())?;
                table.over(&builtin)
            }
            None => builtin,
        }
        .for_ranks(world);
        table.check_for(
            backend.name(),
            backend.algorithms(),
            backend.shape_includes_slot(),
            self.reproducibility,
        )?;
        Ok(table)
    }
}

/// Every rank's (setup error, agreed fields), as all-gathered by `new`.
type Agreement = (Option<String>, Vec<(String, String)>);

/// The most settings a rank may send in its [`Agreement`] (a build sends about ten).
const MAX_AGREED_FIELDS: usize = 256;

/// The first rank that reported a setup error, with it.
pub(super) fn first_setup_error(errors: &[Option<String>]) -> Option<(usize, String)> {
    errors
        .iter()
        .enumerate()
        .find_map(|(rank, e)| e.clone().map(|e| (rank, e)))
}

/// Fails (identically on every rank: they all read the same values) when a rank could not
/// set up, or when ranks differ in a field that must be equal.
pub(super) fn check_agreement(all: &[Agreement]) -> Result<()> {
    let errors: Vec<Option<String>> = all.iter().map(|(e, _)| e.clone()).collect();
    if let Some((rank, reason)) = first_setup_error(&errors) {
        return Err(AllReduceError::PeerSetup { rank, reason });
    }
    // Compared name by name below: a peer's list is bounded first, so that a lying peer
    // cannot make the comparison quadratic in what it sends.
    if let Some((rank, (_, fields))) = all
        .iter()
        .enumerate()
        .find(|(_, (_, fields))| fields.len() > MAX_AGREED_FIELDS)
    {
        return Err(AllReduceError::PeerSetup {
            rank,
            reason: format!(
                "it sent {} settings to agree on, more than any build has ({MAX_AGREED_FIELDS})",
                fields.len()
            ),
        });
    }
    // Fields in the order rank 0 sent them, then any only some other rank sent.
    let mut names: Vec<&str> = Vec::new();
    for (_, fields) in all {
        for (name, _) in fields {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    for name in names {
        let values: Vec<(usize, String)> = all
            .iter()
            .enumerate()
            .map(|(rank, (_, fields))| {
                let value = fields
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or_else(|| "nothing".to_string(), |(_, v)| v.clone());
                (rank, value)
            })
            .collect();
        if values.iter().any(|(_, v)| *v != values[0].1) {
            return Err(AllReduceError::ConfigMismatch {
                field: name.to_string(),
                values,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_sending_more_settings_than_any_build_is_refused_before_they_are_compared() {
        let honest: Agreement = (None, vec![("max_bytes".into(), "8388608".into())]);
        let flood: Agreement = (
            None,
            (0..20_000)
                .map(|i| (format!("f{i}"), String::new()))
                .collect(),
        );
        match check_agreement(&[honest, flood]) {
            Err(AllReduceError::PeerSetup { rank: 1, reason }) => {
                assert!(reason.contains("20000 settings"), "{reason}")
            }
            other => panic!("expected PeerSetup naming rank 1, got {other:?}"),
        }
    }
}
