//! What the coordination suspends before locking and resumes after unlocking: every tpcomm
//! object whose device state would block a checkpoint (imported CUDA IPC mappings) or that
//! must let the driver release its memory.

use std::error::Error;

use tpcomm_allreduce::{Backend, CustomAllReduce};
use tpcomm_transport::Communicator;

/// A boxed error of a suspendable object.
pub type BoxError = Box<dyn Error + Send + Sync + 'static>;

/// A tpcomm object that takes part in a group checkpoint through communicator `C`.
///
/// Both transitions are collective over `C`: every rank calls them on its copy of the
/// object, in the same order as its peers. [`checkpoint_group`](crate::checkpoint_group)
/// calls every registered object's [`prepare_for_suspend`](Self::prepare_for_suspend) before
/// locking any process and its [`reinit_after_resume`](Self::reinit_after_resume) after
/// every process is unlocked.
pub trait Suspendable<C: Communicator + ?Sized> {
    /// What the object is ("custom all-reduce (cuda)"), for errors and for the check that
    /// every rank registered the same objects in the same order: the same on every rank
    /// for objects that pair, and different for objects that do not.
    fn name(&self) -> String;

    /// Whether the object can suspend so that its process can be checkpointed and restored;
    /// `Err` says why not (checked on every rank before anything is suspended).
    fn suspend_support(&self) -> Result<(), String>;

    /// Releases what would block a checkpoint (closes every imported peer mapping).
    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError>;

    /// Rebuilds what [`prepare_for_suspend`](Self::prepare_for_suspend) released, with
    /// fresh handles (a checkpoint and restore invalidates every CUDA IPC handle the process
    /// exported before).
    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError>;
}

/// The custom all-reduce on any backend: suspend closes every imported mapping (memory that
/// keeps addresses detaches them, and releases the all-reduce's own buffers); the resume
/// exports fresh handles (`PeerMappings::reopen_all`) and rewrites the stable tables in
/// place where an address moved, so graphs captured before the checkpoint stay valid. It
/// can suspend while Active or Suspended (Failed and Closed cannot), not while its stream is
/// captured, and not while it maps a peer buffer that the checkpoint could not bring back
/// (`CustomAllReduce::check_checkpoint`: legacy CUDA IPC memory of another process).
impl<B: Backend, C: Communicator + ?Sized> Suspendable<C> for CustomAllReduce<B> {
    fn name(&self) -> String {
        format!("custom all-reduce ({})", self.backend().name())
    }

    fn suspend_support(&self) -> Result<(), String> {
        self.check_suspend().map_err(|e| e.to_string())?;
        self.check_checkpoint().map_err(|e| e.to_string())
    }

    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError> {
        Ok(CustomAllReduce::prepare_for_suspend(self, comm)?)
    }

    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError> {
        Ok(CustomAllReduce::reinit_after_resume(self, comm)?)
    }
}

/// The custom kernels with the NCCL fallback. NCCL keeps its device memory and its own
/// peer mappings unless the library can suspend (`ncclCommSuspend`, NCCL 2.29+): with an
/// older library the object reports that it cannot suspend, and the checkpoint is refused
/// before anything is touched (NCCL 2.28.9, the GPU machine's, is such a library).
#[cfg(feature = "nccl")]
impl<C, M> Suspendable<C> for tpcomm_allreduce::DeviceAllReduce<M>
where
    C: Communicator + ?Sized,
    M: tpcomm_ipc::DevicePeerMemory,
{
    fn name(&self) -> String {
        "device all-reduce (custom kernels + NCCL)".into()
    }

    fn suspend_support(&self) -> Result<(), String> {
        // A rank whose custom part refuses would go straight to `ncclCommSuspend` while its
        // peers wait for it in the custom part's steps.
        self.check_suspend().map_err(|e| e.to_string())?;
        self.check_checkpoint().map_err(|e| e.to_string())?;
        nccl_suspend_support(
            self.nccl().library().supports_suspend(),
            self.nccl().library().version(),
        )
    }

    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError> {
        Ok(tpcomm_allreduce::DeviceAllReduce::prepare_for_suspend(
            self, comm,
        )?)
    }

    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError> {
        Ok(tpcomm_allreduce::DeviceAllReduce::reinit_after_resume(
            self, comm,
        )?)
    }
}

/// An NCCL communicator on its own: `ncclCommSuspend(NCCL_SUSPEND_MEM)` /
/// `ncclCommResume` (collective among the NCCL ranks; `comm` is not used). A library without
/// them (NCCL before 2.29) cannot suspend, and the checkpoint is refused at the check.
#[cfg(feature = "nccl")]
impl<C: Communicator + ?Sized> Suspendable<C> for tpcomm_transport::NcclCommunicator {
    fn name(&self) -> String {
        "NCCL communicator".into()
    }

    fn suspend_support(&self) -> Result<(), String> {
        nccl_suspend_support(self.library().supports_suspend(), self.library().version())
    }

    fn prepare_for_suspend(&mut self, _comm: &C) -> Result<(), BoxError> {
        Ok(self.suspend()?)
    }

    fn reinit_after_resume(&mut self, _comm: &C) -> Result<(), BoxError> {
        Ok(self.resume()?)
    }
}

/// Whether an NCCL library of `version` that does (not) export `ncclCommSuspend` /
/// `ncclCommResume` lets its communicator's process be checkpointed.
pub fn nccl_suspend_support(supports_suspend: bool, version: i32) -> Result<(), String> {
    if supports_suspend {
        Ok(())
    } else {
        Err(format!(
            "the loaded NCCL ({version}) has no ncclCommSuspend / ncclCommResume (NCCL 2.29+): \
             its device memory and peer mappings would stay in place through the checkpoint"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::nccl_suspend_support;

    #[test]
    fn nccl_without_comm_suspend_cannot_suspend_and_says_its_version() {
        let why = nccl_suspend_support(false, 22809).unwrap_err();
        assert!(
            why.contains("22809") && why.contains("ncclCommSuspend"),
            "{why}"
        );
        assert!(nccl_suspend_support(true, 22900).is_ok());
    }
}
