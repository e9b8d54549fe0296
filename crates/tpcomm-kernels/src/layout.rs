//! Rust mirrors of the structs the kernels share with the host (`kernels/allreduce.cuh`).
//!
//! Sizes, alignments and offsets are checked at compile time here, and against the CUDA
//! compiler's own view (the `tpcomm_ar_layout` table compiled into every cubin and the
//! PTX) by the crate's tests: allocate exactly [`SIGNAL_BYTES`] per Signal block and
//! write tables with these types, and the kernels read what was meant.

use std::mem::{align_of, offset_of, size_of};

/// Largest world size a kernel serves (`kMaxRanks`).
pub const MAX_RANKS: usize = 8;
/// Capacity of a Signal block in thread blocks: no launch uses more blocks (`kMaxBlocks`).
pub const MAX_BLOCKS: usize = 64;
/// Blocks a launch uses at most unless told otherwise (`kDefaultBlocks`).
pub const DEFAULT_BLOCKS: u32 = 36;
/// Threads per block of every entry point, also its launch bound (`kThreads`).
pub const THREADS: u32 = 512;
/// Every data access moves one pack of this many bytes; sizes and pointers must be
/// multiples of it (`kPackBytes`).
pub const PACK_BYTES: u64 = 16;

/// Flag slots of one barrier kind: `[block][writer rank]`, on their own 128-byte lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(128))]
pub struct FlagSlots(pub [[u32; MAX_RANKS]; MAX_BLOCKS]);

/// Start-barrier slots: `[block][writer rank]`, 64 bits written in one access: the flag in
/// the low half, the writer's launch shape ([`LaunchShape`]) in the high half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(128))]
pub struct StartSlots(pub [[u64; MAX_RANKS]; MAX_BLOCKS]);

/// Per-block barrier counters, on their own 128-byte lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(128))]
pub struct BlockCounters(pub [u32; MAX_BLOCKS]);

/// One rank's Signal block (`tpcomm::Signal`), in that rank's device memory.
///
/// Allocate [`SIGNAL_BYTES`] with this alignment and zero it before the first launch on
/// any rank (all ranks' counters must agree; see `docs/kernels.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(128))]
pub struct Signal {
    /// `start.0[b][p]`: the flag rank `p` stored for block `b` in the start barrier (low
    /// half) and the shape of its launch (high half).
    pub start: StartSlots,
    /// `end.0[b][p]`: the flag rank `p` stored for block `b` in the second barrier of a
    /// launch (one-stage end barrier, two-stage middle barrier).
    pub end: FlagSlots,
    /// The value block `b` used in its last barrier (owner only).
    pub counter: BlockCounters,
    /// 0, or the first barrier timeout or shape mismatch this rank saw: see
    /// [`ErrorWord::decode`].
    pub error: u32,
    /// Unused, zero.
    pub reserved: u32,
    /// Never touched by kernels: the host lifecycle's proof-of-mapping word.
    pub nonce: u64,
    /// With [`ErrorWord::ShapeMismatch`]: this rank's launch shape and the peer's
    /// ([`LaunchShape::decode`]).
    pub mismatch: [u32; 2],
}

impl Signal {
    /// A Signal block with every word zero (the state before the first launch).
    pub const fn zeroed() -> Signal {
        Signal {
            start: StartSlots([[0; MAX_RANKS]; MAX_BLOCKS]),
            end: FlagSlots([[0; MAX_RANKS]; MAX_BLOCKS]),
            counter: BlockCounters([0; MAX_BLOCKS]),
            error: 0,
            reserved: 0,
            nonce: 0,
            mismatch: [0; 2],
        }
    }
}

/// A rank's stable table of peer Signal blocks and two-stage temp buffers
/// (`tpcomm::RankSignals`): device addresses as mapped in this process, entry `rank`
/// being the rank's own allocations. Unused entries (rank >= world size) are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct RankSignals {
    /// `Signal*` of every rank.
    pub signals: [u64; MAX_RANKS],
    /// Two-stage temp buffer of every rank (at least
    /// [`LaunchConfig::temp_bytes`](crate::LaunchConfig::temp_bytes) each, 16-byte aligned).
    pub temps: [u64; MAX_RANKS],
}

/// A stable slot of input addresses (`tpcomm::RankData`): entry `r` is rank `r`'s input
/// as mapped in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct RankData {
    /// `const void*` of every rank's input.
    pub ptrs: [u64; MAX_RANKS],
}

/// Bytes of one Signal block.
pub const SIGNAL_BYTES: usize = size_of::<Signal>();
/// Alignment a Signal block needs.
pub const SIGNAL_ALIGN: usize = align_of::<Signal>();

