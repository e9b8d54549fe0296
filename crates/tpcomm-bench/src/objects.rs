//! `tpcomm-bench objects`: tpcomm's object all-gather against the hand-written floor.
//!
//! For each payload (one value per rank) three variants are timed in the same run, their
//! iterations interleaved (the order rotates every iteration):
//!
//! - `tpcomm owned`: [`tpcomm::objects::all_gather`], returning `Vec<T>`;
//! - `tpcomm borrowed`: [`tpcomm::objects::all_gather_borrowed`] then
//!   [`Gathered::decode`] into values that borrow from the receive buffer (`&Bytes` for a
//!   blob, records whose `name` is a `&str`);
//! - `floor` (the peer): what a careful program would write by hand over the same
//!   [`Communicator`]: postcard encode, a fixed all-gather of the 64-bit lengths, one
//!   `all_gather_varcount` of the bytes, postcard decode into owned values. No failure
//!   agreement, no cap, no round path: the least work there is.
//!
//! Each iteration is timed on every rank until its result is in hand (dropping the result
//! is not timed, for any variant). Every variant is checked once per payload, before timing,
//! against the values every rank sent.

use std::fmt;
use std::hint::black_box;

use clap::Args;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_bytes::{ByteBuf, Bytes};
use tpcomm::objects::Gathered;
use tpcomm::transport::dense_displacements;
use tpcomm::Communicator;

use crate::error::BenchError;
use crate::harness::{
    agree, elapsed_ns, link_peers, slowest, time_once, time_variants, Order, Plan, Row, Target,
};
use crate::launch::{self, PerRank, RunArgs, RunInfo, Session};
use crate::sweep::{format_bytes, parse_bytes, IterArgs};
use crate::table::{col, Column};
use crate::transport::{pattern, splitmix64};

/// The default payloads: a small and a large blob, few and many records.
const DEFAULT_PAYLOADS: &str = "blob:64,blob:65536,blob:16MiB,records:1000,records:100000";

/// The variants, in table order; the last is the peer.
const VARIANTS: [&str; 3] = ["tpcomm owned", "tpcomm borrowed", "floor"];
const TABLE: &str = "object all_gather";

/// Options of `tpcomm-bench objects`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct ObjectsArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

    /// Payloads, comma-separated: `blob:BYTES` (one byte string per rank, `serde_bytes`;
    /// BYTES takes K/KiB, M/MiB, G/GiB) or `records:N` (N records of
    /// `{ id: u64, name: String (16 chars), tokens: Vec<u32> (8), score: f64 }` per rank).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_payload,
        default_value = DEFAULT_PAYLOADS,
        value_name = "PAYLOADS"
    )]
    pub(crate) payloads: Vec<Payload>,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) iter: IterArgs,
}

/// Runs the subcommand.
pub(crate) fn run(args: &ObjectsArgs) -> Result<(), BenchError> {
    args.iter.validate()?;
    if args.payloads.is_empty() {
        return Err(BenchError::Usage("--payloads is empty".into()));
    }
    if let Some(p) = args
        .payloads
        .iter()
        .find(|p| matches!(p, Payload::Blob(n) if *n > i32::MAX as usize / 2))
    {
        return Err(BenchError::Usage(format!(
            "{p}: blobs are limited to {} here (the floor is one varcount call)",
            format_bytes(1 << 30)
        )));
    }
    launch::launch(&args.run, &ObjectsJob { args }).map(drop)
}

const COLUMNS: [Column; 7] = [
    Column::new("payload", "", 15, |r, _| r.case.clone()),
    Column::new("bytes/rank", "(B)", 11, |r, _| r.bytes.to_string()),
    col::variant("variant", 16),
    col::iters(),
    col::time("median", 12),
    col::min(12),
    col::vs_peer("ratio", "to floor", 9),
];

