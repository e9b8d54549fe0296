//! The host Signal block: its layout, its flag words as atomics (what the barrier of
//! `flags` runs over: [`SignalBlocks`]) and the launch shape every rank publishes before the
//! start barrier and compares after it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::flags;
use crate::dtype::DType;
use crate::error::Result;

/// Host Signal block: three flag arrays (one 64-byte line each; the start line also holds
/// the shape tags, one 32-bit word per writer, after its 8 flags), the epoch counters (one
/// per barrier kind, in `flags::Kind::index` order), the nonce, the shapes (this rank's 64-bit word of what it launched, at its own index).
/// Offsets in bytes.
const START: usize = 0;
const SHAPE_TAGS: usize = START + 32;
const MID: usize = 64;
const END: usize = 128;
pub(super) const COUNTER: usize = 192;
pub(super) const NONCE: usize = 256;
const SHAPES: usize = 320;
pub(super) const SIGNAL_BYTES: usize = 384;

/// A shape word: bits 0..40 the byte count, 40..44 the element type (code, never 0),
/// 44..64 the RankData slot. `Config` bounds `max_bytes` below 2^40 and the slots to 2^20
/// (`Config::MAX_BYTES`, `Config::MAX_SLOTS`), so every field fits.
const SHAPE_BYTES_BITS: u32 = 40;
const SHAPE_DTYPE_BITS: u32 = 4;
const SHAPE_SLOT_SHIFT: u32 = SHAPE_BYTES_BITS + SHAPE_DTYPE_BITS;

/// The shape word of a launch of `bytes` bytes of `dtype` from `slot` (never 0).
#[inline]
pub(super) fn shape_word(dtype: DType, bytes: usize, slot: usize) -> u64 {
    let code: u64 = match dtype {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::Bf16 => 3,
    };
    (bytes as u64 & ((1 << SHAPE_BYTES_BITS) - 1))
        | (code << SHAPE_BYTES_BITS)
        | ((slot as u64) << SHAPE_SLOT_SHIFT)
}

/// The 32-bit tag of a shape word that peers compare: the shape itself (bit 31 clear:
/// 16-byte packs in bits 0..20, the element type in 20..22, the slot in 22..31) when the
/// launch is whole packs, at most 2^20 - 1 of them and from a slot below 512; otherwise a
/// digest of the whole word with bit 31 set. So two tags are equal for different shapes only
/// when both are digests that collide.
#[inline]
pub(super) fn shape_tag(word: u64) -> u32 {
    let bytes = word & ((1 << SHAPE_BYTES_BITS) - 1);
    let code = (word >> SHAPE_BYTES_BITS) & ((1 << SHAPE_DTYPE_BITS) - 1);
    let slot = word >> SHAPE_SLOT_SHIFT;
    let packs = bytes / 16;
    if bytes.is_multiple_of(16) && packs < (1 << 20) && code < 4 && slot < (1 << 9) {
        return (packs | (code << 20) | (slot << 22)) as u32;
    }
    (crate::backend::mix64(word.wrapping_add(0x9E37_79B9_7F4A_7C15)) as u32) | 0x8000_0000
}

/// Bytes, element type name and slot of a shape word.
pub(super) fn decode_shape(word: u64) -> (u64, &'static str, usize) {
    let bytes = word & ((1 << SHAPE_BYTES_BITS) - 1);
    let dtype = match (word >> SHAPE_BYTES_BITS) & ((1 << SHAPE_DTYPE_BITS) - 1) {
        1 => "f32",
        2 => "f16",
        3 => "bf16",
        _ => "unknown",
    };
    (bytes, dtype, (word >> SHAPE_SLOT_SHIFT) as usize)
}

/// A flag word of a Signal block at `base + offset`.
///
/// # Safety
/// `base` must be the 8-byte aligned address of a live, mapped Signal block of at least
/// `SIGNAL_BYTES` bytes for as long as the reference is used.
#[inline]
pub(super) unsafe fn flag<'a>(base: u64, offset: usize) -> &'a AtomicU32 {
    // SAFETY: the caller guarantees an aligned live mapping; offsets are 4-byte aligned
    // inside SIGNAL_BYTES and the memory is only ever accessed atomically.
    unsafe { AtomicU32::from_ptr((base as usize + offset) as *mut u32) }
}

/// The group's Signal blocks as mapped in this process, for [`flags::FlagBarrier`].
pub(super) struct SignalBlocks<'a> {
    own: u64,
    signals: &'a [u64; 8],
}

