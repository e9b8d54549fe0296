//! What the fake-driver tests share: a group of rank threads, each rank its own process
//! (`pid_of`, `options`), suspendable objects that record their transitions (`Probe`,
//! `Other`), one checkpoint per rank and the outcomes (`run_probe`, `run_two`), the failure
//! every rank agreed on, the ordering rules of the driver's call log, a driver with faults the
//! fake does not model (`Faulty`), and peer memory a restore cannot bring back
//! (`Unrestorable`).

use std::time::Duration;

use tpcomm_allreduce::{Config, CustomAllReduce, HostBackend};
use tpcomm_checkpoint::fake::{Call, Event, FakeDriver};
use tpcomm_checkpoint::{
    checkpoint_group, Aftermath, BoxError, CheckpointDriver, CheckpointError, CheckpointOptions,
    CheckpointReport, Paused, ProcessState, Step, StepFailure, Suspendable,
};
use tpcomm_ipc::HostMemory;
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

pub(crate) const WORLDS: [usize; 3] = [2, 3, 4];

pub(crate) fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(20))
}

pub(crate) fn pid_of(rank: usize) -> u32 {
    1000 + rank as u32
}

pub(crate) fn options(rank: usize) -> CheckpointOptions {
    CheckpointOptions {
        pid: Some(pid_of(rank)),
        ..CheckpointOptions::default()
    }
}

/// A suspendable object that records what was called and fails where told. Its
/// transitions are collective (a barrier), like a real object's.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    pub(crate) fail_prepare: bool,
    pub(crate) fail_reinit: bool,
    pub(crate) cannot_suspend: bool,
    pub(crate) prepared: usize,
    pub(crate) resumed: usize,
}

impl<C: Communicator + ?Sized> Suspendable<C> for Probe {
    fn name(&self) -> String {
        "probe".into()
    }
    fn suspend_support(&self) -> Result<(), String> {
        if self.cannot_suspend {
            Err("it holds device state it cannot release".into())
        } else {
            Ok(())
        }
    }
    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.prepared, self.fail_prepare, "prepare")
    }
    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.resumed, self.fail_reinit, "reinit")
    }
}

/// One collective step of a probe: a barrier, counted, failing after it when told to.
pub(crate) fn probe_step<C: Communicator + ?Sized>(
    comm: &C,
    count: &mut usize,
    fail: bool,
    what: &str,
) -> Result<(), BoxError> {
    comm.barrier()?;
    *count += 1;
    if fail {
        return Err(format!("injected {what} failure").into());
    }
    Ok(())
}

pub(crate) fn host_ar(comm: &LocalCommunicator) -> CustomAllReduce<HostBackend> {
    CustomAllReduce::new(
        HostBackend::new(),
        HostMemory::new(),
        comm,
        Config::default(),
    )
    .expect("host all-reduce")
}

/// Index of the first / last event of `call` in the log.
pub(crate) fn first(log: &[Event], call: Call) -> Option<usize> {
    log.iter().position(|e| e.call == call)
}
pub(crate) fn last(log: &[Event], call: Call) -> Option<usize> {
    log.iter().rposition(|e| e.call == call)
}

/// The ordering rules on the log: every lock before any checkpoint; every restore before any
/// unlock.
pub(crate) fn assert_ordering(log: &[Event]) {
    if let (Some(l), Some(c)) = (last(log, Call::Lock), first(log, Call::Checkpoint)) {
        assert!(l < c, "a checkpoint before every lock: {log:?}");
    }
    if let (Some(r), Some(u)) = (last(log, Call::Restore), first(log, Call::Unlock)) {
        assert!(r < u, "an unlock before every restore: {log:?}");
    }
}

pub(crate) type Outcome = (Result<CheckpointReport, CheckpointError>, Probe);

/// Runs one checkpoint on `world` ranks with one probe each (set up by `probe`), every rank
/// a process of its own on `driver`.
pub(crate) fn run_probe<D: CheckpointDriver + ?Sized>(
    world: usize,
    driver: &D,
    probe: impl Fn(usize) -> Probe + Sync,
) -> Vec<Outcome> {
    every_rank(world, |comm| {
        let mut p = probe(comm.rank());
        let out = checkpoint_own_process(&comm, driver, &mut [&mut p], |_| Ok(()));
        (out, p)
    })
}

pub(crate) fn failed(out: &Result<CheckpointReport, CheckpointError>) -> &CheckpointError {
    out.as_ref().expect_err("the checkpoint should have failed")
}

