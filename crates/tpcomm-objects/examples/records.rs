//! Where the time of an object all-gather of many records goes: serialization, the
//! collective, and decoding, each timed alone, next to the whole `all_gather`.
//!
//! ```text
//! records [--records N] [--ranks N] [--iters N]
//! records --blob BYTES [--ranks N] [--iters N]    only the all_gather of one blob per rank
//! ```
//!
//! The records are those of `tpcomm-bench objects` (`records:N`): `{ id: u64, name: String
//! (16 chars), tokens: Vec<u32> (8), score: f64 }`. Single-thread figures (median of
//! `--iters`): `postcard::to_allocvec` of one rank's value, `decode_from` of it (one
//! rank's block), postcard's decode of it over the values decoded before (what
//! `all_gather_into` does), and the same decode of every rank's block one after the other
//! (what each rank of an all-gather does). Then the median over iterations of the slowest
//! rank's `all_gather` on a local group, as the bench counts it.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use tpcomm_objects::{all_gather, decode_from};
use tpcomm_transport::{Communicator, LocalGroup};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    id: u64,
    name: String,
    tokens: Vec<u32>,
    score: f64,
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn record(rank: usize, i: usize) -> Record {
    let seed = ((rank as u64) << 40) ^ i as u64;
    Record {
        id: ((rank as u64) << 32) | i as u64,
        name: format!("r{rank}-rec-{i:09}"),
        tokens: (0..8u64)
            .map(|t| (splitmix64(seed.wrapping_mul(31).wrapping_add(t)) % 128_256) as u32)
            .collect(),
        score: (splitmix64(!seed) >> 11) as f64 / (1u64 << 53) as f64,
    }
}

fn median_ms(mut ns: Vec<u64>) -> f64 {
    ns.sort_unstable();
    ns[ns.len() / 2] as f64 / 1e6
}

fn time<R>(iters: usize, mut f: impl FnMut() -> R) -> f64 {
    let mut ns = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        let r = f();
        ns.push(start.elapsed().as_nanos() as u64);
        drop(r);
    }
    median_ms(ns)
}

fn main() {
    let (mut n, mut ranks, mut iters) = (100_000usize, 2usize, 20usize);
    let mut blob = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value: usize = args
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a number"));
        match flag.as_str() {
            "--records" => n = value,
            "--ranks" => ranks = value,
            "--iters" => iters = value,
            "--blob" => blob = Some(value),
            other => panic!("unknown argument {other}"),
        }
    }
    if let Some(bytes) = blob {
        return blob_all_gather(bytes, ranks, iters);
    }
    let values: Vec<Vec<Record>> = (0..ranks)
        .map(|r| (0..n).map(|i| record(r, i)).collect())
        .collect();
    let blocks: Vec<Vec<u8>> = values
        .iter()
        .map(|v| postcard::to_allocvec(v).unwrap())
        .collect();
    println!(
        "# records:{n}, {ranks} ranks, {} bytes per rank; medians of {iters} iterations",
        blocks[0].len()
    );
    let ser = time(iters, || postcard::to_allocvec(&values[0]).unwrap());
    let one = time(iters, || decode_from::<Vec<Record>>(0, &blocks[0]).unwrap());
    let plain = time(iters, || {
        postcard::from_bytes::<Vec<Record>>(&blocks[0]).unwrap()
    });
    // Over the values of the last iteration, as `all_gather_into` decodes (`Record` is
    // replaced whole unless serde_derive's `deserialize_in_place` feature is on).
    let mut place: Vec<Record> = postcard::from_bytes(&blocks[1]).unwrap();
    let in_place = time(iters, || {
        let mut de = postcard::Deserializer::from_bytes(&blocks[0]);
        Vec::<Record>::deserialize_in_place(&mut de, &mut place).unwrap();
    });
    let every = time(iters, || {
        blocks
            .iter()
            .enumerate()
            .map(|(r, b)| decode_from::<Vec<Record>>(r, b).unwrap())
            .collect::<Vec<_>>()
    });
    println!("  serialize one rank's value     {ser:10.3} ms");
    println!("  decode one rank's block        {one:10.3} ms");
    println!("  postcard::from_bytes, one block {plain:9.3} ms (no depth bound)");
    println!("  postcard in place, one block {in_place:11.3} ms (over the last values)");
    println!("  decode every rank's block      {every:10.3} ms");
    let results = LocalGroup::new(ranks).run(|comm| {
        let mine = &values[comm.rank()];
        let mut local = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            comm.barrier().unwrap();
            let start = Instant::now();
            let all = all_gather(&comm, mine).unwrap();
            let ns = start.elapsed().as_nanos() as u64;
            assert_eq!(all.len(), comm.size());
            drop(all);
            if i >= 2 {
                local.push(ns);
            }
        }
        local
    });
    let per_rank: Vec<Vec<u64>> = results.into_iter().map(|r| r.unwrap()).collect();
    let slowest: Vec<u64> = (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).max().unwrap())
        .collect();
    println!(
        "  all_gather (slowest rank)      {:10.3} ms",
        median_ms(slowest)
    );
}

/// The median and fastest of the slowest rank's `all_gather` of one `bytes`-byte blob per
/// rank (a barrier before each).
fn blob_all_gather(bytes: usize, ranks: usize, iters: usize) {
    let results = LocalGroup::new(ranks).run(|comm| {
        let mine = serde_bytes::ByteBuf::from(vec![comm.rank() as u8; bytes]);
        let mut local = Vec::with_capacity(iters);
        for i in 0..iters + 20 {
            comm.barrier().unwrap();
            let start = Instant::now();
            let all: Vec<serde_bytes::ByteBuf> = all_gather(&comm, &mine).unwrap();
            let ns = start.elapsed().as_nanos() as u64;
            drop(all);
            if i >= 20 {
                local.push(ns);
            }
        }
        local
    });
    let per_rank: Vec<Vec<u64>> = results.into_iter().map(|r| r.unwrap()).collect();
    let mut slowest: Vec<u64> = (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).max().unwrap())
        .collect();
    slowest.sort_unstable();
    println!(
        "# blob:{bytes}, {ranks} ranks: all_gather median {:.3} us, fastest {:.3} us",
        slowest[iters / 2] as f64 / 1e3,
        slowest[0] as f64 / 1e3
    );
}
