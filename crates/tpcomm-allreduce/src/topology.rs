//! Whether the custom kernels may run on a group's GPUs, decided from probed links.
//!
//! The peer-memory kernels read every peer's buffers over peer-to-peer (P2P) access; at more
//! than two ranks they are only faster than NCCL when every pair of GPUs is connected by
//! NVLink (vLLM's rule: over PCIe, the one-stage kernel's n reads per element saturate the
//! bus). The CUDA backend probes, on every rank, how its GPU reaches every peer's
//! (`CudaBackend::new`: NVML loaded at run time when available, else the driver's
//! `cuDeviceCanAccessPeer` for GPUs visible in the process), all-gathers the rows, merges
//! the two views of each pair ([`merge`]) and decides with [`decide`], a pure function of
//! the merged matrix and [`TopologyCheck`]: every rank computes the same verdict from the
//! same gathered rows. The decision and its reason are returned
//! (`CudaBackend::topology`) and traced; a refusal is a
//! [`FallbackReason`] (NCCL serves the group).
//!
//! This module is always built (no CUDA needed), so the decision table is tested host-side
//! with probe results fed in.

use std::fmt;

use crate::dispatch::FallbackReason;

/// How the GPUs of two ranks are connected, as probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// Both ranks run on the same GPU (ranks as threads or processes of one device).
    SameDevice,
    /// NVLink (NVML: P2P status over NVLink is OK).
    NvLink,
    /// Peer-to-peer access without NVLink (NVML: P2P reads OK, no NVLink): PCIe.
    Pcie,
    /// The driver allows peer access (`cuDeviceCanAccessPeer`), link kind unknown (no NVML).
    P2p,
    /// No peer-to-peer access between the GPUs.
    NoP2p,
    /// Nothing could be probed: the peer's GPU is not visible in this process
    /// (`CUDA_VISIBLE_DEVICES` per rank) and NVML is not available.
    Unknown,
}

impl Link {
    /// A stable code, for the all-gather of probe rows.
    pub fn code(self) -> u8 {
        match self {
            Link::SameDevice => 1,
            Link::NvLink => 2,
            Link::Pcie => 3,
            Link::P2p => 4,
            Link::NoP2p => 5,
            Link::Unknown => 0,
        }
    }

    /// The link of a code; anything unknown (a peer of another version) is
    /// [`Unknown`](Link::Unknown).
    pub fn from_code(code: u8) -> Self {
        match code {
            1 => Link::SameDevice,
            2 => Link::NvLink,
            3 => Link::Pcie,
            4 => Link::P2p,
            5 => Link::NoP2p,
            _ => Link::Unknown,
        }
    }

    fn strength(self) -> u8 {
        // What a view says, most decisive first: a refusal of P2P wins (the kernels would
        // fault), then the link kinds from the most specific probe down to nothing.
        match self {
            Link::NoP2p => 5,
            Link::SameDevice => 4,
            Link::NvLink => 3,
            Link::Pcie => 2,
            Link::P2p => 1,
            Link::Unknown => 0,
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Link::SameDevice => "the same GPU",
            Link::NvLink => "NVLink",
            Link::Pcie => "PCIe peer-to-peer",
            Link::P2p => "peer-to-peer (link kind unknown: no NVML)",
            Link::NoP2p => "no peer-to-peer access",
            Link::Unknown => "not probed (GPU not visible, no NVML)",
        })
    }
}

/// How [`decide`] uses the probe ([`Config::topology`](crate::Config::topology); every rank
/// must pass the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TopologyCheck {
    /// vLLM's rule (the default): 2 ranks need peer-to-peer access (or an unprobed link,
    /// which CUDA IPC and the creation-time P2P data test then decide); more than 2 ranks
    /// need every pair NVLink-connected (or on the same GPU).
    #[default]
    Auto,
    /// Run the kernels whatever the probe says (a machine whose NVLink NVML cannot see, or a
    /// benchmark of the kernels over PCIe). A pair without P2P still fails at setup, when
    /// the mappings are opened or the P2P data test reads them.
    Assume,
    /// Never run the kernels on this group: every request falls back (NCCL).
    Off,
}

impl TopologyCheck {
    /// A short name (for the settings agreement).
    pub fn name(self) -> &'static str {
        match self {
            TopologyCheck::Auto => "auto",
            TopologyCheck::Assume => "assume",
            TopologyCheck::Off => "off",
        }
    }
}

/// The merged link between every two ranks, the verdict and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyDecision {
    /// `links[r][p]`: how rank `r`'s GPU reaches rank `p`'s (both views merged; symmetric;
    /// the diagonal is [`Link::SameDevice`]).
    pub links: Vec<Vec<Link>>,
    /// `Ok` when the kernels may run; the reason every request falls back otherwise.
    pub verdict: Result<(), FallbackReason>,
    /// Why, in words (traced when the backend is created).
    pub reason: String,
}