/// The targets, judged on the tpcomm rows.
fn targets() -> Vec<Target> {
    let tpcomm = |rows: &[Row]| -> Vec<Row> {
        rows.iter()
            .filter(|r| r.variant.starts_with("tpcomm") && r.vs_peer.is_some())
            .cloned()
            .collect()
    };
    let list = |rows: &[Row]| {
        rows.iter()
            .map(|r| format!("{} {} {:.2}x", r.case, r.variant, r.vs_peer.unwrap_or(0.0)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    vec![
        Target {
            what: "tpcomm within 1.3x of the floor on every payload".into(),
            why: "the failure agreement, the length cap and the round path must not cost more \
                  than a third of the least work an all-gather of objects takes",
            judge: Box::new(move |rows: &[Row]| {
                let rows = tpcomm(rows);
                let worst = rows.iter().max_by(|a, b| {
                    a.vs_peer
                        .unwrap_or(0.0)
                        .total_cmp(&b.vs_peer.unwrap_or(0.0))
                })?;
                let over: Vec<Row> = rows
                    .iter()
                    .filter(|r| r.vs_peer.unwrap_or(0.0) > 1.3)
                    .cloned()
                    .collect();
                Some(if over.is_empty() {
                    (true, format!("worst {}", list(std::slice::from_ref(worst))))
                } else {
                    (false, format!("over: {}", list(&over)))
                })
            }),
        },
        Target {
            what: "tpcomm at most 0.8x the floor on blob:64".into(),
            why: "small values take one collective (lengths and bytes together) where the \
                  floor takes two, which should show as at least a 20% gain",
            judge: Box::new(move |rows: &[Row]| {
                let small: Vec<Row> = tpcomm(rows)
                    .into_iter()
                    .filter(|r| r.case == "blob:64")
                    .collect();
                (!small.is_empty()).then(|| {
                    let met = small.iter().all(|r| r.vs_peer.unwrap_or(f64::MAX) <= 0.8);
                    (met, list(&small))
                })
            }),
        },
    ]
}

/// One value per rank, of one of two shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Payload {
    /// One byte string of this many bytes (`serde_bytes::ByteBuf`).
    Blob(usize),
    /// This many [`Record`]s.
    Records(usize),
}

impl fmt::Display for Payload {
    /// The name as `--payloads` takes it: `blob:64`, `blob:65536`, `blob:16MiB`, `records:1000`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Payload::Blob(n) if n >= 1 << 20 && n % (1 << 20) == 0 => {
                write!(f, "blob:{}MiB", n >> 20)
            }
            Payload::Blob(n) => write!(f, "blob:{n}"),
            Payload::Records(n) => write!(f, "records:{n}"),
        }
    }
}

impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Parses `blob:BYTES` or `records:N`.
fn parse_payload(text: &str) -> Result<Payload, String> {
    let (kind, size) = text
        .trim()
        .split_once(':')
        .ok_or_else(|| format!("`{text}`: expected blob:BYTES or records:N"))?;
    match kind {
        "blob" => parse_bytes(size).map(Payload::Blob),
        "records" => size
            .trim()
            .parse()
            .map(Payload::Records)
            .map_err(|e| format!("`{size}`: {e}")),
        other => Err(format!(
            "unknown payload kind `{other}` (use blob:BYTES or records:N)"
        )),
    }
}

/// A record of the `records:N` payloads (about 50 bytes of postcard).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) tokens: Vec<u32>,
    pub(crate) score: f64,
}

/// The borrowed form of [`Record`]: `name` points into the receive buffer.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordRef<'a> {
    pub(crate) id: u64,
    #[serde(borrow)]
    pub(crate) name: &'a str,
    pub(crate) tokens: Vec<u32>,
    pub(crate) score: f64,
}

/// Tokens per record.
const TOKENS: usize = 8;
/// Token ids are below this (a Llama-3-sized vocabulary), so most take 3 varint bytes.
const VOCABULARY: u64 = 128_256;

/// Record `i` of `rank`: deterministic, so that every rank can rebuild every rank's value.
fn record(rank: usize, i: usize) -> Record {
    let seed = ((rank as u64) << 40) ^ i as u64;
    Record {
        id: ((rank as u64) << 32) | i as u64,
        name: format!("r{rank}-rec-{i:09}"),
        tokens: (0..TOKENS as u64)
            .map(|t| (splitmix64(seed.wrapping_mul(31).wrapping_add(t)) % VOCABULARY) as u32)
            .collect(),
        score: (splitmix64(!seed) >> 11) as f64 / (1u64 << 53) as f64,
    }
}

