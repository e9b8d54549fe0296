//! The buffers of one transport collective at one size on one rank ([`Case`]), filled with
//! each rank's pattern and checked after the call, for `transport`, `peer-check` and the MPI
//! peers that run the same case.

use std::time::Instant;

use clap::ValueEnum;
use serde::Serialize;
use tpcomm::transport::ReduceOp;
use tpcomm::transport::{dense_displacements, GatherRecv, Layout};
use tpcomm::Communicator;

use crate::data::elements::{check, expected, input};
use crate::data::pattern::pattern;
use crate::engine::error::BenchError;
use crate::engine::row::Bus;
use crate::engine::timing::elapsed_ns;

/// Root of broadcast and gather.
pub(crate) const ROOT: usize = 0;

/// The collectives this subcommand measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub(crate) enum TransportOp {
    /// Fixed-size all-gather.
    AllGather,
    /// Varcount all-gather (allgatherv), near-equal counts.
    AllGatherVarcount,
    /// Varcount gather to rank 0 (gatherv), near-equal counts.
    GatherVarcount,
    /// Broadcast from rank 0.
    Broadcast,
    /// Varcount all-to-all (alltoallv), equal blocks.
    AllToAllVarcount,
    /// Numeric all-reduce of f32, summed (`Communicator::all_reduce`).
    AllReduce,
}

impl TransportOp {
    pub(crate) fn name(self) -> &'static str {
        match self {
            TransportOp::AllGather => "all_gather",
            TransportOp::AllGatherVarcount => "all_gather_varcount",
            TransportOp::GatherVarcount => "gather_varcount",
            TransportOp::Broadcast => "broadcast",
            TransportOp::AllToAllVarcount => "all_to_all_varcount",
            TransportOp::AllReduce => "all_reduce",
        }
    }

    pub(crate) fn root(self) -> Option<usize> {
        match self {
            TransportOp::GatherVarcount | TransportOp::Broadcast => Some(ROOT),
            _ => None,
        }
    }

    pub(crate) fn bus(self) -> Bus {
        match self {
            TransportOp::Broadcast => Bus::Same,
            TransportOp::AllReduce => Bus::AllReduce,
            _ => Bus::AllButOwnShare,
        }
    }

    /// What `size` means for this operation, for the table's title.
    pub(crate) fn size_meaning(self) -> &'static str {
        match self {
            TransportOp::AllGather | TransportOp::AllGatherVarcount => {
                "size = bytes gathered (all ranks' contributions); busbw = algbw * (n-1)/n"
            }
            TransportOp::GatherVarcount => {
                "size = bytes gathered at root 0; busbw = algbw * (n-1)/n"
            }
            TransportOp::Broadcast => "size = buffer bytes, root 0; busbw = algbw",
            TransportOp::AllToAllVarcount => {
                "size = bytes each rank sends (n equal blocks); busbw = algbw * (n-1)/n"
            }
            TransportOp::AllReduce => {
                "size = bytes of the f32 vector each rank reduces (sum); busbw = algbw * 2(n-1)/n"
            }
        }
    }
}

/// The buffers of one operation at one size on one rank.
///
/// `counts` / `displs` describe the receive buffer (one entry per rank) for every
/// operation but broadcast, and with equal blocks the send buffer of all-to-all too;
/// `mpi_counts` the same two tables as MPI's 32-bit counts, converted before timing.
#[derive(Debug)]
pub(crate) struct Case {
    pub(crate) op: TransportOp,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    /// The size in the table's convention.
    pub(crate) bytes: usize,
    pub(crate) send: Vec<u8>,
    /// Receive buffer; the buffer itself for broadcast; empty off the root for gather.
    pub(crate) recv: Vec<u8>,
    pub(crate) counts: Vec<usize>,
    pub(crate) displs: Vec<usize>,
    pub(crate) mpi_counts: [Vec<i32>; 2],
    /// All-reduce's input and output (the byte buffers are empty then).
    pub(crate) send_f32: Vec<f32>,
    pub(crate) recv_f32: Vec<f32>,
}

