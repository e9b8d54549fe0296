//! [`FaultInjection`]: a backend wrapper that fails chosen calls, for lifecycle tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{IpcError, Result};
use crate::memory::{MemoryRegion, PeerMemory};

/// The operation a fault targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// `PeerMemory::export`.
    Export,
    /// `PeerMemory::open`.
    Open,
    /// `PeerMemory::close`.
    Close,
}

/// Wraps a backend and fails the `n`-th call (counting from 1) of one operation with
/// [`IpcError::StaleHandle`] naming the injection; every other call goes through. Clones
/// share the counters, so a fault can be armed after the wrapper was handed over.
///
/// The batch calls are deliberately not forwarded: `export_all` and `open_all` keep the
/// trait's defaults, one `export` / `open` per handle, so that every handle counts as a call
/// a fault can hit; and `export_stamp` stays `None`, so that the registry exports on every
/// reopen and an armed export fault fires there. The inner backend's batch paths are tested
/// on it directly.
#[derive(Debug, Clone)]
pub struct FaultInjection<M> {
    inner: M,
    plan: Arc<FaultPlan>,
}

#[derive(Debug, Default)]
struct FaultPlan {
    /// Which point (0 = none, 1 = export, 2 = open, 3 = close) and at which call.
    point: AtomicU64,
    at: AtomicU64,
    calls: [AtomicU64; 3],
}

fn index(p: FaultPoint) -> usize {
    match p {
        FaultPoint::Export => 0,
        FaultPoint::Open => 1,
        FaultPoint::Close => 2,
    }
}

impl<M: PeerMemory> FaultInjection<M> {
    /// Wraps `inner` with no fault armed.
    pub fn new(inner: M) -> Self {
        Self {
            inner,
            plan: Arc::default(),
        }
    }

    /// Arms a fault: the `n`-th call of `point` from now on fails (`n >= 1`; a call past
    /// the counter's range never comes, so such a fault never fires).
    pub fn arm(&self, point: FaultPoint, n: u64) {
        let i = index(point);
        let now = self.plan.calls[i].load(Ordering::SeqCst);
        self.plan
            .at
            .store(now.saturating_add(n.max(1)), Ordering::SeqCst);
        self.plan.point.store(i as u64 + 1, Ordering::SeqCst);
    }

    /// Calls made so far of `point`.
    pub fn calls(&self, point: FaultPoint) -> u64 {
        self.plan.calls[index(point)].load(Ordering::SeqCst)
    }

    fn tick(&self, point: FaultPoint) -> Result<()> {
        let i = index(point);
        let call = self.plan.calls[i].fetch_add(1, Ordering::SeqCst) + 1;
        if self.plan.point.load(Ordering::SeqCst) == i as u64 + 1
            && self.plan.at.load(Ordering::SeqCst) == call
        {
            self.plan.point.store(0, Ordering::SeqCst);
            return Err(IpcError::StaleHandle(format!(
                "injected fault at {point:?} call #{call}"
            )));
        }
        Ok(())
    }
}

impl<M: PeerMemory> PeerMemory for FaultInjection<M> {
    type Handle = M::Handle;
    type Buffer = M::Buffer;
    type Mapping = M::Mapping;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn allocate(&self, bytes: usize) -> Result<M::Buffer> {
        self.inner.allocate(bytes)
    }
    fn allocate_private(&self, bytes: usize) -> Result<M::Buffer> {
        self.inner.allocate_private(bytes)
    }
    fn retire(&self, buffer: M::Buffer) {
        self.inner.retire(buffer);
    }
    fn export(&self, addr: u64, len: usize) -> Result<M::Handle> {
        self.tick(FaultPoint::Export)?;
        self.inner.export(addr, len)
    }
    fn open(&self, handle: &M::Handle) -> Result<M::Mapping> {
        self.tick(FaultPoint::Open)?;
        self.inner.open(handle)
    }
    fn close(&self, mapping: M::Mapping) -> Result<()> {
        // The mapping is closed for real either way; only the report fails.
        let closed = self.inner.close(mapping);
        self.tick(FaultPoint::Close)?;
        closed
    }
    fn keeps_addresses(&self) -> bool {
        self.inner.keeps_addresses()
    }
    fn detach(&self, mapping: &mut M::Mapping) -> Result<()> {
        self.inner.detach(mapping)
    }
    fn reattach(&self, mapping: &mut M::Mapping, handle: &M::Handle) -> Result<()> {
        self.tick(FaultPoint::Open)?;
        self.inner.reattach(mapping, handle)
    }
    fn releases_backing(&self) -> bool {
        self.inner.releases_backing()
    }
    fn release_backing(&self, buffer: &mut M::Buffer) -> Result<usize> {
        self.inner.release_backing(buffer)
    }
    fn restore_backing(&self, buffer: &mut M::Buffer) -> Result<()> {
        self.inner.restore_backing(buffer)
    }
    fn close_exports(&self, regions: &mut dyn Iterator<Item = crate::Region>) {
        self.inner.close_exports(regions);
    }
    fn checkpoint_blocker(&self, handle: &M::Handle) -> Option<String> {
        self.inner.checkpoint_blocker(handle)
    }
    fn write<R: MemoryRegion>(&self, region: &R, offset: usize, src: &[u8]) -> Result<()> {
        self.inner.write(region, offset, src)
    }
    fn read<R: MemoryRegion>(&self, region: &R, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.inner.read(region, offset, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostMemory;

    #[test]
    fn arming_a_fault_beyond_every_call_never_fires_and_does_not_panic() {
        let memory = FaultInjection::new(HostMemory::new());
        let buffer = memory.allocate(4096).expect("allocate");
        memory.export(buffer.addr(), 64).expect("export");
        // `u64::MAX` calls from now: past the counter's range, so it never fires.
        memory.arm(FaultPoint::Export, u64::MAX);
        memory
            .export(buffer.addr(), 64)
            .expect("not the armed call");
        // Arming again still works.
        memory.arm(FaultPoint::Export, 1);
        assert!(memory.export(buffer.addr(), 64).is_err());
        memory.export(buffer.addr(), 64).expect("fired once");
    }
}
