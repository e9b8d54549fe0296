//! Which algorithm serves an all-reduce, as a pure function of size and world size.
//!
//! One-stage: every rank reads every peer's whole input and reduces it (n reads of the
//! whole size per rank, two barriers). Two-stage: each rank reduces one n-th into its temp
//! buffer, a release/acquire barrier, then every rank gathers the n reduced parts (about
//! two whole-size passes per rank, three barriers). One-stage wins while latency
//! dominates; two-stage once bandwidth does, earlier for larger worlds. The thresholds
//! below were measured on the host backend with `tpcomm-bench allreduce` (docs/all-reduce.md).

use std::fmt;

/// The algorithm a launch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank reads all inputs.
    OneStage,
    /// Reduce-scatter, then all-gather.
    TwoStage,
}

impl Algorithm {
    /// `"1stage"` or `"2stage"`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::OneStage => "1stage",
            Algorithm::TwoStage => "2stage",
        }
    }
}

/// Why an all-reduce goes to the fallback (MPI or NCCL) instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackReason {
    /// The byte size is not a multiple of 16 (kernels move 16-byte packs).
    SizeNotMultipleOf16 {
        /// The size.
        bytes: usize,
    },
    /// Larger than the staging buffers.
    TooLarge {
        /// The size.
        bytes: usize,
        /// The largest size served.
        max: usize,
    },
    /// More ranks than the tables hold.
    UnsupportedWorldSize {
        /// The world size.
        world: usize,
    },
    /// Nothing to reduce.
    Empty,
    /// Two ranks' devices cannot access each other's memory (no P2P between them): the
    /// peer-memory kernels cannot run on this group.
    NoPeerAccess {
        /// The rank whose device cannot reach the peer's.
        rank: usize,
        /// The peer.
        peer: usize,
    },
    /// More than 2 ranks whose GPUs are not all NVLink-connected: over PCIe the kernels are
    /// slower than NCCL (`crate::topology`).
    NotNvLinked {
        /// One rank of the first pair that is not NVLink-connected.
        rank: usize,
        /// The other.
        peer: usize,
        /// How they are connected.
        link: crate::topology::Link,
    },
    /// The topology check is off (`Config::topology`): the kernels never run.
    TopologyOff,
    /// The backend has no launch for this request (the CUDA kernels serve world sizes 2,
    /// 4, 6 and 8).
    NoKernel {
        /// What the backend said.
        reason: String,
    },
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FallbackReason::SizeNotMultipleOf16 { bytes } => {
                write!(f, "{bytes} bytes is not a multiple of 16")
            }
            FallbackReason::TooLarge { bytes, max } => {
                write!(f, "{bytes} bytes is above the maximum of {max}")
            }
            FallbackReason::UnsupportedWorldSize { world } => {
                write!(f, "world size {world} is not supported (1..=8)")
            }
            FallbackReason::Empty => f.write_str("empty input"),
            FallbackReason::NoPeerAccess { rank, peer } => write!(
                f,
                "rank {rank}'s device cannot access rank {peer}'s device memory (no P2P)"
            ),
            FallbackReason::NoKernel { reason } => write!(f, "no custom kernel: {reason}"),
            FallbackReason::NotNvLinked { rank, peer, link } => write!(
                f,
                "ranks {rank} and {peer} are connected by {link}, not NVLink (more than 2 ranks \
                 need every pair on NVLink)"
            ),
            FallbackReason::TopologyOff => {
                f.write_str("the custom kernels are turned off (Config::topology)")
            }
        }
    }
}

/// Largest world size the tables hold.
pub const MAX_RANKS: usize = 8;

