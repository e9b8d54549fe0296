//! `tpcomm-bench transport`: the collectives of `tpcomm-transport` over host bytes.
//!
//! Ranks are threads of one process (the local backend) by default; under `mpirun` with
//! `--transport mpi` they are MPI ranks, and every operation is also timed through rsmpi
//! called directly on `MPI_COMM_WORLD`, in the same run, iterations interleaved with
//! tpcomm's, so that the table shows what the wrapper costs (`ratio` = tpcomm / direct).
//!
//! Per size: the data is verified once (outside timing; every rank learns whether any rank
//! saw wrong bytes, so nobody is left waiting), then warm-up iterations, then timed ones.
//! Each iteration is a barrier followed by the operation, timed on every rank; the
//! per-rank times are all-gathered after the loop and the iteration's time is the slowest
//! rank's. Sizes follow nccl-tests: all-gather and gather count the bytes gathered in
//! total, all-to-all the bytes each rank sends, broadcast the buffer.

#[cfg(feature = "mpi")]
mod direct;

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use serde::Serialize;
use tpcomm::transport::{dense_displacements, GatherRecv, Layout, LocalGroup};
use tpcomm::Communicator;

use crate::error::BenchError;
use crate::launch::{first_rank_output, warn_if_under_mpirun, DEFAULT_LOCAL_RANKS};
use crate::report::{self, BusModel, Machine, Measurement, Report, Row, Table};
use crate::sweep::SweepArgs;
use crate::timing::{elapsed_ns, median, ranks_flagging, slowest};

/// Root of broadcast and gather.
const ROOT: usize = 0;
/// The wrapper's target: median within this factor of direct rsmpi at every size.
const RATIO_TARGET: f64 = 1.1;

/// Which transport carries the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Transport {
    /// Threads of this process (`LocalGroup`).
    Local,
    /// MPI ranks (run under `mpirun`; needs the `mpi` feature).
    Mpi,
}

/// The collectives this subcommand measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TransportOp {
    /// Fixed-size all-gather.
    #[value(name = "all_gather")]
    AllGather,
    /// Varcount all-gather (allgatherv), near-equal counts.
    #[value(name = "all_gather_varcount")]
    AllGatherVarcount,
    /// Varcount gather to rank 0 (gatherv), near-equal counts.
    #[value(name = "gather_varcount")]
    GatherVarcount,
    /// Broadcast from rank 0.
    #[value(name = "broadcast")]
    Broadcast,
    /// Varcount all-to-all (alltoallv), equal blocks.
    #[value(name = "all_to_all_varcount")]
    AllToAllVarcount,
}

impl TransportOp {
    /// Every operation, in the default order of `--ops`.
    #[cfg(test)]
    pub(crate) const ALL: [TransportOp; 5] = [
        TransportOp::AllGather,
        TransportOp::AllGatherVarcount,
        TransportOp::GatherVarcount,
        TransportOp::Broadcast,
        TransportOp::AllToAllVarcount,
    ];

    fn name(self) -> &'static str {
        match self {
            TransportOp::AllGather => "all_gather",
            TransportOp::AllGatherVarcount => "all_gather_varcount",
            TransportOp::GatherVarcount => "gather_varcount",
            TransportOp::Broadcast => "broadcast",
            TransportOp::AllToAllVarcount => "all_to_all_varcount",
        }
    }

    fn root(self) -> Option<usize> {
        match self {
            TransportOp::GatherVarcount | TransportOp::Broadcast => Some(ROOT),
            _ => None,
        }
    }

    fn bus(self) -> BusModel {
        match self {
            TransportOp::Broadcast => BusModel::Same,
            _ => BusModel::AllButOwnShare,
        }
    }

    /// What `size` means for this operation, for the table's title.
    fn size_meaning(self) -> &'static str {
        match self {
            TransportOp::AllGather | TransportOp::AllGatherVarcount => {
                "size = bytes gathered (all ranks' contributions); busbw = algbw * (n-1)/n"
            }
            TransportOp::GatherVarcount => {
                "size = bytes gathered at root 0; busbw = algbw * (n-1)/n"
            }
            TransportOp::Broadcast => "size = buffer bytes, root 0; busbw = algbw",
            TransportOp::AllToAllVarcount => {
                "size = bytes each rank sends (n equal blocks); busbw = algbw * (n-1)/n"
            }
        }
    }
}

