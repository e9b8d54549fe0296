//! The MPI peer: the same collective called through rsmpi on `MPI_COMM_WORLD`, the way a C
//! program calls MPI: one plain call on buffers allocated (and counts converted to 32-bit
//! MPI counts) once per case, before timing, so that each timed iteration is the MPI call
//! and nothing else. `tpcomm-bench peer-check` compares it with a standalone C loop of the
//! same calls (`src/peer_loop.c`).

use crate::launch::RunInfo;
use crate::transport::Case;

/// `MPI_COMM_WORLD` through rsmpi, in MPI mode.
#[cfg(feature = "mpi")]
pub(crate) struct MpiWorld(mpi::topology::SimpleCommunicator);

#[cfg(feature = "mpi")]
impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MpiWorld")
    }
}

#[cfg(feature = "mpi")]
impl MpiWorld {
    /// The world communicator when this run's ranks are MPI ranks.
    pub(crate) fn for_run(info: &RunInfo) -> Option<Self> {
        (info.transport == "mpi").then(|| Self(mpi::topology::SimpleCommunicator::world()))
    }

    /// Runs `case`'s operation once as the plain MPI call on its buffers and 32-bit counts;
    /// its nanoseconds, the clock started right before the call, as a C loop starts it.
    pub(crate) fn run(&self, case: &mut Case) -> u64 {
        use crate::transport::{TransportOp as Op, ROOT};
        use mpi::collective::{CommunicatorCollectives as _, Root as _};
        use mpi::datatype::{Partition, PartitionMut};
        use mpi::topology::Communicator as _;
        let comm = &self.0;
        let [counts, displs] = &case.mpi_counts;
        let (send, recv) = (&case.send[..], &mut case.recv[..]);
        let root = comm.process_at_rank(ROOT as i32);
        let start = std::time::Instant::now();
        match case.op {
            Op::AllGather => comm.all_gather_into(send, recv),
            Op::AllGatherVarcount => comm.all_gather_varcount_into(
                send,
                &mut PartitionMut::new(recv, &counts[..], &displs[..]),
            ),
            Op::GatherVarcount if case.rank == ROOT => root.gather_varcount_into_root(
                send,
                &mut PartitionMut::new(recv, &counts[..], &displs[..]),
            ),
            Op::GatherVarcount => root.gather_varcount_into(send),
            Op::Broadcast => root.broadcast_into(recv),
            Op::AllToAllVarcount => comm.all_to_all_varcount_into(
                &Partition::new(send, &counts[..], &displs[..]),
                &mut PartitionMut::new(recv, &counts[..], &displs[..]),
            ),
            Op::AllReduce => return self.all_reduce_sum(&case.send_f32, &mut case.recv_f32),
        }
        crate::harness::elapsed_ns(start)
    }

    /// `MPI_Allreduce` (sum) of `input` into `output`, timed as [`MpiWorld::run`] times.
    pub(crate) fn all_reduce_sum(&self, input: &[f32], output: &mut [f32]) -> u64 {
        use mpi::collective::{CommunicatorCollectives as _, SystemOperation};
        let start = std::time::Instant::now();
        self.0
            .all_reduce_into(input, output, SystemOperation::sum());
        crate::harness::elapsed_ns(start)
    }
}

/// Without the `mpi` feature there is no MPI peer.
#[cfg(not(feature = "mpi"))]
#[derive(Debug)]
pub(crate) enum MpiWorld {}

#[cfg(not(feature = "mpi"))]
impl MpiWorld {
    pub(crate) fn for_run(_: &RunInfo) -> Option<Self> {
        None
    }

    pub(crate) fn run(&self, _: &mut Case) -> u64 {
        match *self {}
    }

    pub(crate) fn all_reduce_sum(&self, _: &[f32], _: &mut [f32]) -> u64 {
        match *self {}
    }
}
