//! The encoder's depth bound and shape: a `serde::Serializer` wrapper that counts nesting
//! as the decoder's [`Bounded`](crate::depth) counts it, and records the value's
//! [`Shape`].
//!
//! postcard encodes a recursive value by recursion too: an honest value nested 100,000
//! levels deep overflows a 2 MiB stack in the encoder (a debug build's from about 5,000).
//! [`Limited`] wraps postcard's serializer and every compound it hands out, so that each
//! container entered (option, sequence, tuple, tuple struct, map, struct, enum and its
//! tuple or struct variant, newtype struct) takes a level of the same [`Budget`] the
//! decoder keeps, for as long as it is being encoded: a value that encodes within
//! `max_depth` decodes within it, and one that does not is refused before it recurses
//! further ([`EncodeError::TooDeep`]). Every 8th level looks at the stack left, and where
//! less than 256 KiB is, the encoder stops with [`EncodeError::StackShort`] instead of
//! overflowing it: the encoder's frames are small (a `Serialize` borrows what it writes), so
//! the 512 levels the limit allows fit a 2 MiB stack. The decoder's way, the whole decode
//! run again on a fresh segment (`stack.rs`), would need the bytes written so far taken
//! back, which a flavor streaming into a ring cannot do.

use serde::ser::{
    self, Serialize, SerializeMap, SerializeSeq, SerializeStruct, SerializeStructVariant,
    SerializeTuple, SerializeTupleStruct, SerializeTupleVariant, Serializer,
};

use crate::depth::Budget;
use crate::shape::{Kind, Shape};

/// Why a value could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// postcard refused the value (or its output refused the bytes).
    #[error("postcard refused the value")]
    Postcard(#[from] postcard::Error),
    /// The value nests containers deeper than the limit (counted as the decoder counts
    /// them): encoding stopped there, and nothing the encoder wrote should be sent.
    #[error("the value nests deeper than {limit} levels (Options::max_depth)")]
    TooDeep {
        /// The limit in force.
        limit: usize,
    },
    /// The value nests deeper than the encoding thread's stack holds: less than 256 KiB of
    /// it was left at level `level` (within the limit). Nothing the encoder wrote should be
    /// sent; a thread with a larger stack encodes it.
    #[error("the value nests deeper than this thread's stack holds (at level {level})")]
    StackShort {
        /// The level reached.
        level: usize,
    },
}

/// Encodes `value` into postcard's `flavor` with nesting bounded by `max_depth` (as
/// decoding bounds it), and records its [`Shape`]: the building block for callers that
/// write postcard's output themselves (a size pass, a ring's chunks). Never overflows the
/// stack.
pub fn encode_shaped_with_flavor<T, F>(
    value: &T,
    flavor: F,
    max_depth: usize,
) -> Result<(F::Output, Shape), EncodeError>
where
    T: Serialize + ?Sized,
    F: postcard::ser_flavors::Flavor,
{
    let budget = Budget::recording(max_depth, 0);
    let mut serializer = postcard::Serializer { output: flavor };
    let encoded = value.serialize(Limited {
        inner: &mut serializer,
        budget: &budget,
    });
    match encoded {
        Ok(()) => {
            let output = serializer.output.finalize()?;
            Ok((output, budget.shape.shape()))
        }
        Err(_) if budget.exceeded() => Err(EncodeError::TooDeep { limit: max_depth }),
        Err(e) => match budget.shortage() {
            Some(short) => Err(EncodeError::StackShort { level: short.level }),
            None => Err(EncodeError::Postcard(e)),
        },
    }
}

/// [`encode_append`](crate::encode_append) with nesting bounded by `max_depth` and the
/// value's [`Shape`] recorded.
pub fn encode_append_shaped<T: Serialize + ?Sized>(
    value: &T,
    buf: Vec<u8>,
    max_depth: usize,
) -> Result<(Vec<u8>, Shape), EncodeError> {
    encode_shaped_with_flavor(value, crate::collectives::append_flavor(buf), max_depth)
}

/// A serializer whose nesting is bounded by `budget`, recording the shape.
struct Limited<'b, S> {
    inner: S,
    budget: &'b Budget,
}

/// A value serialized through a bounded serializer.
struct Limit<'b, T: ?Sized> {
    value: &'b T,
    budget: &'b Budget,
}

impl<T: Serialize + ?Sized> Serialize for Limit<'_, T> {
    #[inline]
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(Limited {
            inner: s,
            budget: self.budget,
        })
    }
}