// The layout the CUDA side has (see kernels/allreduce.cuh): flags, counters and the status
// words each start a 128-byte line.
const _: () = assert!(size_of::<FlagSlots>() == 2048);
const _: () = assert!(size_of::<StartSlots>() == 4096);
const _: () = assert!(size_of::<BlockCounters>() == 256);
const _: () = assert!(SIGNAL_BYTES == 6528);
const _: () = assert!(SIGNAL_ALIGN == 128);
const _: () = assert!(offset_of!(Signal, start) == 0);
const _: () = assert!(offset_of!(Signal, end) == 4096);
const _: () = assert!(offset_of!(Signal, counter) == 6144);
const _: () = assert!(offset_of!(Signal, error) == 6400);
const _: () = assert!(offset_of!(Signal, error) % 128 == 0);
const _: () = assert!(offset_of!(Signal, nonce) == 6408);
const _: () = assert!(offset_of!(Signal, mismatch) == 6416);
const _: () = assert!(size_of::<RankSignals>() == 128 && align_of::<RankSignals>() == 8);
const _: () = assert!(offset_of!(RankSignals, temps) == 64);
const _: () = assert!(size_of::<RankData>() == 64 && align_of::<RankData>() == 8);
const _: () = assert!(MAX_BLOCKS <= 256 && MAX_RANKS <= 256); // error word: 8 bits each
const _: () = assert!(DEFAULT_BLOCKS as usize <= MAX_BLOCKS);

/// Name of the device global holding the CUDA compiler's view of the layout.
pub const LAYOUT_SYMBOL: &str = "tpcomm_ar_layout";
/// Version of that table's format (`kLayoutVersionValue`).
pub const LAYOUT_VERSION: u64 = 2;

/// The `tpcomm_ar_layout` table this crate expects, in `tpcomm::LayoutIndex` order:
/// version, max ranks, max blocks, default blocks, threads, pack bytes, then size, align
/// and field offsets of Signal, RankSignals and RankData, then entries appended later.
pub const fn expected_layout() -> [u64; 21] {
    [
        LAYOUT_VERSION,
        MAX_RANKS as u64,
        MAX_BLOCKS as u64,
        DEFAULT_BLOCKS as u64,
        THREADS as u64,
        PACK_BYTES,
        size_of::<Signal>() as u64,
        align_of::<Signal>() as u64,
        offset_of!(Signal, start) as u64,
        offset_of!(Signal, end) as u64,
        offset_of!(Signal, counter) as u64,
        offset_of!(Signal, error) as u64,
        offset_of!(Signal, nonce) as u64,
        size_of::<RankSignals>() as u64,
        align_of::<RankSignals>() as u64,
        offset_of!(RankSignals, signals) as u64,
        offset_of!(RankSignals, temps) as u64,
        size_of::<RankData>() as u64,
        align_of::<RankData>() as u64,
        offset_of!(RankData, ptrs) as u64,
        offset_of!(Signal, mismatch) as u64,
    ]
}

/// Names of the [`expected_layout`] entries, for test messages.
pub const LAYOUT_NAMES: [&str; 21] = [
    "version",
    "max ranks",
    "max blocks",
    "default blocks",
    "threads",
    "pack bytes",
    "sizeof(Signal)",
    "alignof(Signal)",
    "offsetof(Signal, start)",
    "offsetof(Signal, end)",
    "offsetof(Signal, counter)",
    "offsetof(Signal, error)",
    "offsetof(Signal, nonce)",
    "sizeof(RankSignals)",
    "alignof(RankSignals)",
    "offsetof(RankSignals, signals)",
    "offsetof(RankSignals, temps)",
    "sizeof(RankData)",
    "alignof(RankData)",
    "offsetof(RankData, ptrs)",
    "offsetof(Signal, mismatch)",
];

/// Which barrier of a launch a timeout happened in (`tpcomm::BarrierKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierKind {
    /// The entry barrier of both algorithms.
    Start,
    /// The exit barrier of the one-stage kernel.
    End,
    /// The barrier between reduce-scatter and all-gather of the two-stage kernel.
    Mid,
}

/// A peer that did not arrive at a barrier within the launch's `timeout_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarrierTimeout {
    /// The barrier.
    pub barrier: BarrierKind,
    /// The thread block that gave up first.
    pub block: u32,
    /// The rank whose flag never came.
    pub peer: usize,
}

/// A peer whose start flag carried another launch shape than this rank's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeMismatch {
    /// The thread block that saw it first.
    pub block: u32,
    /// The peer.
    pub peer: usize,
}

/// The decoded [`Signal::error`] word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorWord {
    /// No error recorded.
    Clear,
    /// A barrier timed out.
    Timeout(BarrierTimeout),
    /// A peer launched another shape ([`Signal::mismatch`] holds both shapes).
    ShapeMismatch(ShapeMismatch),
    /// A value this version does not know (kept raw).
    Unknown(u32),
}