impl<'a> SignalBlocks<'a> {
    /// # Safety
    /// `own` and every `signals[p]` a barrier names (`p < world`) must be live, mapped
    /// Signal blocks of at least `SIGNAL_BYTES` bytes for as long as the value is used.
    #[inline]
    pub(super) unsafe fn new(own: u64, signals: &'a [u64; 8]) -> Self {
        Self { own, signals }
    }

    /// The shape word `writer` publishes in the block at `base`.
    ///
    /// # Safety
    /// `base` is this rank's own block or one of `signals[..world]` (per [`Self::new`]),
    /// and `writer < 8`.
    #[inline]
    unsafe fn shape(base: u64, writer: usize) -> &'a AtomicU64 {
        debug_assert!(writer < 8);
        // SAFETY: per the contract, a live block of SIGNAL_BYTES, 8-byte aligned (own block:
        // an allocation's start; peers' blocks: checked in `launch`); SHAPES + 8 * writer
        // keeps that alignment and stays inside the block for `writer < 8`; the word is only
        // ever accessed atomically.
        unsafe { AtomicU64::from_ptr((base as usize + SHAPES + 8 * writer) as *mut u64) }
    }

    /// Stores this rank's shape word into its own block and its tag into every block's tag
    /// for `rank` (before the start barrier, whose release stores publish both).
    #[inline]
    pub(super) fn publish_shape(&self, rank: usize, world: usize, word: u64) {
        // SAFETY: this rank's own block is live (`Self::new`); `rank < world <= 8` (the
        // driver refuses larger groups).
        unsafe { Self::shape(self.own, rank) }.store(word, Ordering::Relaxed);
        let tag = shape_tag(word);
        for p in 0..world {
            // SAFETY: `signals[p]` for `p < world` is a live, 8-byte aligned block
            // (`Self::new`, checked in `launch`); SHAPE_TAGS + 4 * rank stays inside the start
            // line for `rank < 8`; the word is only ever accessed atomically.
            unsafe { flag(self.signals[p], SHAPE_TAGS + 4 * rank) }.store(tag, Ordering::Relaxed);
        }
    }

    /// After the start barrier: the first peer whose published shape differs from `word`.
    #[inline]
    pub(super) fn check_shapes(&self, rank: usize, world: usize, word: u64) -> Result<()> {
        let tag = shape_tag(word);
        for peer in 0..world {
            // SAFETY: this rank's own block is live (`Self::new`); `peer < world <= 8`. The
            // start barrier's acquire loads ordered the peer's store before this load.
            let their_tag =
                unsafe { flag(self.own, SHAPE_TAGS + 4 * peer) }.load(Ordering::Relaxed);
            if their_tag != tag {
                // SAFETY: `signals[peer]` is live and aligned (as above); the peer stored its
                // word before its start flag, which this rank acquired.
                let theirs =
                    unsafe { Self::shape(self.signals[peer], peer) }.load(Ordering::Relaxed);
                let (bytes, dtype, slot) = decode_shape(word);
                let (peer_bytes, peer_dtype, peer_slot) = decode_shape(theirs);
                return Err(crate::AllReduceError::LaunchMismatch {
                    rank,
                    bytes,
                    dtype,
                    slot: Some(slot),
                    peer,
                    peer_bytes,
                    peer_dtype,
                    peer_slot: Some(peer_slot),
                });
            }
        }
        Ok(())
    }
}

#[inline]
fn array(kind: flags::Kind) -> usize {
    match kind {
        flags::Kind::Start => START,
        flags::Kind::Mid => MID,
        flags::Kind::End => END,
    }
}

impl flags::Blocks for SignalBlocks<'_> {
    type Slot = AtomicU32;

    #[inline(always)]
    fn peer(&self, peer: usize, kind: flags::Kind, writer: usize) -> &AtomicU32 {
        // SAFETY: per `SignalBlocks::new`, the tables hold live Signal mappings for every
        // rank of the group (`CustomAllReduce` rewrites them after every reopen before any
        // launch); `writer < world <= 8` keeps the slot inside its 64-byte array.
        unsafe { flag(self.signals[peer], array(kind) + 4 * writer) }
    }

    #[inline(always)]
    fn own(&self, kind: flags::Kind, writer: usize) -> &AtomicU32 {
        // SAFETY: this rank's own Signal block, alive for the launch (`SignalBlocks::new`).
        unsafe { flag(self.own, array(kind) + 4 * writer) }
    }
}

pub(super) type Barrier<'a> = flags::FlagBarrier<'a, SignalBlocks<'a>>;
