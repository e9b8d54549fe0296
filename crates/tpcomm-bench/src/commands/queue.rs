//! `tpcomm-bench queue`: the broadcast queue against the object broadcast, mpi4py and the
//! memcpy floor.
//!
//! One writer (rank 0) sends one value per iteration to every other rank. For each payload,
//! four variants are timed in the same run, their iterations interleaved:
//!
//! - `queue`: [`BroadcastQueue::send`] on the writer, [`BroadcastQueue::recv`] (an owned
//!   value) on every reader, through one queue made at the start of the run (as an engine
//!   makes it once), with the queue's default ring unless `--depth` / `--chunk-bytes` say;
//! - `queue borrowed`: the same, the readers decoding with
//!   [`BroadcastQueue::recv_borrowed`] into values that borrow from the queue's receive
//!   buffer (`&Bytes`, request ids as `&str`);
//! - `objects::broadcast` (the peer): [`tpcomm::objects::broadcast`] of the same value from
//!   rank 0 over the run's transport (threads, or MPI processes), as an engine without the
//!   queue would send its step;
//! - `memcpy floor`: every rank copies the value's postcard bytes once, at the same time,
//!   between two warm buffers of its own: the data movement no shared-memory broadcast of
//!   the encoded value can avoid (the writer's copy in, each reader's copy out, overlapped);
//! - `hand-off floor`: the writer encodes the value, copies it into shared memory and stores
//!   a sequence number, each reader spins on it, copies the bytes out and decodes them
//!   ([`HandoffFloor`]): the queue's work without its ring, checks and flow control, which
//!   bounds what any shared-memory queue of serde values can reach on this machine for a
//!   value that fits in one chunk.
//!
//! With `--transport local`, mpi4py's `comm.bcast` of the equivalent Python object (bytes, or
//! a dict of lists of dicts) is timed first, in its own `mpirun` job with as many ranks.
//!
//! Each iteration starts at a barrier and is timed on every rank until its value is in hand
//! (the writer: until `send` returns); the iteration's time is its slowest rank's. Every
//! variant is checked once per payload before timing.

use std::hint::black_box;

use clap::Args;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm::queue::{BroadcastQueue, QueueConfig};
use tpcomm::transport::copy::copy_slice;
use tpcomm::Communicator;

use crate::data::payload::{
    fingerprint, parse_payload, BlobShape, Payload, RecordsShape, Shape, StepShape,
};
use crate::engine::error::BenchError;
use crate::engine::launch::{self, Bench, RunArgs};
use crate::engine::row::{link_peers, Row};
use crate::engine::session::Session;
use crate::engine::sweep::{format_bytes, parse_bytes};
use crate::engine::table::{col, Column};
use crate::engine::targets::{floor_bound, within, Target};
use crate::engine::timing::{elapsed_ns, slowest, time_once, Spec};
use crate::peers::handoff_floor::HandoffFloor;
use crate::peers::mpi4py::{faster_on_every_payload, Mpi4py, Mpi4pyRun, WithMpi4py, MPI4PY};

/// The default payloads: bytes and scheduler steps of about 64 B, 4 KiB, 64 KiB, 1 MiB and
/// 8 MiB.
const DEFAULT_PAYLOADS: &str =
    "blob:64,blob:4096,blob:65536,blob:1MiB,blob:8MiB,step:1,step:48,step:790,step:12600,step:100000";

/// The variants, in table order.
const VARIANTS: [&str; 5] = [
    "queue",
    "queue borrowed",
    "objects::broadcast",
    "memcpy floor",
    "hand-off floor",
];
/// The peer every row is compared with.
const PEER: &str = VARIANTS[2];
/// The floor of the copies.
const FLOOR: &str = VARIANTS[3];
/// The floor of a shared-memory hand-off of the encoded value.
const HANDOFF: &str = VARIANTS[4];
/// How much faster than the broadcast the latency target asks the queue to be.
const LATENCY_SPEEDUP: f64 = 5.0;
const TABLE: &str = "queue broadcast";
/// Payloads up to this many bytes are the latency target's (64 B to 4 KiB).
const SMALL_BYTES: usize = 4096 + 64;
/// Blobs of at least this many bytes are the bandwidth target's.
const LARGE_BYTES: usize = 1 << 20;

