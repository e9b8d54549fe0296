//! The arguments of each collective converted to MPI's once: counts, displacements and
//! roots to `int` (with checks), reductions to handles, half-precision inputs widened. The
//! blocking path and the timed path take the same prepared call, so a conversion and its
//! error exist once per collective.

use std::ffi::c_int;

use mpi::ffi;

use super::conv::{float_type, mpi_type, reduce_op};
use super::{MpiCommunicator, MAX_COUNT};
use crate::check::{AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs};
use crate::error::{ArgumentError, Op, Result, TransportError};
use crate::reduce::{widen_half, DataType};

/// `MPI_Allgather`'s arguments.
pub(super) struct AllGatherCall<'a> {
    pub(super) send: &'a [u8],
    /// `size * count` bytes (checked by `AllGatherArgs`).
    pub(super) recv: &'a mut [u8],
    /// Bytes per rank: the send count and every receive count.
    pub(super) count: c_int,
}

/// `MPI_Allgatherv`'s arguments.
pub(super) struct VarcountCall<'a> {
    pub(super) send: &'a [u8],
    pub(super) recv: &'a mut [u8],
    pub(super) send_count: c_int,
    /// One count and one displacement per rank.
    pub(super) counts: &'a [c_int],
    pub(super) displs: &'a [c_int],
}

/// `MPI_Gatherv`'s arguments.
pub(super) struct GatherCall<'a> {
    pub(super) send: &'a [u8],
    pub(super) send_count: c_int,
    pub(super) root: c_int,
    /// The receive buffer and its tables at the root; `None` elsewhere, where MPI ignores
    /// the receive arguments.
    pub(super) recv: Option<RecvTables<'a>>,
}

/// A receive buffer with one count and one displacement per rank.
pub(super) struct RecvTables<'a> {
    pub(super) buf: &'a mut [u8],
    pub(super) counts: &'a [c_int],
    pub(super) displs: &'a [c_int],
}

/// `MPI_Bcast`'s arguments.
pub(super) struct BroadcastCall<'a> {
    /// Read at the root, written elsewhere.
    pub(super) buf: &'a mut [u8],
    pub(super) root: c_int,
    pub(super) count: c_int,
}

/// `MPI_Allreduce`'s arguments.
pub(super) struct AllReduceCall<'a> {
    /// `None` in place: the receive buffer holds the input.
    pub(super) send: Option<&'a [u8]>,
    pub(super) recv: &'a mut [u8],
    /// Elements per rank.
    pub(super) count: c_int,
    pub(super) dtype: DataType,
    pub(super) op: ffi::MPI_Op,
    /// The input widened to `f32` when `dtype` is `f16` or `bf16`, which MPI has no type
    /// for: they travel as `MPI_FLOAT` and are rounded back.
    pub(super) wide: Option<Vec<f32>>,
}

/// `MPI_Alltoallv`'s arguments.
pub(super) struct AllToAllCall<'a> {
    pub(super) send: &'a [u8],
    pub(super) recv: &'a mut [u8],
    /// One count and one displacement per rank, each.
    pub(super) send_counts: &'a [c_int],
    pub(super) send_displs: &'a [c_int],
    pub(super) recv_counts: &'a [c_int],
    pub(super) recv_displs: &'a [c_int],
}

impl MpiCommunicator {
    pub(super) fn all_gather_call<'a>(
        &self,
        args: &'a mut AllGatherArgs<'_>,
    ) -> Result<AllGatherCall<'a>> {
        let count = self.int(Op::AllGather, "send count", self.rank, args.block_len())?;
        let (send, recv) = args.parts();
        Ok(AllGatherCall { send, recv, count })
    }

    /// Converts the tables into `tables`, which the caller keeps in its frame for the call.
    pub(super) fn varcount_call<'a>(
        &self,
        send: &'a [u8],
        recv: &'a mut [u8],
        counts: &[usize],
        displs: &[usize],
        tables: &'a mut [IntTable; 2],
    ) -> Result<VarcountCall<'a>> {
        let op = Op::AllGatherVarcount;
        let send_count = self.int(op, "send count", self.rank, send.len())?;
        let [counts_table, displs_table] = tables;
        let counts = self.ints(op, "counts", counts, counts_table)?;
        let displs = self.ints(op, "displacements", displs, displs_table)?;
        Ok(VarcountCall {
            send,
            recv,
            send_count,
            counts,
            displs,
        })
    }

    /// Converts the root's tables into `tables`, which the caller keeps in its frame for the
    /// call.
    pub(super) fn gather_call<'a>(
        &self,
        args: &'a mut GatherArgs<'_>,
        tables: &'a mut [IntTable; 2],
    ) -> Result<GatherCall<'a>> {
        let op = Op::GatherVarcount;
        let root = self.int(op, "root", self.rank, args.root())?;
        let (send, layout) = args.parts();
        let send_count = self.int(op, "send count", self.rank, send.len())?;
        let [counts_table, displs_table] = tables;
        let recv = match layout {
            Some(layout) => Some(RecvTables {
                counts: self.ints(op, "counts", layout.counts, counts_table)?,
                displs: self.ints(op, "displacements", layout.displs, displs_table)?,
                buf: &mut *layout.recv,
            }),
            None => None,
        };
        Ok(GatherCall {
            send,
            send_count,
            root,
            recv,
        })
    }

    pub(super) fn broadcast_call<'a>(
        &self,
        args: &'a mut BroadcastArgs<'_>,
    ) -> Result<BroadcastCall<'a>> {
        let op = Op::Broadcast;
        let root = self.int(op, "root", self.rank, args.root())?;
        let buf = args.buf();
        let count = self.int(op, "buffer length", self.rank, buf.len())?;
        Ok(BroadcastCall { buf, root, count })
    }

    pub(super) fn all_reduce_call<'a>(
        &self,
        args: &'a mut AllReduceArgs<'_>,
    ) -> Result<AllReduceCall<'a>> {
        let count = self.int(Op::AllReduce, "element count", self.rank, args.count())?;
        let (dtype, op) = (args.dtype(), reduce_op(args.op()));
        let wide = widen_half(dtype, args.input());
        let (send, recv) = args.parts();
        Ok(AllReduceCall {
            send,
            recv,
            count,
            dtype,
            op,
            wide,
        })
    }

    /// Converts the four tables into `tables`, which the caller keeps in its frame for the
    /// call.
    pub(super) fn all_to_all_call<'a>(
        &self,
        args: &'a mut AllToAllArgs<'_>,
        tables: &'a mut [IntTable; 4],
    ) -> Result<AllToAllCall<'a>> {
        let op = Op::AllToAllVarcount;
        let (send, recv) = args.parts();
        let [send_counts, send_displs, recv_counts, recv_displs] = tables;
        let send_counts = self.ints(op, "send counts", send.counts, send_counts)?;
        let send_displs = self.ints(op, "send displacements", send.displs, send_displs)?;
        let recv_counts = self.ints(op, "counts", recv.counts, recv_counts)?;
        let recv_displs = self.ints(op, "displacements", recv.displs, recv_displs)?;
        Ok(AllToAllCall {
            send: send.buf,
            recv: recv.buf,
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
        })
    }
}

