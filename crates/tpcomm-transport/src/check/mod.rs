//! Argument checks shared by every backend.
//!
//! The provided methods of [`Communicator`](crate::Communicator) run these checks and hand
//! the backend a *checked* argument bundle. The bundles have private fields and no public
//! constructor, so a backend can only ever receive arguments that went through this module:
//! the checks live in one place and cannot be skipped by a new backend. Each bundle also
//! records the rank and size it was checked for (`Group`), which every backend compares
//! with its own: a wrapper that forwards a bundle while reporting another rank or size gets
//! an error.
//!
//! The checks run on every call, so their cost is part of every collective's latency. The
//! bundle constructors are `#[inline(always)]`: the provided methods are generic, so they
//! are compiled in the caller's crate, where a constructor that is not inlined returns its
//! `Result<bundle>` through memory and the caller reloads it with wider loads than the
//! stores that wrote it, which x86 cores cannot forward (a store-forwarding stall). A
//! layout is first tried by a short loop that only accepts (see `Shape::layout`); the
//! full check, which names the first problem, runs when that loop is not sure.

//!
//! Here: `Shape` (what a check knows of the communicator) and `Group` (what a bundle
//! records); `bundles` holds the host bundles and their checks, `layout` the check of a
//! counts/displacements table, `device` the device collectives' length check.

mod bundles;
mod device;
mod layout;

use crate::error::{ArgumentError, Op, Result, TransportError};

pub use bundles::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, GatherRecv, Layout,
    VarcountArgs,
};
pub use device::{device_count, DeviceCollective};

/// The facts about a communicator that the checks need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) op: Op,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) max_count: usize,
}

/// The rank and size a bundle of arguments was checked for.
///
/// The provided methods of [`Communicator`](crate::Communicator) check arguments against the
/// rank and size of the communicator they are called on. A communicator that wraps another
/// and forwards the checked bundle to it reports its own rank and size, which need not be
/// the inner one's; so every backend compares the bundle's group with its own
/// ([`Group::expect`]) before it touches a buffer: a bundle checked for another group is an
/// error, never a transfer sized for another group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Group {
    rank: usize,
    size: usize,
}

impl Group {
    pub(crate) fn new(rank: usize, size: usize) -> Self {
        Self { rank, size }
    }

    /// `Ok` when the bundle was checked for rank `rank` of a communicator of `size` ranks.
    #[inline(always)]
    pub(crate) fn expect(self, op: Op, rank: usize, size: usize) -> Result<()> {
        if self.rank == rank && self.size == size {
            return Ok(());
        }
        Err(self.mismatch(op, rank, size))
    }

    #[cold]
    #[inline(never)]
    fn mismatch(self, op: Op, rank: usize, size: usize) -> TransportError {
        TransportError::InvalidArgument {
            op,
            rank,
            source: ArgumentError::OtherGroup {
                checked_rank: self.rank,
                checked_size: self.size,
                rank,
                size,
            },
        }
    }
}

impl Shape {
    /// The group arguments checked with this shape were checked for.
    #[inline(always)]
    fn group(&self) -> Group {
        Group::new(self.rank, self.size)
    }

    fn err(&self, source: ArgumentError) -> TransportError {
        TransportError::InvalidArgument {
            op: self.op,
            rank: self.rank,
            source,
        }
    }

    fn root(&self, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.err(ArgumentError::RootOutOfRange {
                root,
                size: self.size,
            }));
        }
        Ok(())
    }

    fn count(&self, which: &'static str, index: usize, value: usize) -> Result<()> {
        if value > self.max_count {
            return Err(self.err(ArgumentError::CountTooLarge {
                which,
                index,
                value,
                max: self.max_count,
            }));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