/// Options of `tpcomm-bench transport`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct TransportArgs {
    /// Ranks (threads) of the local group [default: 2]. Not with `--transport mpi`, where
    /// `mpirun -np` decides.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) ranks: Option<u32>,

    /// Transport carrying the collectives.
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub(crate) transport: Transport,

    /// Operations to measure, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "all_gather,all_gather_varcount,gather_varcount,broadcast,all_to_all_varcount",
        value_name = "OPS"
    )]
    pub(crate) ops: Vec<TransportOp>,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) sweep: SweepArgs,

    /// Also write every figure (and every iteration's time) to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

/// Runs the subcommand.
pub(crate) fn run(args: &TransportArgs) -> Result<(), BenchError> {
    args.sweep.validate()?;
    match args.transport {
        Transport::Local => run_local(args),
        #[cfg(feature = "mpi")]
        Transport::Mpi => direct::run_mpi(args),
        #[cfg(not(feature = "mpi"))]
        Transport::Mpi => Err(BenchError::Usage(
            "this tpcomm-bench was built without MPI: rebuild with \
             `cargo build --release -p tpcomm-bench --features mpi`"
                .into(),
        )),
    }
}

fn run_local(args: &TransportArgs) -> Result<(), BenchError> {
    warn_if_under_mpirun();
    if let Some(path) = &args.json {
        report::check_writable(path)?;
    }
    let ranks = args.ranks.unwrap_or(DEFAULT_LOCAL_RANKS) as usize;
    let machine = Machine::current();
    let table = Table { direct: false };
    print_preamble(
        args,
        &table,
        &machine,
        "local (threads of this process)",
        ranks,
        None,
    );
    let results =
        LocalGroup::new(ranks).run(|comm| bench_rank(&comm, None::<&NoDirect>, args, &table));
    let rows = first_rank_output(results)?;
    finish(args, &table, machine, "local", ranks, None, &rows)
}

/// Prints the lines above the first table (rank 0 only).
fn print_preamble(
    args: &TransportArgs,
    table: &Table,
    machine: &Machine,
    transport: &str,
    ranks: usize,
    mpi_library: Option<&str>,
) {
    table.note(&format!(
        "tpcomm-bench transport: {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    ));
    let plural = if ranks == 1 { "" } else { "s" };
    table.note(&format!("transport {transport}, {ranks} rank{plural}"));
    if let Some(lib) = mpi_library {
        table.note(&format!("MPI library: {lib}"));
    }
    table.note(&format!("machine: {}", machine.describe()));
    table.note(&args.sweep.describe());
    table
        .note("time: median over iterations of the slowest rank (a barrier before each iteration)");
    table.note("min: fastest iteration; data verified once per size before timing");
    if std::env::var_os("RUST_LOG").is_some() {
        table.note("RUST_LOG is set: tracing spans enabled by it add to tpcomm's times");
    }
    if table.direct {
        table.note(&format!(
            "direct: the same collective through rsmpi on MPI_COMM_WORLD, iterations interleaved \
             with tpcomm's; ratio = tpcomm median / direct median (target <= {RATIO_TARGET:.2}x)"
        ));
    }
}

/// Prints the closing summary and writes the JSON report (rank 0 only).
fn finish(
    args: &TransportArgs,
    table: &Table,
    machine: Machine,
    transport: &'static str,
    ranks: usize,
    mpi_library: Option<String>,
    rows: &[Row],
) -> Result<(), BenchError> {
    if table.direct {
        let ratios: Vec<(f64, &Row)> = rows
            .iter()
            .filter_map(|r| r.ratio.map(|x| (x, r)))
            .collect();
        if let Some(&(worst, worst_row)) = ratios.iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
            let mut sorted: Vec<f64> = ratios.iter().map(|&(x, _)| x).collect();
            sorted.sort_unstable_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            let over = sorted.iter().filter(|&&x| x > RATIO_TARGET).count();
            table.note("");
            table.note(&format!(
                "wrapper cost (tpcomm / direct rsmpi median): median {median:.2}x over {} rows, \
                 max {worst:.2}x ({} {} B); {over} rows above {RATIO_TARGET:.2}x",
                sorted.len(),
                worst_row.op,
                worst_row.bytes
            ));
        }
    }
    if let Some(path) = &args.json {
        let report = Report {
            tool: "tpcomm-bench",
            version: env!("CARGO_PKG_VERSION"),
            subcommand: "transport",
            command_line: std::env::args().collect(),
            unix_time: report::unix_time(),
            machine,
            transport,
            ranks,
            mpi_library,
            settings: args,
            rows,
            targets: &[],
        };
        report::write_json(path, &report)?;
        table.note(&format!("JSON written to {}", path.display()));
    }
    Ok(())
}

/// One way of running the collectives: tpcomm's [`Communicator`], or rsmpi directly.
trait Collectives {
    /// `"tpcomm"` or `"rsmpi"`, for errors.
    const NAME: &'static str;

    /// Waits for every rank.
    fn barrier(&self) -> Result<(), BenchError>;

    /// Runs `case.op` once on `case`'s buffers.
    fn run(&self, case: &mut Case) -> Result<(), BenchError>;
}

/// The collectives through a tpcomm [`Communicator`].
#[derive(Debug)]
struct Tpcomm<'a, C>(&'a C);

