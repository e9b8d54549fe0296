//! Suspend and resume: drain, close the mappings, release memory (`prepare_for_suspend`);
//! restore, reopen, rewrite the tables, reset and prove (`reinit_after_resume`); and what a
//! coordinator asks first (`check_suspend`, `check_checkpoint`).

use tpcomm_ipc::PeerMemory;
use tpcomm_transport::Communicator;

use super::{open_mut, CustomAllReduce, SlotSource, SIGNAL, STAGING};
use crate::backend::Backend;
use crate::error::{AllReduceError, Result};
use crate::lifecycle::{Phase, Step, Transition};

impl<B: Backend> CustomAllReduce<B> {
    /// Whether [`prepare_for_suspend`](Self::prepare_for_suspend) would start on this rank:
    /// the communicator is Active or Suspended and its stream is not being captured.
    /// Otherwise that call refuses at once on this rank while its peers wait for it in the
    /// collective steps (until their timeout), so a coordinator asks every rank first and
    /// starts only when none refuses (as `tpcomm_checkpoint::checkpoint_group` does).
    pub fn check_suspend(&self) -> Result<()> {
        match self.phase() {
            Phase::Active | Phase::Suspended => {}
            phase => {
                return Err(AllReduceError::WrongState {
                    call: "prepare_for_suspend",
                    phase,
                })
            }
        }
        self.refuse_while_capturing("prepare_for_suspend")
    }

    /// Fails unless this rank's process can be checkpointed and restored with its peers
    /// (`tpcomm-checkpoint` asks before anything is suspended): every peer buffer it maps
    /// must come back after a restore, as the peer-memory backend judges it
    /// ([`PeerMemory::checkpoint_blocker`]). The first that would not is
    /// [`AllReduceError::NotCheckpointable`], naming it (the base buffers, a registered
    /// buffer or a graph buffer of which rank, at which address) and why. Legacy CUDA IPC
    /// mappings of another process are such buffers: after a checkpoint and restore of both
    /// processes the driver refuses to open fresh legacy handles.
    pub fn check_checkpoint(&self) -> Result<()> {
        let res = self.resources("check_checkpoint")?;
        let Some(blocker) = res.peers.checkpoint_blockers().into_iter().next() else {
            return Ok(());
        };
        let what = if blocker.exchange == res.base {
            match blocker.index {
                SIGNAL => "Signal block",
                STAGING => "staging buffer",
                _ => "temp buffer",
            }
            .to_string()
        } else if self
            .buffers
            .values()
            .any(|reg| reg.exchange == blocker.exchange)
        {
            "registered buffer".to_string()
        } else {
            let slot = self
                .slots
                .iter()
                .position(|s| *s == Some(SlotSource::Exchanged(blocker.exchange, blocker.index)));
            match slot {
                Some(slot) => format!("graph buffer (RankData slot {slot})"),
                None => "buffer".to_string(),
            }
        };
        let addr = res
            .peers
            .address(blocker.exchange, blocker.rank, blocker.index)
            .map_or_else(|_| "a closed mapping".to_string(), |a| format!("{a:#x}"));
        Err(AllReduceError::NotCheckpointable {
            rank: self.rank,
            buffer: format!(
                "rank {}'s {what} (mapped at {addr}, {} bytes)",
                blocker.rank, blocker.len
            ),
            reason: blocker.reason,
        })
    }

    /// Bytes of this rank's Signal, staging and temp buffers whose memory the last
    /// [`prepare_for_suspend`](Self::prepare_for_suspend) released (a backend that
    /// [releases backing](PeerMemory::releases_backing): CUDA virtual memory,
    /// `HostMemory::stable`); 0 after the resume and for other backends.
    pub fn released_bytes(&self) -> usize {
        self.released
    }