/// Sizes up to this many bytes use one-stage, for each world size (index = world size), in
/// launches that read their inputs where they are (registered inputs, captured plans).
///
/// Measured with `tpcomm-bench allreduce` on the host backend (2-core machine, f32, medians
/// of 3 to 8 runs; `docs/all-reduce.md`, "Dispatch"): two-stage is 10-20% faster than one-stage from
/// 128 KiB on 2 ranks and from 64-128 KiB on 4 ranks, within a few percent of it below,
/// and a replayed one-stage plan is 1.5-2x faster than two-stage from 8 to 64 KiB on 2 ranks.
/// Larger worlds read more peers per element in one-stage, so they switch no later.
pub const ONE_STAGE_MAX_BYTES: [usize; MAX_RANKS + 1] = [
    0,
    usize::MAX,
    64 << 10,
    64 << 10,
    64 << 10,
    32 << 10,
    32 << 10,
    32 << 10,
    32 << 10,
];

/// [`ONE_STAGE_MAX_BYTES`] for the host backend's eager launches, which copy the caller's
/// input into the staging buffer (RankData slot 0) first: one-stage copies all of it (peers
/// read all of it), two-stage only the parts peers read, so two-stage wins earlier. Measured
/// like the table above: on 2 ranks two-stage is 5-25% faster from 8 KiB (two MPI runs and
/// two local-thread runs) and 1-35% slower below. Other world sizes: as
/// [`ONE_STAGE_MAX_BYTES`] (4 MPI ranks, oversubscribed on 2 cores, still switch at 64 KiB;
/// 5-8 ranks not measured).
///
/// Ranks pick their table by slot, and the host launch's shape includes the slot, so ranks
/// that would pick different algorithms (one launching from the staging slot, one from a
/// registered slot) are refused with a `LaunchMismatch` before their barriers differ.
pub const STAGED_ONE_STAGE_MAX_BYTES: [usize; MAX_RANKS + 1] = {
    let mut table = ONE_STAGE_MAX_BYTES;
    table[2] = 4 << 10;
    table
};

/// Sizes up to this many bytes use one-stage on CUDA GPUs, for each world size (index =
/// world size): vLLM's cut-offs, measured on NVLink-connected GPUs (its
/// `custom_all_reduce.cuh`): 2 ranks always one-stage; 4 ranks one-stage below 512 KiB;
/// 6 and 8 ranks below 256 KiB. World sizes without a kernel (3, 5, 7) take their next
/// larger neighbour's value (they fall back anyway). tpcomm has not measured its own on
/// several GPUs yet (`tpcomm-bench gpu` sweeps both algorithms so that a multi-GPU run can
/// replace them).
pub const CUDA_ONE_STAGE_MAX_BYTES: [usize; MAX_RANKS + 1] = [
    0,
    usize::MAX,
    usize::MAX,
    (512 << 10) - 1,
    (512 << 10) - 1,
    (256 << 10) - 1,
    (256 << 10) - 1,
    (256 << 10) - 1,
    (256 << 10) - 1,
];

/// The algorithm for `bytes` on `world` ranks with the host backend's thresholds
/// ([`ONE_STAGE_MAX_BYTES`]), or why the fallback must serve it.
pub fn choose(bytes: usize, world: usize, max_bytes: usize) -> Result<Algorithm, FallbackReason> {
    choose_with(&ONE_STAGE_MAX_BYTES, bytes, world, max_bytes)
}

