//! What more than one test binary of this crate uses.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tpcomm_transport::check::{
    AllGatherArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use tpcomm_transport::{Communicator, GatherRecv, LocalCommunicator, Result as TResult};

/// A global allocator that tracks the largest single allocation, to prove that no buffer is
/// sized from a hostile length or an invalid option. A test binary installs it with
/// `#[global_allocator] static GLOBAL: PeakAlloc = PeakAlloc;`.
pub(crate) struct PeakAlloc;

/// The largest allocation since it was last reset, under [`PeakAlloc`].
pub(crate) static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: delegates every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Tests that measure the whole process's allocations run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Waits for this test's turn among those that measure allocations (a test that panicked
/// in its turn does not stop the others).
pub(crate) fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The methods of a test communicator that wraps a `LocalCommunicator` in `self.inner` and
/// changes only transfers: rank, size, `max_count` and the barrier are the inner one's,
/// `backend_name` is `$backend`, and `split` is never called by these tests.
macro_rules! forward_queries {
    ($backend:literal) => {
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
            $backend
        }
        fn split(&self, _: Option<u32>, _: i32) -> tpcomm_transport::Result<Option<Self>> {
            unimplemented!("not used by these tests")
        }
        fn raw_barrier(&self) -> tpcomm_transport::Result<()> {
            self.inner.barrier()
        }
    };
}
#[allow(unused_imports)] // Used by some of the test binaries only.
pub(crate) use forward_queries;

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

/// Rewrites what a rank receives, the same way on every rank, as a relay that damages bytes
/// in flight for everybody would: `headers(entry size, received bytes)` after every
/// fixed-size all-gather (the header exchanges), `payloads(received bytes)` after every
/// varcount all-gather (the payloads). Every other collective is forwarded as it is.
pub(crate) struct Rewriting<'f> {
    pub(crate) inner: LocalCommunicator,
    pub(crate) headers: &'f (dyn Fn(usize, &mut [u8]) + Sync),
    pub(crate) payloads: &'f (dyn Fn(&mut [u8]) + Sync),
}

impl Communicator for Rewriting<'_> {
    forward_queries!("rewriting");
    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> TResult<()> {
        let (send, recv) = args.parts();
        self.inner.all_gather(send, recv)?;
        (self.headers)(send.len(), recv);
        Ok(())
    }
    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> TResult<()> {
        let (send, recv, counts, displs) = args.parts();
        self.inner.all_gather_varcount(send, recv, counts, displs)?;
        (self.payloads)(recv);
        Ok(())
    }
    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> TResult<()> {
        let root = args.root();
        let (send, recv) = args.parts();
        let recv = recv.map(|r| GatherRecv {
            recv: &mut *r.recv,
            counts: r.counts,
            displs: r.displs,
        });
        self.inner.gather_varcount(root, send, recv)
    }
    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> TResult<()> {
        let root = args.root();
        self.inner.broadcast(root, args.buf())
    }
    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> TResult<()> {
        let (send, recv) = args.parts();
        self.inner.all_to_all_varcount(send, recv)
    }
}
