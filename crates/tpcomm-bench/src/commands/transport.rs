//! `tpcomm-bench transport`: the collectives of `tpcomm-transport` over host bytes.
//!
//! Ranks are threads of one process (the local backend) by default; under `mpirun` with
//! `--transport mpi` they are MPI ranks, and every operation is also timed as the plain MPI
//! call on `MPI_COMM_WORLD` (the peer, [`MpiWorld`]), in the same run, iterations
//! interleaved with tpcomm's, so that the table shows what the wrapper costs
//! (`ratio` = tpcomm / direct). In MPI mode both are timed as a C loop times its call: an
//! `MPI_Barrier`, then the call between two clock reads.
//!
//! Per size: the data is verified once per path (outside timing; every rank learns whether
//! any rank saw wrong bytes), then the harness warms up and times. Sizes follow nccl-tests:
//! all-gather and gather count the bytes gathered in total, all-to-all the bytes each rank
//! sends, broadcast the buffer, all-reduce the f32 vector each rank reduces (summed, with
//! small integers so that every order of summation gives the same exact result).

use clap::Args;
use serde::Serialize;
use tpcomm::Communicator;

use crate::data::collective::{Case, TransportOp};
use crate::engine::error::BenchError;
use crate::engine::launch::{Bench, RunArgs};
use crate::engine::row::Row;
use crate::engine::session::Session;
use crate::engine::sweep::SweepArgs;
use crate::engine::table::{col, Column};
use crate::engine::targets::{within, RatioLine, Target};
use crate::engine::timing::{time_once, Spec};
use crate::peers::mpi_world::MpiWorld;

/// The wrapper's target: median within this factor of the direct MPI call at every size.
const RATIO_TARGET: f64 = 1.1;
/// The variants: tpcomm, and the MPI peer in MPI mode.
const VARIANTS: [&str; 2] = ["tpcomm", "rsmpi"];

/// Options of `tpcomm-bench transport`.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct TransportArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

    /// Operations to measure, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "all_gather,all_gather_varcount,gather_varcount,broadcast,all_to_all_varcount,all_reduce",
        value_name = "OPS"
    )]
    pub(crate) ops: Vec<TransportOp>,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) sweep: SweepArgs,
}

/// The nccl-tests columns; with the MPI peer, its time and the ratio.
pub(crate) fn columns(with_peer: bool) -> Vec<Column> {
    let mut c = vec![
        col::size(12),
        Column::fact("count", "(elements)", 12, "count"),
        Column::fact("type", "", 6, "type"),
        Column::fact("root", "", 5, "root"),
        col::iters(),
        col::time::<3>("time", 10),
        col::min::<3>(10),
        col::algbw(8),
        col::busbw(8),
    ];
    if with_peer {
        c.extend([
            Column::new("direct", "(us)", 10, |_, p| {
                col::f3(p.map(|p| p.stats.median_us))
            }),
            Column::new("dir min", "(us)", 10, |_, p| {
                col::f3(p.map(|p| p.stats.min_us))
            }),
            col::vs_peer("ratio", "tp/dir", 7),
        ]);
    }
    c
}

impl Bench for TransportArgs {
    const NAME: &'static str = "transport";
    const MPI_TARGETS: bool = true;
    const STATED_FOR: &'static str = "2 MPI ranks (mpirun -np 2 ... --transport mpi)";

    fn run_args(&self) -> &RunArgs {
        &self.run
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.sweep.validate()
    }

    fn preamble(&self, mpi: bool) -> Vec<String> {
        let mut lines = vec![
            self.sweep.describe(),
            "time: median over iterations of the slowest rank (a barrier before each iteration, \
             the clock started right before the call)"
                .into(),
            "min: fastest iteration; data verified once per size before timing".into(),
        ];
        if mpi {
            lines.push(format!(
                "direct: the same collective as a plain MPI call (MPI's C API on \
                 MPI_COMM_WORLD, warm buffers), iterations interleaved with tpcomm's, both \
                 timed after an MPI_Barrier; ratio = tpcomm median / direct median (target \
                 <= {RATIO_TARGET:.2}x)"
            ));
        }
        lines
    }

