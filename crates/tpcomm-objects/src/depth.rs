//! A nesting-depth bound for decoding peer bytes.
//!
//! postcard decodes a recursive type (an enum holding `Vec<Self>` or `Box<Self>`) by
//! recursion and has no depth limit, so 10,000 crafted levels (20 KB) overflow a 2 MiB thread
//! stack: the process aborts. [`Bounded`] wraps any `serde::Deserializer` and everything it
//! hands out (sequence, map and enum accesses, the deserializers of `Some` and newtypes, the
//! seeds of elements and variants), so that every nested value of the peer's bytes is decoded
//! through it. Each *container* entered (option, sequence, tuple, tuple struct, map, struct,
//! enum, newtype struct, and `deserialize_any`/`deserialize_ignored_any`) takes one level of a
//! shared [`Budget`] for as long as it is being decoded; entering one more than the budget
//! allows fails with a serde error before recursing, and the budget remembers it so that the
//! caller reports [`DecodeError::TooDeep`](crate::DecodeError::TooDeep).
//!
//! Leaves (integers, strings, bytes, unit) pass through with their visitor wrapped only so
//! that a visitor handed a nested access by an unusual deserializer stays bounded. Everything
//! is generic and inlined: the cost on the decode path is a counter update per container.
//!
//! Every [`STACK_LOOK_EVERY`]th level looks at the stack left and, where it runs short,
//! fails the decode, which its caller runs again from the first byte on a fresh segment (see
//! `stack.rs`), so that the allowed depth is safe on any thread's stack; and the wrappers
//! record the value's [`Shape`](crate::Shape) when asked (see `shape.rs`). Recording is a
//! type parameter of the wrappers (`REC`): a container entered once the shape's calls are all
//! recorded (or when no shape is asked for) hands its elements wrappers that record nothing,
//! so that the leaves of a large value pay no look at the recorder.

use std::cell::Cell;
use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

use crate::shape::{Kind, Recorder};
use crate::stack::{self, Shortage, STACK_LOOK_EVERY};

/// The levels of nesting left, shared by every wrapper of one decode (or encode, see
/// `encode_bound.rs`).
#[derive(Debug)]
pub(crate) struct Budget {
    left: Cell<usize>,
    /// The levels allowed.
    max: usize,
    exceeded: Cell<bool>,
    /// Where the stack was when the budget was made (`stack::here`).
    start: usize,
    /// Where the stack first ran short, if it did.
    short: Cell<Option<Shortage>>,
    /// Elements the containers decoded so far may still reserve up front, together.
    reserve_left: Cell<usize>,
    /// The shape of the value so far (see `shape.rs`); off unless asked for.
    pub(crate) shape: Recorder,
}

impl Budget {
    /// A budget of `max_depth` nested containers, for a decode of `input_bytes` bytes.
    ///
    /// Containers reserve room for their announced length before reading an element
    /// (serde caps each at 1 MiB, but a nested one keeps it while its children decode):
    /// the size hints they see are granted from `input_bytes` elements for the whole
    /// decode, since every element that is not zero-sized takes at least one input byte.
    /// So up-front reservations grow with the bytes a peer sent, not with the depth.
    pub(crate) fn new(max_depth: usize, input_bytes: usize) -> Self {
        Self {
            left: Cell::new(max_depth),
            max: max_depth,
            exceeded: Cell::new(false),
            start: stack::here(),
            short: Cell::new(None),
            reserve_left: Cell::new(input_bytes),
            shape: Recorder::off(),
        }
    }

    /// [`Budget::new`], recording the value's [`Shape`](crate::Shape).
    pub(crate) fn recording(max_depth: usize, input_bytes: usize) -> Self {
        Self {
            shape: Recorder::new(),
            ..Self::new(max_depth, input_bytes)
        }
    }

    /// The part of a container's size hint still covered by the input.
    #[inline]
    fn grant(&self, hint: Option<usize>) -> Option<usize> {
        hint.map(|h| {
            let granted = h.min(self.reserve_left.get());
            self.reserve_left.set(self.reserve_left.get() - granted);
            granted
        })
    }

    /// Whether a decode through this budget failed because it nested too deep.
    pub(crate) fn exceeded(&self) -> bool {
        self.exceeded.get()
    }

