//! Peak memory of an honest rank when a peer announces a large length (under the cap) and
//! then sends nothing, through a transport that stages buffers the way the MPI transport
//! does with a timeout (every call copies its receive buffer into an owned one).
//!
//! Before: the honest rank allocated the whole announced receive buffer, and the transport
//! copied all of it into its staging buffer: twice the announced bytes. Now the payload
//! moves in rounds of at most `Options::DEFAULT_ROUND_BYTES`, so the staging copy is one
//! round, and the receive buffer is only written as rounds arrive: the peak is the announced
//! bytes plus one round.
//!
//! Also: the up-front reservations of containers a peer's bytes announce, across every
//! nesting level, stay bounded by the bytes it sent.
//!
//! A dedicated test binary whose tests take turns (`common::serial`), so that the live-bytes
//! counter of its global allocator sees one of them at a time.

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde_bytes::ByteBuf;
mod common;
use common::{forward_queries, serial};

use tpcomm_objects::{
    all_gather, all_to_all, broadcast, decode_from, gather, scan_with, scatter, DecodeError,
    ObjectError, Options, AGREED_RESERVE_BYTES,
};
use tpcomm_transport::check::{
    AllGatherArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use tpcomm_transport::{
    Communicator, GatherRecv, Layout, LocalCommunicator, LocalGroup, Result as TResult,
};

/// Counts live heap bytes and their peak.
struct LiveBytes;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    /// On this thread, requests larger than this many bytes fail (0: no limit), as under
    /// strict overcommit. Const-initialized: reading it never allocates.
    static REFUSE_ABOVE: Cell<usize> = const { Cell::new(0) };
}