/// Options of `tpcomm-bench queue`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct QueueArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

    /// Payloads, comma-separated: `blob:BYTES` (a byte string, `serde_bytes`; BYTES takes
    /// K/KiB, M/MiB, G/GiB), `step:N` (a scheduler step of N requests, each a 16-character
    /// id, a prompt length, 4 tokens, a 16-block table and sampling parameters: about 80
    /// bytes of postcard) or `records:N` (the objects bench's records).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_payload,
        default_value = DEFAULT_PAYLOADS,
        value_name = "PAYLOADS"
    )]
    pub(crate) payloads: Vec<Payload>,

    /// Chunks in the queue's ring [default: the queue's, 16].
    #[arg(long, value_name = "N")]
    pub(crate) depth: Option<usize>,

    /// Payload bytes per chunk of the ring [default: the queue's, 256 KiB].
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) chunk_bytes: Option<usize>,

    /// Skip the mpi4py peer (otherwise run, with the local transport, when
    /// `python3 -c "import mpi4py"` works and `mpirun` exists).
    #[arg(long)]
    pub(crate) no_mpi4py: bool,
}

/// Runs the subcommand: the mpi4py peer first (its own MPI job), then the bench's ranks.
pub(crate) fn run(args: &QueueArgs) -> Result<(), BenchError> {
    if args.payloads.is_empty() {
        return Err(BenchError::Usage("--payloads is empty".into()));
    }
    let mpi4py = Mpi4py::measure("queue", "bcast", &args.run, &args.payloads, args.no_mpi4py);
    launch::run(&WithMpi4py { args, mpi4py })
}

const COLUMNS: [Column; 7] = [
    Column::new("payload", "", 13, |r, _| r.case.clone()),
    Column::new("bytes", "(B)", 9, |r, _| r.bytes.to_string()),
    col::variant("variant", 18),
    col::iters(),
    col::time::<2>("median", 11),
    col::min::<2>(11),
    col::vs_peer("ratio", "to bcast", 9),
];

/// The targets.
fn targets() -> Vec<Target> {
    let queue = |r: &Row| r.variant.starts_with("queue");
    vec![
        Target {
            what: "queue at least 5x faster than objects::broadcast over MPI from 64 B to 4 KiB"
                .into(),
            why: "a collective per step (a rendezvous of every rank, the transport's protocol) \
                  is what the queue replaces: an engine's step metadata must reach the readers \
                  in a small fraction of what the broadcast costs",
            line: None,
            judge: {
                let queue_rows = within(
                    move |r| queue(r) && r.bytes <= SMALL_BYTES,
                    |x| x,
                    1.0 / LATENCY_SPEEDUP,
                );
                Box::new(move |rows: &[Row]| {
                    let (met, detail) = queue_rows(rows)?;
                    Some((met, format!("{detail}{}", handoff_bound(rows))))
                })
            },
        },
        Target {
            what: "queue within 2x of the memcpy floor for byte messages of 1 MiB and more".into(),
            why: "past a few KiB the cost is the copies: the writer's encoding and the copy into \
                  the ring, each reader's copy out and its decode; streaming the chunks overlaps \
                  the ring copies, so the whole should stay within twice one copy",
            line: None,
            judge: Box::new(|rows: &[Row]| {
                let ratios: Vec<(String, f64)> = rows
                    .iter()
                    .filter(|r| r.variant.starts_with("queue") && r.case.starts_with("blob:"))
                    .filter(|r| r.bytes >= LARGE_BYTES)
                    .filter_map(|r| Some((format!("{} {}", r.case, r.variant), to_floor(rows, r)?)))
                    .collect();
                if ratios.is_empty() {
                    return None;
                }
                let met = ratios.iter().all(|(_, x)| *x <= 2.0);
                let detail: Vec<String> =
                    ratios.iter().map(|(n, x)| format!("{n} {x:.2}x")).collect();
                Some((met, detail.join(", ")))
            }),
        },
        Target {
            what: "queue faster than mpi4py comm.bcast on every payload".into(),
            why: "Python engines send their step with pickle over a collective; a Rust engine \
                  must never pay more for it",
            line: None,
            judge: faster_on_every_payload("queue"),
        },
    ]
}

