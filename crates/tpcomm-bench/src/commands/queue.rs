//! `tpcomm-bench queue`: the broadcast queue against the object broadcast, mpi4py and the
//! floors of a shared-memory hand-off.
//!
//! One writer (rank 0) sends one value per iteration to every other rank. For each payload,
//! six variants are timed in the same run, their iterations interleaved:
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
//!   value that fits in one chunk;
//! - `copy floor`: the value's postcard bytes copied by the writer into shared memory and
//!   out by each reader on its own core, chunk by chunk with the queue's chunk size
//!   ([`CopyFloor`]): the two copies between processes that a broadcast of large bytes
//!   cannot avoid, overlapped as the queue's streaming overlaps them.
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
use crate::engine::targets::{within, Judge, Target};
use crate::engine::timing::{elapsed_ns, slowest, time_once, Spec};
use crate::peers::copy_floor::CopyFloor;
use crate::peers::handoff_floor::HandoffFloor;
use crate::peers::mpi4py::{faster_on_every_payload, Mpi4py, Mpi4pyRun, WithMpi4py, MPI4PY};

/// The default payloads: bytes and scheduler steps of about 64 B, 4 KiB, 64 KiB, 1 MiB and
/// 8 MiB.
const DEFAULT_PAYLOADS: &str =
    "blob:64,blob:4096,blob:65536,blob:1MiB,blob:8MiB,step:1,step:48,step:790,step:12600,step:100000";

/// The variants, in table order.
const VARIANTS: [&str; 6] = [
    "queue",
    "queue borrowed",
    "objects::broadcast",
    "memcpy floor",
    "hand-off floor",
    "copy floor",
];
/// The peer every row is compared with.
const PEER: &str = VARIANTS[2];
/// The floor of one copy on one core.
const FLOOR: &str = VARIANTS[3];
/// The floor of a shared-memory hand-off of the encoded value.
const HANDOFF: &str = VARIANTS[4];
/// The floor of the two copies between processes.
const COPY: &str = VARIANTS[5];
/// The latency target: the queue at most this factor of the hand-off floor...
const LATENCY_RATIO: f64 = 1.15;
/// ...and the bandwidth target: at most this factor of the copy floor.
const COPY_RATIO: f64 = 1.3;
/// Readers through the transport: the queue at most this factor of `objects::broadcast`.
const REMOTE_RATIO: f64 = 1.2;
const TABLE: &str = "queue broadcast";
/// Blobs up to this many bytes are the latency target's (64 B to 4 KiB); scheduler steps
/// are, whatever their size.
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

    /// Readers read through the transport (`QueueConfig::via_transport`), as readers on
    /// another host do, also where they could map the ring.
    #[arg(long)]
    pub(crate) via_transport: bool,
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

/// The judge of "the queue's rows that `pick` chooses (owned and borrowed) within `limit`
/// of `floor` measured on the same payload": met when every ratio is; the detail counts
/// them and names those outside, or the farthest.
fn within_floor(floor: &'static str, pick: impl Fn(&Row) -> bool + 'static, limit: f64) -> Judge {
    Box::new(move |rows: &[Row]| {
        let ratios: Vec<(String, f64)> = rows
            .iter()
            .filter(|r| r.variant.starts_with("queue") && pick(r))
            .filter_map(|r| Some((format!("{} {}", r.case, r.variant), to(floor, rows, r)?)))
            .collect();
        let (farthest, x) = ratios.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
        let outside: Vec<String> = ratios
            .iter()
            .filter(|(_, x)| *x > limit)
            .map(|(n, x)| format!("{n} {x:.2}x"))
            .collect();
        let mut detail = format!(
            "{} of {} rows within",
            ratios.len() - outside.len(),
            ratios.len()
        );
        if outside.is_empty() {
            detail.push_str(&format!(", farthest {farthest} {x:.2}x"));
        } else {
            detail.push_str(&format!("; outside: {}", outside.join(", ")));
        }
        Some((outside.is_empty(), detail))
    })
}

/// `judge` on the rows of the payloads whose readers read through the transport: those
/// measured without the shared-memory floors.
fn through_the_transport(judge: Judge) -> Judge {
    Box::new(move |rows: &[Row]| {
        let ring = |r: &Row| {
            rows.iter()
                .any(|f| f.is(HANDOFF) && f.table == r.table && f.case == r.case)
        };
        let remote: Vec<Row> = rows.iter().filter(|r| !ring(r)).cloned().collect();
        judge(&remote)
    })
}

/// Whether `row` is a message of the latency target: a blob up to 4 KiB, or a scheduler
/// step.
fn latency_case(row: &Row) -> bool {
    (row.case.starts_with("blob:") && row.bytes <= SMALL_BYTES) || row.case.starts_with("step:")
}