/// The algorithm for `bytes` on `world` ranks when sizes up to `one_stage_max[world]` use
/// one-stage (a backend's table: [`ONE_STAGE_MAX_BYTES`], [`CUDA_ONE_STAGE_MAX_BYTES`]),
/// or why the fallback must serve it.
pub fn choose_with(
    one_stage_max: &[usize; MAX_RANKS + 1],
    bytes: usize,
    world: usize,
    max_bytes: usize,
) -> Result<Algorithm, FallbackReason> {
    if world == 0 || world > MAX_RANKS {
        return Err(FallbackReason::UnsupportedWorldSize { world });
    }
    if bytes == 0 {
        return Err(FallbackReason::Empty);
    }
    if !bytes.is_multiple_of(16) {
        return Err(FallbackReason::SizeNotMultipleOf16 { bytes });
    }
    if bytes > max_bytes {
        return Err(FallbackReason::TooLarge {
            bytes,
            max: max_bytes,
        });
    }
    Ok(if bytes <= one_stage_max[world] {
        Algorithm::OneStage
    } else {
        Algorithm::TwoStage
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_sizes_use_one_stage_and_large_ones_two_stage() {
        for world in 2..=MAX_RANKS {
            let t = ONE_STAGE_MAX_BYTES[world];
            assert_eq!(choose(16, world, 8 << 20), Ok(Algorithm::OneStage));
            assert_eq!(choose(t, world, 8 << 20), Ok(Algorithm::OneStage));
            assert_eq!(choose(t + 16, world, 8 << 20), Ok(Algorithm::TwoStage));
        }
    }

    #[test]
    fn eager_launches_from_the_staging_slot_switch_to_two_stage_no_later() {
        for world in 1..=MAX_RANKS {
            assert!(STAGED_ONE_STAGE_MAX_BYTES[world] <= ONE_STAGE_MAX_BYTES[world]);
        }
        let (staged, zero_copy) = (&STAGED_ONE_STAGE_MAX_BYTES, &ONE_STAGE_MAX_BYTES);
        assert_eq!(
            choose_with(staged, 8 << 10, 2, 8 << 20),
            Ok(Algorithm::TwoStage)
        );
        assert_eq!(
            choose_with(zero_copy, 8 << 10, 2, 8 << 20),
            Ok(Algorithm::OneStage)
        );
        assert_eq!(
            choose_with(staged, 4 << 10, 2, 8 << 20),
            Ok(Algorithm::OneStage)
        );
    }

    #[test]
    fn cuda_cut_offs_are_vllms_nvlink_measurements() {
        let table = &CUDA_ONE_STAGE_MAX_BYTES;
        let max = 64 << 20;
        let pick = |bytes, world| choose_with(table, bytes, world, max);
        // (world, largest one-stage size, smallest two-stage size)
        for (world, one, two) in [
            (4, (512 << 10) - 16, 512 << 10),
            (6, (256 << 10) - 16, 256 << 10),
            (8, (256 << 10) - 16, 256 << 10),
        ] {
            assert_eq!(pick(16, world), Ok(Algorithm::OneStage), "world {world}");
            assert_eq!(pick(one, world), Ok(Algorithm::OneStage), "world {world}");
            assert_eq!(pick(two, world), Ok(Algorithm::TwoStage), "world {world}");
        }
        // Two ranks: one-stage at every size served.
        assert_eq!(pick(max, 2), Ok(Algorithm::OneStage));
        // Decode-size all-reduces (32-512 KiB) that the host table sends to two-stage.
        assert_eq!(choose(128 << 10, 4, max), Ok(Algorithm::TwoStage));
        assert_eq!(pick(128 << 10, 4), Ok(Algorithm::OneStage));
        assert_eq!(pick(128 << 10, 8), Ok(Algorithm::OneStage));
        // The fallback reasons are the same as with the host table.
        assert_eq!(
            pick(24, 4),
            Err(FallbackReason::SizeNotMultipleOf16 { bytes: 24 })
        );
    }

    #[test]
    fn a_single_rank_never_needs_two_stages() {
        assert_eq!(choose(8 << 20, 1, 8 << 20), Ok(Algorithm::OneStage));
    }

    #[test]
    fn unsupported_inputs_name_their_reason() {
        assert_eq!(
            choose(24, 2, 1 << 20),
            Err(FallbackReason::SizeNotMultipleOf16 { bytes: 24 })
        );
        assert_eq!(choose(0, 2, 1 << 20), Err(FallbackReason::Empty));
        assert_eq!(
            choose(32, 9, 1 << 20),
            Err(FallbackReason::UnsupportedWorldSize { world: 9 })
        );
        assert_eq!(
            choose(64, 2, 32),
            Err(FallbackReason::TooLarge { bytes: 64, max: 32 })
        );
    }
}