/// What the hand-off floor allows the latency target: "; `hand-off floor` bounds the
/// speedup at X (payload)", the smallest speedup over the broadcast that the floor itself
/// reaches on the small payloads (out of reach when below the target's).
fn handoff_bound(rows: &[Row]) -> String {
    let speedups = rows
        .iter()
        .filter(|r| r.is(HANDOFF) && r.bytes <= SMALL_BYTES)
        .filter_map(|f| {
            let peer = rows.iter().find(|p| p.is(PEER) && p.case == f.case)?;
            (f.stats.median_us > 0.0).then(|| (peer.stats.median_us / f.stats.median_us, f))
        });
    speedups
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map_or_else(String::new, |(x, f)| {
            floor_bound(
                &format!("`{HANDOFF}`"),
                &format!("the speedup at {x:.1}x ({})", f.case),
                x >= LATENCY_SPEEDUP,
                "",
            )
        })
}

/// `row`'s median over the memcpy floor's of its case.
fn to_floor(rows: &[Row], row: &Row) -> Option<f64> {
    let floor = rows
        .iter()
        .find(|f| f.is(FLOOR) && f.table == row.table && f.case == row.case)?;
    (floor.stats.median_us > 0.0).then(|| row.stats.median_us / floor.stats.median_us)
}

/// Per payload: the queue's ratios to the floor, and how much slower the peers are.
fn summary_lines(rows: &[Row]) -> Vec<String> {
    let mut cases: Vec<&str> = Vec::new();
    for r in rows {
        if !cases.contains(&r.case.as_str()) {
            cases.push(&r.case);
        }
    }
    cases
        .into_iter()
        .filter_map(|case| {
            let q = rows.iter().find(|r| r.case == case && r.is(VARIANTS[0]))?;
            let mut parts = Vec::new();
            for v in [VARIANTS[0], VARIANTS[1]] {
                if let Some(x) = rows
                    .iter()
                    .find(|r| r.case == case && r.is(v))
                    .and_then(|r| to_floor(rows, r))
                {
                    parts.push(format!("{v} / floor {x:.2}x"));
                }
            }
            if let Some(h) = rows.iter().find(|r| r.case == case && r.is(HANDOFF)) {
                parts.push(format!(
                    "queue / {HANDOFF} {:.2}x",
                    q.stats.median_us / h.stats.median_us
                ));
            }
            for peer in [PEER, MPI4PY] {
                if let Some(p) = rows.iter().find(|r| r.case == case && r.is(peer)) {
                    parts.push(format!(
                        "{peer} / queue {:.1}x",
                        p.stats.median_us / q.stats.median_us
                    ));
                }
            }
            Some(format!("{case}: {}", parts.join(", ")))
        })
        .collect()
}

/// What one rank keeps across the iterations of a payload.
struct State<'q, C: Communicator, S: Shape> {
    queue: &'q mut BroadcastQueue<C>,
    /// The writer's value (rank 0's), on every rank (the readers check against it).
    value: S::Owned,
    /// Its postcard bytes, and the memcpy floor's destination.
    bytes: Vec<u8>,
    copy: Vec<u8>,
    /// The hand-off floor, and where its readers copy the bytes out.
    handoff: HandoffFloor,
    received: Vec<u8>,
}

/// Runs variant `v` once as one timed iteration; with `check`, also says what is wrong with
/// what arrived, if anything.
fn once<C: Communicator, S: Shape>(
    comm: &C,
    st: &mut State<'_, C, S>,
    v: usize,
    check: bool,
) -> Result<(u64, Option<String>), BenchError> {
    let writer = comm.rank() == 0;
    let mut problem = None;
    let wrong = |ok: bool| (!ok).then(|| "the value differs from the writer's".to_string());
    let ns = time_once(comm, |start| {
        let ns;
        match v {
            0 | 1 if writer => {
                st.queue.send(&st.value)?;
                ns = elapsed_ns(start);
            }
            0 => {
                let got: S::Owned = st.queue.recv()?;
                ns = elapsed_ns(start);
                if check {
                    problem = wrong(got == st.value);
                }
                drop(black_box(got));
            }
            1 => {
                let got: S::Borrowed<'_> = st.queue.recv_borrowed()?;
                ns = elapsed_ns(start);
                if check {
                    problem = wrong(S::borrowed_eq(&got, &st.value));
                }
                drop(black_box(got));
            }
            2 => {
                let got: S::Owned =
                    tpcomm::objects::broadcast(comm, 0, writer.then_some(&st.value))?;
                ns = elapsed_ns(start);
                if check {
                    problem = wrong(got == st.value);
                }
                drop(black_box(got));
            }
            3 => {
                copy_slice(&mut st.copy, &st.bytes);
                ns = elapsed_ns(start);
                black_box(&st.copy);
                if check {
                    problem = wrong(st.copy == st.bytes);
                }
            }
            _ if writer => {
                st.handoff.send(&st.value)?;
                ns = elapsed_ns(start);
            }
            _ => {
                st.handoff.recv_into(&mut st.received)?;
                let got: S::Owned = postcard::from_bytes(&st.received)?;
                ns = elapsed_ns(start);
                if check {
                    problem = wrong(got == st.value);
                }
                drop(black_box(got));
            }
        }
        Ok(ns)
    })?;
    Ok((ns, problem))
}

