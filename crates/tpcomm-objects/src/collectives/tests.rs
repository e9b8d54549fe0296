//! The encoder's bytes against postcard's own.

use super::codec::{append, FIXED_PIECES};
use proptest::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Serialize)]
struct Mixed {
    id: u64,
    name: String,
    tokens: Vec<u32>,
    bytes: serde_bytes::ByteBuf,
    score: f64,
    tag: Option<i128>,
    map: BTreeMap<String, Vec<i16>>,
}

proptest! {
    /// Appending gives exactly postcard's bytes after whatever the buffer held, for
    /// pieces on both sides of `FIXED_PIECES` (strings and byte strings of every length
    /// up to 100, varints of every width).
    #[test]
    fn append_writes_postcards_bytes_after_the_prefix(
        prefix in proptest::collection::vec(any::<u8>(), 0..40),
        id in any::<u64>(),
        name in "\\PC{0,100}",
        tokens in proptest::collection::vec(any::<u32>(), 0..40),
        bytes in proptest::collection::vec(any::<u8>(), 0..100),
        score in any::<f64>(),
        tag in any::<Option<i128>>(),
        map in proptest::collection::btree_map("[a-z]{0,40}", proptest::collection::vec(any::<i16>(), 0..8), 0..4),
    ) {
        let value = Mixed { id, name, tokens, bytes: serde_bytes::ByteBuf::from(bytes), score, tag, map };
        let got = append(&value, prefix.clone()).unwrap();
        let mut want = prefix;
        want.extend(postcard::to_stdvec(&value).unwrap());
        prop_assert_eq!(got, want);
    }
}

#[test]
fn append_handles_pieces_of_every_length_around_the_fixed_ones() {
    for len in 0..=4 * FIXED_PIECES {
        let s: String = "é".repeat(len / 2) + &"x".repeat(len % 2);
        assert_eq!(s.len(), len);
        assert_eq!(
            append(&s, vec![7]).unwrap(),
            [vec![7], postcard::to_stdvec(&s).unwrap()].concat(),
            "string of {len} bytes"
        );
    }
}
