//! `split` (`MPI_Comm_split`, which has no nonblocking form): with a timeout, first a bounded
//! barrier, then every rank's agreement to split (a split word and whether its color is
//! valid), so that an absent peer or one in another collective fails it on every rank.

use std::ffi::c_int;

use mpi::ffi;

use super::conv::{check, comm_null};
use super::{free_comm, MpiCommunicator, MAX_COUNT};
use crate::communicator::Communicator;
use crate::error::{ArgumentError, Op, Result, TransportError};

/// What every rank sends first in a split (`"tpcsplit"`): bytes of another collective are
/// not taken for a split.
const SPLIT_WORD: u64 = u64::from_le_bytes(*b"tpcsplit");

impl MpiCommunicator {
    /// [`Communicator::split`] of this backend.
    pub(super) fn split_group(&self, color: Option<u32>, key: i32) -> Result<Option<Self>> {
        let op = Op::Split;
        let mpi_color = match color {
            // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
            None => Ok(unsafe { ffi::RSMPI_UNDEFINED }),
            Some(c) => c_int::try_from(c).map_err(|_| TransportError::InvalidArgument {
                op,
                rank: self.rank,
                source: ArgumentError::CountTooLarge {
                    which: "color",
                    index: self.rank,
                    value: usize::try_from(c).unwrap_or(usize::MAX),
                    max: MAX_COUNT,
                },
            }),
        };
        // A communicator broken by an abandoned collective refuses splits as it refuses
        // collectives: `MPI_Comm_split` on it would block on its undefined state. With a
        // timeout, every rank first meets in a bounded barrier, so that an absent peer is
        // an error within the timeout rather than a wait in `MPI_Comm_split`, which MPI
        // cannot bound.
        if let Some(timeout) = self.timed(op)? {
            self.timed_barrier_for(op, timeout)?;
        }
        // Then every rank announces that it splits (and whether MPI can take its color), in
        // a fixed-size all-gather, bounded like the barrier: a peer whose barrier matched the
        // one above but that is not splitting, or one passing a color out of range, fails
        // the split on every rank instead of leaving them in `MPI_Comm_split`.
        self.agree_on_split(mpi_color.is_ok())?;
        let mpi_color = mpi_color?;
        let guard = self.lock(op)?;
        let mut new = comm_null();
        // SAFETY: `self.comm` is a live communicator owned by `self` (freed only in Drop),
        // MPI is initialized (a live communicator implies it), and `new` is a valid place
        // for the new handle.
        let code = unsafe { ffi::MPI_Comm_split(self.comm, mpi_color, key, &mut new) };
        check(op, "MPI_Comm_split", code)?;
        let Some(color) = color else {
            if new != comm_null() {
                // Not what MPI specifies for MPI_UNDEFINED; do not leak it.
                if let Err(e) = free_comm(&mut new) {
                    tracing::warn!(error = %e, "freeing an unexpected split result failed");
                }
            }
            tracing::debug!(rank = self.rank, key, "split: no color, no sub-group");
            return Ok(None);
        };
        if new == comm_null() {
            return Err(TransportError::Setup(format!(
                "MPI_Comm_split returned MPI_COMM_NULL for color {color}"
            )));
        }
        let mut child = Self::adopt(new, self.serialize, op)?;
        // Arming the timeout runs a collective, which takes the lock itself.
        drop(guard);
        if let Some(timeout) = self.timeout {
            child.arm_timeout(timeout)?;
        }
        tracing::debug!(
            rank = self.rank,
            color,
            key,
            new_rank = child.rank,
            new_size = child.size,
            "split"
        );
        Ok(Some(child))
    }

    /// The all-gather before `MPI_Comm_split`: every rank's [`SPLIT_WORD`] and whether its
    /// color is valid. A rank whose bytes are not a split word is in another collective:
    /// the communicator is out of step and broken. A valid color announced by every rank
    /// but this one's is refused on this rank with its own error (returned by the caller).
    fn agree_on_split(&self, color_valid: bool) -> Result<()> {
        const LEN: usize = 16;
        let mut mine = [0u8; LEN];
        mine[..8].copy_from_slice(&SPLIT_WORD.to_le_bytes());
        mine[8] = u8::from(color_valid) + 1;
        let mut all = vec![0u8; LEN * self.size];
        self.all_gather(&mine, &mut all)?;
        let word = |r: usize| &all[r * LEN..(r + 1) * LEN];
        if let Some(r) = (0..self.size).find(|&r| word(r)[..8] != mine[..8] || word(r)[8] == 0) {
            let reason = format!("rank {r} was not splitting when this rank split");
            let _ = self.broken.set((Some(r), reason.clone()));
            return Err(TransportError::Mismatch {
                op: Op::Split,
                rank: self.rank,
                detail: reason,
            });
        }
        let invalid: Vec<usize> = (0..self.size).filter(|&r| word(r)[8] != 2).collect();
        // This rank's own invalid color is the caller's error to return.
        if invalid.is_empty() || invalid.contains(&self.rank) {
            return Ok(());
        }
        Err(TransportError::Mismatch {
            op: Op::Split,
            rank: self.rank,
            detail: format!("ranks {invalid:?} passed a color MPI cannot take"),
        })
    }
}
