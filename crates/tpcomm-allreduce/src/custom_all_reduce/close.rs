//! Closing: `close` (local, from any phase; what a peer may still see is documented there),
//! `close_with` (collective: every rank drains, then a tagged step, then the release), and
//! the close on drop.

use tpcomm_ipc::PeerMemory;
use tpcomm_transport::Communicator;

use super::{CustomAllReduce, Resources};
use crate::backend::Backend;
use crate::error::Result;

impl<B: Backend> CustomAllReduce<B> {
    /// Releases everything (mappings and local buffers) from any phase; later calls fail
    /// with a Closed error. **Not collective**: prefer [`close_with`](Self::close_with)
    /// whenever the communicator is at hand. Returns the first error closing met, after
    /// releasing everything anyway.
    ///
    /// What a peer may see after a non-collective close (or a drop) of this rank: every
    /// launch this rank issued has finished (it drains them first), and its last barrier
    /// proves that every peer has read this rank's input. A peer may still be copying its
    /// share of a two-stage result from this rank's temp buffer (that launch has no end
    /// barrier): on the host backend its mapping keeps those pages and their values (the
    /// buffers peers map are retired, [`PeerMemory::retire`], so no later buffer of this
    /// process is carved over them); on CUDA this is the case of the second item below. A peer that starts a launch this rank
    /// never joins writes into this rank's Signal block and reads its staging or temp buffer
    /// through its own mapping:
    /// - host backend: the peer's mapping keeps the memfd pages alive until the peer unmaps
    ///   them, so it reads stale but valid memory and its barrier times out naming this rank
    ///   ([`AllReduceError::Timeout`](crate::AllReduceError::Timeout));
    /// - CUDA: the memory is freed with `cuMemFree` while the peer still has it mapped,
    ///   which CUDA documents as undefined behaviour: the peer may read garbage, fault, or
    ///   time out. Close collectively.
    pub fn close(&mut self) -> Result<()> {
        self.release(false)
    }

    /// Drains, closes the mappings and frees this rank's buffers; `agreed`: every rank
    /// passed the Close step, so no peer reads or writes them any more. Otherwise the
    /// buffers peers map (Signal, staging, temp) are retired ([`PeerMemory::retire`]): a
    /// late peer finds what was there, not another buffer of this process.
    fn release(&mut self, agreed: bool) -> Result<()> {
        self.lifecycle.close();
        let Some(mut res) = self.res.take() else {
            return Ok(());
        };
        // Launches still in flight read these buffers: wait for them (bounded by the launch
        // timeout) before anything is freed. A suspend that released them drained first.
        if self.released == 0 {
            if let Err(e) = self.backend.synchronize(res.peers.backend(), &res.signal) {
                tracing::warn!(error = %e, "draining launches before close failed");
            }
        }
        let closed = res.peers.close_all().map(drop);
        let Resources {
            peers,
            signal,
            staging,
            temp,
            ..
        } = res;
        for buffer in [signal, staging, temp] {
            if agreed {
                drop(buffer);
            } else {
                peers.backend().retire(buffer);
            }
        }
        Ok(closed?)
    }

    /// Collective close, from any phase: drains this rank's launches, then a tagged step
    /// ([`Step::Close`](tpcomm_ipc::Step::Close)) that every rank joins after draining, and
    /// only then closes the mappings and frees the Signal, staging, temp buffers and tables:
    /// no peer can still be reading them. Every rank must call it (a peer that never does
    /// makes this rank's step fail at the transport timeout; a peer in another step is named
    /// in [`StepMismatch`](tpcomm_ipc::IpcError::StepMismatch)). Everything is released
    /// whatever fails; the first error is returned. A no-op when already Closed.
    pub fn close_with<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.check_communicator(comm)?;
        let Some(res) = self.res.as_mut() else {
            self.lifecycle.close();
            return Ok(());
        };
        let _span = tracing::debug_span!("allreduce_close", rank = self.rank).entered();
        // A suspend that released the buffers drained every launch before.
        let drained = if self.released == 0 {
            self.backend.synchronize(res.peers.backend(), &res.signal)
        } else {
            Ok(())
        };
        let agreed = res.peers.agree(comm, tpcomm_ipc::Step::Close, &());
        let closed = self.release(drained.is_ok() && agreed.is_ok());
        drained?;
        agreed?;
        closed
    }
}

impl<B: Backend> Drop for CustomAllReduce<B> {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "closing the custom all-reduce on drop failed");
        }
    }
}
