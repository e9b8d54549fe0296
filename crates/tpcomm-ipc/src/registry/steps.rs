//! The registry's collective steps: each one tagged with the group and its sequence number
//! (see `crate::step`), on the communicator the registry was made for.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::Communicator;

use super::PeerMappings;
use crate::error::{IpcError, Result};
use crate::memory::PeerMemory;
use crate::step::{tagged_all_gather, Step, StepTag};

/// Fails unless `comm` is rank `rank` of `size` ([`IpcError::WrongCommunicator`]).
fn same_group<C: Communicator + ?Sized>(rank: usize, size: usize, comm: &C) -> Result<()> {
    if comm.rank() == rank && comm.size() == size {
        return Ok(());
    }
    Err(IpcError::WrongCommunicator {
        rank,
        size,
        comm_rank: comm.rank(),
        comm_size: comm.size(),
    })
}

impl<B: PeerMemory> PeerMappings<B> {
    /// Collective: all-gathers `value` as the next tagged step `step` of this group (see
    /// [`StepTag`]); every rank's value in rank order. A rank in another step fails it on
    /// every rank in a tagged step with [`IpcError::StepMismatch`]. For the collective steps
    /// of a layer built on the registry (a transition's barriers), so that they are
    /// sequenced and checked with the registry's own.
    pub fn agree<C, T>(&mut self, comm: &C, step: Step, value: &T) -> Result<Vec<T>>
    where
        C: Communicator + ?Sized,
        T: Serialize + DeserializeOwned,
    {
        self.check_communicator(comm)?;
        let tag = self.next_tag(step);
        tagged_all_gather(comm, tag, value)
    }

    /// Fails unless `comm` is rank `rank` of `size`, as the group this registry was created
    /// for: every collective indexes its results by rank.
    pub fn check_communicator<C: Communicator + ?Sized>(&self, comm: &C) -> Result<()> {
        same_group(self.rank, self.size, comm)
    }

    /// The tag of the next step; the sequence advances whatever the step's outcome.
    fn next_tag(&mut self, step: Step) -> StepTag {
        let tag = StepTag {
            step,
            group: self.group,
            sequence: self.sequence,
        };
        self.sequence += 1;
        tag
    }
}
