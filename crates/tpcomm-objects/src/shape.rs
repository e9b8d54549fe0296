//! A value's shape as serde sees it.
//!
//! postcard's bytes say nothing of their type: `0u64` and `""` are the same byte, and a
//! reader that asks for the wrong type may decode a value silently. serde offers no schema,
//! but both sides of a value make the same calls of serde's data model, in the same order:
//! the writer's `Serialize` calls `serialize_u64`, a reader's `Deserialize` of a matching
//! type calls `deserialize_u64`. A [`Shape`] folds the first [`SHAPE_CALLS`] of those calls
//! (the data model's kind, and the field count of a struct or tuple: no names, so that an
//! owned type and its borrowing twin, `String` and `&str`, `Step` and `StepRef<'a>`, have
//! one shape) into 64 bits. The writer's encoding records it, the reader's decoding records
//! its own, and a difference is [`DecodeError::ShapeMismatch`](crate::DecodeError): a value
//! of another type, caught even when its bytes decode.
//!
//! Equivalent in the fold: `str` and `string`, `bytes` and `byte_buf`, `unit` and unit
//! structs, every kind of struct and tuple of `n` fields, every kind of enum variant (the
//! variant index is the value's, not the type's). Left out: newtype structs (postcard
//! writes their inner value alone), identifiers. Not caught: a difference past the first
//! [`SHAPE_CALLS`] calls, and types the data model does not tell apart (`Vec<u8>` and
//! `[u8]` are sequences of `u8` on both sides).

use std::cell::Cell;

/// How many calls of serde's data model a [`Shape`] folds.
pub const SHAPE_CALLS: u32 = 32;

/// A fingerprint of a value's shape: the data-model kinds of the first [`SHAPE_CALLS`]
/// calls its `Serialize` (writer) or `Deserialize` (reader) makes, folded into 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape(u64);

impl Shape {
    /// The shape from its 64 bits (as a frame or a ring carries them).
    pub const fn from_bits(bits: u64) -> Self {
        Self(bits)
    }

    /// Its 64 bits.
    pub const fn bits(self) -> u64 {
        self.0
    }
}

/// A call of serde's data model, as the fold sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Bool = 1,
    I8,
    I16,
    I32,
    I64,
    I128,
    U8,
    U16,
    U32,
    U64,
    U128,
    F32,
    F64,
    Char,
    /// `str` and `string`.
    Str,
    /// `bytes` and `byte_buf`.
    Bytes,
    Option,
    /// `unit` and unit structs.
    Unit,
    Seq,
    Map,
    /// Structs, tuples and tuple structs (the field count goes with it).
    Fields,
    /// Enums, whatever the variant.
    Enum,
}

/// The FNV-1a offset basis: the shape of nothing.
const EMPTY: u64 = 0xcbf2_9ce4_8422_2325;
/// The FNV-1a 64-bit prime.
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// The fold of one encoding or decoding: the calls left to record and the shape so far.
#[derive(Debug)]
pub(crate) struct Recorder {
    left: Cell<u32>,
    shape: Cell<u64>,
}

impl Recorder {
    /// A recorder of the first [`SHAPE_CALLS`] calls.
    pub(crate) fn new() -> Self {
        Self {
            left: Cell::new(SHAPE_CALLS),
            shape: Cell::new(EMPTY),
        }
    }

    /// A recorder that records nothing (decodes that check no shape).
    pub(crate) fn off() -> Self {
        Self {
            left: Cell::new(0),
            shape: Cell::new(EMPTY),
        }
    }

    /// Records a call of `kind` (with `fields` for [`Kind::Fields`], 0 otherwise).
    #[inline]
    pub(crate) fn record(&self, kind: Kind, fields: usize) {
        let left = self.left.get();
        if left == 0 {
            return;
        }
        self.left.set(left - 1);
        let word = kind as u64 | (fields as u64) << 8;
        self.shape
            .set((self.shape.get() ^ word).wrapping_mul(PRIME));
    }

    /// Whether it still records calls.
    #[inline]
    pub(crate) fn recording(&self) -> bool {
        self.left.get() > 0
    }

    /// The shape recorded.
    pub(crate) fn shape(&self) -> Shape {
        Shape(self.shape.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fold_tells_kinds_and_field_counts_apart_and_stops_after_its_calls() {
        let fold = |calls: &[(Kind, usize)]| {
            let r = Recorder::new();
            calls.iter().for_each(|&(k, n)| r.record(k, n));
            r.shape()
        };
        assert_ne!(fold(&[(Kind::U64, 0)]), fold(&[(Kind::Str, 0)]));
        assert_ne!(fold(&[(Kind::Fields, 2)]), fold(&[(Kind::Fields, 3)]));
        assert_ne!(
            fold(&[(Kind::U8, 0)]),
            fold(&[(Kind::U8, 0), (Kind::U8, 0)])
        );
        let many = vec![(Kind::U8, 0); SHAPE_CALLS as usize];
        let more = vec![(Kind::U8, 0); SHAPE_CALLS as usize + 5];
        assert_eq!(fold(&many), fold(&more));
        let off = Recorder::off();
        off.record(Kind::U64, 0);
        assert_eq!(off.shape(), Recorder::new().shape());
    }
}
