//! `tpcomm-bench peer-check`: checks the MPI peer of the other subcommands (the plain MPI
//! call from Rust through rsmpi's bindings of MPI's C API, [`crate::peers::mpi_world`])
//! against the same call made from C.
//!
//! `src/peers/peer_loop.c` is one iteration of a C benchmark loop (a barrier, one MPI call
//! timed with `CLOCK_MONOTONIC`); each rank compiles it with `mpicc` into a shared library
//! and loads it. The harness then runs three variants on the same buffers, iterations
//! interleaved, at every size of the sweep: `rsmpi`, the peer as `transport` and `allreduce`
//! time it (an `MPI_Barrier`, then `Instant` around the call); `C loop`, the C iteration
//! timing itself; and `C call`, the same C call after the harness's own barrier (tpcomm's,
//! which times the local transport's rows), so that `C call / C loop` is what that barrier
//! adds. A peer within `--tolerance` of the C loop measures MPI, not the Rust binding or
//! the harness around it. Run it under `mpirun -np 2` with `--transport mpi`.

use clap::Args;
use serde::Serialize;
use tpcomm::Communicator;

use crate::data::collective::{Case, TransportOp};
use crate::engine::error::BenchError;
use crate::engine::launch::{self, Bench, RunArgs, Transport};
use crate::engine::session::Session;
use crate::engine::sweep::SweepArgs;
use crate::engine::table::{col, Column};
use crate::engine::targets::{within, RatioLine, Target};
use crate::engine::timing::{elapsed_ns, time_once, Spec};
use crate::peers::c_loop::CLoop;
use crate::peers::mpi_world::MpiWorld;

/// The calls checked: the transport operation whose peer is the call, the C loop's op code.
const CALLS: [(TransportOp, i32); 3] = [
    (TransportOp::AllGather, 0),
    (TransportOp::AllGatherVarcount, 1),
    (TransportOp::AllReduce, CLoop::ALL_REDUCE),
];
const VARIANTS: [&str; 3] = ["rsmpi", "C loop", "C call"];

/// Options of `tpcomm-bench peer-check`.
#[derive(Debug, Clone, Args, Serialize)]
#[command(mut_arg("min_bytes", |a| a.default_value("64")))]
#[command(mut_arg("max_bytes", |a| a.default_value("4MiB")))]
#[command(mut_arg("factor", |a| a.default_value("4")))]
pub(crate) struct PeerCheckArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) sweep: SweepArgs,

    /// The largest difference from the C loop still counted as the same, in percent.
    #[arg(long, default_value_t = 5.0, value_name = "PCT")]
    pub(crate) tolerance: f64,
}

/// `peer-check` with the C loop loaded.
#[derive(Serialize)]
struct PeerCheck<'a> {
    #[serde(flatten)]
    args: &'a PeerCheckArgs,
    #[serde(skip)]
    c_loop: CLoop,
}

/// Runs the subcommand: builds and loads the C loop, then the ranks.
pub(crate) fn run(args: &PeerCheckArgs) -> Result<(), BenchError> {
    if args.run.transport != Transport::Mpi || cfg!(not(feature = "mpi")) {
        return Err(BenchError::Usage(
            "peer-check compares MPI calls: run it under mpirun with --transport mpi (and a \
             tpcomm-bench built with --features mpi)"
                .into(),
        ));
    }
    if !args.sweep.min_bytes.is_multiple_of(16) {
        return Err(BenchError::Usage(
            "--min-bytes must be a multiple of 16 (the all-reduce moves f32)".into(),
        ));
    }
    launch::run(&PeerCheck {
        args,
        c_loop: CLoop::load()?,
    })
}

/// The target: `rsmpi` within `tol` percent of the C loop, either way, at every size.
fn targets(tol: f64) -> Vec<Target> {
    vec![Target {
        what: format!("the MPI peer (rsmpi) within {tol}% of the C loop at every size"),
        why: "the peer stands for what MPI itself costs; a binding or a harness that adds \
              or hides time would make every comparison with it wrong",
        line: RatioLine::new(VARIANTS[1], 1.0 + tol / 100.0),
        judge: within(|r| r.is(VARIANTS[0]), |x| (x - 1.0).abs(), tol / 100.0),
    }]
}