    /// Takes one level; past the budget, remembers it and fails with `too_deep()`.
    #[inline]
    pub(crate) fn enter_or<E>(&self, too_deep: impl FnOnce() -> E) -> Result<(), E> {
        match self.left.get() {
            0 => {
                self.exceeded.set(true);
                Err(too_deep())
            }
            left => {
                self.left.set(left - 1);
                Ok(())
            }
        }
    }

    #[inline]
    fn enter<E: de::Error>(&self) -> Result<(), E> {
        self.enter_or(|| E::custom("nesting too deep"))
    }

    /// Gives a level back.
    #[inline]
    pub(crate) fn leave(&self) {
        self.left.set(self.left.get() + 1);
    }

    /// The levels taken now (the current one counted from 1).
    #[inline]
    pub(crate) fn level(&self) -> usize {
        self.max - self.left.get()
    }

    /// Whether the level just entered is one the stack is looked at and less than
    /// [`RED_ZONE`](stack::RED_ZONE) of it is left (the first time remembered for
    /// [`shortage`](Self::shortage)).
    #[inline]
    pub(crate) fn stack_short(&self) -> bool {
        self.level().is_multiple_of(STACK_LOOK_EVERY) && self.look_at_the_stack()
    }

    /// [`stack_short`](Self::stack_short) at a level where the stack is looked at: out of
    /// line and not generic, so that the containers it is looked in stay small.
    #[cold]
    #[inline(never)]
    fn look_at_the_stack(&self) -> bool {
        let Some(short) = stack::look(self.level(), self.start) else {
            return false;
        };
        if self.short.get().is_none() {
            self.short.set(Some(short));
        }
        true
    }

    /// Where the stack first ran short under this budget, if it did.
    pub(crate) fn shortage(&self) -> Option<Shortage> {
        self.short.get()
    }

    /// `inner`, bounded by this budget (recording the shape if `REC`).
    #[inline]
    fn bound<D, const REC: bool>(&self, inner: D) -> Bounded<'_, D, REC> {
        Bounded {
            inner,
            budget: self,
        }
    }

    /// Runs `f` one level deeper; fails instead where the stack runs short (the caller
    /// sees [`shortage`](Self::shortage) and decodes again on a fresh segment: see
    /// `stack.rs`). `f` is called in this one place, so that it inlines.
    #[inline]
    fn nested<T, E: de::Error>(&self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        self.enter()?;
        if self.stack_short() {
            self.leave();
            return Err(E::custom("the stack runs short"));
        }
        let r = f();
        self.leave();
        r
    }
}

/// A deserializer whose nesting is bounded by `budget`; with `REC`, it records the calls
/// it sees in the budget's shape (while the recorder takes any).
pub(crate) struct Bounded<'b, D, const REC: bool> {
    pub(crate) inner: D,
    pub(crate) budget: &'b Budget,
}

/// A visitor, seed or access wrapped so that what it hands on stays bounded (and, with
/// `REC`, recorded).
struct Wrap<'b, X, const REC: bool> {
    inner: X,
    budget: &'b Budget,
}

impl<'b, X, const REC: bool> Wrap<'b, X, REC> {
    #[inline]
    fn new(inner: X, budget: &'b Budget) -> Self {
        Self { inner, budget }
    }
}

/// Hands `$inner` on to `$call` wrapped for the children of a container: recording while
/// this wrapper records and the recorder still takes calls, recording nothing otherwise.
macro_rules! to_children {
    ($self:ident, $inner:expr, |$w:ident| $call:expr) => {
        if REC && $self.budget.shape.recording() {
            let $w = Wrap::<_, true>::new($inner, $self.budget);
            $call
        } else {
            let $w = Wrap::<_, false>::new($inner, $self.budget);
            $call
        }
    };
}

/// Methods that decode a leaf: forwarded with the visitor wrapped. Arguments before the
/// visitor are written in parentheses after the method's name.
macro_rules! leaf {
    ($($method:ident $(($($arg:ident: $ty:ty),*))? => $kind:expr),* $(,)?) => {$(
        #[inline]
        fn $method<V: Visitor<'de>>(
            self,
            $($($arg: $ty,)*)?
            visitor: V,
        ) -> Result<V::Value, D::Error> {
            if REC {
                if let Some(kind) = $kind {
                    self.budget.shape.record(kind, 0);
                }
            }
            self.inner.$method($($($arg,)*)? Wrap::<_, REC>::new(visitor, self.budget))
        }
    )*};
}