/// Runs `f` on every rank of a group of `world` threads (see [`group`]): every rank's
/// result, in rank order (a rank that panicked fails the test).
pub(crate) fn every_rank<T: Send>(
    world: usize,
    f: impl Fn(LocalCommunicator) -> T + Sync,
) -> Vec<T> {
    group(world)
        .run(f)
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect()
}

/// [`checkpoint_group`] with this rank its own process ([`options`]).
pub(crate) fn checkpoint_own_process<D: CheckpointDriver + ?Sized>(
    comm: &LocalCommunicator,
    driver: &D,
    objects: &mut [&mut dyn Suspendable<LocalCommunicator>],
    pause: impl FnOnce(&Paused) -> Result<(), BoxError>,
) -> Result<CheckpointReport, CheckpointError> {
    checkpoint_group(comm, driver, objects, &options(comm.rank()), pause)
}

/// A pause that panics on rank `rank` and passes elsewhere.
pub(crate) fn pause_panicking_on(rank: usize) -> impl FnOnce(&Paused) -> Result<(), BoxError> {
    move |p| {
        if p.rank == rank {
            panic!("the pause panicked");
        }
        Ok(())
    }
}

/// The failure of `out`, which every rank names: `step`, failed first on `rank`.
pub(crate) fn failed_at(
    out: &Result<CheckpointReport, CheckpointError>,
    step: Step,
    rank: usize,
) -> &CheckpointError {
    let e = failed(out);
    assert_eq!((e.step(), e.rank()), (step, rank), "{e}");
    e
}

/// Rank `rank`'s process (`pid_of`) is running on `driver`.
pub(crate) fn assert_running(driver: &FakeDriver, rank: usize) {
    assert_eq!(
        driver.state_of(pid_of(rank)),
        ProcessState::Running,
        "rank {rank}: {:?}",
        driver.log()
    );
}

/// The failure every rank agreed on: the first one and what was left behind.
pub(crate) fn agreed_failure(
    out: &Result<CheckpointReport, CheckpointError>,
) -> (&StepFailure, &Aftermath) {
    match failed(out) {
        CheckpointError::Failed {
            first, aftermath, ..
        } => (first, aftermath),
        _ => panic!("{out:?}"),
    }
}

/// A failed exchange on this rank: its step and what this rank's process was left in.
pub(crate) fn exchange_failure(out: &Result<CheckpointReport, CheckpointError>) -> (Step, &str) {
    match failed(out) {
        CheckpointError::Exchange { step, local, .. } => (*step, local),
        _ => panic!("{out:?}"),
    }
}

/// The fake driver with faults the fake itself does not model: `cuCheckpointProcessGetState`
/// always failing (unless `state_readable`), one call on one pid that does its work and
/// then fails anyway (a call that failed late), a pause before the unlocks of one pid, and
/// one pid whose CUDA IPC imports the driver cannot see (as the real driver cannot see
/// another process's).
pub(crate) struct Faulty {
    pub(crate) fake: FakeDriver,
    pub(crate) state_readable: bool,
    pub(crate) late: Option<(Call, u32)>,
    pub(crate) slow_unlock: Option<(u32, Duration)>,
    pub(crate) imports_unseen: Option<u32>,
}

impl Faulty {
    /// The fake with its state unreadable and nothing else changed.
    pub(crate) fn new(fake: &FakeDriver) -> Self {
        Self {
            fake: fake.clone(),
            state_readable: false,
            late: None,
            slow_unlock: None,
            imports_unseen: None,
        }
    }

    pub(crate) fn late(fake: &FakeDriver, call: Call, pid: u32) -> Self {
        Self {
            late: Some((call, pid)),
            ..Self::new(fake)
        }
    }

    /// `done`, or a failure when `call` on `pid` is the late one.
    fn outcome(
        &self,
        call: Call,
        pid: u32,
        done: Result<(), tpcomm_checkpoint::DriverError>,
    ) -> Result<(), tpcomm_checkpoint::DriverError> {
        done?;
        if self.late == Some((call, pid)) {
            return Err(tpcomm_checkpoint::DriverError {
                entry_point: "late".into(),
                pid,
                code: 909,
                name: "CUDA_ERROR_TIMEOUT".into(),
            });
        }
        Ok(())
    }
}

