//! The MPI peer: the same collective called through rsmpi on `MPI_COMM_WORLD`, the way a C
//! program calls MPI: one plain call on buffers allocated (and counts converted to 32-bit
//! MPI counts) once per case, before timing, so that each timed iteration is the MPI call
//! and nothing else. `tpcomm-bench transport --check-peer` compares it with a standalone C
//! loop of the same calls (`src/peer_loop.c`).

use crate::launch::RunInfo;

/// One MPI collective and its buffers; counts and displacements are MPI's 32-bit counts.
#[derive(Debug)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) enum MpiCall<'a> {
    AllGather {
        send: &'a [u8],
        recv: &'a mut [u8],
    },
    AllGatherV {
        send: &'a [u8],
        recv: &'a mut [u8],
        counts: &'a [i32],
        displs: &'a [i32],
    },
    /// `recv` only on the root.
    GatherV {
        root: usize,
        send: &'a [u8],
        recv: Option<(&'a mut [u8], &'a [i32], &'a [i32])>,
    },
    Broadcast {
        root: usize,
        buf: &'a mut [u8],
    },
    AllToAllV {
        send: &'a [u8],
        send_counts: &'a [i32],
        send_displs: &'a [i32],
        recv: &'a mut [u8],
        counts: &'a [i32],
        displs: &'a [i32],
    },
    AllReduceSum {
        input: &'a [f32],
        output: &'a mut [f32],
    },
}

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

    /// Runs `call` once; its nanoseconds, the clock started right before the call, as a C
    /// loop starts it.
    pub(crate) fn run(&self, call: MpiCall<'_>) -> u64 {
        use mpi::collective::{CommunicatorCollectives as _, Root as _, SystemOperation};
        use mpi::datatype::{Partition, PartitionMut};
        use mpi::topology::Communicator as _;
        let comm = &self.0;
        let start = std::time::Instant::now();
        match call {
            MpiCall::AllGather { send, recv } => comm.all_gather_into(send, recv),
            MpiCall::AllGatherV {
                send,
                recv,
                counts,
                displs,
            } => comm.all_gather_varcount_into(send, &mut PartitionMut::new(recv, counts, displs)),
            MpiCall::GatherV { root, send, recv } => {
                let root = comm.process_at_rank(root as i32);
                match recv {
                    Some((buf, counts, displs)) => root.gather_varcount_into_root(
                        send,
                        &mut PartitionMut::new(buf, counts, displs),
                    ),
                    None => root.gather_varcount_into(send),
                }
            }
            MpiCall::Broadcast { root, buf } => {
                comm.process_at_rank(root as i32).broadcast_into(buf)
            }
            MpiCall::AllToAllV {
                send,
                send_counts,
                send_displs,
                recv,
                counts,
                displs,
            } => comm.all_to_all_varcount_into(
                &Partition::new(send, send_counts, send_displs),
                &mut PartitionMut::new(recv, counts, displs),
            ),
            MpiCall::AllReduceSum { input, output } => {
                comm.all_reduce_into(input, output, SystemOperation::sum())
            }
        }
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

    pub(crate) fn run(&self, _: MpiCall<'_>) -> u64 {
        match *self {}
    }
}