/// Methods that decode a container: forwarded one level deeper, with the visitor wrapped.
/// Arguments as for `leaf!`.
macro_rules! container {
    ($($method:ident $(($($arg:ident: $ty:ty),*))? => $record:expr),* $(,)?) => {$(
        #[inline]
        fn $method<V: Visitor<'de>>(
            self,
            $($($arg: $ty,)*)?
            visitor: V,
        ) -> Result<V::Value, D::Error> {
            let budget = self.budget;
            if REC {
                if let Some((kind, fields)) = $record {
                    budget.shape.record(kind, fields);
                }
            }
            budget.nested(|| self.inner.$method($($($arg,)*)? Wrap::<_, REC>::new(visitor, budget)))
        }
    )*};
}

impl<'de, D: Deserializer<'de>, const REC: bool> Deserializer<'de> for Bounded<'_, D, REC> {
    type Error = D::Error;

    leaf!(
        deserialize_bool => Some(Kind::Bool),
        deserialize_i8 => Some(Kind::I8),
        deserialize_i16 => Some(Kind::I16),
        deserialize_i32 => Some(Kind::I32),
        deserialize_i64 => Some(Kind::I64),
        deserialize_i128 => Some(Kind::I128),
        deserialize_u8 => Some(Kind::U8),
        deserialize_u16 => Some(Kind::U16),
        deserialize_u32 => Some(Kind::U32),
        deserialize_u64 => Some(Kind::U64),
        deserialize_u128 => Some(Kind::U128),
        deserialize_f32 => Some(Kind::F32),
        deserialize_f64 => Some(Kind::F64),
        deserialize_char => Some(Kind::Char),
        deserialize_str => Some(Kind::Str),
        deserialize_string => Some(Kind::Str),
        deserialize_bytes => Some(Kind::Bytes),
        deserialize_byte_buf => Some(Kind::Bytes),
        deserialize_unit => Some(Kind::Unit),
        deserialize_identifier => None::<Kind>,
        deserialize_unit_struct(name: &'static str) => Some(Kind::Unit),
    );

    container!(
        deserialize_any => None::<(Kind, usize)>,
        deserialize_ignored_any => None::<(Kind, usize)>,
        deserialize_option => Some((Kind::Option, 0)),
        deserialize_seq => Some((Kind::Seq, 0)),
        deserialize_map => Some((Kind::Map, 0)),
        deserialize_newtype_struct(name: &'static str) => None::<(Kind, usize)>,
        deserialize_tuple(len: usize) => Some((Kind::Fields, len)),
        deserialize_tuple_struct(name: &'static str, len: usize) => Some((Kind::Fields, len)),
        deserialize_struct(name: &'static str, fields: &'static [&'static str])
            => Some((Kind::Fields, fields.len())),
        deserialize_enum(name: &'static str, variants: &'static [&'static str])
            => Some((Kind::Enum, 0)),
    );

    #[inline]
    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

macro_rules! forward_visit {
    ($($method:ident: $ty:ty),* $(,)?) => {$(
        #[inline]
        fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>, const REC: bool> Visitor<'de> for Wrap<'_, V, REC> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit!(
        visit_bool: bool,
        visit_i8: i8,
        visit_i16: i16,
        visit_i32: i32,
        visit_i64: i64,
        visit_i128: i128,
        visit_u8: u8,
        visit_u16: u16,
        visit_u32: u32,
        visit_u64: u64,
        visit_u128: u128,
        visit_f32: f32,
        visit_f64: f64,
        visit_char: char,
        visit_str: &str,
        visit_borrowed_str: &'de str,
        visit_string: String,
        visit_bytes: &[u8],
        visit_borrowed_bytes: &'de [u8],
        visit_byte_buf: Vec<u8>,
    );

    #[inline]
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    #[inline]
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    #[inline]
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_some(self.budget.bound::<_, REC>(d))
    }

    #[inline]
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner
            .visit_newtype_struct(self.budget.bound::<_, REC>(d))
    }

    #[inline]
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        to_children!(self, seq, |w| self.inner.visit_seq(w))
    }

    #[inline]
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        to_children!(self, map, |w| self.inner.visit_map(w))
    }

    #[inline]
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        to_children!(self, data, |w| self.inner.visit_enum(w))
    }
}

/// A seed deserializes its value through a bounded deserializer.
impl<'de, S: DeserializeSeed<'de>, const REC: bool> DeserializeSeed<'de> for Wrap<'_, S, REC> {
    type Value = S::Value;

    #[inline]
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.deserialize(self.budget.bound::<_, REC>(d))
    }
}

impl<'de, A: SeqAccess<'de>, const REC: bool> SeqAccess<'de> for Wrap<'_, A, REC> {
    type Error = A::Error;

    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.inner
            .next_element_seed(Wrap::<_, REC>::new(seed, self.budget))
    }

    #[inline]
    fn size_hint(&self) -> Option<usize> {
        self.budget.grant(self.inner.size_hint())
    }
}

impl<'de, A: MapAccess<'de>, const REC: bool> MapAccess<'de> for Wrap<'_, A, REC> {
    type Error = A::Error;

    #[inline]
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.inner
            .next_key_seed(Wrap::<_, REC>::new(seed, self.budget))
    }

    #[inline]
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.inner
            .next_value_seed(Wrap::<_, REC>::new(seed, self.budget))
    }

    #[inline]
    fn size_hint(&self) -> Option<usize> {
        self.budget.grant(self.inner.size_hint())
    }
}

impl<'b, 'de, A: EnumAccess<'de>, const REC: bool> EnumAccess<'de> for Wrap<'b, A, REC> {
    type Error = A::Error;
    type Variant = Wrap<'b, A::Variant, REC>;

