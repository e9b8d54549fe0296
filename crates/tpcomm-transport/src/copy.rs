//! Byte copies that stay fast whatever the two addresses are: [`copy_bytes`], and its safe
//! forms [`copy_slice`], [`extend_from_slice`] and [`to_vec`]. tpcomm copies bulk bytes
//! through them: the threads transport's posts and deliveries, the MPI transport's staging
//! copies, the objects layer's encoding and round copies, the host peer-memory backend's
//! reads and writes, and the host all-reduce's copy into its output. Copies into shared
//! memory that other cores have just read (the broadcast queue's ring) go through
//! [`copy_to_shared`], which streams large ones with non-temporal stores.
//!
//! glibc's `memcpy` (2.36, x86-64, CPUs with fast short `rep movsb`) moves copies between
//! about 2 KiB and its non-temporal threshold with `rep movsb`, and on the AMD EPYC VMs it was
//! measured on that path runs about 15 times slower when the destination lies 1 to 63 bytes
//! after the source modulo 4 KiB: 256 KiB in 86-110 us instead of 6 us,
//! 64 KiB in 24-30 us instead of 1.5 us. That relation is the common one for a two-stage
//! all-reduce's output: the temp buffers are page-aligned, and glibc places a large `Vec` (an
//! `mmap`ed chunk) 16 bytes after a page boundary. Between heap blocks it comes and goes with
//! the heap's layout: glibc spaces 64 KiB blocks 65,552 bytes apart, 16 bytes past a whole
//! number of pages, so one block copied into the next is exactly that case.
//! A forward vector loop does not escape it either (each load then aliases the
//! store 16 bytes behind it, 4 KiB apart: about 4x slower), but a *backward* loop does: its
//! pending stores all lie above the next load. [`copy_bytes`] takes that loop, with aligned stores
//! (none splits a cache line) and unaligned loads, for exactly that relation, and `memcpy`
//! otherwise. Measured on the same machine (rustc -O, best of 5): with AVX (32-byte stores)
//! the backward loop copies 4 KiB to 8 MiB at `memcpy`'s speed between page-aligned buffers
//! (256 KiB: 6.3 us against 6.5 us; 8 MiB: 282 us against 283 us); the 16-byte loop used
//! without AVX is about 1.3x slower than that, still 10x faster than the slow path.

/// Copies shorter than this go to `memcpy` whatever the addresses: glibc copies them with its
/// vector loop, which has no slow case.
pub const SMALL: usize = 2048;
/// Destination offsets (modulo 4 KiB, after the source) that `memcpy` copies slowly.
const SLOW_WINDOW: std::ops::Range<usize> = 1..64;

/// Whether `memcpy` from `src` to `dst` of `n` bytes would take its slow path here.
pub fn needs_backward(dst: usize, src: usize, n: usize) -> bool {
    n >= SMALL && SLOW_WINDOW.contains(&(dst.wrapping_sub(src) % 4096))
}

