//! Which kernel to launch, with how many blocks and threads: pure functions, no GPU.

use crate::layout::{MAX_BLOCKS, MAX_RANKS, PACK_BYTES, THREADS};

/// Element types a caller may ask to reduce. Only [`Dtype::F32`], [`Dtype::F16`] and
/// [`Dtype::Bf16`] have kernels (all accumulate in fp32); the others exist so that a
/// request for them gets a typed [`UnsupportedReason::Dtype`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
    /// 64-bit IEEE float (no kernel).
    F64,
    /// 32-bit signed integer (no kernel).
    I32,
    /// 64-bit signed integer (no kernel).
    I64,
    /// 8-bit unsigned integer (no kernel).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// The name used in kernel names (`f32`, `f16`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F64 => "f64",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
            Dtype::U8 => "u8",
        }
    }
}

/// The two all-reduce kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank reads every input and writes the full sum: 2 barriers, reads
    /// `world_size x bytes` per rank. For small sizes.
    OneStage,
    /// Reduce-scatter into per-rank temp buffers, then all-gather: reads
    /// `2 x bytes` per rank. For larger sizes.
    TwoStage,
}

impl Algorithm {
    /// The name used in kernel names (`1stage`, `2stage`).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::OneStage => "1stage",
            Algorithm::TwoStage => "2stage",
        }
    }
}

/// World sizes with a kernel.
pub const WORLD_SIZES: [usize; 4] = [2, 4, 6, 8];
/// Element types with a kernel.
pub const DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];
/// Both algorithms.
pub const ALGORITHMS: [Algorithm; 2] = [Algorithm::OneStage, Algorithm::TwoStage];

/// Every entry point in `kernels/allreduce.cu`, `tpcomm_ar_<algorithm>_<dtype>_w<n>`,
/// in [`ALGORITHMS`] x [`DTYPES`] x [`WORLD_SIZES`] order.
pub const KERNELS: [&str; 24] = [
    "tpcomm_ar_1stage_f32_w2",
    "tpcomm_ar_1stage_f32_w4",
    "tpcomm_ar_1stage_f32_w6",
    "tpcomm_ar_1stage_f32_w8",
    "tpcomm_ar_1stage_f16_w2",
    "tpcomm_ar_1stage_f16_w4",
    "tpcomm_ar_1stage_f16_w6",
    "tpcomm_ar_1stage_f16_w8",
    "tpcomm_ar_1stage_bf16_w2",
    "tpcomm_ar_1stage_bf16_w4",
    "tpcomm_ar_1stage_bf16_w6",
    "tpcomm_ar_1stage_bf16_w8",
    "tpcomm_ar_2stage_f32_w2",
    "tpcomm_ar_2stage_f32_w4",
    "tpcomm_ar_2stage_f32_w6",
    "tpcomm_ar_2stage_f32_w8",
    "tpcomm_ar_2stage_f16_w2",
    "tpcomm_ar_2stage_f16_w4",
    "tpcomm_ar_2stage_f16_w6",
    "tpcomm_ar_2stage_f16_w8",
    "tpcomm_ar_2stage_bf16_w2",
    "tpcomm_ar_2stage_bf16_w4",
    "tpcomm_ar_2stage_bf16_w6",
    "tpcomm_ar_2stage_bf16_w8",
];

/// The entry point for an algorithm, element type and world size, `None` when there is
/// no such kernel.
pub fn kernel_name(algorithm: Algorithm, dtype: Dtype, world_size: usize) -> Option<&'static str> {
    let a = ALGORITHMS.iter().position(|&x| x == algorithm)?;
    let d = DTYPES.iter().position(|&x| x == dtype)?;
    let w = WORLD_SIZES.iter().position(|&x| x == world_size)?;
    KERNELS
        .get((a * DTYPES.len() + d) * WORLD_SIZES.len() + w)
        .copied()
}

