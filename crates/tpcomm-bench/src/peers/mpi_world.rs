//! The MPI peer: the same collective called on `MPI_COMM_WORLD` through MPI's C API (rsmpi's
//! `ffi` module), the way a C program calls MPI: one plain call on buffers allocated (and
//! counts converted to 32-bit MPI counts) once per case, before timing, so that each timed
//! iteration is an `MPI_Barrier` and the MPI call, and nothing else. [`CLoop`] is the
//! reference it is checked against: the same calls made from a C loop (`peer_loop.c`), in
//! `tpcomm-bench peer-check` and in `allreduce`.
//!
//! [`CLoop`]: crate::peers::c_loop::CLoop

use crate::data::collective::Case;
use crate::engine::error::BenchError;
use crate::engine::launch::RunInfo;
#[cfg(feature = "mpi")]
use crate::peers::{mpi_int, same_length};

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

    /// Runs `case`'s operation once as the plain MPI call on its buffers and 32-bit counts,
    /// through MPI's C API (`mpi::ffi`), as a C benchmark loop calls it: with `timed`, an
    /// `MPI_Barrier` first and the call between two clock reads (its nanoseconds on this
    /// rank); otherwise the call alone (0).
    ///
    /// rsmpi's safe calls are not used here: each one asks MPI for the communicator's size
    /// and converts its buffer lengths on every call, about 10 ns that a C loop does not
    /// spend, 2-3% of a 64-byte all-gather (`tpcomm-bench peer-check` compares this peer with
    /// a C loop).
    pub(crate) fn run(&self, case: &mut Case, timed: bool) -> Result<u64, BenchError> {
        use crate::data::collective::{TransportOp as Op, ROOT};
        use mpi::ffi;
        use mpi::raw::AsRaw as _;
        let comm = self.0.as_raw();
        let [counts, displs] = &case.mpi_counts;
        let (counts, displs) = (counts.as_ptr(), displs.as_ptr());
        let (send_len, recv_len) = (mpi_int(case.send.len())?, mpi_int(case.recv.len())?);
        let floats = mpi_int(case.send_f32.len())?;
        let (send, recv) = (case.send.as_ptr().cast(), case.recv.as_mut_ptr().cast());
        let (send_f32, recv_f32) = (case.send_f32.as_ptr(), case.recv_f32.as_mut_ptr());
        let (root, is_root) = (ROOT as i32, case.rank == ROOT);
        // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
        let byte = unsafe { ffi::RSMPI_UINT8_T };
        self.iteration(timed, case.op.name(), || {
            // SAFETY: the buffers and count tables are the case's, as large as `Case::new`
            // made them for this operation on this communicator's ranks (the receive buffer
            // is `send_len * size` bytes for all-gather; the tables have one entry per rank
            // and describe the receive buffer; all-to-all's equal blocks make them the send
            // layout too; all-reduce's vectors hold `floats` each); every rank makes the same
            // call.
            unsafe {
                match case.op {
                    Op::AllGather => {
                        ffi::MPI_Allgather(send, send_len, byte, recv, send_len, byte, comm)
                    }
                    Op::AllGatherVarcount => {
                        ffi::MPI_Allgatherv(send, send_len, byte, recv, counts, displs, byte, comm)
                    }
                    Op::GatherVarcount => ffi::MPI_Gatherv(
                        send,
                        send_len,
                        byte,
                        if is_root { recv } else { std::ptr::null_mut() },
                        counts,
                        displs,
                        byte,
                        root,
                        comm,
                    ),
                    Op::Broadcast => ffi::MPI_Bcast(recv, recv_len, byte, root, comm),
                    Op::AllToAllVarcount => ffi::MPI_Alltoallv(
                        send, counts, displs, byte, recv, counts, displs, byte, comm,
                    ),
                    Op::AllReduce => all_reduce_floats(send_f32, recv_f32, floats, comm),
                }
            }
        })
    }

    /// `MPI_Barrier` on the world, called as a C loop calls it.
    pub(crate) fn barrier(&self) -> Result<(), BenchError> {
        use mpi::raw::AsRaw as _;
        // SAFETY: MPI is initialized (the ranks are MPI ranks) and the communicator is the
        // world.
        match unsafe { mpi::ffi::MPI_Barrier(self.0.as_raw()) } {
            0 => Ok(()),
            rc => Err(BenchError::Usage(format!("MPI_Barrier failed ({rc})"))),
        }
    }

    /// `MPI_Allreduce` (sum) of `input` into `output` through MPI's C API, as
    /// [`MpiWorld::run`] runs it: with `timed`, after an `MPI_Barrier` and between two clock
    /// reads (its nanoseconds), otherwise the call alone (0).
    pub(crate) fn all_reduce_sum(
        &self,
        input: &[f32],
        output: &mut [f32],
        timed: bool,
    ) -> Result<u64, BenchError> {
        use mpi::raw::AsRaw as _;
        same_length("MPI_Allreduce", input, output)?;
        let count = mpi_int(input.len())?;
        let comm = self.0.as_raw();
        let (input, output) = (input.as_ptr(), output.as_mut_ptr());
        // SAFETY: `input` and `output` hold `count` floats each (checked above); MPI is
        // initialized and every rank makes the call.
        self.iteration(timed, "all_reduce", || unsafe {
            all_reduce_floats(input, output, count, comm)
        })
    }

    /// One iteration of a C benchmark loop around `call` (an MPI call returning its code):
    /// with `timed`, an `MPI_Barrier` first and `call` between two clock reads (its
    /// nanoseconds on this rank), otherwise `call` alone (0); an error naming `what` unless
    /// MPI returns success.
    fn iteration(
        &self,
        timed: bool,
        what: &str,
        call: impl FnOnce() -> i32,
    ) -> Result<u64, BenchError> {
        if timed {
            self.barrier()?;
        }
        let start = std::time::Instant::now();
        let rc = call();
        let ns = if timed {
            crate::engine::timing::elapsed_ns(start)
        } else {
            0
        };
        match rc {
            0 => Ok(ns),
            rc => Err(BenchError::Usage(format!("MPI {what} failed ({rc})"))),
        }
    }
}

/// `MPI_Allreduce` (sum) of `count` floats from `input` into `output` on `comm`; MPI's code.
///
/// # Safety
/// `input` and `output` hold `count` floats each; MPI is initialized and every rank of `comm`
/// makes the same call.
#[cfg(feature = "mpi")]
unsafe fn all_reduce_floats(
    input: *const f32,
    output: *mut f32,
    count: i32,
    comm: mpi::ffi::MPI_Comm,
) -> i32 {
    use mpi::ffi;
    // SAFETY: per this function's contract; the datatype and op are rsmpi's immutable handle
    // constants.
    unsafe {
        ffi::MPI_Allreduce(
            input.cast(),
            output.cast(),
            count,
            ffi::RSMPI_FLOAT,
            ffi::RSMPI_SUM,
            comm,
        )
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

    pub(crate) fn run(&self, _: &mut Case, _: bool) -> Result<u64, BenchError> {
        match *self {}
    }

    pub(crate) fn barrier(&self) -> Result<(), BenchError> {
        match *self {}
    }

    pub(crate) fn all_reduce_sum(
        &self,
        _: &[f32],
        _: &mut [f32],
        _: bool,
    ) -> Result<u64, BenchError> {
        match *self {}
    }
}