/// Verifies, warms up and times the variants on one payload.
fn bench_payload<C: Communicator, S: Shape>(
    s: &Session<'_>,
    comm: &C,
    queue: &mut BroadcastQueue<C>,
    shape: &S,
    payload: Payload,
    mpi4py: Option<&Mpi4pyRun>,
) -> Result<Vec<Row>, BenchError>
where
    S::Owned: Serialize + DeserializeOwned,
{
    let value = shape.value(0);
    let bytes = postcard::to_allocvec(&value)?;
    let len = slowest(comm, &[bytes.len() as u64])?[0] as usize;
    if let Some(py) = mpi4py {
        let ours = fingerprint::<S>(std::slice::from_ref(&value));
        py.check(payload, "value differs", &ours)?;
    }
    let spec = Spec {
        peer: Some(PEER),
        ..Spec::new(TABLE, payload.to_string(), len, &VARIANTS)
    };
    let mut st = State::<C, S> {
        queue,
        value,
        copy: vec![0; bytes.len()],
        handoff: HandoffFloor::new(comm, len)?,
        received: Vec::with_capacity(len),
        bytes,
    };
    s.verify(comm, &spec, &mut st, |st, k| Ok(once(comm, st, k, true)?.1))?;
    let mut rows = s.measure(
        comm,
        &spec,
        &mut st,
        |st, k| Ok(once(comm, st, k, false)?.0),
    )?;
    st.handoff.close()?;
    if let Some(py) = mpi4py {
        rows.extend(py.row(TABLE, payload, len));
        link_peers(&mut rows, |r| r.is(MPI4PY).then(|| PEER.into()));
    }
    Ok(rows)
}

impl WithMpi4py<'_, QueueArgs> {
    fn config(&self) -> QueueConfig {
        let default = QueueConfig::default();
        QueueConfig {
            depth: self.args.depth.unwrap_or(default.depth),
            chunk_bytes: self.args.chunk_bytes.unwrap_or(default.chunk_bytes),
            ..default
        }
    }
}