/// Why a request has no kernel; the caller then uses its fallback (NCCL, MPI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnsupportedReason {
    /// The kernels reduce f32, f16 and bf16 only.
    #[error("no all-reduce kernel for element type {}", .0.name())]
    Dtype(Dtype),
    /// The kernels serve world sizes 2, 4, 6 and 8.
    #[error("no all-reduce kernel for world size {0} (supported: 2, 4, 6, 8)")]
    WorldSize(usize),
    /// Zero bytes: nothing to launch.
    #[error("empty all-reduce: nothing to launch")]
    Empty,
    /// The kernels move 16-byte packs.
    #[error("{bytes} bytes is not a multiple of 16")]
    SizeNotMultipleOf16 {
        /// The requested size.
        bytes: u64,
    },
    /// Pack indices are 32-bit in the kernels.
    #[error("{bytes} bytes exceeds the kernels' maximum of {max} bytes")]
    TooLarge {
        /// The requested size.
        bytes: u64,
        /// The largest size a kernel takes.
        max: u64,
    },
    /// A launch uses between 1 and [`MAX_BLOCKS`] blocks.
    #[error("max_blocks {requested} is outside 1..={capacity}")]
    BlockCount {
        /// The requested bound.
        requested: u32,
        /// The Signal block's capacity.
        capacity: u32,
    },
    /// Inputs, outputs and temp buffers must be 16-byte aligned.
    #[error("address {address:#x} is not 16-byte aligned")]
    Misaligned {
        /// The offending device address.
        address: u64,
    },
}

/// Largest size in bytes any kernel takes (pack indices are `int`).
pub const MAX_BYTES: u64 = i32::MAX as u64 * PACK_BYTES;

/// How to launch one all-reduce. Every rank computes the same configuration from the same
/// arguments; ranks must never launch different grids for one all-reduce, since block `b`
/// only synchronizes with block `b` of its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Entry point in the fatbin.
    pub kernel: &'static str,
    /// Grid size (x), between 1 and `max_blocks`.
    pub blocks: u32,
    /// Block size (x): always [`THREADS`].
    pub threads: u32,
    /// Dynamic shared memory: always 0.
    pub shared_mem_bytes: u32,
    /// The `n_elems` kernel argument.
    pub elements: u64,
    /// Bytes each rank's temp buffer must hold at least (0 for one-stage).
    pub temp_bytes: u64,
}

/// Packs the rank with the largest share reduces in the two-stage kernel: an equal share
/// plus the remainder (the last rank's).
fn largest_part(packs: u64, world_size: u64) -> u64 {
    packs - (world_size - 1) * (packs / world_size)
}

/// The launch for reducing `bytes` of `dtype` across `world_size` ranks with
/// `algorithm`, using at most `max_blocks` blocks ([`crate::DEFAULT_BLOCKS`] unless tuned).
///
/// Blocks: one thread per 16-byte pack of the work one rank does in one pass (all packs
/// for one-stage, the largest part for two-stage), rounded up to whole blocks of
/// [`THREADS`], at least 1 and at most `max_blocks`; threads loop when there is more work.
///
/// # Errors
/// An [`UnsupportedReason`]: element type, world size, zero or non-multiple-of-16 sizes,
/// sizes above [`MAX_BYTES`], or `max_blocks` outside `1..=MAX_BLOCKS`.
pub fn launch_config(
    dtype: Dtype,
    world_size: usize,
    bytes: u64,
    algorithm: Algorithm,
    max_blocks: u32,
) -> Result<LaunchConfig, UnsupportedReason> {
    if !DTYPES.contains(&dtype) {
        return Err(UnsupportedReason::Dtype(dtype));
    }
    if !WORLD_SIZES.contains(&world_size) {
        return Err(UnsupportedReason::WorldSize(world_size));
    }
    if max_blocks == 0 || max_blocks as usize > MAX_BLOCKS {
        return Err(UnsupportedReason::BlockCount {
            requested: max_blocks,
            capacity: MAX_BLOCKS as u32,
        });
    }
    if bytes == 0 {
        return Err(UnsupportedReason::Empty);
    }
    if !bytes.is_multiple_of(PACK_BYTES) {
        return Err(UnsupportedReason::SizeNotMultipleOf16 { bytes });
    }
    if bytes > MAX_BYTES {
        return Err(UnsupportedReason::TooLarge {
            bytes,
            max: MAX_BYTES,
        });
    }
    debug_assert!(world_size <= MAX_RANKS);
    let packs = bytes / PACK_BYTES;
    let (work, temp_bytes) = match algorithm {
        Algorithm::OneStage => (packs, 0),
        Algorithm::TwoStage => {
            let part = largest_part(packs, world_size as u64);
            (part, part * PACK_BYTES)
        }
    };
    let blocks = work
        .div_ceil(u64::from(THREADS))
        .clamp(1, u64::from(max_blocks)) as u32;
    let kernel =
        kernel_name(algorithm, dtype, world_size).ok_or(UnsupportedReason::Dtype(dtype))?;
    Ok(LaunchConfig {
        kernel,
        blocks,
        threads: THREADS,
        shared_mem_bytes: 0,
        elements: bytes / dtype.size_bytes(),
        temp_bytes,
    })
}

