//! The `_into` variants: all-gather, gather and broadcast decoded over the values of the
//! caller's last call (serde's `deserialize_in_place`, through `Gathered::decode_into`), so
//! that a loop gathering per-step state keeps its strings' and vectors' allocations.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::Communicator;

use super::broadcast::broadcast_decode;
use super::gather::gather_value;
use crate::error::Result;
use crate::gathered::decode_exact_in_place;
use crate::options::Options;

/// [`all_gather`] into the values of the last call: `out` ends with one value per rank, in
/// rank order, each decoded over the value that was there (see
/// [`Gathered::decode_into`](crate::Gathered::decode_into)).
///
/// For a loop that gathers the same kind of value at every step (an engine's per-step
/// state): strings and vectors keep their allocations from one step to the next, so the
/// steady state allocates little or nothing, and `out`'s memory stays warm (a fresh `Vec<T>`
/// per call makes the allocator fetch and fault in new pages for large results, which can
/// take as long as the decode itself). Derived structs are replaced whole unless
/// `serde_derive`'s `deserialize_in_place` feature is on, which makes them reuse their
/// fields too (`docs/protocol.md`, "Decoding into the last call's values").
///
/// Errors as [`all_gather`]. An error decided before decoding (a peer's failure, the cap,
/// the transport) leaves `out` as it was; a decode error leaves it empty.
///
/// ```
/// use tpcomm_objects::all_gather_into;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut all: Vec<Vec<u32>> = Vec::new();
///     for step in 0..4u32 {
///         let mine = vec![step; comm.rank() + 1];
///         all_gather_into(&comm, &mine, &mut all)?; // reuses last step's vectors
///     }
///     Ok::<_, tpcomm_objects::ObjectError>(all)
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![vec![3], vec![3, 3], vec![3, 3, 3]]);
/// }
/// ```
///
/// [`all_gather`]: super::all_gather
pub fn all_gather_into<C, T>(comm: &C, value: &T, out: &mut Vec<T>) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    all_gather_into_with(comm, value, out, &Options::default())
}

/// [`all_gather_into`] with options.
pub fn all_gather_into_with<C, T>(
    comm: &C,
    value: &T,
    out: &mut Vec<T>,
    opts: &Options,
) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let decoded = gather_value(comm, "all_gather", None, value, opts, |g| {
        g.decode_into(out)
    })?;
    decoded.expect("every rank receives");
    Ok(())
}

/// [`gather`] into the values of the last call: on the root, `out` ends with one value per
/// rank, in rank order, each decoded over the value that was there (as [`all_gather_into`]
/// does); returns `true` there. Elsewhere `out` is not touched and the call returns `false`.
///
/// Errors as [`gather`]. On the root, an error decided before decoding leaves `out` as it
/// was; a decode error leaves it empty.
///
/// ```
/// use tpcomm_objects::gather_into;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut reports: Vec<String> = Vec::new();
///     let mut filled = false;
///     for step in 0..3 {
///         let mine = format!("rank {} step {step}", comm.rank());
///         filled = gather_into(&comm, 0, &mine, &mut reports)?; // reuses last step's strings
///     }
///     Ok::<_, tpcomm_objects::ObjectError>((filled, reports))
/// });
/// let (filled, reports) = results[0].as_ref().unwrap().as_ref().unwrap();
/// assert!(filled);
/// assert_eq!(reports[2], "rank 2 step 2");
/// assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap(), &(false, vec![]));
/// ```
///
/// [`gather`]: super::gather
pub fn gather_into<C, T>(comm: &C, root: usize, value: &T, out: &mut Vec<T>) -> Result<bool>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    gather_into_with(comm, root, value, out, &Options::default())
}

/// [`gather_into`] with options.
pub fn gather_into_with<C, T>(
    comm: &C,
    root: usize,
    value: &T,
    out: &mut Vec<T>,
    opts: &Options,
) -> Result<bool>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let decoded = gather_value(comm, "gather", Some(root), value, opts, |g| {
        g.decode_into(out)
    })?;
    Ok(decoded.is_some())
}

/// [`broadcast`] into the value of the last call: every rank's `out` ends equal to the root's
/// value, decoded over what `out` held (serde's `Deserialize::deserialize_in_place`: strings
/// and vectors keep their allocations), as [`all_gather_into`] does for an all-gather. The
/// root's `out` is decoded from its own bytes like every other rank's, so that all ranks hold
/// the same value however `T` serializes.
///
/// Errors as [`broadcast`]. An error decided before decoding leaves `out` as it was; after a
/// decode error `out` holds some valid `T` that must not be used as the root's value.
///
/// ```
/// use tpcomm_objects::broadcast_into;
/// use tpcomm_transport::{Communicator, LocalGroup};
///
/// let results = LocalGroup::new(3).run(|comm| {
///     let mut schedule: Vec<u64> = Vec::new();
///     for step in 0..3u64 {
///         let root_has = (comm.rank() == 0).then(|| vec![step; 4]);
///         broadcast_into(&comm, 0, root_has.as_ref(), &mut schedule)?;
///     }
///     Ok::<_, tpcomm_objects::ObjectError>(schedule)
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), vec![2; 4]);
/// }
/// ```
///
/// [`broadcast`]: super::broadcast
pub fn broadcast_into<C, T>(comm: &C, root: usize, value: Option<&T>, out: &mut T) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    broadcast_into_with(comm, root, value, out, &Options::default())
}

/// [`broadcast_into`] with options.
pub fn broadcast_into_with<C, T>(
    comm: &C,
    root: usize,
    value: Option<&T>,
    out: &mut T,
    opts: &Options,
) -> Result<()>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    broadcast_decode(comm, root, value, opts, |bytes| {
        decode_exact_in_place(root, bytes, opts.max_depth, out)
    })
}
