//! Which algorithm serves an all-reduce: a [`DispatchTable`] per backend (world size,
//! element type and where the inputs are read, size ranges -> algorithm), built in or read
//! from a file that `tpcomm-bench tune` writes on the machine it runs on.
//!
//! One-stage: every rank reads every peer's whole input and reduces it (n reads of the
//! whole size per rank, two barriers). Two-stage: each rank reduces one n-th into its temp
//! buffer, a release/acquire barrier, then every rank gathers the n reduced parts (about
//! two whole-size passes per rank, three barriers). One-stage wins while latency
//! dominates; two-stage once bandwidth does, earlier for larger worlds; where exactly
//! depends on the machine. Both sum every element in rank order with f32 accumulation, so
//! they give the same bits: a table that chooses only between them never changes a result
//! ([`Reproducibility::BitStable`]). A table may also send sizes to the transport's own
//! all-reduce (MPI, NCCL), whose order is its own, only with [`Reproducibility::AnyOrder`].
//!
//! `table.rs` holds the table and its built-in defaults, `parse.rs` the file format
//! (`docs/all-reduce.md`, "Dispatch").

mod parse;
mod table;

use std::fmt;

pub use parse::{TableError, TableProblem, DISPATCH_TABLE_ENV, FORMAT_LINE};
pub use table::{Band, Choice, DispatchTable, Input, Key, Reproducibility};

/// The algorithm a launch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank reads all inputs.
    OneStage,
    /// Reduce-scatter, then all-gather.
    TwoStage,
}

impl Algorithm {
    /// Both algorithms, in table order.
    pub const ALL: [Algorithm; 2] = [Algorithm::OneStage, Algorithm::TwoStage];

    /// `"1stage"` or `"2stage"`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::OneStage => "1stage",
            Algorithm::TwoStage => "2stage",
        }
    }
}

impl FallbackReason {
    /// Whether the custom path can still serve the input in several launches of sizes it
    /// serves (what [`Reproducibility::BitStable`] does instead of the transport's
    /// all-reduce): a size above the staging buffers, one that is not a multiple of 16
    /// bytes (its last elements padded), or nothing at all (no launch).
    pub fn chunkable(&self) -> bool {
        matches!(
            self,
            FallbackReason::TooLarge { .. }
                | FallbackReason::SizeNotMultipleOf16 { .. }
                | FallbackReason::Empty
        )
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
    /// The dispatch table sends this size to the transport's own all-reduce (allowed with
    /// [`Reproducibility::AnyOrder`] only).
    TableChoosesTransport {
        /// The size.
        bytes: usize,
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
            FallbackReason::TableChoosesTransport { bytes } => write!(
                f,
                "the dispatch table sends {bytes} bytes to the transport's all-reduce"
            ),
        }
    }
}

/// Largest world size the tables hold.
pub const MAX_RANKS: usize = 8;

/// The host backend's built-in table ([`DispatchTable::host`]), for registered inputs and
/// captured plans: sizes up to this many bytes use one-stage, for each world size (index =
/// world size), in launches that read their inputs where they are.
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

/// The host backend's built-in table ([`DispatchTable::host`]) for its eager launches, which
/// copy the caller's input into the staging buffer (RankData slot 0) first: one-stage copies
/// all of it (peers
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

/// The CUDA backend's built-in table ([`DispatchTable::cuda`]): sizes up to this many bytes
/// use one-stage on CUDA GPUs, for each world size (index =
/// world size): vLLM's cut-offs, measured on NVLink-connected GPUs (its
/// `custom_all_reduce.cuh`): 2 ranks always one-stage; 4 ranks one-stage below 512 KiB;
/// 6 and 8 ranks below 256 KiB. World sizes without a kernel (3, 5, 7) take their next
/// larger neighbour's value (they fall back anyway). tpcomm has not measured its own on
/// several GPUs yet (`tpcomm-bench gpu` sweeps both algorithms; a table file replaces them on
/// a machine that measured its own).
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

