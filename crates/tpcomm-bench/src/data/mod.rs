//! What the benchmarks move, built the same way on every rank so that every receiver can
//! check what arrived: byte patterns ([`pattern`]), the buffers of a transport collective
//! ([`collective`]), the all-reduces' element data ([`elements`]) and the object and queue
//! payloads ([`payload`]).

pub(crate) mod collective;
pub(crate) mod elements;
pub(crate) mod pattern;
pub(crate) mod payload;