/// A compound of the inner serializer, its elements bounded, giving back `levels` levels
/// when it ends.
struct Compound<'b, C> {
    inner: C,
    budget: &'b Budget,
    levels: usize,
}

impl<'b, S: Serializer> Limited<'b, S> {
    fn limit<'v, T: ?Sized>(&self, value: &'v T) -> Limit<'v, T>
    where
        'b: 'v,
    {
        Limit {
            value,
            budget: self.budget,
        }
    }

    /// Takes `levels` levels (recording `kind` with `fields`), failing past the budget or
    /// where the thread's stack runs short (see [`Budget::stack_short`]).
    #[inline]
    fn enter(&self, levels: usize, kind: Kind, fields: usize) -> Result<(), S::Error> {
        self.budget.shape.record(kind, fields);
        for taken in 0..levels {
            let entered = self
                .budget
                .enter_or(|| <S::Error as ser::Error>::custom("nesting too deep"))
                .and_then(|()| self.stack());
            if let Err(e) = entered {
                (0..taken).for_each(|_| self.budget.leave());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Fails when the level just entered is one the stack is looked at and the thread's
    /// runs short ([`Budget::stack_short`]).
    #[inline]
    fn stack(&self) -> Result<(), S::Error> {
        if self.budget.stack_short() {
            self.budget.leave();
            return Err(<S::Error as ser::Error>::custom("the stack runs short"));
        }
        Ok(())
    }

    /// Gives `levels` levels back.
    fn leave(&self, levels: usize) {
        (0..levels).for_each(|_| self.budget.leave());
    }

    /// A leaf of `kind`.
    #[inline]
    fn leaf(&self, kind: Kind) {
        self.budget.shape.record(kind, 0);
    }
}

/// Leaf methods: recorded, then forwarded.
macro_rules! leaves {
    ($($method:ident($ty:ty) => $kind:ident),* $(,)?) => {$(
        #[inline]
        fn $method(self, v: $ty) -> Result<S::Ok, S::Error> {
            self.leaf(Kind::$kind);
            self.inner.$method(v)
        }
    )*};
}

impl<'b, S: Serializer> Serializer for Limited<'b, S> {
    type Ok = S::Ok;
    type Error = S::Error;
    type SerializeSeq = Compound<'b, S::SerializeSeq>;
    type SerializeTuple = Compound<'b, S::SerializeTuple>;
    type SerializeTupleStruct = Compound<'b, S::SerializeTupleStruct>;
    type SerializeTupleVariant = Compound<'b, S::SerializeTupleVariant>;
    type SerializeMap = Compound<'b, S::SerializeMap>;
    type SerializeStruct = Compound<'b, S::SerializeStruct>;
    type SerializeStructVariant = Compound<'b, S::SerializeStructVariant>;

    leaves!(
        serialize_bool(bool) => Bool,
        serialize_i8(i8) => I8,
        serialize_i16(i16) => I16,
        serialize_i32(i32) => I32,
        serialize_i64(i64) => I64,
        serialize_i128(i128) => I128,
        serialize_u8(u8) => U8,
        serialize_u16(u16) => U16,
        serialize_u32(u32) => U32,
        serialize_u64(u64) => U64,
        serialize_u128(u128) => U128,
        serialize_f32(f32) => F32,
        serialize_f64(f64) => F64,
        serialize_char(char) => Char,
        serialize_str(&str) => Str,
        serialize_bytes(&[u8]) => Bytes,
    );

    #[inline]
    fn collect_str<T: std::fmt::Display + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        self.leaf(Kind::Str);
        self.inner.collect_str(value)
    }

    #[inline]
    fn serialize_unit(self) -> Result<S::Ok, S::Error> {
        self.leaf(Kind::Unit);
        self.inner.serialize_unit()
    }

    #[inline]
    fn serialize_unit_struct(self, name: &'static str) -> Result<S::Ok, S::Error> {
        self.leaf(Kind::Unit);
        self.inner.serialize_unit_struct(name)
    }

    fn serialize_none(self) -> Result<S::Ok, S::Error> {
        // The decoder takes the option's level whatever its value.
        self.enter(1, Kind::Option, 0)?;
        self.leave(1);
        self.inner.serialize_none()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        self.enter(1, Kind::Option, 0)?;
        let r = self.inner.serialize_some(&Limit {
            value,
            budget: self.budget,
        });
        self.budget.leave();
        r
    }

    fn serialize_unit_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
    ) -> Result<S::Ok, S::Error> {
        self.enter(1, Kind::Enum, 0)?;
        self.leave(1);
        self.inner.serialize_unit_variant(name, index, variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        self.budget
            .enter_or(|| <S::Error as ser::Error>::custom("nesting too deep"))?;
        self.stack()?;
        let limited = self.limit(value);
        let r = self.inner.serialize_newtype_struct(name, &limited);
        self.budget.leave();
        r
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        self.enter(1, Kind::Enum, 0)?;
        let limited = self.limit(value);
        let r = self
            .inner
            .serialize_newtype_variant(name, index, variant, &limited);
        self.budget.leave();
        r
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Self::SerializeSeq, S::Error> {
        self.enter(1, Kind::Seq, 0)?;
        match self.inner.serialize_seq(len) {
            Ok(c) => Ok(Compound {
                inner: c,
                budget: self.budget,
                levels: 1,
            }),
            Err(e) => Err(e),
        }
    }

    fn serialize_tuple(self, len: usize) -> Result<Self::SerializeTuple, S::Error> {
        self.enter(1, Kind::Fields, len)?;
        let budget = self.budget;
        let c = self.inner.serialize_tuple(len)?;
        Ok(Compound {
            inner: c,
            budget,
            levels: 1,
        })
    }

    fn serialize_tuple_struct(
        self,
        name: &'static str,
        len: usize,
    ) -> Result<Self::SerializeTupleStruct, S::Error> {
        self.enter(1, Kind::Fields, len)?;
        let budget = self.budget;
        let c = self.inner.serialize_tuple_struct(name, len)?;
        Ok(Compound {
            inner: c,
            budget,
            levels: 1,
        })
    }

    fn serialize_tuple_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeTupleVariant, S::Error> {
        // The enum's level and the variant's, as the decoder takes them.
        self.budget.shape.record(Kind::Enum, 0);
        self.enter(2, Kind::Fields, len)?;
        let budget = self.budget;
        let c = self
            .inner
            .serialize_tuple_variant(name, index, variant, len)?;
        Ok(Compound {
            inner: c,
            budget,
            levels: 2,
        })
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Self::SerializeMap, S::Error> {
        self.enter(1, Kind::Map, 0)?;
        let budget = self.budget;
        let c = self.inner.serialize_map(len)?;
        Ok(Compound {
            inner: c,
            budget,
            levels: 1,
        })
    }

    fn serialize_struct(
        self,
        name: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStruct, S::Error> {
        self.enter(1, Kind::Fields, len)?;
        let budget = self.budget;
        let c = self.inner.serialize_struct(name, len)?;
        Ok(Compound {
            inner: c,
            budget,
            levels: 1,
        })
    }

    fn serialize_struct_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStructVariant, S::Error> {
        self.budget.shape.record(Kind::Enum, 0);
        self.enter(2, Kind::Fields, len)?;
        let budget = self.budget;
        let c = self
            .inner
            .serialize_struct_variant(name, index, variant, len)?;
        Ok(Compound {
            inner: c,
            budget,
            levels: 2,
        })
    }

    #[inline]
    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

impl<C> Compound<'_, C> {
    fn limit<'v, T: ?Sized>(&self, value: &'v T) -> Limit<'v, T>
    where
        Self: 'v,
    {
        Limit {
            value,
            budget: self.budget,
        }
    }

    /// Gives the compound's levels back.
    fn done(&self) {
        (0..self.levels).for_each(|_| self.budget.leave());
    }
}

/// The compounds whose elements come one by one: each element bounded, the levels given
/// back at the end.
macro_rules! compounds {
    ($($trait:ident::$method:ident),* $(,)?) => {$(
        impl<C: $trait> $trait for Compound<'_, C> {
            type Ok = C::Ok;
            type Error = C::Error;

            #[inline]
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), C::Error> {
                let limited = self.limit(value);
                self.inner.$method(&limited)
            }

            fn end(self) -> Result<C::Ok, C::Error> {
                self.done();
                self.inner.end()
            }
        }
    )*};
}

compounds!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

/// The compounds whose fields have names: each field bounded, skipped ones forwarded.
macro_rules! named_compounds {
    ($($trait:ident),* $(,)?) => {$(
        impl<C: $trait> $trait for Compound<'_, C> {
            type Ok = C::Ok;
            type Error = C::Error;

            #[inline]
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<(), C::Error> {
                let limited = self.limit(value);
                self.inner.serialize_field(key, &limited)
            }

            fn skip_field(&mut self, key: &'static str) -> Result<(), C::Error> {
                self.inner.skip_field(key)
            }

            fn end(self) -> Result<C::Ok, C::Error> {
                self.done();
                self.inner.end()
            }
        }
    )*};
}