    #[inline]
    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Self::Variant), A::Error> {
        let budget = self.budget;
        let (value, variant) = self.inner.variant_seed(Wrap::<_, REC>::new(seed, budget))?;
        Ok((value, Wrap::new(variant, budget)))
    }
}

impl<'de, A: VariantAccess<'de>, const REC: bool> VariantAccess<'de> for Wrap<'_, A, REC> {
    type Error = A::Error;

    #[inline]
    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    #[inline]
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.inner
            .newtype_variant_seed(Wrap::<_, REC>::new(seed, self.budget))
    }

    #[inline]
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        let budget = self.budget;
        if REC {
            budget.shape.record(Kind::Fields, len);
        }
        budget.nested(|| {
            self.inner
                .tuple_variant(len, Wrap::<_, REC>::new(visitor, budget))
        })
    }

    #[inline]
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        let budget = self.budget;
        if REC {
            budget.shape.record(Kind::Fields, fields.len());
        }
        budget.nested(|| {
            self.inner
                .struct_variant(fields, Wrap::<_, REC>::new(visitor, budget))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    enum Tree {
        Leaf(u8),
        Node(Vec<Tree>),
    }

    fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8], depth: usize) -> (Option<T>, bool) {
        let budget = Budget::new(depth, bytes.len());
        let mut de = postcard::Deserializer::from_bytes(bytes);
        let v = T::deserialize(Bounded::<_, false> {
            inner: &mut de,
            budget: &budget,
        })
        .ok();
        (v, budget.exceeded())
    }

    /// `Node([Node([... Leaf(7)])])`, `levels` nodes deep.
    fn nested(levels: usize) -> Vec<u8> {
        let mut b = [1u8, 1].repeat(levels);
        b.extend([0, 7]);
        b
    }

    #[test]
    fn a_value_within_the_budget_decodes_unchanged() {
        // Each node is an enum and a sequence: two levels; the leaf's enum one more.
        let (v, exceeded) = decode::<Tree>(&nested(2), 5);
        assert_eq!(v, Some(Tree::Node(vec![Tree::Node(vec![Tree::Leaf(7)])])));
        assert!(!exceeded);
    }

    #[test]
    fn one_level_past_the_budget_is_refused_and_remembered() {
        let (v, exceeded) = decode::<Tree>(&nested(2), 4);
        assert!(v.is_none());
        assert!(exceeded);
    }

    #[test]
    fn the_budget_is_restored_between_siblings() {
        // Node([Leaf, Leaf, ..., Leaf]): width never adds depth.
        let mut b = vec![1, 100];
        b.extend([0u8, 1].repeat(100));
        let (v, exceeded) = decode::<Tree>(&b, 3);
        assert!(matches!(v, Some(Tree::Node(children)) if children.len() == 100));
        assert!(!exceeded);
    }

    #[test]
    fn borrowed_strings_still_borrow_from_the_input() {
        let bytes = postcard::to_allocvec(&("peer", Some(vec!["a", "bc"]))).unwrap();
        let (v, _) = decode::<(&str, Option<Vec<&str>>)>(&bytes, 8);
        let (s, rest) = v.expect("decodes");
        assert_eq!((s, rest), ("peer", Some(vec!["a", "bc"])));
        assert!(bytes.as_ptr_range().contains(&s.as_ptr()));
    }
}