/// `queue` with the mpi4py peer's figures, measured before the ranks start.
impl Bench for WithMpi4py<'_, QueueArgs> {
    const NAME: &'static str = "queue";
    const MPI_TARGETS: bool = true;
    const STATED_FOR: &'static str = "2 MPI ranks (mpirun -np 2 ... --transport mpi)";

    fn run_args(&self) -> &RunArgs {
        &self.args.run
    }

    fn validate(&self) -> Result<(), BenchError> {
        if self.args.run.ranks == Some(1) {
            return Err(BenchError::Usage(
                "--ranks 1: the queue needs a reader (1 writer, 1 to 7 readers)".into(),
            ));
        }
        Ok(())
    }

    fn preamble(&self, _mpi: bool) -> Vec<String> {
        let c = self.config();
        vec![
            "what: rank 0 sends one value per iteration to every other rank (the readers)".into(),
            "time: median over iterations of the slowest rank (a barrier before each); a reader \
             until its value is in hand, the writer until send returns"
                .into(),
            "min: fastest iteration; every variant verified once per payload before timing".into(),
            format!(
                "queue: BroadcastQueue send / recv (owned values), one queue for the run, ring of \
                 {} chunks of {}",
                c.depth,
                format_bytes(c.chunk_bytes)
            ),
            "queue borrowed: the same with recv_borrowed (&Bytes, request ids as &str)".into(),
            "objects::broadcast (the peer of the ratio column): tpcomm::objects::broadcast from \
             rank 0 over this run's transport"
                .into(),
            "memcpy floor: every rank copies the value's postcard bytes once, at the same time, \
             between two warm buffers"
                .into(),
            "hand-off floor: the writer encodes the value, copies it into shared memory and \
             stores a sequence number; each reader spins on it, copies the bytes out and \
             decodes them (the queue's work without ring, checks or flow control)"
                .into(),
            "bytes: postcard bytes of the value".into(),
            self.mpi4py.describe(
                "mpi4py: comm.bcast from rank 0 of the same value as a Python object (bytes; a \
                 dict of lists of dicts), pickled, in its own mpirun job before this one, same \
                 timing; data checked identical (fingerprint)",
            ),
        ]
    }

    fn targets(&self) -> Vec<Target> {
        targets()
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        s.header(
            "broadcast queue: one writer's value to every reader, per iteration",
            &COLUMNS,
        );
        s.progress.plan(self.args.payloads.len());
        let mut queue = BroadcastQueue::create(comm, self.config())?;
        if s.prints() {
            let l = queue.locality();
            s.note(&format!(
                "readers on the ring: {:?}; through the transport: {:?}",
                l.shared_memory, l.transport
            ));
        }
        for &payload in &self.args.payloads {
            let py = self.mpi4py.of(payload);
            let q = &mut queue;
            let rows = match payload {
                Payload::Blob(n) => bench_payload(s, comm, q, &BlobShape(n), payload, py)?,
                Payload::Records(n) => bench_payload(s, comm, q, &RecordsShape(n), payload, py)?,
                Payload::Step(n) => bench_payload(s, comm, q, &StepShape(n), payload, py)?,
            };
            s.rows(&COLUMNS, rows, |_| true);
        }
        queue.close_with(comm)?;
        s.closing(summary_lines(s.kept()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_payloads_are_bytes_and_steps_of_five_sizes() {
        let args = parse!(Queue, ["queue"]);
        assert_eq!(args.payloads.len(), 10);
        assert_eq!(args.payloads[4], Payload::Blob(8 << 20));
        assert_eq!(args.payloads[9], Payload::Step(100_000));
    }

    #[test]
    fn the_targets_judge_the_small_rows_against_the_broadcast_and_the_large_against_the_floor() {
        let row = |case: &str, bytes, variant, us| {
            let mut r = Row::of_us(TABLE, case, variant, us);
            r.bytes = bytes;
            r
        };
        let mut rows = vec![
            row("blob:64", 66, "queue", 2.0),
            row("blob:64", 66, PEER, 20.0),
            row("blob:1MiB", 1 << 20, "queue", 300.0),
            row("blob:1MiB", 1 << 20, FLOOR, 100.0),
            row("blob:1MiB", 1 << 20, PEER, 600.0),
        ];
        link_peers(&mut rows, |r| (!r.is(PEER)).then(|| PEER.to_string()));
        let v = crate::engine::targets::judge(&targets(), &rows);
        assert_eq!(v.len(), 2, "no mpi4py row: its target is not judged");
        assert!(v[0].met, "{v:?}");
        assert!(!v[1].met);
        assert_eq!(v[1].detail, "blob:1MiB queue 3.00x");
        let lines = summary_lines(&rows);
        assert_eq!(
            lines[1],
            "blob:1MiB: queue / floor 3.00x, objects::broadcast / queue 2.0x"
        );
    }

    #[test]
    fn the_latency_verdict_quotes_the_speedup_the_hand_off_floor_allows() {
        let row = |case: &str, variant, us| {
            let mut r = Row::of_us(TABLE, case, variant, us);
            r.bytes = 66;
            r
        };
        let verdict = |floor_us| {
            let mut rows = vec![
                row("blob:64", "queue", 0.3),
                row("blob:64", PEER, 1.0),
                row("blob:64", HANDOFF, floor_us),
            ];
            link_peers(&mut rows, |r| (!r.is(PEER)).then(|| PEER.to_string()));
            crate::engine::targets::judge(&targets(), &rows).remove(0)
        };
        let slow_floor = verdict(0.25);
        assert!(!slow_floor.met);
        assert!(
            slow_floor.detail.ends_with(
                "; `hand-off floor` bounds the speedup at 4.0x (blob:64): out of reach on this \
                 machine"
            ),
            "{}",
            slow_floor.detail
        );
        let fast_floor = verdict(0.1);
        assert!(
            fast_floor
                .detail
                .ends_with("; `hand-off floor` bounds the speedup at 10.0x (blob:64)"),
            "{}",
            fast_floor.detail
        );
    }
}
