//! What more than one test binary of this crate uses.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes that serialize verbatim (a tuple of `u8`: postcard writes no length), so that a
/// hostile rank sends exactly the crafted encoding through the ordinary collectives.
#[derive(Debug, Clone)]
pub(crate) struct Crafted(pub(crate) Vec<u8>);

impl Serialize for Crafted {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(self.0.len())?;
        for b in &self.0 {
            t.serialize_element(b)?;
        }
        t.end()
    }
}

/// Only so that the hostile rank can take part in the collectives; what it decodes is not
/// looked at.
impl<'de> Deserialize<'de> for Crafted {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u8::deserialize(d).map(|b| Crafted(vec![b]))
    }
}

/// A value whose serialization fails when `fail` is set (as `(false, text)` otherwise).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct FailOn {
    pub(crate) fail: bool,
    pub(crate) text: String,
}

impl Serialize for FailOn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.fail {
            Err(serde::ser::Error::custom("refusing to serialize"))
        } else {
            (false, &self.text).serialize(s)
        }
    }
}