impl<C: Communicator> Collectives for Tpcomm<'_, C> {
    const NAME: &'static str = "tpcomm";

    fn barrier(&self) -> Result<(), BenchError> {
        Ok(self.0.barrier()?)
    }

    fn run(&self, case: &mut Case) -> Result<(), BenchError> {
        let comm = self.0;
        match case.op {
            TransportOp::AllGather => comm.all_gather(&case.send, &mut case.recv)?,
            TransportOp::AllGatherVarcount => {
                comm.all_gather_varcount(&case.send, &mut case.recv, &case.counts, &case.displs)?
            }
            TransportOp::GatherVarcount => {
                let recv = (comm.rank() == ROOT).then_some(GatherRecv {
                    recv: &mut case.recv,
                    counts: &case.counts,
                    displs: &case.displs,
                });
                comm.gather_varcount(ROOT, &case.send, recv)?
            }
            TransportOp::Broadcast => comm.broadcast(ROOT, &mut case.recv)?,
            TransportOp::AllToAllVarcount => comm.all_to_all_varcount(
                Layout {
                    buf: &case.send,
                    counts: &case.send_counts,
                    displs: &case.send_displs,
                },
                Layout {
                    buf: &mut case.recv,
                    counts: &case.counts,
                    displs: &case.displs,
                },
            )?,
        }
        Ok(())
    }
}

/// The "no direct path" of the local transport.
#[derive(Debug)]
enum NoDirect {}

impl Collectives for NoDirect {
    const NAME: &'static str = "none";

    fn barrier(&self) -> Result<(), BenchError> {
        match *self {}
    }

    fn run(&self, _: &mut Case) -> Result<(), BenchError> {
        match *self {}
    }
}

/// The buffers of one operation at one size on one rank.
///
/// `counts` / `displs` describe the receive buffer (one entry per rank) for every
/// operation but broadcast; `send_counts` / `send_displs` the send buffer of all-to-all.
#[derive(Debug)]
struct Case {
    op: TransportOp,
    rank: usize,
    size: usize,
    /// The size in the table's convention.
    bytes: usize,
    send: Vec<u8>,
    /// Receive buffer; the buffer itself for broadcast; empty off the root for gather.
    recv: Vec<u8>,
    counts: Vec<usize>,
    displs: Vec<usize>,
    send_counts: Vec<usize>,
    send_displs: Vec<usize>,
    /// The same layouts as MPI counts, for the direct path.
    #[cfg(feature = "mpi")]
    mpi: direct::Counts,
}

impl Case {
    /// Buffers for `op` at about `requested` bytes; `None` when the operation cannot move
    /// that few bytes over `size` ranks (equal blocks of at least one byte).
    fn new(
        op: TransportOp,
        requested: usize,
        rank: usize,
        size: usize,
    ) -> Result<Option<Self>, BenchError> {
        let overflow =
            || BenchError::Usage(format!("{requested} bytes over {size} ranks overflows"));
        let block = requested / size;
        let (bytes, send_len, recv_len, counts) = match op {
            TransportOp::AllGather | TransportOp::AllToAllVarcount => {
                if block == 0 {
                    return Ok(None);
                }
                let total = block * size;
                let send_len = if op == TransportOp::AllGather {
                    block
                } else {
                    total
                };
                (total, send_len, total, vec![block; size])
            }
            TransportOp::AllGatherVarcount | TransportOp::GatherVarcount => {
                let counts = near_equal_split(requested, size);
                let recv_len = if op == TransportOp::GatherVarcount && rank != ROOT {
                    0
                } else {
                    requested
                };
                (requested, counts[rank], recv_len, counts)
            }
            TransportOp::Broadcast => (requested, 0, requested, Vec::new()),
        };
        let (displs, _) = dense_displacements(&counts).ok_or_else(overflow)?;
        let (send_counts, send_displs) = if op == TransportOp::AllToAllVarcount {
            (counts.clone(), displs.clone())
        } else {
            (Vec::new(), Vec::new())
        };
        // The receive layout of all-to-all: `counts[j]` bytes from rank j. With equal blocks
        // it is the send layout too.
        let case = Self {
            op,
            rank,
            size,
            bytes,
            send: vec![0; send_len],
            recv: vec![0; recv_len],
            #[cfg(feature = "mpi")]
            mpi: direct::Counts::new(&counts, &displs, &send_counts, &send_displs)?,
            counts,
            displs,
            send_counts,
            send_displs,
        };
        Ok(Some(case))
    }