impl CheckpointDriver for Faulty {
    fn support(&self) -> Result<tpcomm_checkpoint::DriverInfo, tpcomm_checkpoint::Unsupported> {
        self.fake.support()
    }
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), tpcomm_checkpoint::DriverError> {
        self.outcome(Call::Lock, pid, self.fake.lock(pid, timeout))
    }
    fn checkpoint(&self, pid: u32) -> Result<(), tpcomm_checkpoint::DriverError> {
        self.outcome(Call::Checkpoint, pid, self.fake.checkpoint(pid))
    }
    fn restore(&self, pid: u32) -> Result<(), tpcomm_checkpoint::DriverError> {
        self.outcome(Call::Restore, pid, self.fake.restore(pid))
    }
    fn unlock(&self, pid: u32) -> Result<(), tpcomm_checkpoint::DriverError> {
        if let Some((slow, pause)) = self.slow_unlock {
            if slow == pid {
                std::thread::sleep(pause);
            }
        }
        self.outcome(Call::Unlock, pid, self.fake.unlock(pid))
    }
    fn state(&self, pid: u32) -> Result<ProcessState, tpcomm_checkpoint::DriverError> {
        if self.state_readable {
            return self.fake.state(pid);
        }
        Err(tpcomm_checkpoint::DriverError {
            entry_point: "cuCheckpointProcessGetState".into(),
            pid,
            code: 999,
            name: "CUDA_ERROR_UNKNOWN".into(),
        })
    }
    fn imported_ipc_mappings(&self, pid: u32) -> Option<usize> {
        if self.imports_unseen == Some(pid) {
            return None;
        }
        self.fake.imported_ipc_mappings(pid)
    }
}

/// Runs one checkpoint on two ranks (each its own process) with `driver`.
pub(crate) fn run_two(driver: &(dyn CheckpointDriver + Sync)) -> Vec<Outcome> {
    run_probe(2, driver, |_| Probe::default())
}

/// A suspendable object of another kind than [`Probe`] (its transitions are barriers too).
#[derive(Debug, Default)]
pub(crate) struct Other(pub(crate) usize);

impl<C: Communicator + ?Sized> Suspendable<C> for Other {
    fn name(&self) -> String {
        "other".into()
    }
    fn suspend_support(&self) -> Result<(), String> {
        Ok(())
    }
    fn prepare_for_suspend(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.0, false, "prepare")
    }
    fn reinit_after_resume(&mut self, comm: &C) -> Result<(), BoxError> {
        probe_step(comm, &mut self.0, false, "reinit")
    }
}

/// Host memory whose peer handles a checkpoint cannot bring back, as legacy CUDA IPC
/// handles of another process cannot be opened again after a restore.
#[derive(Debug, Clone, Default)]
pub(crate) struct Unrestorable(HostMemory);

impl tpcomm_ipc::PeerMemory for Unrestorable {
    type Handle = tpcomm_ipc::HostHandle;
    type Buffer = tpcomm_ipc::HostBuffer;
    type Mapping = tpcomm_ipc::HostMapping;

    fn name(&self) -> &'static str {
        "host-unrestorable"
    }
    fn allocate(&self, bytes: usize) -> tpcomm_ipc::Result<Self::Buffer> {
        self.0.allocate(bytes)
    }
    fn allocate_private(&self, bytes: usize) -> tpcomm_ipc::Result<Self::Buffer> {
        self.0.allocate_private(bytes)
    }
    fn export(&self, addr: u64, len: usize) -> tpcomm_ipc::Result<Self::Handle> {
        self.0.export(addr, len)
    }
    fn open(&self, handle: &Self::Handle) -> tpcomm_ipc::Result<Self::Mapping> {
        self.0.open(handle)
    }
    fn close(&self, mapping: Self::Mapping) -> tpcomm_ipc::Result<()> {
        self.0.close(mapping)
    }
    fn write<R: tpcomm_ipc::MemoryRegion>(
        &self,
        region: &R,
        offset: usize,
        src: &[u8],
    ) -> tpcomm_ipc::Result<()> {
        self.0.write(region, offset, src)
    }
    fn read<R: tpcomm_ipc::MemoryRegion>(
        &self,
        region: &R,
        offset: usize,
        dst: &mut [u8],
    ) -> tpcomm_ipc::Result<()> {
        self.0.read(region, offset, dst)
    }
    fn checkpoint_blocker(&self, handle: &Self::Handle) -> Option<String> {
        Some(format!(
            "memory of process {} that cannot be opened again after a restore",
            handle.pid
        ))
    }
}