/// The blob of `rank`: `bytes` bytes of the transport bench's pseudo-random pattern.
fn blob(rank: usize, bytes: usize) -> ByteBuf {
    let mut v = vec![0u8; bytes];
    pattern(&mut v, rank, 0x0b1e_c705, 0);
    ByteBuf::from(v)
}

/// A payload shape: its owned type, its borrowed type, and how to build and check values.
trait Shape: Sync {
    type Owned: Serialize + DeserializeOwned + PartialEq + Send + Sync;
    type Borrowed<'a>: Deserialize<'a>;

    /// The value of `rank`.
    fn value(&self, rank: usize) -> Self::Owned;

    /// Whether a borrowed value equals the owned one.
    fn borrowed_eq(got: &Self::Borrowed<'_>, want: &Self::Owned) -> bool;
}

struct BlobShape(usize);

impl Shape for BlobShape {
    type Owned = ByteBuf;
    type Borrowed<'a> = &'a Bytes;

    fn value(&self, rank: usize) -> ByteBuf {
        blob(rank, self.0)
    }

    fn borrowed_eq(got: &&Bytes, want: &ByteBuf) -> bool {
        got[..] == want[..]
    }
}

struct RecordsShape(usize);

impl Shape for RecordsShape {
    type Owned = Vec<Record>;
    type Borrowed<'a> = Vec<RecordRef<'a>>;

    fn value(&self, rank: usize) -> Vec<Record> {
        (0..self.0).map(|i| record(rank, i)).collect()
    }

    fn borrowed_eq(got: &Vec<RecordRef<'_>>, want: &Vec<Record>) -> bool {
        got.len() == want.len()
            && got.iter().zip(want).all(|(g, w)| {
                g.id == w.id && g.name == w.name && g.tokens == w.tokens && g.score == w.score
            })
    }
}

/// The floor: postcard encode, lengths then bytes through `comm`, postcard decode.
fn floor_all_gather<C: Communicator, T: Serialize + DeserializeOwned>(
    comm: &C,
    value: &T,
) -> Result<Vec<T>, BenchError> {
    let bytes = postcard::to_allocvec(value)?;
    let mut words = vec![0u8; 8 * comm.size()];
    comm.all_gather(&(bytes.len() as u64).to_le_bytes(), &mut words)?;
    let counts = words
        .chunks_exact(8)
        .map(|w| {
            let mut word = [0u8; 8];
            word.copy_from_slice(w);
            usize::try_from(u64::from_le_bytes(word))
        })
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| BenchError::Usage("floor: a length does not fit usize".into()))?;
    let (displs, total) = dense_displacements(&counts)
        .filter(|&(_, total)| total <= comm.max_count())
        .ok_or_else(|| {
            BenchError::Usage(format!(
                "floor: the payload exceeds one varcount call ({} bytes)",
                comm.max_count()
            ))
        })?;
    let mut recv = vec![0u8; total];
    comm.all_gather_varcount(&bytes, &mut recv, &counts, &displs)?;
    counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| Ok(postcard::from_bytes(&recv[d..d + c])?))
        .collect()
}

/// Runs variant `v` once on this rank's `value`, as one timed iteration.
fn time_variant<C: Communicator, S: Shape>(
    comm: &C,
    v: usize,
    value: &S::Owned,
) -> Result<u64, BenchError> {
    time_once(comm, |start| match v {
        0 => {
            let all: Vec<S::Owned> = tpcomm::objects::all_gather(comm, value)?;
            let ns = elapsed_ns(start);
            drop(black_box(all));
            Ok(ns)
        }
        1 => {
            let gathered = tpcomm::objects::all_gather_borrowed(comm, value)?;
            let all: Vec<S::Borrowed<'_>> = gathered.decode()?;
            let ns = elapsed_ns(start);
            drop(black_box(all));
            drop(gathered);
            Ok(ns)
        }
        _ => {
            let all: Vec<S::Owned> = floor_all_gather(comm, value)?;
            let ns = elapsed_ns(start);
            drop(black_box(all));
            Ok(ns)
        }
    })
}