impl Case {
    /// Buffers for `op` at about `requested` bytes; `None` when the operation cannot move
    /// that few bytes over `size` ranks (equal blocks of at least one byte).
    pub(crate) fn new(
        op: TransportOp,
        requested: usize,
        rank: usize,
        size: usize,
    ) -> Result<Option<Self>, BenchError> {
        let overflow =
            || BenchError::Usage(format!("{requested} bytes over {size} ranks overflows"));
        let block = requested / size;
        // All-reduce: f32 elements, in `send_f32` / `recv_f32` (the byte buffers stay empty).
        let elements = requested / std::mem::size_of::<f32>();
        let (bytes, send_len, recv_len, counts) = match op {
            TransportOp::AllReduce if elements == 0 => return Ok(None),
            TransportOp::AllReduce => (elements * 4, 0, 0, Vec::new()),
            TransportOp::AllGather | TransportOp::AllToAllVarcount if block == 0 => {
                return Ok(None)
            }
            TransportOp::AllGather => (block * size, block, block * size, vec![block; size]),
            TransportOp::AllToAllVarcount => {
                (block * size, block * size, block * size, vec![block; size])
            }
            TransportOp::AllGatherVarcount | TransportOp::GatherVarcount => {
                let counts = near_equal_split(requested, size);
                let recv_len = if op == TransportOp::GatherVarcount && rank != ROOT {
                    0
                } else {
                    requested
                };
                (requested, counts[rank], recv_len, counts)
            }
            TransportOp::Broadcast => (requested, 0, requested, Vec::new()),
        };
        let f32s = if op == TransportOp::AllReduce {
            elements
        } else {
            0
        };
        let (displs, _) = dense_displacements(&counts).ok_or_else(overflow)?;
        // With equal blocks, the receive layout of all-to-all is its send layout too.
        let mpi = |v: &[usize]| {
            v.iter()
                .map(|&x| i32::try_from(x).map_err(|_| overflow()))
                .collect::<Result<Vec<i32>, _>>()
        };
        Ok(Some(Self {
            op,
            rank,
            size,
            bytes,
            send: vec![0; send_len],
            recv: vec![0; recv_len],
            mpi_counts: [mpi(&counts)?, mpi(&displs)?],
            counts,
            displs,
            send_f32: vec![0.0; f32s],
            recv_f32: vec![0.0; f32s],
        }))
    }

    /// Elements per rank, for the table's `count` column.
    pub(crate) fn count(&self) -> usize {
        match self.op {
            TransportOp::AllReduce => self.send_f32.len(),
            _ => self.bytes,
        }
    }

