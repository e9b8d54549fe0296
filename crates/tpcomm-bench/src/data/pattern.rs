//! The pseudo-random byte streams every byte payload is drawn from: a stream per rank and
//! salt, readable from any offset, so that a receiver can rebuild what each rank sent.

/// Writes bytes `offset..offset + out.len()` of the pseudo-random stream of `(rank, salt)`.
pub(crate) fn pattern(out: &mut [u8], rank: usize, salt: u64, offset: usize) {
    let mut pos = offset;
    let mut i = 0;
    while i < out.len() {
        let word = splitmix64(salt ^ ((rank as u64) << 48) ^ (pos / 8) as u64).to_le_bytes();
        let start = pos % 8;
        let take = (8 - start).min(out.len() - i);
        out[i..i + take].copy_from_slice(&word[start..start + take]);
        i += take;
        pos += take;
    }
}

/// SplitMix64: one well-mixed 64-bit word of `x`.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_at_an_offset_continues_the_stream() {
        let mut whole = vec![0u8; 100];
        pattern(&mut whole, 3, 7, 0);
        let mut tail = vec![0u8; 61];
        pattern(&mut tail, 3, 7, 39);
        assert_eq!(&whole[39..], &tail[..]);
    }
}
