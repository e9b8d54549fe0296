//! The blocking path: each collective's MPI call on the caller's buffers, holding the
//! process-wide lock when MPI needs calls serialized. Empty buffers are replaced by scratch
//! bytes, since an empty slice's address is Open MPI's `MPI_IN_PLACE`.

use std::ffi::c_void;
use std::ptr;

use mpi::ffi;

use super::args::{
    AllGatherCall, AllReduceCall, AllToAllCall, BroadcastCall, GatherCall, VarcountCall,
};
use super::conv::{byte_type, check, float_type};
use super::MpiCommunicator;
use crate::copy::to_vec;
use crate::error::{Op, Result};
use crate::reduce::narrow_half;

/// The blocking path of a prepared call (see `args`): its MPI call on the caller's buffers.
pub(super) trait Blocking {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()>;
}

impl MpiCommunicator {
    pub(super) fn blocking_barrier(&self) -> Result<()> {
        let _guard = self.lock(Op::Barrier)?;
        // SAFETY: `self.comm` is a live communicator owned by `self`.
        let code = unsafe { ffi::MPI_Barrier(self.comm) };
        check(Op::Barrier, "MPI_Barrier", code)
    }
}

impl Blocking for AllGatherCall<'_> {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()> {
        let op = Op::AllGather;
        let count = self.count;
        let mut scratch = Scratch::default();
        let send = send_ptr(self.send, &scratch.send);
        let recv = recv_ptr(self.recv, &mut scratch.recv);
        let byte = byte_type();
        let _guard = mpi.lock(op)?;
        // SAFETY: `send` is valid for `count` bytes (this rank's slice, or scratch when
        // empty); `recv` is valid for writes of `size * count` bytes (checked by
        // `AllGatherArgs`), and is a distinct, non-overlapping allocation from `send`
        // (a `&[u8]` and a `&mut [u8]` cannot overlap; the scratch bytes are distinct).
        // Both outlive the blocking call. `mpi.comm` is live.
        let code = unsafe { ffi::MPI_Allgather(send, count, byte, recv, count, byte, mpi.comm) };
        check(op, "MPI_Allgather", code)
    }
}

impl Blocking for VarcountCall<'_> {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()> {
        let op = Op::AllGatherVarcount;
        let VarcountCall {
            send,
            recv,
            send_count,
            counts,
            displs,
        } = self;
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        let recv = recv_ptr(recv, &mut scratch.recv);
        let byte = byte_type();
        let _guard = mpi.lock(op)?;
        // SAFETY: `VarcountArgs` guarantees one count and displacement per rank, each region
        // inside `recv` and non-overlapping, and `send.len() == counts[rank]`; `counts` and
        // `displs` hold `size` ints and outlive the call. `send` and `recv` point to
        // distinct memory (scratch bytes when empty) valid for the call. `mpi.comm` is
        // live.
        let code = unsafe {
            ffi::MPI_Allgatherv(
                send,
                send_count,
                byte,
                recv,
                counts.as_ptr(),
                displs.as_ptr(),
                byte,
                mpi.comm,
            )
        };
        check(op, "MPI_Allgatherv", code)
    }
}

impl Blocking for GatherCall<'_> {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()> {
        let op = Op::GatherVarcount;
        let GatherCall {
            send,
            send_count,
            root,
            recv,
        } = self;
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        // Receive arguments are significant at the root only; elsewhere MPI ignores them
        // and null is allowed.
        let (recv, counts_ptr, displs_ptr) = match recv {
            Some(layout) => (
                recv_ptr(layout.buf, &mut scratch.recv),
                layout.counts.as_ptr(),
                layout.displs.as_ptr(),
            ),
            None => (ptr::null_mut(), ptr::null(), ptr::null()),
        };
        let byte = byte_type();
        let _guard = mpi.lock(op)?;
        // SAFETY: `send` is valid for `send_count` bytes. At the root, `GatherArgs`
        // guarantees a receive layout with one in-bounds, non-overlapping region per rank,
        // `counts_ptr`/`displs_ptr` point to `size` ints in `counts_table`/`displs_table`,
        // all outliving the call, and `recv` is distinct from `send`; at other ranks the
        // receive arguments are null, which MPI ignores there. `root` is in range
        // (checked). `mpi.comm` is live.
        let code = unsafe {
            ffi::MPI_Gatherv(
                send, send_count, byte, recv, counts_ptr, displs_ptr, byte, root, mpi.comm,
            )
        };
        check(op, "MPI_Gatherv", code)
    }
}