/// Checks that a device address (input, output or temp buffer) is 16-byte aligned, as the
/// packed loads and stores need.
///
/// # Errors
/// [`UnsupportedReason::Misaligned`] naming the address.
pub fn check_alignment(address: u64) -> Result<(), UnsupportedReason> {
    if address.is_multiple_of(PACK_BYTES) {
        Ok(())
    } else {
        Err(UnsupportedReason::Misaligned { address })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DEFAULT_BLOCKS;
    use proptest::prelude::*;

    #[test]
    fn every_supported_combination_names_its_own_kernel() {
        let mut seen = std::collections::HashSet::new();
        for a in ALGORITHMS {
            for d in DTYPES {
                for w in WORLD_SIZES {
                    let name = kernel_name(a, d, w).unwrap();
                    assert_eq!(name, format!("tpcomm_ar_{}_{}_w{w}", a.name(), d.name()));
                    assert!(seen.insert(name));
                }
            }
        }
        assert_eq!(seen.len(), KERNELS.len());
    }

    #[test]
    fn small_one_stage_f16_on_4_ranks_uses_one_block() {
        let c = launch_config(Dtype::F16, 4, 1024, Algorithm::OneStage, DEFAULT_BLOCKS).unwrap();
        assert_eq!(
            c,
            LaunchConfig {
                kernel: "tpcomm_ar_1stage_f16_w4",
                blocks: 1,
                threads: 512,
                shared_mem_bytes: 0,
                elements: 512,
                temp_bytes: 0,
            }
        );
    }

    #[test]
    fn block_count_grows_with_size_up_to_the_bound() {
        let blocks = |bytes| {
            launch_config(Dtype::F32, 2, bytes, Algorithm::OneStage, DEFAULT_BLOCKS)
                .unwrap()
                .blocks
        };
        assert_eq!(blocks(16), 1);
        assert_eq!(blocks(512 * 16), 1);
        assert_eq!(blocks(512 * 16 + 16), 2);
        assert_eq!(blocks(10 * 512 * 16), 10);
        assert_eq!(blocks(8 << 20), 36);
        let c = launch_config(Dtype::F32, 2, 8 << 20, Algorithm::OneStage, 64).unwrap();
        assert_eq!(c.blocks, 64);
    }

    #[test]
    fn two_stage_sizes_blocks_and_temp_by_the_largest_part() {
        // 6 ranks, 100 packs: parts of 16, the last rank takes 16 + 4 = 20.
        let c = launch_config(Dtype::Bf16, 6, 100 * 16, Algorithm::TwoStage, 36).unwrap();
        assert_eq!(c.kernel, "tpcomm_ar_2stage_bf16_w6");
        assert_eq!(c.temp_bytes, 20 * 16);
        assert_eq!(c.elements, 800);
        assert_eq!(c.blocks, 1);
        // 8 ranks, 1 MiB f32: 8192 packs per rank -> 16 blocks of 512.
        let c = launch_config(Dtype::F32, 8, 1 << 20, Algorithm::TwoStage, 36).unwrap();
        assert_eq!((c.blocks, c.temp_bytes), (16, 128 << 10));
        // Fewer packs than ranks: the last rank does all of it.
        let c = launch_config(Dtype::F32, 8, 48, Algorithm::TwoStage, 36).unwrap();
        assert_eq!(c.temp_bytes, 48);
    }

    #[test]
    fn unsupported_requests_say_why() {
        use UnsupportedReason as U;
        let lc = |d, w, b, m| launch_config(d, w, b, Algorithm::OneStage, m);
        assert_eq!(lc(Dtype::F64, 2, 1024, 36), Err(U::Dtype(Dtype::F64)));
        assert_eq!(lc(Dtype::I32, 2, 1024, 36), Err(U::Dtype(Dtype::I32)));
        for w in [0, 1, 3, 5, 7, 9, 16] {
            assert_eq!(lc(Dtype::F32, w, 1024, 36), Err(U::WorldSize(w)));
        }
        assert_eq!(lc(Dtype::F32, 2, 0, 36), Err(U::Empty));
        assert_eq!(
            lc(Dtype::F16, 2, 1000, 36),
            Err(U::SizeNotMultipleOf16 { bytes: 1000 })
        );
        assert_eq!(
            lc(Dtype::F32, 2, MAX_BYTES + 16, 36),
            Err(U::TooLarge {
                bytes: MAX_BYTES + 16,
                max: MAX_BYTES
            })
        );
        assert_eq!(
            lc(Dtype::F32, 2, 1024, 0),
            Err(U::BlockCount {
                requested: 0,
                capacity: 64
            })
        );
        assert!(lc(Dtype::F32, 2, 1024, 65).is_err());
        assert!(lc(Dtype::F32, 2, MAX_BYTES, 64).is_ok());
    }

    #[test]
    fn misaligned_addresses_are_named() {
        assert_eq!(check_alignment(0x7f00_0000_0000), Ok(()));
        assert_eq!(
            check_alignment(0x7f00_0000_0008),
            Err(UnsupportedReason::Misaligned {
                address: 0x7f00_0000_0008
            })
        );
        let msg = UnsupportedReason::Misaligned { address: 0x18 }.to_string();
        assert!(msg.contains("0x18"), "{msg}");
    }

    proptest! {
        #[test]
        fn launches_cover_every_pack_within_the_bounds(
            packs in 1u64..5_000_000,
            w in prop::sample::select(WORLD_SIZES.to_vec()),
            d in prop::sample::select(DTYPES.to_vec()),
            two_stage in any::<bool>(),
            max_blocks in 1u32..=64,
        ) {
            let a = if two_stage { Algorithm::TwoStage } else { Algorithm::OneStage };
            let c = launch_config(d, w, packs * 16, a, max_blocks).unwrap();
            prop_assert!(c.blocks >= 1 && c.blocks <= max_blocks);
            prop_assert_eq!(c.threads, THREADS);
            prop_assert_eq!(c.elements * d.size_bytes(), packs * 16);
            // The grid-stride loop covers the per-rank work: blocks * threads threads, each
            // taking every (blocks * threads)-th pack; never more blocks than needed.
            let work = if two_stage { largest_part(packs, w as u64) } else { packs };
            prop_assert!(u64::from(c.blocks - 1) * u64::from(THREADS) < work);
            if two_stage {
                // Every rank's part fits the temp buffer.
                let part = packs / w as u64;
                prop_assert!(part * 16 <= c.temp_bytes);
                prop_assert_eq!((w as u64 - 1) * part * 16 + c.temp_bytes, packs * 16);
            } else {
                prop_assert_eq!(c.temp_bytes, 0);
            }
        }
    }
}
