use super::reduction::{part, reduce, reduce_blocks, BLOCK};
use super::signal::{decode_shape, shape_tag, shape_word};
use super::wide::Wide;
use crate::dtype::DType;
use half::{bf16, f16};

/// `reduce` (the AVX2 build where the CPU has it) and the portable build both give what
/// one f32 sum per element in rank order from `-0.0` gives, bit for bit (every element
/// that is `-0.0` on every rank sums to `-0.0`), for 1 to 8 inputs, and write only
/// `range` (whole blocks and a partial one, starting off a block boundary).
fn reductions_match_the_scalar_sum<T: Wide>() {
    let n = 40 * BLOCK + 37;
    let range = 5..n - 3;
    for ranks in [1, 2, 3, 8] {
        let inputs: Vec<Vec<T>> = (0..ranks)
            .map(|r| {
                (0..n)
                    .map(|i| match i % 11 {
                        0 => T::from_f32(-0.0),
                        _ => T::from_f32(((i * 7 + r * 13) % 97) as f32 * 0.37 - 17.0),
                    })
                    .collect()
            })
            .collect();
        let addresses: Vec<u64> = inputs.iter().map(|v| v.as_ptr() as u64).collect();
        let zero = T::from_f32(0.0);
        let want: Vec<T> = (0..n)
            .map(|i| match range.contains(&i) {
                true => T::from_f32(inputs.iter().fold(-0.0, |acc, v| acc + v[i].to_f32())),
                false => zero,
            })
            .collect();
        assert!(want[range.start.next_multiple_of(11)]
            .to_f32()
            .is_sign_negative());
        let bits = |v: &[T]| v.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
        let mut portable = vec![zero; n];
        let mut dispatched = vec![zero; n];
        let mut also = vec![zero; n];
        // SAFETY: every input holds `n` elements; the outputs hold `n` each and are three
        // separate vectors, apart from the inputs.
        unsafe {
            reduce_blocks::<T, false>(
                &addresses,
                portable.as_mut_ptr() as u64,
                None,
                range.clone(),
            );
            reduce::<T>(
                &addresses,
                dispatched.as_mut_ptr() as u64,
                Some(also.as_mut_ptr() as u64),
                range.clone(),
            );
        }
        let what = format!("{:?}, {ranks} inputs", T::DTYPE);
        assert_eq!(bits(&portable), bits(&want), "{what}: portable");
        assert_eq!(bits(&dispatched), bits(&want), "{what}: dispatched");
        assert_eq!(bits(&also), bits(&want), "{what}: also");
    }
}

#[test]
fn every_build_of_the_reduction_sums_like_the_scalar_loop() {
    reductions_match_the_scalar_sum::<f32>();
    reductions_match_the_scalar_sum::<f16>();
    reductions_match_the_scalar_sum::<bf16>();
}

#[test]
fn shape_tags_are_exact_for_ordinary_launches_and_flagged_digests_beyond() {
    let base = shape_word(DType::F32, 4096, 3);
    assert_eq!(shape_tag(base) >> 31, 0);
    // Exact: one field differs, the tag differs.
    for other in [
        shape_word(DType::F32, 4112, 3),
        shape_word(DType::F16, 4096, 3),
        shape_word(DType::F32, 4096, 4),
        shape_word(DType::F32, (1 << 24) - 16, 511),
    ] {
        assert_ne!(shape_tag(base), shape_tag(other));
        assert_eq!(shape_tag(other) >> 31, 0);
    }
    // Beyond the exact range (16 MiB, slot 512): digests, never equal to an exact tag.
    let big = shape_word(DType::F32, 1 << 24, 3);
    let far = shape_word(DType::F32, 4096, 512);
    assert_eq!(shape_tag(big) >> 31, 1);
    assert_eq!(shape_tag(far) >> 31, 1);
    assert_ne!(shape_tag(big), shape_tag(far));
    assert_ne!(
        shape_tag(big),
        shape_tag(shape_word(DType::F32, (1 << 24) + 16, 3))
    );
}

#[test]
fn shape_words_round_trip_and_differ_in_every_field() {
    let base = shape_word(DType::F32, 4096, 3);
    assert_eq!(decode_shape(base), (4096, "f32", 3));
    assert_eq!(
        decode_shape(shape_word(DType::Bf16, 16, 0)),
        (16, "bf16", 0)
    );
    assert_ne!(base, 0);
    assert_ne!(base, shape_word(DType::F32, 4112, 3));
    assert_ne!(base, shape_word(DType::F16, 4096, 3));
    assert_ne!(base, shape_word(DType::F32, 4096, 4));
    assert_eq!(decode_shape(base | (0xf << 40)).1, "unknown");
}

#[test]
fn parts_cover_every_element_once_in_whole_packs() {
    for world in 1..=8 {
        for count in [4usize, 8, 12, 1000, 4096, 4100] {
            let mut next = 0;
            for r in 0..world {
                let p = part(count, 4, world, r);
                assert_eq!(p.start, next);
                assert!(p.start.is_multiple_of(4) || p.is_empty());
                next = p.end;
            }
            assert_eq!(next, count);
        }
    }
}
