//! Where the values decoded by an all-gather land, relative to tpcomm's receive buffer, and
//! what that costs: one byte string per rank, decoded by a type that copies its bytes (with
//! `copy_from_slice`, glibc's `memcpy`, as `Vec<u8>` and `String` do) to a place chosen by
//! the run, `16 * k` bytes into a fixed buffer of the rank's, for every `k` of a page.
//!
//! ```text
//! layouts [--bytes N] [--iters N]
//! ```
//!
//! Prints, for each destination offset, the median over iterations of the slowest rank's
//! `all_gather`, then how many offsets took more than twice the median offset's time. Where
//! `memcpy` runs about 20 times slower for a destination 1 to 63 bytes after its source
//! modulo 4 KiB (`rep movsb` on AMD EPYC with glibc 2.36), a receive buffer that never moves
//! makes some destinations slow on every call; tpcomm moves its receive buffer's bytes by 64
//! at each call (`buffers::receive_offset`), so that no destination is slow on more than one
//! call in 64.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::time::Instant;

use serde::de::{Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use tpcomm_objects::all_gather;
use tpcomm_transport::{Communicator, LocalGroup};

thread_local! {
    /// Where this thread's decoded bytes go, and the offset of the first value in it.
    static DEST: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static AT: Cell<usize> = const { Cell::new(0) };
}

/// A byte string on the wire; decoded, its bytes are copied into `DEST` at `AT` (then `AT`
/// moves past them) and only their length is kept.
struct Placed {
    bytes: Vec<u8>,
    len: usize,
}

impl Serialize for Placed {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.bytes)
    }
}

impl<'de> Deserialize<'de> for Placed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Placed;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<Placed, E> {
                let at = AT.get();
                DEST.with_borrow_mut(|d| d[at..at + v.len()].copy_from_slice(v));
                AT.set(at + v.len());
                Ok(Placed {
                    bytes: Vec::new(),
                    len: v.len(),
                })
            }
        }
        d.deserialize_bytes(V)
    }
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bytes = arg(&args, "--bytes", 64 << 10);
    let iters = arg(&args, "--iters", 100);
    let offsets: Vec<usize> = (0..4096).step_by(16).collect();
    let results = LocalGroup::new(2).run(|comm| {
        DEST.with_borrow_mut(|d| *d = vec![0u8; 4096 + 2 * bytes]);
        let mine = Placed {
            bytes: vec![comm.rank() as u8 + 1; bytes],
            len: bytes,
        };
        let mut medians = Vec::with_capacity(offsets.len());
        for &off in &offsets {
            let mut times = Vec::with_capacity(iters);
            for i in 0..iters + 10 {
                comm.barrier()?;
                AT.set(off);
                let t = Instant::now();
                let got: Vec<Placed> = all_gather(&comm, &mine).expect("all_gather");
                let us = t.elapsed().as_secs_f64() * 1e6;
                assert!(got.iter().all(|p| p.len == bytes));
                if i >= 10 {
                    times.push(us);
                }
            }
            medians.push(times);
        }
        Ok::<_, tpcomm_transport::TransportError>(medians)
    });
    let ranks: Vec<Vec<Vec<f64>>> = results
        .into_iter()
        .map(|r| r.expect("rank ran").expect("rank succeeded"))
        .collect();
    let mut per_offset = Vec::with_capacity(offsets.len());
    for (o, &off) in offsets.iter().enumerate() {
        let mut slowest: Vec<f64> = (0..iters)
            .map(|i| ranks.iter().map(|r| r[o][i]).fold(0.0, f64::max))
            .collect();
        slowest.sort_by(f64::total_cmp);
        let median = slowest[iters / 2];
        println!("destination +{off:4} B: median {median:8.2} us");
        per_offset.push(median);
    }
    let mut sorted = per_offset.clone();
    sorted.sort_by(f64::total_cmp);
    let typical = sorted[sorted.len() / 2];
    let slow: Vec<usize> = offsets
        .iter()
        .zip(&per_offset)
        .filter(|(_, &m)| m > 2.0 * typical)
        .map(|(&off, _)| off)
        .collect();
    println!(
        "{bytes} B per rank, 2 ranks (threads), {iters} iterations per offset: median offset \
         {typical:.2} us; {} of {} offsets over 2x that: {slow:?}",
        slow.len(),
        offsets.len()
    );
}
