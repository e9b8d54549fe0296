//! The length exchange, the inline slots and the payload path, fed by hostile peers.
//!
//! One rank of a fake group runs a real object collective; every byte its peers "send"
//! (length words, inline slots, payload rounds, broadcast chunks) comes from the fuzz input.
//! The collective must return a value or an error, never panic, and no allocation may be
//! sized from an announced length past the cap (`Options::max_total_bytes`): the largest
//! allocation stays under the cap plus serde's own bounded preallocation (1 MiB).

#![no_main]

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;
use tpcomm_objects::Options;
use tpcomm_transport::check::{
    AllGatherArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use tpcomm_transport::{Communicator, Result as TransportResult};

/// The largest single allocation since the last reset.
static LARGEST: AtomicUsize = AtomicUsize::new(0);

struct PeakAlloc;

// SAFETY: delegates every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

/// Serde preallocates at most 1 MiB for a sequence whatever its announced length.
const SERDE_PREALLOCATION: usize = 1 << 20;
/// Header buffers: at most 8 blocks of an options field and 8 words, or 8 256-byte entries.
const HEADER_ALLOWANCE: usize = 64 << 10;

/// Rank `rank` of a group of `size` whose peers send the bytes of `stream` in call order
/// (zeros once it runs out). With `same_options`, the peers' header entries carry this
/// rank's options field (when the header moves in one call), so that the fuzzer gets past
/// the options agreement to the lengths; without, it exercises the agreement itself.
#[derive(Debug)]
struct HostilePeers<'a> {
    rank: usize,
    size: usize,
    max_count: usize,
    same_options: bool,
    stream: Mutex<&'a [u8]>,
}

/// Where the options field sits in a header contribution of `len` bytes: after the length
/// word of a 256-byte entry (all-gather, gather, broadcast), or first in a block of an
/// options field and one word per rank (scatter, all-to-all). `None` for a chunk.
fn options_field(len: usize, size: usize) -> Option<std::ops::Range<usize>> {
    if len == 256 {
        Some(8..32)
    } else if len == 24 + 8 * size {
        Some(0..24)
    } else {
        None
    }
}

impl HostilePeers<'_> {
    fn fill(&self, dst: &mut [u8]) {
        let mut s = self.stream.lock().unwrap();
        let n = dst.len().min(s.len());
        dst[..n].copy_from_slice(&s[..n]);
        dst[n..].fill(0);
        *s = &s[n..];
    }

    /// Fills rank `r`'s region `dst` with `own` when `r` is this rank, else with peer bytes.
    fn deliver(&self, r: usize, dst: &mut [u8], own: &[u8]) {
        if r == self.rank {
            dst.copy_from_slice(own);
        } else {
            self.fill(dst);
        }
    }

    fn varcount(&self, send: &[u8], recv: &mut [u8], counts: &[usize], displs: &[usize]) {
        for r in 0..self.size {
            let region = &mut recv[displs[r]..displs[r] + counts[r]];
            self.deliver(r, region, send);
        }
    }
}

impl Communicator for HostilePeers<'_> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn max_count(&self) -> usize {
        self.max_count
    }
    fn backend_name(&self) -> &'static str {
        "hostile-peers"
    }
    fn split(&self, _: Option<u32>, _: i32) -> TransportResult<Option<Self>> {
        Ok(None)
    }
    fn raw_barrier(&self) -> TransportResult<()> {
        Ok(())
    }
    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> TransportResult<()> {
        let (send, recv) = args.parts();
        let block = send.len();
        let field = options_field(block, self.size).filter(|_| self.same_options);
        for (r, region) in recv.chunks_exact_mut(block.max(1)).enumerate() {
            self.deliver(r, region, send);
            if let Some(f) = field.clone() {
                region[f.clone()].copy_from_slice(&send[f]);
            }
        }
        Ok(())
    }
    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> TransportResult<()> {
        let (send, recv, counts, displs) = args.parts();
        self.varcount(send, recv, counts, displs);
        Ok(())
    }
    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> TransportResult<()> {
        let (send, recv) = args.parts();
        if let Some(r) = recv {
            self.varcount(send, r.recv, r.counts, r.displs);
        }
        Ok(())
    }
    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> TransportResult<()> {
        if args.root() != self.rank {
            self.fill(args.buf());
        }
        Ok(())
    }
    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> TransportResult<()> {
        let (send, recv) = args.parts();
        let me = self.rank;
        let own = &send.buf[send.displs[me]..send.displs[me] + send.counts[me]];
        for r in 0..self.size {
            let region = &mut recv.buf[recv.displs[r]..recv.displs[r] + recv.counts[r]];
            self.deliver(r, region, own);
        }
        Ok(())
    }
}