    /// Collective: drain, tagged barrier, close every imported mapping (Signal blocks,
    /// staging, temp, registered and graph buffers), tagged barrier. A no-op while
    /// Suspended; a failure leaves the communicator Failed.
    ///
    /// The barriers are tagged steps of the registry
    /// ([`PeerMappings::agree`](tpcomm_ipc::PeerMappings::agree)): a peer that is in
    /// another step (it failed an earlier one, or runs another collective) is reported as
    /// [`IpcError::StepMismatch`](tpcomm_ipc::IpcError::StepMismatch) naming it, never
    /// paired with this step silently.
    pub fn prepare_for_suspend<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.transition(comm, Transition::Suspend)
    }

    /// What both transitions do around their steps: the communicator and capture checks,
    /// the lifecycle's verdict (nothing to do when already there), the steps inside a debug
    /// span named for the call, and their outcome reported to the lifecycle.
    fn transition<C: Communicator + ?Sized>(&mut self, comm: &C, t: Transition) -> Result<()> {
        self.check_communicator(comm)?;
        self.refuse_while_capturing(t.name())?;
        if self.lifecycle.begin(t)? == Step::NoOp {
            return Ok(());
        }
        let _span = match t {
            Transition::Suspend => tracing::debug_span!("prepare_for_suspend", rank = self.rank),
            Transition::Resume => tracing::debug_span!("reinit_after_resume", rank = self.rank),
        }
        .entered();
        let outcome = match t {
            Transition::Suspend => self.suspend_steps(comm),
            Transition::Resume => self.resume_steps(comm),
        };
        self.lifecycle.finish(t, outcome)
    }

    fn suspend_steps<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        let res = open_mut(&mut self.res, "prepare_for_suspend")?;
        // Launches still running read peer mappings: every rank drains its own before
        // anybody closes. A failed drain or close still joins both steps (peers are not left
        // waiting); only this rank fails.
        let drained = self.backend.synchronize(res.peers.backend(), &res.signal);
        res.peers
            .agree(comm, tpcomm_ipc::Step::SuspendDrained, &())?;
        let closed = res.peers.close_all();
        res.peers
            .agree(comm, tpcomm_ipc::Step::SuspendClosed, &())?;
        tracing::debug!(closed = ?closed.as_ref().ok(), "mappings closed for suspend");
        drained?;
        closed?;
        // Every peer has let go of this rank's buffers (the step above): where the backend
        // can, their memory goes now, and comes back fresh at the same addresses on resume.
        let memory = res.peers.backend();
        if memory.releases_backing() {
            for buffer in [&mut res.signal, &mut res.staging, &mut res.temp] {
                let freed = memory.release_backing(buffer);
                self.released += *freed.as_ref().unwrap_or(&0);
                freed?;
            }
            tracing::debug!(bytes = self.released, "buffer memory released for suspend");
        }
        Ok(())
    }

    /// Maps fresh memory back under the buffers the suspend released (a no-op when none
    /// was); the Signal block's is zeroed like every fresh allocation.
    fn restore_buffers(&mut self) -> Result<()> {
        if self.released == 0 {
            return Ok(());
        }
        let res = open_mut(&mut self.res, "reinit_after_resume")?;
        let memory = res.peers.backend();
        for buffer in [&mut res.signal, &mut res.staging, &mut res.temp] {
            memory.restore_backing(buffer)?;
        }
        self.released = 0;
        Ok(())
    }

    /// Collective: fresh handles, exchange, reopen; rewrite every RankSignals and RankData
    /// entry in place; reset and re-agree the flag counters; prove the new mappings (each
    /// rank writes a fresh nonce into its Signal block and reads every peer's through the new
    /// mapping); tagged barrier. A no-op while Active; a failure leaves the communicator
    /// Failed. Every exchange is a tagged step, as in
    /// [`prepare_for_suspend`](Self::prepare_for_suspend).
    pub fn reinit_after_resume<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        self.transition(comm, Transition::Resume)
    }

    fn resume_steps<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        // Local bookkeeping; should it fail, the reopen below still runs (every rank joins
        // it) and reports a region that cannot be exported, agreed.
        if let Err(e) = self.replace_abandoned_inputs() {
            tracing::warn!(rank = self.rank, error = %e, "replacing abandoned captured inputs failed");
        }
        // Likewise: a buffer left without memory cannot be exported, which the reopen
        // reports on every rank.
        if let Err(e) = self.restore_buffers() {
            tracing::warn!(rank = self.rank, error = %e, "restoring the released buffers failed");
        }
        {
            let res = open_mut(&mut self.res, "reinit_after_resume")?;
            // Failures of the reopen are agreed by the registry: every rank returns here.
            res.peers.reopen_all(comm)?;
        }
        // A local failure from here on still joins both remaining steps, announcing no
        // nonce, then reports itself; peers skip its proof (no voting: they stay Active).
        let reset = self.write_tables().and_then(|()| {
            let res = self.resources("reinit_after_resume")?;
            self.backend.reset_signal(res.peers.backend(), &res.signal)
        });
        // Everybody reset its flags and wrote its nonce before anybody reads or launches.
        let (prepared, proof) = self.nonce_test(
            comm,
            "reinit_after_resume",
            tpcomm_ipc::Step::ResumeNonces,
            reset,
        )?;
        let res = open_mut(&mut self.res, "reinit_after_resume")?;
        // A failed proof still joins the last step: peers are not left waiting.
        res.peers.agree(comm, tpcomm_ipc::Step::ResumeProved, &())?;
        prepared?;
        proof
    }
}