fn refused(size: usize) -> bool {
    let limit = REFUSE_ABOVE.try_with(Cell::get).unwrap_or(0);
    limit != 0 && size > limit
}

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: delegates every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for LiveBytes {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        grew(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        grew(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        if refused(new_size) {
            return std::ptr::null_mut();
        }
        if new_size >= layout.size() {
            grew(new_size - layout.size());
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: LiveBytes = LiveBytes;

/// What the hostile rank announces: well under the default cap (8 GiB), well over a round.
const ANNOUNCED: u64 = 256 << 20;
const HOSTILE: usize = 1;

/// Rank 1 overwrites its own length word with `ANNOUNCED` in every header it sends (it then
/// sees its own length corrupted and leaves: it never sends the bytes). The honest rank
/// stages every receive buffer in an owned copy, as the MPI transport's timed path does.
#[derive(Debug)]
struct Peer {
    inner: LocalCommunicator,
}

impl Communicator for Peer {
    forward_queries!("staging");
    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> TResult<()> {
        let (send, recv) = args.parts();
        let mut send = send.to_vec();
        if self.rank() == HOSTILE {
            send[..8].copy_from_slice(&ANNOUNCED.to_le_bytes());
        }
        self.inner.all_gather(&send, recv)
    }
    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> TResult<()> {
        let (send, recv, counts, displs) = args.parts();
        let (send, mut staged) = (send.to_vec(), recv.to_vec());
        self.inner
            .all_gather_varcount(&send, &mut staged, counts, displs)?;
        recv.copy_from_slice(&staged);
        Ok(())
    }
    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> TResult<()> {
        let root = args.root();
        let (send, recv) = args.parts();
        let send = send.to_vec();
        match recv {
            Some(r) => {
                let mut staged = r.recv.to_vec();
                self.inner.gather_varcount(
                    root,
                    &send,
                    Some(GatherRecv {
                        recv: &mut staged,
                        counts: r.counts,
                        displs: r.displs,
                    }),
                )?;
                r.recv.copy_from_slice(&staged);
                Ok(())
            }
            None => self.inner.gather_varcount(root, &send, None),
        }
    }
    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> TResult<()> {
        let root = args.root();
        let buf = args.buf();
        let mut staged = buf.to_vec();
        self.inner.broadcast(root, &mut staged)?;
        buf.copy_from_slice(&staged);
        Ok(())
    }
    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> TResult<()> {
        let (send, recv) = args.parts();
        let (staged_send, mut staged) = (send.buf.to_vec(), recv.buf.to_vec());
        self.inner.all_to_all_varcount(
            Layout {
                buf: &staged_send,
                counts: send.counts,
                displs: send.displs,
            },
            Layout {
                buf: &mut staged,
                counts: recv.counts,
                displs: recv.displs,
            },
        )?;
        recv.buf.copy_from_slice(&staged);
        Ok(())
    }
}

/// One collective as both ranks run it.
type Case<'a> = &'a (dyn Fn(&Peer) -> Result<(), ObjectError> + Sync);

/// Runs `f` on two ranks (rank 1 hostile) and returns the honest rank's result and the
/// peak of live heap bytes above what was live before.
fn peak_of(
    f: impl Fn(&Peer) -> Result<(), ObjectError> + Sync,
) -> (Result<(), ObjectError>, usize) {
    let group = LocalGroup::new(2).timeout(Duration::from_secs(20));
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut results = group.run(|inner| f(&Peer { inner }));
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (
        results.remove(0).expect("the honest rank does not panic"),
        peak,
    )
}

#[test]
fn a_peer_announcing_a_large_length_costs_the_announced_bytes_plus_one_round() {
    let _serial = serial();
    let announced = ANNOUNCED as usize;
    let bound = announced + Options::DEFAULT_ROUND_BYTES + (4 << 20);
    let value = ByteBuf::from(vec![7u8; 64]);
    let cases: [(&str, Case<'_>); 3] = [
        ("all_gather", &|c| all_gather(c, &value).map(drop)),
        ("gather", &|c| gather(c, 0, &value).map(drop)),
        ("broadcast", &|c| {
            let root_value = (c.rank() == HOSTILE).then_some(&value);
            broadcast(c, HOSTILE, root_value).map(drop)
        }),
    ];
    for (name, case) in cases {
        let (honest, peak) = peak_of(case);
        assert!(
            matches!(honest, Err(ObjectError::Transport(_))),
            "{name}: the honest rank fails when the hostile one leaves, got {honest:?}"
        );
        assert!(
            peak <= bound,
            "{name}: peak {peak} bytes for {announced} announced (bound {bound}: announced + one round)"
        );
    }
}

/// A recursive type with maps, as a user may gather (a JSON-like value).
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
enum Json {
    Null,
    Map(HashMap<u32, Json>),
}

/// 128 levels of `Map` each announcing 2^32 - 1 entries (7 bytes a level, 896 in all):
/// serde reserves up to 1 MiB of entries for every announced map (postcard's map access
/// passes the announced length on as the size hint), and each level keeps its reservation
/// while the next is decoded.
#[test]
fn nested_map_preallocation_from_a_peer_is_bounded_by_its_bytes() {
    let _serial = serial();
    let level = [1u8, 0xff, 0xff, 0xff, 0xff, 0x0f, 0];
    let bytes: Vec<u8> = level.repeat(128);
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let decoded = decode_from::<Json>(1, &bytes);
    let peak = PEAK.load(Ordering::Relaxed) - base;
    assert!(
        matches!(
            decoded,
            Err(ObjectError::Decode {
                rank: 1,
                source: DecodeError::TooDeep { .. } | DecodeError::Postcard(_)
            })
        ),
        "{decoded:?}"
    );
    assert!(
        peak < 1 << 20,
        "peak {peak} bytes reserved for {} bytes from a peer",
        bytes.len()
    );
}

/// An inclusive scan packs one copy of a rank's value per receiver before the length
/// exchange: rank 0's 3 MiB value, three receivers, 9 MiB, which this allocator refuses
/// (every other buffer of the call stays under its 5 MiB limit). That is a serialization
/// failure agreed by every rank, not an abort of the process.
#[test]
fn a_scan_whose_send_copies_cannot_be_allocated_fails_every_rank_without_an_abort() {
    let _serial = serial();
    let results = LocalGroup::new(3)
        .timeout(Duration::from_secs(20))
        .run(|comm| {
            let len = if comm.rank() == 0 { 3 << 20 } else { 16 };
            let value = ByteBuf::from(vec![comm.rank() as u8; len]);
            REFUSE_ABOVE.set(5 << 20);
            let scanned = scan_with(&comm, &value, |a, _| a);
            REFUSE_ABOVE.set(0);
            comm.barrier()?;
            Ok::<_, tpcomm_transport::TransportError>(scanned.map(drop))
        });
    for (rank, r) in results.into_iter().enumerate() {
        let scanned = r.expect("rank thread").expect("barriers");
        assert!(
            matches!(
                &scanned,
                Err(ObjectError::PeerSerialization { ranks, .. }) if ranks == &[0]
            ),
            "rank {rank}: {scanned:?}"
        );
    }
}

/// One rank is refused its receive buffer (9 MiB, over `AGREED_RESERVE_BYTES`) in each
/// collective with a payload: it returns `Allocation`, every other rank `PeerAllocation`
/// naming it, before any payload moves, and the next collective works on every rank (before,
/// its peers went on into the payload call and met its next collective instead).
#[test]
fn an_allocation_failure_on_one_rank_fails_every_rank_and_keeps_them_in_step() {
    let _serial = serial();
    const BIG: usize = 3 << 20;
    const _: () = assert!(3 * BIG >= AGREED_RESERVE_BYTES);
    type Call = fn(&LocalCommunicator) -> Result<(), ObjectError>;
    // (name, the rank refused, the call).
    let cases: [(&str, usize, Call); 5] = [
        ("all_gather", 0, |c| {
            all_gather(c, &ByteBuf::from(vec![c.rank() as u8; BIG])).map(drop)
        }),
        ("gather", 0, |c| {
            gather(c, 0, &ByteBuf::from(vec![c.rank() as u8; BIG])).map(drop)
        }),
        ("broadcast", 1, |c| {
            let value = (c.rank() == 0).then(|| ByteBuf::from(vec![7u8; 3 * BIG]));
            broadcast(c, 0, value.as_ref()).map(drop)
        }),
        ("scatter", 2, |c| {
            let values: Option<Vec<ByteBuf>> = (c.rank() == 0).then(|| {
                (0..3)
                    .map(|r| ByteBuf::from(vec![r as u8; 3 * BIG]))
                    .collect()
            });
            scatter(c, 0, values.as_deref()).map(drop)
        }),
        ("all_to_all", 2, |c| {
            let values: Vec<ByteBuf> = (0..3)
                .map(|d| ByteBuf::from(vec![d as u8; if d == 2 { BIG } else { 16 }]))
                .collect();
            all_to_all(c, &values).map(drop)
        }),
    ];
    for (name, refused_rank, call) in cases {
        let results = LocalGroup::new(3)
            .timeout(Duration::from_secs(10))
            .run(|comm| {
                if comm.rank() == refused_rank {
                    REFUSE_ABOVE.set(8 << 20);
                }
                let first = call(&comm);
                REFUSE_ABOVE.set(0);
                let next = all_gather(&comm, &(comm.rank() as u32));
                (first, next)
            });
        for (rank, r) in results.into_iter().enumerate() {
            let (first, next) = r.expect("rank thread");
            if rank == refused_rank {
                assert!(
                    matches!(first, Err(ObjectError::Allocation { .. })),
                    "{name}: rank {rank}: {first:?}"
                );
            } else {
                assert!(
                    matches!(&first, Err(ObjectError::PeerAllocation { ranks }) if ranks == &[refused_rank]),
                    "{name}: rank {rank}: {first:?}"
                );
            }
            assert_eq!(
                next.ok(),
                Some(vec![0, 1, 2]),
                "{name}: rank {rank}: next call"
            );
        }
    }
}