/// One pair's link from the two ranks' views: a refusal of P2P wins, then the most specific
/// answer (same GPU, NVLink, PCIe, P2P of unknown kind), then nothing.
pub fn merge(a: Link, b: Link) -> Link {
    if a.strength() >= b.strength() {
        a
    } else {
        b
    }
}

/// The merged matrix of every rank's probe row (`rows[r][p]`: how rank `r` sees rank `p`).
/// A row of the wrong length (a peer of another build) counts as [`Link::Unknown`] for every
/// entry it lacks; nothing indexes past what was received.
pub fn merge_rows(rows: &[Vec<Link>]) -> Vec<Vec<Link>> {
    let world = rows.len();
    let view = |r: usize, p: usize| rows[r].get(p).copied().unwrap_or(Link::Unknown);
    (0..world)
        .map(|r| {
            (0..world)
                .map(|p| {
                    if r == p {
                        Link::SameDevice
                    } else {
                        merge(view(r, p), view(p, r))
                    }
                })
                .collect()
        })
        .collect()
}

/// Whether the kernels may run on a group with these (merged) links, and why. One row per
/// rank; an entry a row lacks counts as [`Link::Unknown`] (nothing indexes past a row), and
/// the decision's `links` are the square matrix so completed.
pub fn decide(links: &[Vec<Link>], check: TopologyCheck) -> TopologyDecision {
    let world = links.len();
    let square: Vec<Vec<Link>> = links
        .iter()
        .map(|row| {
            (0..world)
                .map(|p| row.get(p).copied().unwrap_or(Link::Unknown))
                .collect()
        })
        .collect();
    let links = &square;
    let pairs = || (0..world).flat_map(move |r| (r + 1..world).map(move |p| (r, p, links[r][p])));
    let done = |verdict, reason: String| TopologyDecision {
        links: links.clone(),
        verdict,
        reason,
    };
    match check {
        TopologyCheck::Off => {
            return done(
                Err(FallbackReason::TopologyOff),
                "Config::topology is Off: NCCL serves every request".into(),
            )
        }
        TopologyCheck::Assume => {
            return done(
                Ok(()),
                "Config::topology is Assume: the probe is not enforced".into(),
            )
        }
        TopologyCheck::Auto => {}
    }
    if let Some((rank, peer, _)) = pairs().find(|&(_, _, l)| l == Link::NoP2p) {
        return done(
            Err(FallbackReason::NoPeerAccess { rank, peer }),
            format!("rank {rank}'s GPU has no peer-to-peer access to rank {peer}'s"),
        );
    }
    if world <= 2 {
        let link = pairs().next().map_or(Link::SameDevice, |(_, _, l)| l);
        let reason = match link {
            Link::Unknown => "2 ranks: the link could not be probed (GPU not visible, no NVML); \
                CUDA IPC and the P2P data test decide at creation"
                .to_string(),
            l => format!("2 ranks over {l}"),
        };
        return done(Ok(()), reason);
    }
    match pairs().find(|&(_, _, l)| !matches!(l, Link::NvLink | Link::SameDevice)) {
        Some((rank, peer, link)) => done(
            Err(FallbackReason::NotNvLinked { rank, peer, link }),
            format!(
                "{world} ranks need every pair NVLink-connected; ranks {rank} and {peer} are \
                 connected by {link}"
            ),
        ),
        None => done(
            Ok(()),
            format!("{world} ranks, every pair NVLink-connected (or on one GPU)"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Link::*;

    fn matrix(world: usize, pair: Link) -> Vec<Vec<Link>> {
        (0..world)
            .map(|r| {
                (0..world)
                    .map(|p| if r == p { SameDevice } else { pair })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn two_ranks_run_over_any_peer_to_peer_link() {
        for link in [NvLink, Pcie, P2p, SameDevice, Unknown] {
            let d = decide(&matrix(2, link), TopologyCheck::Auto);
            assert_eq!(d.verdict, Ok(()), "{link}: {}", d.reason);
        }
        let d = decide(&matrix(2, Unknown), TopologyCheck::Auto);
        assert!(d.reason.contains("P2P data test"), "{}", d.reason);
    }

    #[test]
    fn more_than_two_ranks_need_every_pair_on_nvlink() {
        for world in [4, 6, 8] {
            assert_eq!(
                decide(&matrix(world, NvLink), TopologyCheck::Auto).verdict,
                Ok(())
            );
            assert_eq!(
                decide(&matrix(world, SameDevice), TopologyCheck::Auto).verdict,
                Ok(())
            );
            for link in [Pcie, P2p, Unknown] {
                assert_eq!(
                    decide(&matrix(world, link), TopologyCheck::Auto).verdict,
                    Err(FallbackReason::NotNvLinked {
                        rank: 0,
                        peer: 1,
                        link
                    }),
                    "world {world} over {link}"
                );
            }
        }
    }

    #[test]
    fn one_pcie_pair_among_nvlink_pairs_is_named() {
        let mut links = matrix(4, NvLink);
        links[1][3] = Pcie;
        links[3][1] = Pcie;
        let d = decide(&links, TopologyCheck::Auto);
        assert_eq!(
            d.verdict,
            Err(FallbackReason::NotNvLinked {
                rank: 1,
                peer: 3,
                link: Pcie
            })
        );
        assert!(d.reason.contains("ranks 1 and 3"), "{}", d.reason);
    }

    #[test]
    fn a_pair_without_peer_access_refuses_at_any_world_size() {
        for world in [2, 4] {
            let mut links = matrix(world, NvLink);
            links[0][1] = NoP2p;
            links[1][0] = NoP2p;
            assert_eq!(
                decide(&links, TopologyCheck::Auto).verdict,
                Err(FallbackReason::NoPeerAccess { rank: 0, peer: 1 })
            );
        }
    }

    #[test]
    fn the_override_runs_or_refuses_whatever_the_probe_says() {
        let pcie = matrix(8, Pcie);
        assert_eq!(decide(&pcie, TopologyCheck::Assume).verdict, Ok(()));
        assert_eq!(
            decide(&matrix(8, NvLink), TopologyCheck::Off).verdict,
            Err(FallbackReason::TopologyOff)
        );
    }

    #[test]
    fn one_gpu_per_process_is_decided_from_nvml_not_from_visibility() {
        // Each process sees only its own GPU: its driver view of every peer is Unknown. With
        // NVML, one side's answer is enough (NVML sees every GPU of the node).
        let rows = vec![vec![SameDevice, Unknown], vec![NvLink, SameDevice]];
        let links = merge_rows(&rows);
        assert_eq!(links[0][1], NvLink);
        assert_eq!(links[1][0], NvLink);
        // Four processes, NVML everywhere: all NVLink.
        let rows: Vec<Vec<Link>> = (0..4)
            .map(|r| {
                (0..4)
                    .map(|p| if r == p { SameDevice } else { NvLink })
                    .collect()
            })
            .collect();
        assert_eq!(
            decide(&merge_rows(&rows), TopologyCheck::Auto).verdict,
            Ok(())
        );
        // No NVML anywhere: two processes still run (CUDA IPC decides), four do not.
        let unknown2 = vec![vec![SameDevice, Unknown], vec![Unknown, SameDevice]];
        assert_eq!(
            decide(&merge_rows(&unknown2), TopologyCheck::Auto).verdict,
            Ok(())
        );
    }

    #[test]
    fn merging_two_views_keeps_a_refusal_and_the_most_specific_answer() {
        assert_eq!(merge(NvLink, NoP2p), NoP2p);
        assert_eq!(merge(Unknown, Pcie), Pcie);
        assert_eq!(merge(P2p, NvLink), NvLink);
        assert_eq!(merge(Unknown, Unknown), Unknown);
    }

    #[test]
    fn a_short_row_from_a_peer_counts_as_unprobed() {
        let rows = vec![vec![SameDevice, Unknown, Unknown], vec![], vec![]];
        let links = merge_rows(&rows);
        assert_eq!(links.len(), 3);
        assert!(links.iter().all(|row| row.len() == 3));
        assert_eq!(links[1][2], Unknown);
    }

    #[test]
    fn a_ragged_matrix_is_decided_with_missing_links_unprobed() {
        // A caller's matrix whose rows are short (or empty): no index past a row.
        let d = decide(&[vec![SameDevice], vec![]], TopologyCheck::Auto);
        assert_eq!(d.verdict, Ok(()), "{}", d.reason);
        assert_eq!(
            d.links,
            vec![vec![SameDevice, Unknown], vec![Unknown, Unknown]]
        );
        let d = decide(
            &[vec![SameDevice, NvLink, NvLink], vec![NvLink], vec![]],
            TopologyCheck::Auto,
        );
        assert_eq!(
            d.verdict,
            Err(FallbackReason::NotNvLinked {
                rank: 1,
                peer: 2,
                link: Unknown
            })
        );
        assert!(d.links.iter().all(|row| row.len() == 3));
    }

    #[test]
    fn link_codes_round_trip_and_unknown_codes_are_unprobed() {
        for l in [SameDevice, NvLink, Pcie, P2p, NoP2p, Unknown] {
            assert_eq!(Link::from_code(l.code()), l);
        }
        assert_eq!(Link::from_code(200), Unknown);
    }
}
