//! Postcard decode of received bytes into the project's own types, through
//! `tpcomm_objects::decode_from` (the decode every collective runs).
//!
//! Whatever the bytes: an error or a value, never a panic or a stack overflow; and a decoded
//! value encodes and decodes back to itself (compared by encoding, so that a NaN equals
//! itself).
//!
//! The recursive types (`Tree`, `Chain`, and `Value`'s lists and pairs) reach the nesting
//! bound (`Options::max_depth`): postcard alone recursed once per level, so 30,000 levels
//! (the `deep_tree` and `deep_chain` seeds, 30 to 60 KB) overflowed the stack. The maximum
//! input length is raised for this target (`xtask/src/fuzz.rs`) so that such inputs are
//! reachable.

#![no_main]

use std::collections::BTreeMap;
use std::fmt::Debug;

use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tpcomm_ipc::{Envelope, HostHandle};

/// The conformance suite's object value (`tests/src/objects.rs`), mirrored here so that this
/// crate depends on the library crates only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Value {
    Unit,
    Nothing(Option<u32>),
    Bool(bool),
    I64(i64),
    U64(u64),
    F64Bits(u64),
    Text(String),
    List(Vec<Value>),
    Pair(Box<(Value, Value)>),
    Map(BTreeMap<String, Value>),
}

/// An enum holding `Vec<Self>` (a node is `[1, 1]` for one child).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Tree {
    Leaf,
    Node(Vec<Tree>),
}

/// An enum holding `Box<Self>` (a link is `[1]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Chain {
    End,
    Link(Box<Chain>),
}

/// The benchmark's `records:N` payload (`crates/tpcomm-bench/src/data/payload.rs`), mirrored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    id: u64,
    name: String,
    tokens: Vec<u32>,
    score: f64,
}

/// Its borrowed form: `name` points into the received bytes.
#[derive(Debug, Deserialize)]
struct RecordRef<'a> {
    #[allow(dead_code)]
    id: u64,
    #[serde(borrow)]
    name: &'a str,
    #[allow(dead_code)]
    tokens: Vec<u32>,
    #[allow(dead_code)]
    score: f64,
}

/// An options-like struct of plain fields, optional values and a unit enum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Settings {
    max_total_bytes: u64,
    round_bytes: Option<u64>,
    small_slot_bytes: u32,
    path: Path,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
enum Path {
    Small,
    Single,
    Rounds,
}

/// Decodes `bytes` as a `T`; a value must survive an encode/decode round trip.
fn owned<T>(bytes: &[u8])
where
    T: Serialize + DeserializeOwned + Debug,
{
    let decoded = tpcomm_objects::decode_from::<T>(1, bytes);
    if let Err(tpcomm_objects::ObjectError::Decode { rank, .. }) = &decoded {
        assert_eq!(*rank, 1, "a decode error names the sender");
    }
    if let Ok(v) = decoded {
        let again = postcard::to_allocvec(&v).expect("a decoded value encodes");
        let back: T = tpcomm_objects::decode_from(1, &again).expect("its encoding decodes");
        let twice = postcard::to_allocvec(&back).expect("the copy encodes");
        assert_eq!(twice, again, "{v:?} changed in an encode/decode round trip");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which % 14 {
        0 => owned::<Envelope<HostHandle>>(bytes),
        1 => owned::<HostHandle>(bytes),
        // What `PeerMappings` all-gathers: each rank's envelopes, or none after a failed export.
        2 => owned::<Option<Vec<Envelope<HostHandle>>>>(bytes),
        3 => owned::<Vec<String>>(bytes),
        4 => owned::<Value>(bytes),
        5 => owned::<Vec<Value>>(bytes),
        6 => owned::<Record>(bytes),
        7 => owned::<Vec<Record>>(bytes),
        8 => owned::<Settings>(bytes),
        9 => owned::<(u64, Vec<u8>, Option<String>)>(bytes),
        10 => {
            if let Ok(r) = tpcomm_objects::decode_from::<RecordRef<'_>>(1, bytes) {
                assert!(bytes.len() >= r.name.len());
            }
        }
        11 => {
            let _ = tpcomm_objects::decode_from::<Vec<&str>>(1, bytes);
        }
        12 => owned::<Tree>(bytes),
        _ => owned::<Chain>(bytes),
    }
});