    /// The element type, for the table's `type` column.
    pub(crate) fn type_name(&self) -> &'static str {
        match self.op {
            TransportOp::AllReduce => "float",
            _ => "uint8",
        }
    }

    /// Runs the operation once through tpcomm (the MPI peer runs the same case as the plain
    /// MPI call); the call's nanoseconds, the clock started right before it.
    pub(crate) fn run<C: Communicator>(&mut self, comm: &C) -> Result<u64, BenchError> {
        let start = Instant::now();
        match self.op {
            TransportOp::AllGather => comm.all_gather(&self.send, &mut self.recv)?,
            TransportOp::AllGatherVarcount => {
                comm.all_gather_varcount(&self.send, &mut self.recv, &self.counts, &self.displs)?
            }
            TransportOp::GatherVarcount => {
                let recv = (self.rank == ROOT).then_some(GatherRecv {
                    recv: &mut self.recv,
                    counts: &self.counts,
                    displs: &self.displs,
                });
                comm.gather_varcount(ROOT, &self.send, recv)?
            }
            TransportOp::Broadcast => comm.broadcast(ROOT, &mut self.recv)?,
            TransportOp::AllToAllVarcount => comm.all_to_all_varcount(
                Layout {
                    buf: &self.send,
                    counts: &self.counts,
                    displs: &self.displs,
                },
                Layout {
                    buf: &mut self.recv,
                    counts: &self.counts,
                    displs: &self.displs,
                },
            )?,
            TransportOp::AllReduce => {
                comm.all_reduce(&self.send_f32, &mut self.recv_f32, ReduceOp::Sum)?
            }
        }
        Ok(elapsed_ns(start))
    }

    /// Fills the buffers with fresh data for a verification run: the send buffer (and the
    /// root's broadcast buffer) with this rank's pattern, the rest with garbage.
    pub(crate) fn fill(&mut self, salt: u64) {
        if self.op == TransportOp::AllReduce {
            self.send_f32 = input(self.rank, self.send_f32.len(), salt);
            self.recv_f32.fill(f32::NAN);
            return;
        }
        pattern(&mut self.send, self.rank, salt, 0);
        let garbage_salt = !salt;
        if self.op == TransportOp::Broadcast && self.rank == ROOT {
            pattern(&mut self.recv, ROOT, salt, 0);
        } else {
            pattern(&mut self.recv, self.rank, garbage_salt, 0);
        }
    }

    /// Checks the receive buffer after a run on data from [`fill`](Self::fill); returns
    /// what is wrong.
    pub(crate) fn check(&self, salt: u64) -> Option<String> {
        let region = |from: usize, at: usize, offset: usize, len: usize| -> Option<String> {
            let got = self.recv.get(at..at + len)?;
            let mut want = vec![0; len];
            pattern(&mut want, from, salt, offset);
            let bad = got.iter().zip(&want).position(|(g, w)| g != w)?;
            Some(format!(
                "byte {} (from rank {from}, its byte {}) is {:#04x}, expected {:#04x}",
                at + bad,
                offset + bad,
                got[bad],
                want[bad]
            ))
        };
        let short = |len: usize| {
            (self.recv.len() < len)
                .then(|| format!("receive buffer of {} bytes, need {len}", self.recv.len()))
        };
        match self.op {
            TransportOp::AllReduce => check(
                &self.recv_f32,
                &expected(self.size, self.send_f32.len(), salt),
            ),
            TransportOp::GatherVarcount if self.rank != ROOT => None,
            TransportOp::Broadcast => region(ROOT, 0, 0, self.recv.len()),
            TransportOp::AllGather
            | TransportOp::AllGatherVarcount
            | TransportOp::GatherVarcount => (0..self.size).find_map(|r| {
                short(self.displs[r] + self.counts[r])
                    .or_else(|| region(r, self.displs[r], 0, self.counts[r]))
            }),
            TransportOp::AllToAllVarcount => (0..self.size).find_map(|r| {
                // Rank r sent me its block number `rank`, which starts at rank * block.
                let block = self.counts[r];
                short(self.displs[r] + block)
                    .or_else(|| region(r, self.displs[r], self.rank * block, block))
            }),
        }
    }
}

/// Splits `total` into `parts` counts differing by at most one, larger ones first.
fn near_equal_split(total: usize, parts: usize) -> Vec<usize> {
    let (base, extra) = (total / parts, total % parts);
    (0..parts).map(|i| base + usize::from(i < extra)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_equal_split_sums_to_total() {
        assert_eq!(near_equal_split(8, 3), vec![3, 3, 2]);
        assert_eq!(near_equal_split(2, 4), vec![1, 1, 0, 0]);
    }

    #[test]
    fn block_operations_skip_sizes_below_one_byte_per_rank() {
        assert!(Case::new(TransportOp::AllGather, 3, 0, 4)
            .unwrap()
            .is_none());
        assert!(Case::new(TransportOp::AllToAllVarcount, 3, 0, 4)
            .unwrap()
            .is_none());
        assert!(Case::new(TransportOp::AllGatherVarcount, 3, 0, 4)
            .unwrap()
            .is_some());
    }

    #[test]
    fn an_all_reduce_case_checks_the_exact_sum_of_every_rank() {
        // One rank: the sum is its own input.
        let mut case = Case::new(TransportOp::AllReduce, 64, 0, 1)
            .unwrap()
            .unwrap();
        assert_eq!(
            (case.bytes, case.count(), case.type_name()),
            (64, 16, "float")
        );
        case.fill(9);
        assert!(case.check(9).is_some(), "NaN output must not pass");
        case.recv_f32 = case.send_f32.clone();
        assert_eq!(case.check(9), None);
        case.recv_f32[3] += 1.0;
        assert!(case.check(9).unwrap().starts_with("element 3"));
        assert!(Case::new(TransportOp::AllReduce, 3, 0, 2)
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_corrupted_byte_is_found() {
        let mut case = Case::new(TransportOp::AllGather, 96, 0, 1)
            .unwrap()
            .unwrap();
        case.fill(5);
        case.recv = case.send.clone();
        assert_eq!(case.check(5), None);
        case.recv[7] ^= 1;
        assert!(case.check(5).unwrap().starts_with("byte 7"));
    }
}
