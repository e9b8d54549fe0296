//! The [`Communicator`] impl: each collective as one round of posts (two for the
//! all-reduce), every post checked against this rank's own call (counts, lengths, types)
//! before anything is copied out.

use std::sync::atomic::Ordering;

use super::posts::{posted, Outgoing};
use super::rounds::Needs;
use super::shared::Shared;
use super::LocalCommunicator;
use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use crate::communicator::Communicator;
use crate::copy::{copy_slice, extend_from_slice};
use crate::error::{Op, Result};
use crate::reduce::{describe_reduction, reduce_into, slice_of};

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn max_count(&self) -> usize {
        self.shared.config.max_count
    }

    fn backend_name(&self) -> &'static str {
        "local"
    }

    /// This rank's waits are bounded by `timeout` instead of the group's.
    fn bound_waits(&mut self, timeout: std::time::Duration) -> Result<bool> {
        self.timeout = Some(timeout);
        Ok(true)
    }

    fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Self>> {
        const NO_COLOR: usize = usize::MAX;
        let op = Op::Split;
        let meta = vec![color.map_or(NO_COLOR, |c| c as usize), key as i64 as usize];
        let seq = self.seq.load(Ordering::Relaxed);
        let posts = self.exchange(op, None, self.post(&[], &meta), Needs::Everybody)?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..self.size())
            .filter(|&r| posted(&posts, r).meta[0] == color as usize)
            .map(|r| (posted(&posts, r).meta[1] as i64, r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank posted its own color");
        let mut state = self.shared.lock();
        let entry = match state.children.entry((seq, color)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert((
                Shared::new(members.len(), self.shared.config.clone())?,
                members.len(),
            )),
        };
        let child = entry.0.clone();
        entry.1 -= 1;
        if entry.1 == 0 {
            state.children.remove(&(seq, color));
        }
        tracing::debug!(
            rank = self.rank,
            color,
            key,
            new_rank,
            new_size = members.len(),
            "split"
        );
        Ok(Some(LocalCommunicator::new(child, new_rank)))
    }

    fn raw_barrier(&self) -> Result<()> {
        self.exchange(Op::Barrier, None, self.post(&[], &[]), Needs::Everybody)
            .map(drop)
    }

    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGather, self.rank(), self.size())?;
        let op = Op::AllGather;
        let block = args.block_len();
        let post = self.post(args.send(), &[block]);
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        for r in 0..self.size() {
            let len = posted(&posts, r).bytes.len();
            if len != block {
                return Err(self.mismatch(
                    op,
                    format!("rank {r} contributed {len} bytes, this rank {block}"),
                ));
            }
        }
        for (r, chunk) in args
            .recv()
            .chunks_exact_mut(block.max(1))
            .enumerate()
            .take(self.size())
        {
            copy_slice(chunk, &posted(&posts, r).bytes);
        }
        Ok(())
    }

    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGatherVarcount, self.rank(), self.size())?;
        let op = Op::AllGatherVarcount;
        let post = self.post(args.send(), args.counts());
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        let (_, recv, counts, displs) = args.parts();
        for r in 0..self.size() {
            if posted(&posts, r).meta != counts {
                return Err(self.mismatch(
                    op,
                    format!(
                        "rank {r} called with counts {:?}, this rank {counts:?}",
                        posted(&posts, r).meta
                    ),
                ));
            }
        }
        for r in 0..self.size() {
            copy_slice(
                &mut recv[displs[r]..displs[r] + counts[r]],
                &posted(&posts, r).bytes,
            );
        }
        Ok(())
    }

    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::GatherVarcount, self.rank(), self.size())?;
        let op = Op::GatherVarcount;
        let root = args.root();
        let is_root = self.rank == root;
        let post = self.post(args.send(), &[]);
        let needs = if is_root {
            Needs::Everybody
        } else {
            Needs::Nobody
        };
        let posts = self.exchange(op, Some(root), post, needs)?;
        if let (_, Some(layout)) = args.parts() {
            for r in 0..self.size() {
                let got = posted(&posts, r).bytes.len();
                if got != layout.counts[r] {
                    return Err(self.mismatch(
                        op,
                        format!(
                            "rank {r} sent {got} bytes, the root expected {}",
                            layout.counts[r]
                        ),
                    ));
                }
            }
            for r in 0..self.size() {
                let d = layout.displs[r];
                copy_slice(
                    &mut layout.recv[d..d + layout.counts[r]],
                    &posted(&posts, r).bytes,
                );
            }
        }
        Ok(())
    }

    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::Broadcast, self.rank(), self.size())?;
        let op = Op::Broadcast;
        let root = args.root();
        if self.rank == root {
            let post = self.post(args.buf(), &[]);
            self.exchange(op, Some(root), post, Needs::Nobody)?;
            return Ok(());
        }
        let post = self.post(&[], &[args.buf().len()]);
        let posts = self.exchange(op, Some(root), post, Needs::Rank(root))?;
        let data = &posted(&posts, root).bytes;
        let buf = args.buf();
        if data.len() != buf.len() {
            return Err(self.mismatch(
                op,
                format!(
                    "root {root} broadcast {} bytes into a {}-byte buffer",
                    data.len(),
                    buf.len()
                ),
            ));
        }
        copy_slice(buf, data);
        Ok(())
    }

    /// Two rounds, reduce-scatter then all-gather. Round one: every rank posts its input
    /// and its (count, type, op); every rank checks them against its own (a difference is
    /// a `Mismatch` on every rank, since every rank differs from some peer), then reduces
    /// its own slice of the elements (`reduce::slice_of`) over every post in rank order. Round
    /// two: every rank posts its reduced slice and copies every slice into its output.
    /// Each element is reduced once, by one rank, in rank order: bitwise the same result
    /// everywhere.
    fn raw_all_reduce(&self, mut args: AllReduceArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllReduce, self.rank(), self.size())?;
        let op = Op::AllReduce;
        let (dtype, reduce, count) = (args.dtype(), args.op(), args.count());
        let describe = |meta: &[usize]| match meta {
            [count, dtype, reduce] => describe_reduction(*count as u64, *dtype, *reduce),
            _ => format!("{meta:?}"),
        };
        let meta = [count, dtype.index(), reduce.index()];
        let post = self.post(args.input(), &meta);
        let posts = self.exchange(op, None, post, Needs::Everybody)?;
        for r in 0..self.size() {
            let theirs = &posted(&posts, r).meta;
            if theirs[..] != meta[..] {
                return Err(self.mismatch(
                    op,
                    format!(
                        "rank {r} called all_reduce with {}, this rank with {}",
                        describe(theirs),
                        describe(&meta)
                    ),
                ));
            }
        }
        if count == 0 {
            return Ok(());
        }
        let elem = dtype.size();
        let (lo, hi) = slice_of(count, self.size(), self.rank);
        let inputs: Vec<&[u8]> = (0..self.size())
            .map(|r| &posted(&posts, r).bytes[lo * elem..hi * elem])
            .collect();
        let mut mine = vec![0u8; (hi - lo) * elem];
        reduce_into(dtype, reduce, &inputs, &mut mine);
        drop(inputs);
        drop(posts);
        let slices = self.exchange(op, None, self.post_owned(mine), Needs::Everybody)?;
        let (_, recv) = args.parts();
        for r in 0..self.size() {
            let (lo, hi) = slice_of(count, self.size(), r);
            copy_slice(&mut recv[lo * elem..hi * elem], &posted(&slices, r).bytes);
        }
        Ok(())
    }

    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllToAllVarcount, self.rank(), self.size())?;
        let op = Op::AllToAllVarcount;
        let send = args.send();
        let post = self.post_with(|p| {
            extend_from_slice(&mut p.bytes, send.buf);
            p.meta.extend_from_slice(send.counts);
            p.meta.extend_from_slice(send.displs);
        });
        let posts = self.exchange(op, None, Outgoing::Shared(post), Needs::Everybody)?;
        let size = self.size();
        let me = self.rank;
        let (_, recv) = args.parts();
        for r in 0..size {
            let p = posted(&posts, r);
            if p.meta[me] != recv.counts[r] {
                return Err(self.mismatch(
                    op,
                    format!(
                        "rank {r} sends {} bytes to rank {me}, which expects {}",
                        p.meta[me], recv.counts[r]
                    ),
                ));
            }
        }
        for r in 0..size {
            let p = posted(&posts, r);
            let (count, displ) = (p.meta[me], p.meta[size + me]);
            let d = recv.displs[r];
            copy_slice(&mut recv.buf[d..d + count], &p.bytes[displ..displ + count]);
        }
        Ok(())
    }
}