/// Runs variant `v` once and checks that every rank's value arrived (collective).
fn verify<C: Communicator, S: Shape>(
    comm: &C,
    payload: Payload,
    v: usize,
    value: &S::Owned,
    expected: &[S::Owned],
) -> Result<(), BenchError> {
    let first_wrong = |equal: &dyn Fn(usize) -> bool, got: usize| {
        if got != expected.len() {
            return Some(format!("{got} values for {} ranks", expected.len()));
        }
        (0..got)
            .find(|&r| !equal(r))
            .map(|r| format!("the value of rank {r} differs from what it sent"))
    };
    let problem = match v {
        0 => {
            let all: Vec<S::Owned> = tpcomm::objects::all_gather(comm, value)?;
            first_wrong(&|r| all[r] == expected[r], all.len())
        }
        1 => {
            let gathered: Gathered = tpcomm::objects::all_gather_borrowed(comm, value)?;
            let all: Vec<S::Borrowed<'_>> = gathered.decode()?;
            first_wrong(&|r| S::borrowed_eq(&all[r], &expected[r]), all.len())
        }
        _ => {
            let all: Vec<S::Owned> = floor_all_gather(comm, value)?;
            first_wrong(&|r| all[r] == expected[r], all.len())
        }
    };
    agree(comm, problem, || {
        format!("{} all_gather of {payload}", VARIANTS[v])
    })
}

/// Verifies, warms up and times the variants on one payload; the rows are the same on
/// every rank.
fn bench_payload<C: Communicator, S: Shape>(
    s: &Session<'_>,
    comm: &C,
    shape: &S,
    payload: Payload,
    values_per_rank: usize,
    iter: &IterArgs,
) -> Result<Vec<Row>, BenchError> {
    let value = shape.value(comm.rank());
    let expected: Vec<S::Owned> = (0..comm.size()).map(|r| shape.value(r)).collect();
    let own_bytes = postcard::to_allocvec(&value)?.len() as u64;
    let bytes_per_rank = slowest(comm, &[own_bytes])?[0] as usize;
    for v in 0..VARIANTS.len() {
        verify::<C, S>(comm, payload, v, &value, &expected)?;
    }
    drop(expected);
    let timed = time_variants(
        comm,
        Plan {
            iter,
            bytes: bytes_per_rank.saturating_mul(comm.size()),
            variants: VARIANTS.len(),
            order: Order::Rotate,
        },
        &s.progress,
        &mut (),
        |_, v| time_variant::<C, S>(comm, v, &value),
    )?;
    let case = payload.to_string();
    let mut rows: Vec<Row> = timed
        .samples
        .into_iter()
        .zip(VARIANTS)
        .filter_map(|(samples, variant)| {
            let row = Row::new(TABLE, &case, variant, bytes_per_rank, timed.warmup, samples)?;
            Some(row.with("values_per_rank", values_per_rank))
        })
        .collect();
    link_peers(&mut rows, |_| Some(VARIANTS[2].into()));
    Ok(rows)
}

/// The per-rank job of the subcommand.
struct ObjectsJob<'a> {
    args: &'a ObjectsArgs,
}

