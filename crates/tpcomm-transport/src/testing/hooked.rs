//! [`Hooked`]: a communicator that asks a hook before every collective it forwards to
//! another, for tests that count transport calls or make one call fail (or one process die)
//! on one rank. It reports the inner communicator's rank and size and forwards the checked
//! arguments unchanged, so the inner backend's own checks still apply.

use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use crate::{Communicator, Op, Result, TransportError};

/// `inner`, with `hook(op)` run before each collective; an error from the hook is returned
/// instead of making the call (so this rank leaves the collective, as a failed call would).
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use tpcomm_transport::testing::hooked::Hooked;
/// use tpcomm_transport::{Communicator, LocalGroup, TransportError};
///
/// let results = LocalGroup::new(2).run(|comm| {
///     let calls = AtomicUsize::new(0);
///     let counted = Hooked::new(&comm, |_op| {
///         calls.fetch_add(1, Ordering::Relaxed);
///         Ok(())
///     });
///     counted.barrier()?;
///     counted.all_gather(&[counted.rank() as u8], &mut [0u8; 2])?;
///     Ok::<_, TransportError>(calls.load(Ordering::Relaxed))
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), 2);
/// }
/// ```
pub struct Hooked<'c, C, F> {
    inner: &'c C,
    hook: F,
}

impl<'c, C, F> Hooked<'c, C, F>
where
    C: Communicator,
    F: Fn(Op) -> Result<()> + Send + Sync,
{
    /// Wraps `inner`.
    pub fn new(inner: &'c C, hook: F) -> Self {
        Self { inner, hook }
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &'c C {
        self.inner
    }
}

impl<C, F> std::fmt::Debug for Hooked<'_, C, F>
where
    C: Communicator,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked")
            .field("backend", &self.inner.backend_name())
            .field("rank", &self.inner.rank())
            .field("size", &self.inner.size())
            .finish_non_exhaustive()
    }
}

impl<C, F> Communicator for Hooked<'_, C, F>
where
    C: Communicator,
    F: Fn(Op) -> Result<()> + Send + Sync,
{
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn max_count(&self) -> usize {
        self.inner.max_count()
    }
    fn backend_name(&self) -> &'static str {
        "hooked"
    }
    fn split(&self, _color: Option<u32>, _key: i32) -> Result<Option<Self>> {
        Err(TransportError::Unsupported {
            op: Op::Split,
            reason: "a hooked test communicator borrows its inner one and does not split".into(),
        })
    }
    fn raw_barrier(&self) -> Result<()> {
        (self.hook)(Op::Barrier)?;
        self.inner.raw_barrier()
    }
    fn raw_all_gather(&self, args: AllGatherArgs<'_>) -> Result<()> {
        (self.hook)(Op::AllGather)?;
        self.inner.raw_all_gather(args)
    }
    fn raw_all_gather_varcount(&self, args: VarcountArgs<'_>) -> Result<()> {
        (self.hook)(Op::AllGatherVarcount)?;
        self.inner.raw_all_gather_varcount(args)
    }
    fn raw_gather_varcount(&self, args: GatherArgs<'_>) -> Result<()> {
        (self.hook)(Op::GatherVarcount)?;
        self.inner.raw_gather_varcount(args)
    }
    fn raw_broadcast(&self, args: BroadcastArgs<'_>) -> Result<()> {
        (self.hook)(Op::Broadcast)?;
        self.inner.raw_broadcast(args)
    }
    fn raw_all_to_all_varcount(&self, args: AllToAllArgs<'_>) -> Result<()> {
        (self.hook)(Op::AllToAllVarcount)?;
        self.inner.raw_all_to_all_varcount(args)
    }
    fn raw_all_reduce(&self, args: AllReduceArgs<'_>) -> Result<()> {
        (self.hook)(Op::AllReduce)?;
        self.inner.raw_all_reduce(args)
    }
}
