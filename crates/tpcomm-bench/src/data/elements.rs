//! The element data of the all-reduces: each rank's input of small integers, so that every
//! algorithm and element type must match the exact sum bit for bit, and its check.

use tpcomm::allreduce::Element;

use crate::data::pattern::splitmix64;

/// Evaluates `$body` with `$t` naming the Rust element type of the [`DType`](tpcomm::allreduce::DType) `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            ::tpcomm::allreduce::DType::F32 => {
                type $t = f32;
                $body
            }
            ::tpcomm::allreduce::DType::F16 => {
                type $t = ::half::f16;
                $body
            }
            ::tpcomm::allreduce::DType::Bf16 => {
                type $t = ::half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_element;

/// Element `i` of rank `rank`'s input for verification `salt`: an integer in -8..=7, so
/// sums over up to 8 ranks are exact in f32, f16 and bf16 whatever the order.
pub(crate) fn input_value(rank: usize, i: usize, salt: u64) -> f32 {
    (splitmix64(salt ^ ((rank as u64) << 48) ^ i as u64) % 16) as f32 - 8.0
}

/// This rank's input of `count` elements for `salt`.
pub(crate) fn input<T: Element>(rank: usize, count: usize, salt: u64) -> Vec<T> {
    (0..count)
        .map(|i| T::from_f32(input_value(rank, i, salt)))
        .collect()
}

/// The exact sum over `ranks` of [`input`].
pub(crate) fn expected(ranks: usize, count: usize, salt: u64) -> Vec<f32> {
    (0..count)
        .map(|i| (0..ranks).map(|r| input_value(r, i, salt)).sum())
        .collect()
}

/// What is wrong with `got` against `want`, if anything.
pub(crate) fn check<T: Element>(got: &[T], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, expected {}", got.len(), want.len()));
    }
    let bad = got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_f32().to_bits() != w.to_bits())?;
    Some(format!(
        "element {bad} is {}, expected {}",
        got[bad].to_f32(),
        want[bad]
    ))
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn integer_inputs_sum_exactly_in_every_dtype() {
        let want = expected(8, 64, 3);
        let mut sum = vec![0f32; 64];
        for r in 0..8 {
            for (s, v) in sum.iter_mut().zip(input::<bf16>(r, 64, 3)) {
                *s += v.to_f32();
            }
        }
        let got: Vec<bf16> = sum.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(check(&got, &want), None);
        let mut wrong = got.clone();
        wrong[5] = bf16::from_f32(100.0);
        assert!(check(&wrong, &want).unwrap().starts_with("element 5"));
    }
}
