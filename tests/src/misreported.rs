//! A communicator that wraps another and reports a rank or size of its own, while it
//! forwards the arguments it checked to the inner backend: what a careless wrapper does.
//! Every backend must refuse such arguments with a typed error before it touches a buffer
//! (for MPI, a receive buffer checked for fewer ranks would be written past its end).

use tpcomm::transport::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use tpcomm::transport::{
    dense_displacements, ArgumentError, Communicator, GatherRecv, ReduceOp, TransportError,
};

use crate::{layout, still_in_step, CaseResult};

/// `inner`, reporting rank `rank` of `size` ranks.
struct Misreported<'c, C> {
    inner: &'c C,
    rank: usize,
    size: usize,
}

impl<C: Communicator> Communicator for Misreported<'_, C> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn max_count(&self) -> usize {
        self.inner.max_count()
    }
    fn backend_name(&self) -> &'static str {
        "misreported"
    }
    fn split(&self, _color: Option<u32>, _key: i32) -> tpcomm::transport::Result<Option<Self>> {
        Err(TransportError::Setup(
            "a misreported communicator does not split".into(),
        ))
    }
    fn raw_barrier(&self) -> tpcomm::transport::Result<()> {
        self.inner.raw_barrier()
    }
    fn raw_all_gather(&self, args: AllGatherArgs<'_>) -> tpcomm::transport::Result<()> {
        self.inner.raw_all_gather(args)
    }
    fn raw_all_gather_varcount(&self, args: VarcountArgs<'_>) -> tpcomm::transport::Result<()> {
        self.inner.raw_all_gather_varcount(args)
    }
    fn raw_gather_varcount(&self, args: GatherArgs<'_>) -> tpcomm::transport::Result<()> {
        self.inner.raw_gather_varcount(args)
    }
    fn raw_broadcast(&self, args: BroadcastArgs<'_>) -> tpcomm::transport::Result<()> {
        self.inner.raw_broadcast(args)
    }
    fn raw_all_to_all_varcount(&self, args: AllToAllArgs<'_>) -> tpcomm::transport::Result<()> {
        self.inner.raw_all_to_all_varcount(args)
    }
    fn raw_all_reduce(&self, args: AllReduceArgs<'_>) -> tpcomm::transport::Result<()> {
        self.inner.raw_all_reduce(args)
    }
}

/// Every collective of a wrapper that reports another size (one more rank; one rank) or
/// another rank gets `OtherGroup` on every rank, naming both groups; nothing was sent, so
/// the ranks are still in step afterwards.
pub fn misreported_group_gets_a_typed_error<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let mut lies = vec![(me, n + 1)];
    if n > 1 {
        lies.push((0, 1));
        lies.push(((me + 1) % n, n));
    }
    for (rank, size) in lies {
        let w = Misreported {
            inner: comm,
            rank,
            size,
        };
        let what =
            |call: &str| format!("{call} reported as rank {rank} of {size} (really {me} of {n})");
        let expect = |call: &str, r: Result<(), TransportError>| -> CaseResult {
            match r {
                Err(TransportError::InvalidArgument {
                    source:
                        ArgumentError::OtherGroup {
                            checked_rank,
                            checked_size,
                            rank: real_rank,
                            size: real_size,
                        },
                    ..
                }) if (checked_rank, checked_size, real_rank, real_size) == (rank, size, me, n) => {
                    Ok(())
                }
                Err(e) => Err(format!("{}: wrong error: {e}", what(call))),
                Ok(()) => Err(format!("{}: accepted", what(call))),
            }
        };
        let send = [7u8; 4];
        let mut recv = vec![0u8; 4 * size];
        expect("all_gather", w.all_gather(&send, &mut recv))?;
        let counts = vec![4usize; size];
        let (displs, total) = dense_displacements(&counts).expect("small");
        let mut varcount = vec![0u8; total];
        expect(
            "all_gather_varcount",
            w.all_gather_varcount(&send, &mut varcount, &counts, &displs),
        )?;
        let gathered = (rank == 0).then_some(GatherRecv {
            recv: &mut varcount,
            counts: &counts,
            displs: &displs,
        });
        expect("gather_varcount", w.gather_varcount(0, &send, gathered))?;
        let mut buf = [0u8; 4];
        expect("broadcast", w.broadcast(0, &mut buf))?;
        let a2a_send = vec![1u8; total];
        let mut a2a_recv = vec![0u8; total];
        expect(
            "all_to_all_varcount",
            w.all_to_all_varcount(
                layout(&a2a_send, &counts, &displs),
                layout(&mut a2a_recv, &counts, &displs),
            ),
        )?;
        let mut sum = [0f32; 4];
        expect(
            "all_reduce",
            w.all_reduce(&[1f32; 4], &mut sum, ReduceOp::Sum),
        )?;
    }
    still_in_step(comm, "all_gather after the refused calls")
}