const COLUMNS: [Column; 6] = [
    Column::new("call", "", 20, |r, _| r.table.clone()),
    col::size(10),
    col::variant("variant", 7),
    col::iters(),
    col::time::<3>("median", 10),
    col::vs_peer("ratio", "to C loop", 9),
];

impl Bench for PeerCheck<'_> {
    const NAME: &'static str = "peer-check";
    const MPI_TARGETS: bool = true;
    const STATED_FOR: &'static str = "2 MPI ranks";

    fn run_args(&self) -> &RunArgs {
        &self.args.run
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.args.sweep.validate()
    }

    fn preamble(&self, _mpi: bool) -> Vec<String> {
        vec![
            self.args.sweep.describe(),
            "rsmpi: the MPI peer of transport and allreduce (MPI's C API through rsmpi's \
             bindings on MPI_COMM_WORLD, warm buffers): MPI_Barrier, then Instant around the \
             call"
                .into(),
            "C loop: one iteration of a C loop (src/peers/peer_loop.c built with mpicc -O2: \
             MPI_Barrier, then the call timed with CLOCK_MONOTONIC) on the same buffers"
                .into(),
            "C call: the same C call after the harness's barrier (tpcomm's), then Instant \
             around it"
                .into(),
            "iterations interleaved; time: median over iterations of the slowest rank; \
             ratio = median / C loop median"
                .into(),
        ]
    }

    fn targets(&self) -> Vec<Target> {
        targets(self.args.tolerance)
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        let mpi = MpiWorld::for_run(s.info)
            .ok_or_else(|| BenchError::Usage("peer-check runs on MPI ranks only".into()))?;
        let sizes = self.args.sweep.sizes();
        s.progress.plan(CALLS.len() * sizes.len());
        s.header("MPI call: rsmpi (the in-run peer) and the C loop", &COLUMNS);
        for (k, &(op, code)) in CALLS.iter().enumerate() {
            for (i, &bytes) in sizes.iter().enumerate() {
                let Some(mut case) = Case::new(op, bytes, comm.rank(), comm.size())? else {
                    continue;
                };
                let spec = Spec {
                    peer: Some(VARIANTS[1]),
                    ..Spec::new(op.name(), case.bytes.to_string(), case.bytes, &VARIANTS)
                };
                let salt = ((k as u64) << 32) ^ i as u64;
                s.verify(comm, &spec, &mut case, |case, v| {
                    case.fill(salt ^ v as u64);
                    if v == 0 {
                        mpi.run(case, false)?;
                    } else {
                        self.c_loop.run_case(code, case, v == 1)?;
                    }
                    Ok(case.check(salt ^ v as u64))
                })?;
                let rows = s.measure(comm, &spec, &mut case, |case, v| match v {
                    0 => mpi.run(case, true),
                    1 => self.c_loop.run_case(code, case, true),
                    _ => time_once(comm, |start| {
                        self.c_loop.run_case(code, case, false)?;
                        Ok(elapsed_ns(start))
                    }),
                })?;
                s.rows(&COLUMNS, rows, |_| true);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::row::{row_vs, Row};

    #[test]
    fn the_target_judges_the_rsmpi_rows_either_way_within_the_tolerance() {
        let row =
            |variant: &str, bytes: usize, vs| row_vs("all_gather", &bytes.to_string(), variant, vs);
        let judge = |rows: &[Row]| crate::engine::targets::judge(&targets(5.0), rows);
        // C call rows (the harness's own cost) are not what the target is about.
        let v = judge(&[row("rsmpi", 64, 1.04), row("C call", 64, 1.2)]);
        assert!(v[0].met, "{v:?}");
        assert_eq!(
            v[0].detail,
            "1 of 1 rows within, farthest all_gather 64 rsmpi 1.040x"
        );
        let v = judge(&[row("rsmpi", 64, 1.01), row("rsmpi", 256, 0.94)]);
        assert!(!v[0].met);
        assert!(
            v[0].detail
                .ends_with("farthest first: all_gather 256 rsmpi 0.940x"),
            "{v:?}"
        );
        assert_eq!(v[0].line, RatioLine::new("C loop", 1.05));
    }
}