/// Copies `n` bytes from `src` to `dst`, as `std::ptr::copy_nonoverlapping` does, without
/// `memcpy`'s slow case described in the [module docs](self).
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, and the two ranges do not overlap.
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, n: usize) {
    if !needs_backward(dst as usize, src as usize, n) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the caller's contract; AVX is present (checked just above).
        unsafe { backward_avx(dst, src, n) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { backward(dst, src, n) };
}

/// Copies `src` into `dst`, as `<[u8]>::copy_from_slice` does, without `memcpy`'s slow case
/// described in the [module docs](self).
///
/// # Panics
/// When the two slices differ in length (as `copy_from_slice`).
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_slice: destination and source lengths differ"
    );
    // SAFETY: both slices are `src.len()` bytes long, and a `&mut` slice cannot overlap a
    // shared one.
    unsafe { copy_bytes(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
}

/// Appends `src` to `v`, as `Vec::extend_from_slice` does, without `memcpy`'s slow case
/// described in the [module docs](self).
pub fn extend_from_slice(v: &mut Vec<u8>, src: &[u8]) {
    v.reserve(src.len());
    let len = v.len();
    // SAFETY: `reserve` made room for `src.len()` bytes after the first `len`; `src` cannot
    // point into `v`'s spare capacity, which only `v` (borrowed mutably here) reaches; the
    // length grows only over bytes this copy initialized.
    unsafe {
        copy_bytes(v.as_mut_ptr().add(len), src.as_ptr(), src.len());
        v.set_len(len + src.len());
    }
}

/// A new `Vec` holding `src`, as `<[u8]>::to_vec` makes it, without `memcpy`'s slow case
/// described in the [module docs](self).
pub fn to_vec(src: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(src.len());
    extend_from_slice(&mut v, src);
    v
}

/// Copies into shared memory of at least this many bytes take non-temporal stores
/// ([`copy_to_shared`]).
pub const NON_TEMPORAL_MIN_BYTES: usize = 16 << 10;

/// Copies `n` bytes from private memory into shared memory that other cores read (a shared
/// ring's payload, which its readers read last): [`copy_bytes`] below
/// [`NON_TEMPORAL_MIN_BYTES`], non-temporal stores from there on (whole 64-byte lines; the bytes
/// before the first line boundary and after the last through [`copy_bytes`]), then a store
/// fence, so that every byte is visible before the stores that follow (a release store that
/// publishes them).
///
/// Why: the lines were last read by other cores, whose caches still hold them; an ordinary
/// store must take each line back from them first. On the AMD EPYC KVM guest the benchmarks
/// ran on, that made a writer's copy 24 times slower than into its own memory (64 KiB in
/// 28 us, 1 MiB in 440 us, 8 MiB in 3.4 ms, against 1.2 us, 22 us and 230 us), while
/// non-temporal stores, which take no line back, copied them in 2.0 us, 37 us and 300 us,
/// and the reader's copy out afterwards took as long as after ordinary stores (a C program
/// between two MPI processes, medians of 60 rounds). Below [`NON_TEMPORAL_MIN_BYTES`] the
/// difference is under a microsecond either way, so the cut-off costs at most that where it
/// is off for a machine.
///
/// # Safety
/// As [`copy_bytes`]: `src` readable and `dst` writable for `n` bytes, not overlapping.
pub unsafe fn copy_to_shared(dst: *mut u8, src: *const u8, n: usize) {
    if n >= NON_TEMPORAL_MIN_BYTES {
        // SAFETY: the caller's contract.
        unsafe { stream_bytes(dst, src, n) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { copy_bytes(dst, src, n) }
    }
}

/// The non-temporal copy of [`copy_to_shared`].
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(64).min(n);
    let end = head + (n - head) / 64 * 64;
    // SAFETY: the caller's contract covers `[0, n)` of both; `head <= end <= n`; the
    // stores of the loop are 16-byte aligned (`dst + head` is 64-byte aligned); SSE2 is
    // part of x86-64.
    unsafe {
        copy_bytes(dst, src, head);
        let mut i = head;
        while i < end {
            for k in (0..64).step_by(16) {
                let v = _mm_loadu_si128(src.add(i + k).cast::<__m128i>());
                _mm_stream_si128(dst.add(i + k).cast::<__m128i>(), v);
            }
            i += 64;
        }
        _mm_sfence();
        copy_bytes(dst.add(end), src.add(end), n - end);
    }
}

/// Elsewhere: [`copy_bytes`].
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_bytes(dst, src, n) }
}