    /// Fills the buffers with fresh data for a verification run: the send buffer (and the
    /// root's broadcast buffer) with this rank's pattern, the rest with garbage.
    fn fill(&mut self, salt: u64) {
        pattern(&mut self.send, self.rank, salt, 0);
        let garbage_salt = !salt;
        if self.op == TransportOp::Broadcast && self.rank == ROOT {
            pattern(&mut self.recv, ROOT, salt, 0);
        } else {
            pattern(&mut self.recv, self.rank, garbage_salt, 0);
        }
    }

    /// Checks the receive buffer after a run on data from [`fill`](Self::fill); returns
    /// what is wrong.
    fn check(&self, salt: u64) -> Option<String> {
        let region = |from: usize, at: usize, offset: usize, len: usize| -> Option<String> {
            let got = self.recv.get(at..at + len)?;
            let mut want = vec![0; len];
            pattern(&mut want, from, salt, offset);
            let bad = got.iter().zip(&want).position(|(g, w)| g != w)?;
            Some(format!(
                "byte {} (from rank {from}, its byte {}) is {:#04x}, expected {:#04x}",
                at + bad,
                offset + bad,
                got[bad],
                want[bad]
            ))
        };
        let short = |len: usize| {
            (self.recv.len() < len)
                .then(|| format!("receive buffer of {} bytes, need {len}", self.recv.len()))
        };
        match self.op {
            TransportOp::GatherVarcount if self.rank != ROOT => None,
            TransportOp::Broadcast => region(ROOT, 0, 0, self.recv.len()),
            TransportOp::AllGather
            | TransportOp::AllGatherVarcount
            | TransportOp::GatherVarcount => (0..self.size).find_map(|r| {
                short(self.displs[r] + self.counts[r])
                    .or_else(|| region(r, self.displs[r], 0, self.counts[r]))
            }),
            TransportOp::AllToAllVarcount => (0..self.size).find_map(|r| {
                // Rank r sent me its block number `rank`, which starts at rank * block.
                let block = self.counts[r];
                short(self.displs[r] + block)
                    .or_else(|| region(r, self.displs[r], self.rank * block, block))
            }),
        }
    }
}

/// Splits `total` into `parts` counts differing by at most one, larger ones first.
fn near_equal_split(total: usize, parts: usize) -> Vec<usize> {
    let (base, extra) = (total / parts, total % parts);
    (0..parts).map(|i| base + usize::from(i < extra)).collect()
}

/// Writes bytes `offset..offset + out.len()` of the pseudo-random stream of `(rank, salt)`.
pub(crate) fn pattern(out: &mut [u8], rank: usize, salt: u64, offset: usize) {
    let mut pos = offset;
    let mut i = 0;
    while i < out.len() {
        let word = splitmix64(salt ^ ((rank as u64) << 48) ^ (pos / 8) as u64).to_le_bytes();
        let start = pos % 8;
        let take = (8 - start).min(out.len() - i);
        out[i..i + take].copy_from_slice(&word[start..start + take]);
        i += take;
        pos += take;
    }
}

pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Runs every operation at every size on this rank; rank 0 prints the tables and returns
/// the rows (the other ranks return none).
///
/// `direct`, when given, is timed too, interleaved with tpcomm.
fn bench_rank<C: Communicator, D: Collectives>(
    comm: &C,
    direct: Option<&D>,
    args: &TransportArgs,
    table: &Table,
) -> Result<Vec<Row>, BenchError> {
    let printer = (comm.rank() == 0).then_some(table);
    let mut rows = Vec::new();
    let sizes = args.sweep.sizes();
    for (op_index, &op) in args.ops.iter().enumerate() {
        if let Some(t) = printer {
            t.header(&format!("{}: {}", op.name(), op.size_meaning()));
        }
        let mut op_rows = Vec::new();
        for (size_index, &requested) in sizes.iter().enumerate() {
            let Some(mut case) = Case::new(op, requested, comm.rank(), comm.size())? else {
                if let Some(t) = printer {
                    t.note(&format!("{requested} B: skipped, fewer bytes than ranks"));
                }
                continue;
            };
            let salt = ((op_index as u64) << 32) ^ size_index as u64;
            let row = measure(comm, direct, &mut case, args, salt)?;
            if let Some(t) = printer {
                t.row(&row);
            }
            op_rows.push(row);
        }
        if let Some(t) = printer {
            summarize(t, op, &op_rows);
        }
        rows.extend(op_rows);
    }
    Ok(if printer.is_some() { rows } else { Vec::new() })
}

/// The closing line of one operation's table (nccl-tests' "Avg bus bandwidth").
fn summarize(table: &Table, op: TransportOp, rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    let avg = rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64;
    let mut line = format!("{}: avg busbw {avg:.3} GB/s", op.name());
    let ratios: Vec<f64> = rows.iter().filter_map(|r| r.ratio).collect();
    if let Some(max) = ratios.iter().copied().reduce(f64::max) {
        let over = ratios.iter().filter(|&&x| x > RATIO_TARGET).count();
        line.push_str(&format!(
            "; ratio max {max:.2}x, {over} sizes above {RATIO_TARGET:.2}x"
        ));
    }
    table.note(&line);
}

/// Verifies, warms up and times one operation at one size; the row is the same on every
/// rank.
fn measure<C: Communicator, D: Collectives>(
    comm: &C,
    direct: Option<&D>,
    case: &mut Case,
    args: &TransportArgs,
    salt: u64,
) -> Result<Row, BenchError> {
    let tpcomm = Tpcomm(comm);
    verify(comm, &tpcomm, case, salt)?;
    if let Some(d) = direct {
        verify(comm, d, case, salt ^ (1 << 63))?;
    }

    let warmup = args.sweep.iter.warmup_for(case.bytes);
    let mut warm = Vec::with_capacity(warmup);
    let mut warm_direct = Vec::with_capacity(warmup);
    for _ in 0..warmup {
        warm.push(time_once(&tpcomm, case)?);
        if let Some(d) = direct {
            warm_direct.push(time_once(d, case)?);
        }
    }
    // Every rank derives the count from the same gathered figures: all run as many.
    let estimate = median(&slowest(comm, &warm)?).max(median(&slowest(comm, &warm_direct)?));
    let iters = args
        .sweep
        .iter
        .iters_for(std::time::Duration::from_nanos(estimate));

    let mut times = Vec::with_capacity(iters);
    let mut times_direct = Vec::with_capacity(iters);
    for i in 0..iters {
        match direct {
            None => times.push(time_once(&tpcomm, case)?),
            // Alternate which path goes first so that neither always follows the other.
            Some(d) if i % 2 == 0 => {
                times.push(time_once(&tpcomm, case)?);
                times_direct.push(time_once(d, case)?);
            }
            Some(d) => {
                times_direct.push(time_once(d, case)?);
                times.push(time_once(&tpcomm, case)?);
            }
        }
    }
    let samples = slowest(comm, &times)?;
    let direct_samples = match direct {
        Some(_) => Some(slowest(comm, &times_direct)?),
        None => None,
    };
    let op = case.op;
    Row::new(&Measurement {
        op: op.name(),
        bytes: case.bytes,
        elem_size: 1,
        dtype: "uint8",
        root: op.root(),
        ranks: comm.size(),
        bus: op.bus(),
        warmup,
        samples_ns: &samples,
        direct_samples_ns: direct_samples.as_deref(),
    })
    .ok_or_else(|| BenchError::Usage("no timed iterations".into()))
}

/// One timed iteration: a barrier, then the operation; nanoseconds on this rank.
fn time_once<P: Collectives>(path: &P, case: &mut Case) -> Result<u64, BenchError> {
    path.barrier()?;
    let start = Instant::now();
    path.run(case)?;
    Ok(elapsed_ns(start))
}