impl VarcountCall<'_> {
    /// The counts, then the displacements, in one vector (a timed call owns its tables).
    pub(super) fn tables(&self) -> Vec<c_int> {
        [self.counts, self.displs].concat()
    }
}

impl RecvTables<'_> {
    /// The counts, then the displacements, in one vector (a timed call owns its tables).
    pub(super) fn tables(&self) -> Vec<c_int> {
        [self.counts, self.displs].concat()
    }
}

impl AllToAllCall<'_> {
    /// The send counts and displacements, then the receive counts and displacements, in one
    /// vector (a timed call owns its tables).
    pub(super) fn tables(&self) -> Vec<c_int> {
        [
            self.send_counts,
            self.send_displs,
            self.recv_counts,
            self.recv_displs,
        ]
        .concat()
    }
}

impl AllReduceCall<'_> {
    /// This rank's input: the send buffer, or in place the receive buffer's bytes.
    pub(super) fn input(&self) -> &[u8] {
        self.send.unwrap_or(self.recv)
    }

    /// The MPI type the elements travel as: `MPI_FLOAT` when widened, else the element
    /// type's own.
    pub(super) fn datatype(&self) -> ffi::MPI_Datatype {
        if self.wide.is_some() {
            float_type()
        } else {
            mpi_type(self.dtype)
        }
    }
}

impl MpiCommunicator {
    /// Converts a count, displacement or root to MPI's `int`.
    fn int(&self, op: Op, which: &'static str, index: usize, value: usize) -> Result<c_int> {
        c_int::try_from(value).map_err(|_| TransportError::InvalidArgument {
            op,
            rank: self.rank,
            source: ArgumentError::CountTooLarge {
                which,
                index,
                value,
                max: MAX_COUNT,
            },
        })
    }

    /// Converts a counts or displacements table to MPI's `int`s, written in place into
    /// `table` (which the caller keeps in its frame until the MPI call returns); the result
    /// borrows it.
    fn ints<'t>(
        &self,
        op: Op,
        which: &'static str,
        values: &[usize],
        table: &'t mut IntTable,
    ) -> Result<&'t [c_int]> {
        let out = table.slots(values.len());
        for (i, (slot, &v)) in out.iter_mut().zip(values).enumerate() {
            *slot = self.int(op, which, i, v)?;
        }
        Ok(out)
    }
}

/// Storage for a counts or displacements table converted to MPI's `int`: inline up to
/// [`IntTable::INLINE`] ranks, so that a varcount call on a typical group allocates
/// nothing.
///
/// The caller creates it and [`MpiCommunicator::ints`] fills it where it lies. Returning the
/// converted table by value instead (an 80-byte enum, as this module once did) made the
/// compiler copy it through the stack several times with stores and loads of mismatched
/// widths and offsets, which x86 cores cannot forward from store to load: that cost about
/// 20 ns per table on every varcount call (an all-to-all has four tables), more than the
/// rest of the wrapper.
pub(super) struct IntTable {
    inline: [c_int; IntTable::INLINE],
    heap: Vec<c_int>,
}

impl IntTable {
    const INLINE: usize = 16;

    pub(super) fn new() -> Self {
        Self {
            inline: [0; Self::INLINE],
            heap: Vec::new(),
        }
    }

    /// `len` slots to write the table into.
    fn slots(&mut self, len: usize) -> &mut [c_int] {
        if len <= Self::INLINE {
            &mut self.inline[..len]
        } else {
            self.heap.resize(len, 0);
            &mut self.heap
        }
    }
}