/// The backward copy with 16-byte aligned stores.
///
/// # Safety
/// As [`copy_bytes`], and `n >= 16`.
unsafe fn backward(dst: *mut u8, src: *const u8, n: usize) {
    // dst[head..end] is whole 16-byte aligned packs; the bytes before and after go to memcpy.
    let head = (16 - dst as usize % 16) % 16;
    let end = head + (n - head) / 16 * 16;
    // SAFETY: `end <= n`; the caller's contract covers dst[end..n] and src[end..n].
    unsafe { std::ptr::copy_nonoverlapping(src.add(end), dst.add(end), n - end) };
    let mut i = end;
    while i >= head + 64 {
        i -= 64;
        // SAFETY: `head <= i` and `i + 64 <= end <= n`: inside both ranges. `dst + i` is
        // 16-byte aligned (`dst + head` is, and `i - head` is a multiple of 16). The stores
        // are volatile so that the compiler keeps this loop (and its order) rather than
        // replacing it with the `memcpy` call it avoids.
        unsafe {
            let s = src.add(i);
            let d = dst.add(i).cast::<u128>();
            let a = s.add(48).cast::<u128>().read_unaligned();
            let b = s.add(32).cast::<u128>().read_unaligned();
            let c = s.add(16).cast::<u128>().read_unaligned();
            let e = s.cast::<u128>().read_unaligned();
            d.add(3).write_volatile(a);
            d.add(2).write_volatile(b);
            d.add(1).write_volatile(c);
            d.write_volatile(e);
        }
    }
    while i >= head + 16 {
        i -= 16;
        // SAFETY: as above, one pack.
        unsafe {
            let v = src.add(i).cast::<u128>().read_unaligned();
            dst.add(i).cast::<u128>().write_volatile(v);
        }
    }
    // SAFETY: `i <= n`; inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, i) };
}