    /// The wrapper's target, judged on every tpcomm row with a peer.
    fn targets(&self) -> Vec<Target> {
        vec![Target {
            what: format!("tpcomm within {RATIO_TARGET:.2}x of the direct MPI call at every size"),
            why: "a safe wrapper is worth its checks only if it costs next to nothing over \
                  calling MPI directly; 10% is about the run-to-run noise of these figures",
            line: RatioLine::new(VARIANTS[1], RATIO_TARGET),
            judge: within(|_| true, |x| x, RATIO_TARGET),
        }]
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        let sizes = self.sweep.sizes();
        s.progress.plan(self.ops.len() * sizes.len());
        let mpi = MpiWorld::for_run(s.info);
        let columns = columns(mpi.is_some());
        let variants = &VARIANTS[..if mpi.is_some() { 2 } else { 1 }];
        for (op_index, &op) in self.ops.iter().enumerate() {
            s.header(&format!("{}: {}", op.name(), op.size_meaning()), &columns);
            for (size_index, &requested) in sizes.iter().enumerate() {
                let Some(mut case) = Case::new(op, requested, comm.rank(), comm.size())? else {
                    s.note(&format!("{requested} B: skipped, fewer bytes than ranks"));
                    continue;
                };
                let spec = Spec {
                    peer: Some(VARIANTS[1]),
                    bus: Some(op.bus()),
                    ..Spec::new(op.name(), case.bytes.to_string(), case.bytes, variants)
                        .with("count", case.count())
                        .with("type", case.type_name())
                        .with("root", op.root())
                };
                let salt = ((op_index as u64) << 32) ^ size_index as u64;
                s.verify(comm, &spec, &mut case, |case, path| {
                    let salt = salt ^ ((path as u64) << 63);
                    case.fill(salt);
                    match (path, &mpi) {
                        (1, Some(mpi)) => mpi.run(case, false)?,
                        _ => case.run(comm)?,
                    };
                    Ok(case.check(salt))
                })?;
                let rows = s.measure(comm, &spec, &mut case, |case, path| match &mpi {
                    Some(mpi) if path == 1 => mpi.run(case, true),
                    Some(mpi) => {
                        mpi.barrier()?;
                        case.run(comm)
                    }
                    None => time_once(comm, |_| case.run(comm)),
                })?;
                s.rows(&columns, rows, |r| r.is("tpcomm"));
            }
            if let Some(line) = summary(op.name(), s.kept()) {
                s.summary(line);
            }
        }
        Ok(())
    }
}

/// The closing line of one operation's table (nccl-tests' "Avg bus bandwidth").
fn summary(op: &str, rows: &[Row]) -> Option<String> {
    let rows: Vec<&Row> = rows
        .iter()
        .filter(|r| r.table == op && r.is("tpcomm"))
        .collect();
    if rows.is_empty() {
        return None;
    }
    let avg = rows.iter().filter_map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64;
    let mut line = format!("{op}: avg busbw {avg:.3} GB/s");
    let ratios: Vec<f64> = rows.iter().filter_map(|r| r.vs_peer).collect();
    if let Some(max) = ratios.iter().copied().reduce(f64::max) {
        let over = ratios.iter().filter(|&&x| x > RATIO_TARGET).count();
        line.push_str(&format!(
            "; ratio max {max:.2}x, {over} sizes above {RATIO_TARGET:.2}x"
        ));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::row::Bus;

    #[test]
    fn the_summary_line_averages_busbw_and_counts_ratios_above_the_target() {
        let row = |bytes: usize| Row::of_us("all_gather", &bytes.to_string(), "tpcomm", 1.0);
        // 1000 B in 1 us and 2000 B in 1 us: 1 and 2 GB/s.
        let rows = [1000, 2000].map(|b| row(b).bus(Bus::Same, 2));
        let rows = [rows[0].clone().vs(1.0), rows[1].clone().vs(1.2)];
        assert_eq!(
            summary("all_gather", &rows).unwrap(),
            "all_gather: avg busbw 1.500 GB/s; ratio max 1.20x, 1 sizes above 1.10x"
        );
        assert_eq!(summary("broadcast", &rows), None);
    }
}