/// The targets.
fn targets() -> Vec<Target> {
    vec![
        Target {
            what: format!(
                "queue and queue borrowed within {LATENCY_RATIO}x of the hand-off floor per \
                 message from 64 B to 4 KiB and on scheduler steps"
            ),
            why: "the hand-off floor is the least any shared-memory queue of serde values does \
                  per message (encode, copy in, publish, copy out, decode): the ring, its checks \
                  and its flow control must cost little on top of it",
            line: None,
            judge: within_floor(HANDOFF, latency_case, LATENCY_RATIO),
        },
        Target {
            what: format!(
                "queue and queue borrowed within {COPY_RATIO}x of the two-process copy floor for \
                 byte messages of 1 MiB and more"
            ),
            why: "past a few KiB the cost is the copies: the writer's into shared memory and \
                  each reader's out, on different cores; streaming the chunks overlaps them, so \
                  the queue should cost little more than those two copies overlapped",
            line: None,
            judge: within_floor(
                COPY,
                |r| r.case.starts_with("blob:") && r.bytes >= LARGE_BYTES,
                COPY_RATIO,
            ),
        },
        Target {
            what: format!(
                "with readers through the transport (other hosts, or --via-transport): queue \
                 and queue borrowed within {REMOTE_RATIO}x of objects::broadcast on every payload"
            ),
            why: "a reader that cannot map the ring gets each message by the transport's \
                  broadcasts, as objects::broadcast gets its value: the queue's frames, bounded \
                  waits and checks must cost little on top of them",
            line: None,
            judge: through_the_transport(within(
                |r: &Row| r.variant.starts_with("queue"),
                |x| x,
                REMOTE_RATIO,
            )),
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

/// `row`'s median over `floor`'s on the same payload.
fn to(floor: &str, rows: &[Row], row: &Row) -> Option<f64> {
    let f = rows
        .iter()
        .find(|f| f.is(floor) && f.table == row.table && f.case == row.case)?;
    (f.stats.median_us > 0.0).then(|| row.stats.median_us / f.stats.median_us)
}

/// Per payload: the queue's ratios to the floors, and how much slower the peers are.
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
            for floor in [HANDOFF, COPY, FLOOR] {
                for v in [VARIANTS[0], VARIANTS[1]] {
                    if let Some(x) = rows
                        .iter()
                        .find(|r| r.case == case && r.is(v))
                        .and_then(|r| to(floor, rows, r))
                    {
                        parts.push(format!("{v} / {floor} {x:.2}x"));
                    }
                }
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
    /// The hand-off floor, and where its readers copy the bytes out (`None` when the ranks
    /// are on several hosts: shared memory is not there to measure).
    handoff: Option<HandoffFloor>,
    received: Vec<u8>,
    /// The copy floor (its readers copy into `copy`; `None` across hosts too).
    two_copies: Option<CopyFloor>,
}

/// What a floor variant does when the ranks are on several hosts: it is not measured.
fn no_floor() -> BenchError {
    BenchError::Usage("a shared-memory floor across hosts is not measured".into())
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
            5 if writer => {
                st.two_copies
                    .as_mut()
                    .ok_or_else(no_floor)?
                    .send(&st.bytes)?;
                ns = elapsed_ns(start);
            }
            5 => {
                st.two_copies
                    .as_mut()
                    .ok_or_else(no_floor)?
                    .recv_into(&mut st.copy)?;
                ns = elapsed_ns(start);
                black_box(&st.copy);
                if check {
                    problem = wrong(st.copy == st.bytes);
                }
            }
            _ if writer => {
                st.handoff.as_mut().ok_or_else(no_floor)?.send(&st.value)?;
                ns = elapsed_ns(start);
            }
            _ => {
                st.handoff
                    .as_mut()
                    .ok_or_else(no_floor)?
                    .recv_into(&mut st.received)?;
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
    (queue, chunk_bytes): (&mut BroadcastQueue<C>, usize),
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
    // The two shared-memory floors are the bounds of readers that map the ring (every rank
    // on one host); when readers read through the transport (on other hosts, or asked to),
    // the table has the queue, the broadcast (their bound) and the one-core copy.
    let one_host = queue.locality().transport.is_empty()
        && !tpcomm::transport::hosts::hosts(comm)?.spans_hosts();
    let variants: &[&str] = if one_host { &VARIANTS } else { &VARIANTS[..4] };
    let spec = Spec {
        peer: Some(PEER),
        ..Spec::new(TABLE, payload.to_string(), len, variants)
    };
    let mut st = State::<C, S> {
        queue,
        value,
        copy: vec![0; bytes.len()],
        handoff: one_host.then(|| HandoffFloor::new(comm, len)).transpose()?,
        received: Vec::with_capacity(len),
        two_copies: one_host
            .then(|| CopyFloor::new(comm, bytes.len(), chunk_bytes))
            .transpose()?,
        bytes,
    };
    s.verify(comm, &spec, &mut st, |st, k| Ok(once(comm, st, k, true)?.1))?;
    let mut rows = s.measure(
        comm,
        &spec,
        &mut st,
        |st, k| Ok(once(comm, st, k, false)?.0),
    )?;
    if let Some(handoff) = st.handoff {
        handoff.close()?;
    }
    if let Some(two_copies) = st.two_copies {
        two_copies.close()?;
    }
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
            via_transport: self.args.via_transport,
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
            format!(
                "copy floor: the value's postcard bytes copied by the writer into shared memory \
                 and out by each reader (its own core), {} at a time, the copies overlapped",
                format_bytes(c.chunk_bytes)
            ),
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
            let q = (&mut queue, self.config().chunk_bytes);
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

    fn row(case: &str, bytes: usize, variant: &str, us: f64) -> Row {
        let mut r = Row::of_us(TABLE, case, variant, us);
        r.bytes = bytes;
        r
    }

    #[test]
    fn small_blobs_and_steps_are_judged_against_the_hand_off_floor_owned_and_borrowed() {
        let rows = vec![
            row("blob:64", 66, "queue", 1.1),
            row("blob:64", 66, "queue borrowed", 1.0),
            row("blob:64", 66, HANDOFF, 1.0),
            row("step:100000", 8 << 20, "queue", 30_000.0),
            row("step:100000", 8 << 20, HANDOFF, 40_000.0),
            // Large blobs are the copy floor's.
            row("blob:1MiB", 1 << 20, "queue", 900.0),
            row("blob:1MiB", 1 << 20, HANDOFF, 100.0),
        ];
        let v = crate::engine::targets::judge(&targets(), &rows);
        assert_eq!(v.len(), 1, "no copy floor or mpi4py rows: {v:?}");
        assert!(v[0].met, "{v:?}");
        assert_eq!(
            v[0].detail,
            "3 of 3 rows within, farthest blob:64 queue 1.10x"
        );
        let slow = [
            row("step:48", 4000, "queue", 12.0),
            row("step:48", 4000, "queue borrowed", 10.0),
            row("step:48", 4000, HANDOFF, 10.0),
        ];
        let v = crate::engine::targets::judge(&targets(), &slow);
        assert!(!v[0].met);
        assert_eq!(
            v[0].detail,
            "1 of 2 rows within; outside: step:48 queue 1.20x"
        );
    }

    #[test]
    fn payloads_read_through_the_transport_are_judged_against_objects_broadcast_alone() {
        let vs = |mut r: Row, x: f64| {
            r.vs_peer = Some(x);
            r
        };
        let rows = vec![
            // Read through the transport: no shared-memory floor measured.
            vs(row("blob:64", 66, "queue", 7.0), 1.1),
            vs(row("blob:64", 66, "queue borrowed", 7.5), 1.25),
            row("blob:64", 66, PEER, 6.0),
            vs(row("step:790", 65_000, "queue", 160.0), 1.05),
            // Read from the ring: judged against the floors only.
            vs(row("step:1", 83, "queue", 0.7), 3.0),
            row("step:1", 83, HANDOFF, 0.65),
        ];
        let v = crate::engine::targets::judge(&targets(), &rows);
        let remote = v
            .iter()
            .find(|v| v.target.contains("through the transport"))
            .unwrap();
        assert!(!remote.met, "{v:?}");
        assert_eq!(
            remote.detail,
            "2 of 3 rows within; outside, farthest first: queue broadcast blob:64 queue borrowed 1.250x"
        );
        let ring = v.iter().find(|v| v.target.contains("hand-off")).unwrap();
        assert_eq!(
            ring.detail,
            "1 of 1 rows within, farthest step:1 queue 1.08x"
        );
        let fast = [vs(row("blob:64", 66, "queue", 7.0), 1.19)];
        let v = crate::engine::targets::judge(&targets(), &fast);
        assert!(v[0].met, "{v:?}");
    }

    #[test]
    fn byte_messages_of_1_mib_and_more_are_judged_against_the_copy_floor() {
        let rows = vec![
            row("blob:65536", 65536, "queue", 100.0),
            row("blob:65536", 65536, COPY, 10.0),
            row("blob:1MiB", 1 << 20, "queue", 140.0),
            row("blob:1MiB", 1 << 20, "queue borrowed", 100.0),
            row("blob:1MiB", 1 << 20, COPY, 100.0),
            row("blob:1MiB", 1 << 20, FLOOR, 50.0),
            row("blob:1MiB", 1 << 20, PEER, 280.0),
        ];
        let v = crate::engine::targets::judge(&targets(), &rows);
        let copy = v.iter().find(|v| v.target.contains("copy floor")).unwrap();
        assert!(!copy.met);
        assert_eq!(
            copy.detail,
            "1 of 2 rows within; outside: blob:1MiB queue 1.40x"
        );
        let lines = summary_lines(&rows);
        assert_eq!(
            lines[1],
            "blob:1MiB: queue / copy floor 1.40x, queue borrowed / copy floor 1.00x, queue / \
             memcpy floor 2.80x, queue borrowed / memcpy floor 2.00x, objects::broadcast / \
             queue 2.0x"
        );
    }
}