/// Runs the operation once on fresh data and checks what arrived. Collective: every rank
/// learns which ranks saw wrong data, and all of them fail together.
fn verify<C: Communicator, P: Collectives>(
    comm: &C,
    path: &P,
    case: &mut Case,
    salt: u64,
) -> Result<(), BenchError> {
    case.fill(salt);
    path.run(case)?;
    let problem = case.check(salt);
    let bad_ranks = ranks_flagging(comm, problem.is_some())?;
    let Some(&first) = bad_ranks.first() else {
        return Ok(());
    };
    Err(BenchError::WrongData {
        path: P::NAME,
        op: case.op.name(),
        bytes: case.bytes,
        rank: if problem.is_some() { case.rank } else { first },
        detail: problem.unwrap_or_else(|| format!("see rank {first}")),
        bad_ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::IterArgs;
    use tpcomm::transport::LocalGroup;

    fn quick_args(ops: Vec<TransportOp>) -> TransportArgs {
        TransportArgs {
            ranks: None,
            transport: Transport::Local,
            ops,
            sweep: SweepArgs {
                min_bytes: 1,
                max_bytes: 4096,
                factor: 4,
                iter: IterArgs {
                    iters: Some(3),
                    warmup: Some(1),
                },
            },
            json: None,
        }
    }

    #[test]
    fn near_equal_split_sums_to_total() {
        assert_eq!(near_equal_split(8, 3), vec![3, 3, 2]);
        assert_eq!(near_equal_split(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(near_equal_split(8, 2), vec![4, 4]);
    }

    #[test]
    fn pattern_at_an_offset_continues_the_stream() {
        let mut whole = vec![0u8; 100];
        pattern(&mut whole, 3, 7, 0);
        let mut tail = vec![0u8; 61];
        pattern(&mut tail, 3, 7, 39);
        assert_eq!(&whole[39..], &tail[..]);
        let mut other = vec![0u8; 100];
        pattern(&mut other, 4, 7, 0);
        assert_ne!(whole, other);
    }

    #[test]
    fn block_operations_skip_sizes_below_one_byte_per_rank() {
        assert!(Case::new(TransportOp::AllGather, 3, 0, 4)
            .unwrap()
            .is_none());
        assert!(Case::new(TransportOp::AllToAllVarcount, 3, 0, 4)
            .unwrap()
            .is_none());
        assert!(Case::new(TransportOp::AllGatherVarcount, 3, 0, 4)
            .unwrap()
            .is_some());
    }

    #[test]
    fn every_operation_verifies_and_times_on_three_local_ranks() {
        let args = quick_args(TransportOp::ALL.to_vec());
        let table = Table { direct: false };
        let results =
            LocalGroup::new(3).run(|comm| bench_rank(&comm, None::<&NoDirect>, &args, &table));
        let rows = first_rank_output(results).unwrap();
        // Sizes 1, 4, 16, 64, 256, 1024, 4096; block ops skip 1 B over 3 ranks.
        assert_eq!(rows.len(), 5 * 7 - 2);
        assert!(rows.iter().all(|r| r.iters == 3 && r.median_us > 0.0));
        let ag: Vec<usize> = rows
            .iter()
            .filter(|r| r.op == "all_gather")
            .map(|r| r.bytes)
            .collect();
        assert_eq!(ag, vec![3, 15, 63, 255, 1023, 4095]);
    }

    /// A path that corrupts one byte on one rank, as a broken transport would.
    struct Corrupting<'a, C>(Tpcomm<'a, C>, usize);

    impl<C: Communicator> Collectives for Corrupting<'_, C> {
        const NAME: &'static str = "corrupting";
        fn barrier(&self) -> Result<(), BenchError> {
            self.0.barrier()
        }
        fn run(&self, case: &mut Case) -> Result<(), BenchError> {
            self.0.run(case)?;
            if case.rank == self.1 {
                if let Some(b) = case.recv.last_mut() {
                    *b ^= 1;
                }
            }
            Ok(())
        }
    }

    #[test]
    fn wrong_data_on_one_rank_fails_every_rank_naming_it() {
        let results = LocalGroup::new(3).run(|comm| {
            let mut case = Case::new(TransportOp::AllGather, 96, comm.rank(), 3)
                .unwrap()
                .unwrap();
            verify(&comm, &Corrupting(Tpcomm(&comm), 2), &mut case, 5)
        });
        for (rank, r) in results.into_iter().enumerate() {
            match r.unwrap() {
                Err(BenchError::WrongData {
                    rank: culprit,
                    bad_ranks,
                    ..
                }) => {
                    assert_eq!(culprit, 2, "rank {rank}");
                    assert_eq!(bad_ranks, vec![2]);
                }
                other => panic!("rank {rank}: expected WrongData, got {other:?}"),
            }
        }
    }
}