impl Blocking for BroadcastCall<'_> {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()> {
        let op = Op::Broadcast;
        let BroadcastCall { buf, root, count } = self;
        let mut scratch = Scratch::default();
        let buf = recv_ptr(buf, &mut scratch.recv);
        let byte = byte_type();
        let _guard = mpi.lock(op)?;
        // SAFETY: `buf` is valid for reads and writes of `count` bytes (the caller's
        // slice, or a scratch byte when `count == 0`) for the whole blocking call; `root`
        // is in range (checked); `mpi.comm` is live.
        let code = unsafe { ffi::MPI_Bcast(buf, count, byte, root, mpi.comm) };
        check(op, "MPI_Bcast", code)
    }
}

/// `MPI_Allreduce` (see `raw_all_reduce`).
impl Blocking for AllReduceCall<'_> {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()> {
        let op = Op::AllReduce;
        let datatype = self.datatype();
        let (count, dtype, mpi_op) = (self.count, self.dtype, self.op);
        if let Some(wide) = &self.wide {
            let mut out = vec![0f32; wide.len()];
            let mut scratch = Scratch::default();
            let send = send_ptr(bytemuck::cast_slice(wide), &scratch.send);
            let recv = recv_ptr(bytemuck::cast_slice_mut(&mut out), &mut scratch.recv);
            let float = float_type();
            let guard = mpi.lock(op)?;
            // SAFETY: `send` and `recv` point to `count` f32 each (two distinct vectors, or
            // distinct scratch bytes when `count == 0`), properly aligned, alive for the
            // blocking call; `float` is the predefined `MPI_FLOAT`; `mpi.comm` is live.
            let code = unsafe { ffi::MPI_Allreduce(send, recv, count, float, mpi_op, mpi.comm) };
            // The error is looked up (MPI calls too) before the lock goes.
            let checked = check(op, "MPI_Allreduce", code);
            drop(guard);
            checked?;
            narrow_half(dtype, bytemuck::cast_slice(&out), self.recv);
            return Ok(());
        }
        let (send, recv) = (self.send, self.recv);
        let copied;
        let send = match send {
            Some(send) => send,
            None => {
                copied = to_vec(recv);
                &copied
            }
        };
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        let recv = recv_ptr(recv, &mut scratch.recv);
        let _guard = mpi.lock(op)?;
        // SAFETY: `AllReduceArgs` checked that send and receive hold the same `count`
        // elements of `dtype`, whose predefined MPI type `datatype` has the same size;
        // `send` and `recv` are distinct memory (the caller's two slices, a copy of the
        // input in place, or distinct scratch bytes when empty) alive for the blocking call.
        // `mpi.comm` is live.
        let code = unsafe { ffi::MPI_Allreduce(send, recv, count, datatype, mpi_op, mpi.comm) };
        check(op, "MPI_Allreduce", code)
    }
}

impl Blocking for AllToAllCall<'_> {
    fn blocking(self, mpi: &MpiCommunicator) -> Result<()> {
        let op = Op::AllToAllVarcount;
        let AllToAllCall {
            send,
            recv,
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
        } = self;
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        let recv = recv_ptr(recv, &mut scratch.recv);
        let byte = byte_type();
        let _guard = mpi.lock(op)?;
        // SAFETY: `AllToAllArgs` guarantees both layouts have `size` entries whose regions
        // lie inside their buffers, receive regions not overlapping; the four int tables
        // hold `size` entries and outlive the call. `send` and `recv` point to distinct
        // memory (scratch bytes when empty) valid for the call. `mpi.comm` is live.
        let code = unsafe {
            ffi::MPI_Alltoallv(
                send,
                send_counts.as_ptr(),
                send_displs.as_ptr(),
                byte,
                recv,
                recv_counts.as_ptr(),
                recv_displs.as_ptr(),
                byte,
                mpi.comm,
            )
        };
        check(op, "MPI_Alltoallv", code)
    }
}

/// Stand-ins for empty buffers: an empty slice's dangling address (`0x1`) is Open MPI's
/// `MPI_IN_PLACE`, so MPI gets the address of one of these bytes instead.
#[derive(Default)]
struct Scratch {
    send: [u8; 1],
    recv: [u8; 1],
}

/// The address MPI gets for a send buffer.
fn send_ptr(buf: &[u8], scratch: &[u8; 1]) -> *const c_void {
    if buf.is_empty() {
        scratch.as_ptr().cast()
    } else {
        buf.as_ptr().cast()
    }
}

/// The address MPI gets for a receive buffer.
fn recv_ptr(buf: &mut [u8], scratch: &mut [u8; 1]) -> *mut c_void {
    if buf.is_empty() {
        scratch.as_mut_ptr().cast()
    } else {
        buf.as_mut_ptr().cast()
    }
}
