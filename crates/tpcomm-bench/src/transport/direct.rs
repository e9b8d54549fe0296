//! MPI mode: tpcomm's `MpiCommunicator` timed against rsmpi called directly.
//!
//! The direct path is what a program would write with rsmpi's safe API on
//! `MPI_COMM_WORLD` (tpcomm works on a duplicate of it): `barrier`, `all_gather_into`,
//! `all_gather_varcount_into`, `gather_varcount_into(_root)`, `broadcast_into`,
//! `all_to_all_varcount_into`, with the 32-bit counts prepared before timing, as tpcomm's
//! are.

use mpi::collective::{CommunicatorCollectives, Root};
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::Count;
use tpcomm::transport::MpiCommunicator;
use tpcomm::Communicator;

use super::{
    bench_rank, finish, print_preamble, Case, Collectives, TransportArgs, TransportOp, ROOT,
};
use crate::error::{self, BenchError};
use crate::report::{self, Machine, Table};

/// The layouts of a [`Case`] as MPI counts and displacements.
#[derive(Debug)]
pub(super) struct Counts {
    counts: Vec<Count>,
    displs: Vec<Count>,
    send_counts: Vec<Count>,
    send_displs: Vec<Count>,
}

impl Counts {
    pub(super) fn new(
        counts: &[usize],
        displs: &[usize],
        send_counts: &[usize],
        send_displs: &[usize],
    ) -> Result<Self, BenchError> {
        let convert = |v: &[usize]| {
            v.iter()
                .map(|&x| {
                    Count::try_from(x).map_err(|_| {
                        BenchError::Usage(format!("{x} does not fit in an MPI count (i32)"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            counts: convert(counts)?,
            displs: convert(displs)?,
            send_counts: convert(send_counts)?,
            send_displs: convert(send_displs)?,
        })
    }
}

/// The collectives through rsmpi on a communicator (the world).
struct Rsmpi<'a> {
    comm: &'a SimpleCommunicator,
}

impl Collectives for Rsmpi<'_> {
    const NAME: &'static str = "rsmpi";

    fn barrier(&self) -> Result<(), BenchError> {
        self.comm.barrier();
        Ok(())
    }

    fn run(&self, case: &mut Case) -> Result<(), BenchError> {
        let comm = self.comm;
        let t = &case.mpi;
        match case.op {
            TransportOp::AllGather => comm.all_gather_into(&case.send[..], &mut case.recv[..]),
            TransportOp::AllGatherVarcount => {
                let mut recv = PartitionMut::new(&mut case.recv[..], &t.counts[..], &t.displs[..]);
                comm.all_gather_varcount_into(&case.send[..], &mut recv);
            }
            TransportOp::GatherVarcount => {
                let root = comm.process_at_rank(ROOT as i32);
                if case.rank == ROOT {
                    let mut recv =
                        PartitionMut::new(&mut case.recv[..], &t.counts[..], &t.displs[..]);
                    root.gather_varcount_into_root(&case.send[..], &mut recv);
                } else {
                    root.gather_varcount_into(&case.send[..]);
                }
            }
            TransportOp::Broadcast => {
                comm.process_at_rank(ROOT as i32)
                    .broadcast_into(&mut case.recv[..]);
            }
            TransportOp::AllToAllVarcount => {
                let send = Partition::new(&case.send[..], &t.send_counts[..], &t.send_displs[..]);
                let mut recv = PartitionMut::new(&mut case.recv[..], &t.counts[..], &t.displs[..]);
                comm.all_to_all_varcount_into(&send, &mut recv);
            }
        }
        Ok(())
    }
}

/// Runs the subcommand as one MPI rank. On failure the rank prints its error and aborts
/// the whole job, so that no rank stays blocked in a collective its peers left.
pub(super) fn run_mpi(args: &TransportArgs) -> Result<(), BenchError> {
    if args.ranks.is_some() {
        return Err(BenchError::Usage(
            "--ranks is for --transport local; with --transport mpi the ranks are mpirun's \
             (mpirun -np N)"
                .into(),
        ));
    }
    let universe = mpi::initialize()
        .ok_or_else(|| BenchError::Usage("MPI was already initialized in this process".into()))?;
    let world = universe.world();
    let rank = usize::try_from(world.rank()).unwrap_or(0);
    let result = MpiCommunicator::world(&universe)
        .map_err(BenchError::from)
        .and_then(|comm| run_rank(args, &comm, &world));
    if let Err(e) = result {
        eprintln!("tpcomm-bench: rank {rank}: error: {}", error::chain(&e));
        world.abort(1);
    }
    Ok(())
}

fn run_rank(
    args: &TransportArgs,
    comm: &MpiCommunicator,
    world: &SimpleCommunicator,
) -> Result<(), BenchError> {
    let table = Table { direct: true };
    let ranks = comm.size();
    let machine = Machine::current();
    let library = crate::launch::mpi_library_version();
    if comm.rank() == 0 {
        if let Some(path) = &args.json {
            report::check_writable(path)?;
        }
        let transport = "mpi (tpcomm MpiCommunicator on a duplicate of MPI_COMM_WORLD)";
        print_preamble(args, &table, &machine, transport, ranks, library.as_deref());
    }
    let rows = bench_rank(comm, Some(&Rsmpi { comm: world }), args, &table)?;
    if comm.rank() == 0 {
        finish(args, &table, machine, "mpi", ranks, library, &rows)?;
    }
    Ok(())
}