/// Why `bytes` on `world` ranks, of which the staging buffers hold `max_bytes`, cannot take
/// one custom launch whatever the table says; `Ok` when it can.
pub fn check_size(bytes: usize, world: usize, max_bytes: usize) -> Result<(), FallbackReason> {
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    /// The built-in host table's choice, `staged` or not.
    fn host(bytes: usize, world: usize, staged: bool) -> Choice {
        let input = if staged {
            Input::Staged
        } else {
            Input::Registered
        };
        DispatchTable::host()
            .choice(world, DType::F32, input, bytes)
            .expect("the built-in table covers every size")
    }

    const ONE: Choice = Choice::Custom(Algorithm::OneStage);
    const TWO: Choice = Choice::Custom(Algorithm::TwoStage);

    #[test]
    fn small_sizes_use_one_stage_and_large_ones_two_stage() {
        for world in 2..=MAX_RANKS {
            let t = ONE_STAGE_MAX_BYTES[world];
            assert_eq!(host(16, world, false), ONE);
            assert_eq!(host(t, world, false), ONE);
            assert_eq!(host(t + 16, world, false), TWO);
        }
    }

    #[test]
    fn eager_launches_from_the_staging_slot_switch_to_two_stage_no_later() {
        for world in 1..=MAX_RANKS {
            assert!(STAGED_ONE_STAGE_MAX_BYTES[world] <= ONE_STAGE_MAX_BYTES[world]);
        }
        assert_eq!(host(8 << 10, 2, true), TWO);
        assert_eq!(host(8 << 10, 2, false), ONE);
        assert_eq!(host(4 << 10, 2, true), ONE);
    }

    #[test]
    fn cuda_cut_offs_are_vllms_nvlink_measurements() {
        let table = DispatchTable::cuda();
        let pick = |bytes, world| {
            let staged = table.choice(world, DType::Bf16, Input::Staged, bytes);
            assert_eq!(
                staged,
                table.choice(world, DType::Bf16, Input::Registered, bytes),
                "one table for both inputs (the CUDA shape leaves the slot out)"
            );
            staged.expect("covered")
        };
        // (world, largest one-stage size, smallest two-stage size)
        for (world, one, two) in [
            (4, (512 << 10) - 16, 512 << 10),
            (6, (256 << 10) - 16, 256 << 10),
            (8, (256 << 10) - 16, 256 << 10),
        ] {
            assert_eq!(pick(16, world), ONE, "world {world}");
            assert_eq!(pick(one, world), ONE, "world {world}");
            assert_eq!(pick(two, world), TWO, "world {world}");
        }
        // Two ranks: one-stage at every size.
        assert_eq!(pick(usize::MAX, 2), ONE);
        // Decode-size all-reduces (32-512 KiB) that the host table sends to two-stage.
        assert_eq!(host(128 << 10, 4, false), TWO);
        assert_eq!(pick(128 << 10, 4), ONE);
        assert_eq!(pick(128 << 10, 8), ONE);
    }

    #[test]
    fn a_single_rank_never_needs_two_stages() {
        assert_eq!(host(8 << 20, 1, false), ONE);
        assert_eq!(host(8 << 20, 1, true), ONE);
    }

    #[test]
    fn unsupported_inputs_name_their_reason() {
        assert_eq!(
            check_size(24, 2, 1 << 20),
            Err(FallbackReason::SizeNotMultipleOf16 { bytes: 24 })
        );
        assert_eq!(check_size(0, 2, 1 << 20), Err(FallbackReason::Empty));
        assert_eq!(
            check_size(32, 9, 1 << 20),
            Err(FallbackReason::UnsupportedWorldSize { world: 9 })
        );
        assert_eq!(
            check_size(64, 2, 32),
            Err(FallbackReason::TooLarge { bytes: 64, max: 32 })
        );
        assert_eq!(check_size(32, 2, 32), Ok(()));
    }

    #[test]
    fn only_size_reasons_can_be_served_in_several_launches() {
        assert!(FallbackReason::TooLarge { bytes: 64, max: 32 }.chunkable());
        assert!(FallbackReason::SizeNotMultipleOf16 { bytes: 12 }.chunkable());
        assert!(FallbackReason::Empty.chunkable());
        assert!(!FallbackReason::UnsupportedWorldSize { world: 9 }.chunkable());
        assert!(!FallbackReason::TopologyOff.chunkable());
        assert!(!FallbackReason::TableChoosesTransport { bytes: 64 }.chunkable());
    }
}