/// The backward copy with 32-byte aligned AVX stores, four per step.
///
/// # Safety
/// As [`copy_bytes`], `n >= 32`, and the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn backward_avx(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{_mm256_loadu_si256, _mm256_store_si256};
    let head = (32 - dst as usize % 32) % 32;
    let end = head + (n - head) / 32 * 32;
    // SAFETY: `end <= n`; the caller's contract covers dst[end..n] and src[end..n].
    unsafe { std::ptr::copy_nonoverlapping(src.add(end), dst.add(end), n - end) };
    let mut i = end;
    while i >= head + 128 {
        i -= 128;
        // SAFETY: `head <= i` and `i + 128 <= end <= n`: inside both ranges; `dst + i` is
        // 32-byte aligned (`dst + head` is, and `i - head` is a multiple of 32), as the
        // aligned stores need; the loads are unaligned ones.
        unsafe {
            let s = src.add(i);
            let d = dst.add(i);
            let a = _mm256_loadu_si256(s.add(96).cast());
            let b = _mm256_loadu_si256(s.add(64).cast());
            let c = _mm256_loadu_si256(s.add(32).cast());
            let e = _mm256_loadu_si256(s.cast());
            _mm256_store_si256(d.add(96).cast(), a);
            _mm256_store_si256(d.add(64).cast(), b);
            _mm256_store_si256(d.add(32).cast(), c);
            _mm256_store_si256(d.cast(), e);
        }
    }
    // SAFETY: `i <= n`; the rest (under 160 bytes) in front, inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, i) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_copy_writes_exactly_its_bytes_whatever_the_alignment_and_length() {
        let src: Vec<u8> = (0..NON_TEMPORAL_MIN_BYTES + 300)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mut dst = vec![0u8; NON_TEMPORAL_MIN_BYTES + 600];
        for at in [0, 1, 15, 16, 63, 64, 65, 127] {
            for n in [
                0,
                1,
                63,
                64,
                65,
                200,
                NON_TEMPORAL_MIN_BYTES - 1,
                NON_TEMPORAL_MIN_BYTES + 129,
            ] {
                for copy in [stream_bytes, copy_to_shared] {
                    dst.fill(0xee);
                    // SAFETY: `at + n` is within `dst` and `n` within `src`; two allocations.
                    unsafe { copy(dst.as_mut_ptr().add(at), src.as_ptr(), n) };
                    assert!(
                        dst[..at].iter().all(|&b| b == 0xee),
                        "before, at {at} n {n}"
                    );
                    assert_eq!(&dst[at..at + n], &src[..n], "at {at} n {n}");
                    assert!(
                        dst[at + n..].iter().all(|&b| b == 0xee),
                        "after, at {at} n {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_destinations_just_after_the_source_modulo_4k_take_the_backward_loop() {
        assert!(needs_backward(4096 + 16, 0, 1 << 18));
        assert!(needs_backward(8192 + 63, 4096, SMALL));
        assert!(needs_backward(17, 0, SMALL));
        assert!(!needs_backward(4096, 0, 1 << 18), "same offset in the page");
        assert!(!needs_backward(64, 0, 1 << 18), "64 bytes after is fast");
        assert!(
            !needs_backward(0, 16, 1 << 18),
            "destination before the source"
        );
        assert!(
            !needs_backward(16, 0, SMALL - 1),
            "short copies stay with memcpy"
        );
        assert!(needs_backward(16, usize::MAX - 4095, SMALL), "wraps");
    }

    /// Every length around the pack and unroll boundaries, every destination alignment in and
    /// out of the slow window: the bytes copied, nothing around them touched.
    #[test]
    fn copies_exactly_the_bytes_for_every_alignment_and_length() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0xEEu8; 48_000];
        let src_base = src.as_ptr() as usize;
        for len in [
            SMALL,
            SMALL + 1,
            SMALL + 15,
            SMALL + 17,
            4096,
            4097,
            12_345,
            32_768,
        ] {
            for delta in [1usize, 5, 15, 16, 17, 31, 48, 63, 64, 100, 0] {
                // Destination offset in `dst` so that (dst - src) % 4096 == delta.
                let dst_base = dst.as_ptr() as usize;
                let off = (src_base + delta).wrapping_sub(dst_base) % 4096 + 4096;
                let src_off = 3;
                let want_backward =
                    needs_backward(dst_base + off + src_off, src_base + src_off, len);
                assert_eq!(
                    want_backward,
                    (1..64).contains(&delta),
                    "len {len} delta {delta}"
                );
                for which in 0..2 {
                    dst.fill(0xEE);
                    // SAFETY: both ranges inside their vectors (off + 3 + len < 8192 + 3 + 32_768 <
                    // 48_000), and disjoint (two vectors).
                    unsafe {
                        let (d, s) = (
                            dst.as_mut_ptr().add(off + src_off),
                            src.as_ptr().add(src_off),
                        );
                        // The AVX loop where the CPU has it, then the 16-byte loop everywhere.
                        if which == 0 {
                            copy_bytes(d, s, len)
                        } else {
                            backward(d, s, len)
                        }
                    };
                    assert_eq!(
                        &dst[off + src_off..off + src_off + len],
                        &src[src_off..src_off + len],
                        "len {len} delta {delta}"
                    );
                    assert!(dst[..off + src_off].iter().all(|&b| b == 0xEE));
                    assert!(dst[off + src_off + len..].iter().all(|&b| b == 0xEE));
                }
            }
        }
    }

    /// The safe forms, on pairs in and out of the slow window: `extend_from_slice` appends
    /// the bytes after the ones already there; `copy_slice` fills the destination exactly.
    #[test]
    fn safe_forms_append_and_copy_the_bytes_in_and_out_of_the_slow_window() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
        for delta in [0usize, 16, 40, 64, 2000] {
            for len in [0, 1, SMALL - 1, SMALL, 9_999] {
                let mut v: Vec<u8> = Vec::with_capacity(16_384);
                v.extend_from_slice(b"head");
                // Start the source so that the append's destination lies `delta` bytes
                // after it modulo 4 KiB.
                let at = v.as_ptr() as usize + 4;
                let s_off = (at.wrapping_sub(delta).wrapping_sub(src.as_ptr() as usize)) % 4096;
                let piece = &src[s_off..s_off + len];
                assert_eq!(
                    needs_backward(at, piece.as_ptr() as usize, len),
                    (1..64).contains(&delta) && len >= SMALL
                );
                extend_from_slice(&mut v, piece);
                assert_eq!(&v[..4], b"head");
                assert_eq!(&v[4..], piece, "delta {delta} len {len}");

                let mut dst = vec![0u8; len];
                copy_slice(&mut dst, piece);
                assert_eq!(dst, piece, "delta {delta} len {len}");
                assert_eq!(to_vec(piece), piece, "delta {delta} len {len}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn copy_slice_of_different_lengths_panics_as_copy_from_slice_does() {
        copy_slice(&mut [0u8; 3], &[1u8; 4]);
    }
}