impl ErrorWord {
    /// Decodes the word: bit 31 set, bits 16..23 kind (1 start, 2 end, 3 mid: timeouts;
    /// 4: shape mismatch), bits 8..15 block, bits 0..7 peer rank.
    pub fn decode(word: u32) -> ErrorWord {
        if word == 0 {
            return ErrorWord::Clear;
        }
        if word & 0x8000_0000 == 0 || word & 0x7f00_0000 != 0 {
            return ErrorWord::Unknown(word);
        }
        let block = (word >> 8) & 0xff;
        let peer = (word & 0xff) as usize;
        let barrier = match (word >> 16) & 0xff {
            1 => BarrierKind::Start,
            2 => BarrierKind::End,
            3 => BarrierKind::Mid,
            4 => return ErrorWord::ShapeMismatch(ShapeMismatch { block, peer }),
            _ => return ErrorWord::Unknown(word),
        };
        ErrorWord::Timeout(BarrierTimeout {
            barrier,
            block,
            peer,
        })
    }
}

/// A launch's shape as the kernels carry it in the high half of their start flags
/// (`launch_shape()` in allreduce.cuh): bits 0..27 the 16-byte pack count modulo 2^28,
/// bits 28..31 the element type code (1 f32, 2 f16, 3 bf16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// Bytes (pack count times 16, modulo 2^32).
    pub bytes: u64,
    /// Element type name (`"unknown"` for a code this version does not know).
    pub dtype: &'static str,
}

impl LaunchShape {
    /// Decodes a shape word.
    pub fn decode(word: u32) -> LaunchShape {
        LaunchShape {
            bytes: u64::from(word & 0x0fff_ffff) * PACK_BYTES,
            dtype: match word >> 28 {
                1 => "f32",
                2 => "f16",
                3 => "bf16",
                _ => "unknown",
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_signal_has_every_field_zero() {
        let s = Signal::zeroed();
        assert!(s.start.0.iter().flatten().all(|&f| f == 0));
        assert!(s.end.0.iter().flatten().all(|&f| f == 0));
        assert!(s.counter.0.iter().all(|&c| c == 0));
        assert_eq!(s.start.0[MAX_BLOCKS - 1][MAX_RANKS - 1], 0);
        assert_eq!(s.counter.0[0], 0);
        assert_eq!(
            (s.error, s.reserved, s.nonce, s.mismatch),
            (0, 0, 0, [0, 0])
        );
    }

    #[test]
    fn shape_mismatch_words_and_shapes_decode() {
        // error_word(kShape, block 3, peer 1)
        assert_eq!(
            ErrorWord::decode(0x8000_0000 | (4 << 16) | (3 << 8) | 1),
            ErrorWord::ShapeMismatch(ShapeMismatch { block: 3, peer: 1 })
        );
        // launch_shape<float>(1024): 256 packs
        assert_eq!(
            LaunchShape::decode((1 << 28) | 256),
            LaunchShape {
                bytes: 4096,
                dtype: "f32"
            }
        );
        assert_eq!(LaunchShape::decode((3 << 28) | 1).dtype, "bf16");
        assert_eq!(LaunchShape::decode(7 << 28).dtype, "unknown");
    }

    #[test]
    fn error_word_round_trips_the_cuda_encoding() {
        // error_word(kMid, block 35, peer 6) in allreduce.cuh
        let word = 0x8000_0000 | (3 << 16) | (35 << 8) | 6;
        assert_eq!(
            ErrorWord::decode(word),
            ErrorWord::Timeout(BarrierTimeout {
                barrier: BarrierKind::Mid,
                block: 35,
                peer: 6
            })
        );
        assert_eq!(ErrorWord::decode(0), ErrorWord::Clear);
        assert_eq!(
            ErrorWord::decode(0x8000_0000 | (1 << 16)),
            ErrorWord::Timeout(BarrierTimeout {
                barrier: BarrierKind::Start,
                block: 0,
                peer: 0
            })
        );
    }

    #[test]
    fn unknown_error_words_are_kept_raw() {
        for w in [1u32, 0x8009_0000, (2 << 16) | 1, 0xc002_0000] {
            assert_eq!(ErrorWord::decode(w), ErrorWord::Unknown(w), "{w:#x}");
        }
    }

    #[test]
    fn expected_layout_matches_the_names_and_the_constants() {
        let l = expected_layout();
        assert_eq!(l.len(), LAYOUT_NAMES.len());
        assert_eq!(l[6], SIGNAL_BYTES as u64);
        assert_eq!(l[7], 128);
    }
}