impl PerRank for ObjectsJob<'_> {
    type Output = ();

    fn run<C: Communicator>(&self, comm: &C, info: &RunInfo) -> Result<Option<()>, BenchError> {
        let args = self.args;
        let lines = [
            args.iter.describe(),
            "time: median over iterations of the slowest rank (a barrier before each iteration);"
                .into(),
            "  timed until the gathered values are in hand (dropping them is not timed)".into(),
            "min: fastest iteration; every variant verified once per payload before timing".into(),
            "tpcomm owned: tpcomm::objects::all_gather::<T> -> Vec<T>".into(),
            "tpcomm borrowed: all_gather_borrowed + Gathered::decode into &Bytes / records with \
             name: &str"
                .into(),
            "floor: postcard encode + all_gather of u64 lengths + one all_gather_varcount + \
             postcard decode (owned), same communicator"
                .into(),
            "bytes/rank: postcard bytes of one rank's value (largest over ranks)".into(),
        ];
        let json = args.run.json.as_deref();
        let mut s = Session::start(info, "objects", comm.rank(), comm.size(), json, &lines)?;
        s.header(
            "object all-gather: one value per rank, every rank gets all of them",
            &COLUMNS,
        );
        s.progress.plan(args.payloads.len());
        for &payload in &args.payloads {
            s.progress.case(payload.to_string());
            let rows = match payload {
                Payload::Blob(n) => bench_payload(&s, comm, &BlobShape(n), payload, 1, &args.iter)?,
                Payload::Records(n) => {
                    bench_payload(&s, comm, &RecordsShape(n), payload, n, &args.iter)?
                }
            };
            s.rows(&COLUMNS, rows, |_| true);
        }
        s.note("");
        s.note(
            "targets are stated for 2 MPI ranks (mpirun -np 2 ... --transport mpi); on another \
             configuration they are indicative only",
        );
        let binding = info.transport == "mpi" && comm.size() == 2;
        s.finish("objects", json, args, &targets(), binding)?;
        Ok(Some(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpcomm::transport::LocalGroup;

    #[test]
    fn payload_names_round_trip() {
        for name in DEFAULT_PAYLOADS.split(',') {
            assert_eq!(parse_payload(name).unwrap().to_string(), name);
        }
        assert_eq!(parse_payload("blob:16MiB"), Ok(Payload::Blob(16 << 20)));
        assert_eq!(
            parse_payload("blob:64KiB").unwrap().to_string(),
            "blob:65536"
        );
        assert!(parse_payload("records:x").is_err());
        assert!(parse_payload("tensor:4").is_err());
        assert!(parse_payload("64").is_err());
    }

    #[test]
    fn records_have_16_character_names_and_8_tokens() {
        let r = record(1, 99_999);
        assert_eq!(r.name.len(), 16);
        assert_eq!(r.tokens.len(), TOKENS);
        assert!(r.tokens.iter().all(|&t| u64::from(t) < VOCABULARY));
        assert!((0.0..1.0).contains(&r.score));
        assert_ne!(record(0, 5), record(1, 5));
    }

    #[test]
    fn every_variant_verifies_and_times_on_three_local_ranks() {
        let iter = IterArgs {
            iters: Some(3),
            warmup: Some(1),
        };
        let info = RunInfo::local("test");
        let results = LocalGroup::new(3).run(|comm| {
            let s = Session::start(&info, "objects", 1, 3, None, &[])?;
            let mut rows = bench_payload(&s, &comm, &BlobShape(300), Payload::Blob(300), 1, &iter)?;
            rows.extend(bench_payload(
                &s,
                &comm,
                &RecordsShape(10),
                Payload::Records(10),
                10,
                &iter,
            )?);
            Ok::<_, BenchError>(rows)
        });
        let rows = launch::first_rank_output(results).unwrap();
        assert_eq!(rows.len(), 6);
        assert!(rows.iter().all(|r| r.iters == 3 && r.stats.median_us > 0.0));
        let floor = rows.iter().find(|r| r.is("floor")).unwrap();
        assert_eq!((floor.vs_peer, floor.bytes), (Some(1.0), 302));
    }

    #[test]
    fn targets_are_checked_on_every_tpcomm_row() {
        let row = |case: &str, variant: &str, ratio| {
            let mut r = Row::new(TABLE, case, variant, 1, 0, vec![1000]).unwrap();
            r.vs_peer = Some(ratio);
            r
        };
        let rows = [
            row("blob:64", "tpcomm owned", 0.7),
            row("blob:64", "tpcomm borrowed", 0.9),
            row("blob:64", "floor", 1.0),
            row("records:100000", "tpcomm owned", 1.31),
        ];
        let v = crate::harness::Verdict::judge_all(&targets(), &rows, true);
        assert_eq!(v.len(), 2);
        assert!(!v[0].met);
        assert!(
            v[0].detail.contains("records:100000 tpcomm owned 1.31x"),
            "{}",
            v[0].detail
        );
        assert!(!v[1].met, "borrowed is over 0.8x: {:?}", v[1]);
    }
}