named_compounds!(SerializeStruct, SerializeStructVariant);

impl<C: SerializeMap> SerializeMap for Compound<'_, C> {
    type Ok = C::Ok;
    type Error = C::Error;

    #[inline]
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), C::Error> {
        let limited = self.limit(key);
        self.inner.serialize_key(&limited)
    }

    #[inline]
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), C::Error> {
        let limited = self.limit(value);
        self.inner.serialize_value(&limited)
    }

    fn end(self) -> Result<C::Ok, C::Error> {
        self.done();
        self.inner.end()
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::gathered::decode_exact_shaped;

    /// `Node(Some(Node(Some(... Node(None)))))`: two levels a link.
    #[derive(Debug, Serialize, Deserialize)]
    struct Nest(Option<Box<Nest>>);

    fn chain(links: usize) -> Nest {
        (0..links).fold(Nest(None), |n, _| Nest(Some(Box::new(n))))
    }

    #[test]
    fn a_value_encodes_exactly_as_postcard_encodes_it() {
        let value = (7u64, "step", vec![Some(1u8), None], [2u16; 3]);
        let (bytes, _) = encode_append_shaped(&value, Vec::new(), 64).unwrap();
        assert_eq!(bytes, postcard::to_allocvec(&value).unwrap());
    }

    #[test]
    fn the_encoder_takes_the_levels_the_decoder_takes() {
        // 8 links and the innermost option: 18 levels.
        let (bytes, _) = encode_append_shaped(&chain(8), Vec::new(), 18).unwrap();
        assert!(decode_exact_shaped::<Nest>(0, &bytes, 18, None).is_ok());
        assert_eq!(
            encode_append_shaped(&chain(8), Vec::new(), 17).unwrap_err(),
            EncodeError::TooDeep { limit: 17 }
        );
        assert!(decode_exact_shaped::<Nest>(0, &bytes, 17, None).is_err());
    }

    #[test]
    fn a_writer_s_shape_is_the_shape_its_reader_decodes_with() {
        #[derive(Serialize)]
        struct Step {
            id: u64,
            names: Vec<String>,
            blob: serde_bytes::ByteBuf,
            kind: Option<Result<u8, ()>>,
        }
        #[derive(Deserialize)]
        struct StepRef<'a> {
            _id: u64,
            #[serde(borrow)]
            _names: Vec<&'a str>,
            #[serde(borrow)]
            _blob: &'a serde_bytes::Bytes,
            _kind: Option<Result<u8, ()>>,
        }
        let step = Step {
            id: 3,
            names: vec!["a".into(), "bc".into()],
            blob: serde_bytes::ByteBuf::from(vec![1, 2]),
            kind: Some(Err(())),
        };
        let (bytes, shape) = encode_append_shaped(&step, Vec::new(), 64).unwrap();
        assert!(decode_exact_shaped::<StepRef<'_>>(0, &bytes, 64, Some(shape)).is_ok());
        // The same bytes as another type: refused.
        let (zero, shape) = encode_append_shaped(&0u64, Vec::new(), 64).unwrap();
        assert!(decode_exact_shaped::<String>(0, &zero, 64, None).is_ok());
        assert!(decode_exact_shaped::<String>(0, &zero, 64, Some(shape)).is_err());
    }

    /// Runs `f` on a thread of `stack` bytes.
    fn on_stack<R: Send + 'static>(stack: usize, f: impl FnOnce() -> R + Send + 'static) -> R {
        std::thread::Builder::new()
            .stack_size(stack)
            .spawn(f)
            .unwrap()
            .join()
            .unwrap()
    }

    /// Unlinks `n` one link at a time: the drop of a long chain recurses too.
    fn unlink(n: Nest) {
        let mut next = n.0;
        while let Some(n) = next {
            next = n.0;
        }
    }

    #[test]
    fn a_hundred_thousand_levels_are_refused_without_overflowing_the_stack() {
        let refused = on_stack(2 << 20, || {
            let deep = chain(100_000);
            let r = encode_append_shaped(&deep, Vec::new(), 512);
            unlink(deep);
            r
        });
        assert_eq!(refused.unwrap_err(), EncodeError::TooDeep { limit: 512 });
    }

    #[test]
    fn a_value_deeper_than_a_small_stack_holds_is_refused_not_overflowed() {
        let refused = on_stack(256 << 10, || {
            let deep = chain(400);
            let r = encode_append_shaped(&deep, Vec::new(), 512);
            unlink(deep);
            r
        });
        assert!(
            matches!(refused, Err(EncodeError::StackShort { level }) if level % 8 == 0),
            "{refused:?}"
        );
    }
}