/// Reads the shape of the run from the first bytes of the input.
struct Setup {
    size: usize,
    same_options: bool,
    rank: usize,
    max_count: usize,
    opts: Options,
    op: u8,
    own_len: usize,
}

fn setup(data: &[u8]) -> Option<(Setup, &[u8])> {
    let (head, rest) = data.split_at_checked(8)?;
    let size = 1 + usize::from(head[0] % 8);
    let same_options = head[0] & 0x80 == 0;
    let rank = usize::from(head[1]) % size;
    // Mostly a real MPI's limit; sometimes a tiny one, so the header and payload go in rounds.
    let max_count = if head[2] & 0x80 == 0 {
        i32::MAX as usize
    } else {
        16 + usize::from(head[2] & 0x7F)
    };
    let cap = usize::from(u16::from_le_bytes([head[3], head[4]]));
    let opts = Options {
        max_total_bytes: cap,
        round_bytes: (head[5] & 0x80 != 0).then_some(16 + usize::from(head[5] & 0x7F)),
        small_slot_bytes: [0, 1, 8, 100, 224][usize::from(head[5] & 0x7F) % 5],
        max_depth: Options::DEFAULT_MAX_DEPTH,
    };
    let op = head[6];
    let own_len = usize::from(head[7]) * 4;
    Some((
        Setup {
            size,
            same_options,
            rank,
            max_count,
            opts,
            op,
            own_len,
        },
        rest,
    ))
}

fn run(s: &Setup, comm: &HostilePeers<'_>) {
    let mine = vec![0xA5u8; s.own_len];
    let opts = &s.opts;
    let root = usize::from(s.op >> 4) % s.size;
    match s.op % 7 {
        0 => {
            if let Ok(all) = tpcomm_objects::all_gather_with(comm, &mine, opts) {
                assert_eq!(all.len(), s.size);
                assert_eq!(all[s.rank], mine, "this rank's own value came back changed");
            }
        }
        1 => {
            let text = "x".repeat(s.own_len);
            if let Ok(all) = tpcomm_objects::all_gather_with(comm, &text, opts) {
                assert_eq!(all[s.rank], text);
            }
        }
        2 => {
            if let Ok(g) = tpcomm_objects::all_gather_bytes_with(comm, &mine, opts) {
                assert_eq!(g.len(), s.size);
                assert_eq!(g.bytes(s.rank), Some(&mine[..]));
                let _ = g.decode::<&str>();
            }
        }
        3 => {
            if let Ok(got) = tpcomm_objects::gather_with(comm, root, &mine, opts) {
                assert_eq!(got.is_some(), root == s.rank);
                if let Some(all) = got {
                    assert_eq!(all[s.rank], mine);
                }
            }
        }
        4 => {
            let value = (root == s.rank).then_some(&mine);
            if let Ok(v) = tpcomm_objects::broadcast_with(comm, root, value, opts) {
                if root == s.rank {
                    assert_eq!(v, mine);
                }
            }
        }
        5 => {
            let values: Vec<Vec<u8>> = (0..s.size).map(|d| vec![d as u8; s.own_len]).collect();
            let values = (root == s.rank).then_some(&values[..]);
            let _ = tpcomm_objects::scatter_with(comm, root, values, opts);
        }
        _ => {
            let values: Vec<Vec<u8>> = (0..s.size).map(|d| vec![d as u8; s.own_len]).collect();
            if let Ok(got) = tpcomm_objects::all_to_all_with(comm, &values, opts) {
                assert_eq!(got.len(), s.size);
                assert_eq!(got[s.rank], values[s.rank]);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((s, stream)) = setup(data) else {
        return;
    };
    let comm = HostilePeers {
        rank: s.rank,
        size: s.size,
        max_count: s.max_count,
        same_options: s.same_options,
        stream: Mutex::new(stream),
    };
    LARGEST.store(0, Ordering::Relaxed);
    run(&s, &comm);
    let largest = LARGEST.load(Ordering::Relaxed);
    let bound = s.opts.max_total_bytes.max(SERDE_PREALLOCATION) + HEADER_ALLOWANCE;
    assert!(
        largest <= bound,
        "largest allocation {largest} bytes, over the cap {} (bound {bound})",
        s.opts.max_total_bytes
    );
});
