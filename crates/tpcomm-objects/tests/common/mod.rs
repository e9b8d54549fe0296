//! What more than one test binary of this crate uses.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tpcomm_transport::check::{
    AllGatherArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use tpcomm_transport::{Communicator, GatherRecv, LocalCommunicator, Result as TResult};

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
        "rewriting"
    }
    fn split(&self, _: Option<u32>, _: i32) -> TResult<Option<Self>> {
        unimplemented!("not used by these tests")
    }
    fn raw_barrier(&self) -> TResult<()> {
        self.inner.barrier()
    }
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
