//! The timed path ([`MpiCommunicator::with_timeout`]): each collective as its nonblocking
//! variant on owned copies of its buffers and tables, polled until it completes or its
//! deadline passes, when the copies are leaked and the communicator broken; requests are
//! completed without raising their errors on `MPI_COMM_WORLD`'s handler.

use std::ffi::c_int;
use std::ptr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::args::{
    AllGatherCall, AllReduceCall, AllToAllCall, BroadcastCall, GatherCall, VarcountCall,
};
use super::conv::{byte_type, check, mpi_error, MPI_SUCCESS};
use super::guarded::{GuardedBuf, Spare};
use super::roll_call::{grace, RollCall};
use super::MpiCommunicator;
use crate::communicator::Communicator;
use crate::copy::copy_slice;
use crate::error::{Op, Result, TransportError};
use crate::process::{Liveness, ProcessIdentity};
use crate::reduce::narrow_half;
use crate::spin::SpinBudget;

/// The timed path of a prepared call (see `args`): its nonblocking variant on owned copies
/// of the buffers and tables, polled until it completes or `timeout` passes.
pub(super) trait Timed {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()>;
}

/// Collectives bounded by a timeout (see [`MpiCommunicator::with_timeout`]).
///
/// MPI offers no blocking call with a deadline, and a blocked MPI call never returns when a
/// peer died (Open MPI 4.1's shared-memory transport does not notice a dead peer). So with a
/// timeout every collective is started as its nonblocking variant (`MPI_Ibarrier`,
/// `MPI_Iallgather`...) and polled with `MPI_Test` until it completes or the deadline
/// passes. MPI forbids cancelling or freeing a pending collective request, and keeps the
/// right to read the send buffer and write the receive buffer until it completes. So the
/// collective runs on buffers and count tables owned by an `InFlight` (copied in, the
/// receive buffer copied back on completion): at the deadline the `InFlight` is leaked,
/// never freed, and the caller's buffers are free to go. The communicator is then broken:
/// every later collective fails at once (its state is undefined for MPI, and the abandoned
/// request would match the next collective's messages).
///
/// The request is polled with `MPI_Request_get_status`, which invokes no error handler,
/// and completed by `complete_returning_errors`: in Open MPI 4.1 `MPI_Test` raised the
/// error of a failed collective (say `MPI_ERR_TRUNCATE`) on `MPI_COMM_WORLD`'s fatal
/// handler and the job aborted with exit code 15. A failed collective is
/// [`TransportError::Mpi`] with the raw code, and breaks the communicator the same way, as
/// does a collective that fails to start (its peers may have started theirs).
/// The receive copy is a `GuardedBuf`, so that a peer sending more than agreed cannot
/// make MPI write past it (see the module docs).
impl MpiCommunicator {
    /// Bounds every later collective of this communicator (and of its splits) by `timeout`:
    /// a collective that has not completed by then fails with
    /// [`TransportError::Unresponsive`], naming the peers whose process is gone, in the
    /// order they were found gone while waiting (peers on this host are checked through
    /// `/proc` every tenth of the timeout, at most every 100 ms), then the peers that did
    /// not answer a roll call: a rank still waiting a quarter of the timeout (at most 1 s)
    /// before its deadline calls every other peer on a duplicate of the communicator, and
    /// every rank waiting in a timed collective of it answers; a peer on another host that
    /// is lost (or stopped, or cut off) answers nothing and is named as silent; a rank that
    /// runs again only past its deadline (it was stopped, or its host frozen) calls the roll
    /// then and waits the same grace for answers before it names anyone. The first
    /// one named is the rank that died first, as seen from here. After such a
    /// failure every collective of this communicator, and `split`, fails with
    /// [`TransportError::Aborted`]. `split` (`MPI_Comm_split`, which has no nonblocking
    /// form) is preceded by a bounded barrier and a bounded all-gather of a split word, so
    /// that an absent peer, or one in another collective, fails it within the timeout too.
    /// A broken communicator is not freed when dropped (its abandoned collective may still
    /// progress when a late peer arrives): the handle is leaked with that collective's
    /// buffers.
    ///
    /// Collective: every rank calls it (it all-gathers each rank's process identity, under
    /// the timeout already, and duplicates the communicator for the roll call). The cost is
    /// copying each collective's send bytes into an owned buffer, and its receive buffer
    /// (where the collective does not write all of it, or a broadcast's root sends from it)
    /// into an owned receive copy and the result out of it, and polling instead of blocking
    /// (a spin of up to 20 us where this host has a CPU for each of the communicator's ranks
    /// on it and spinning paid lately, then yields between polls up to 10 ms into the wait,
    /// then sleeps of up to 100 us).
    /// The owned buffers are kept between collectives (each up to 16 MiB): the receive copy
    /// is a mapping that ends at a guard page, made again only when a call needs more room.
    /// Without a timeout the blocking MPI calls run on the caller's buffers.
    ///
    /// Errors of the collectives are returned as [`TransportError::Mpi`] (never raised on
    /// `MPI_COMM_WORLD`'s handler), and a peer that sends more bytes than this rank's
    /// receive count gives `MPI_ERR_TRUNCATE` without writing past the receive copy; either,
    /// and a collective that fails to start, breaks the communicator like a timeout (later collectives fail with
    /// [`TransportError::Aborted`]).
    ///
    /// A timeout only helps when the job outlives a dead rank: Open MPI aborts the whole job
    /// when a rank dies unless `mpirun` runs with `--enable-recovery`.
    pub fn with_timeout(mut self, timeout: Duration) -> Result<Self> {
        self.arm_timeout(timeout)?;
        Ok(self)
    }

    /// The bound set by [`with_timeout`](Self::with_timeout), if any.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Sets the timeout and gathers every rank's process identity (collective).
    pub(super) fn arm_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.timeout = Some(timeout);
        let mine = ProcessIdentity::current().encode();
        let mut all = vec![0u8; self.size * ProcessIdentity::LEN];
        self.all_gather(&mine, &mut all)?;
        self.peers = all
            .chunks_exact(ProcessIdentity::LEN)
            .map(ProcessIdentity::decode)
            .collect();
        // Spin only while every rank of this communicator on this host can have a CPU.
        let on_host = self.peers.get(self.rank).map_or(self.size, |me| {
            self.peers.iter().filter(|p| p.same_host(me)).count()
        });
        self.spin = SpinBudget::for_ranks(SPIN, 1, on_host);
        if self.roll.is_none() {
            let _guard = self.lock(Op::Setup)?;
            self.roll = Some(Mutex::new(RollCall::new(self.comm, self.rank, self.size)?));
        }
        Ok(())
    }

    /// Runs `f` on the roll call, if this communicator has one.
    fn with_roll<T>(&self, f: impl FnOnce(&mut RollCall) -> T) -> Option<T> {
        let roll = self.roll.as_ref()?;
        let mut roll = roll.lock().unwrap_or_else(PoisonError::into_inner);
        Some(f(&mut roll))
    }

    /// `Some(timeout)` when collectives are bounded; an error when an earlier one was
    /// abandoned.
    pub(super) fn timed(&self, op: Op) -> Result<Option<Duration>> {
        if let Some(reason) = self.broken.get() {
            let (first_gone, reason) = reason;
            return Err(TransportError::Aborted {
                op,
                rank: self.rank,
                by: first_gone.unwrap_or(self.rank),
                reason: reason.clone(),
            });
        }
        Ok(self.timeout)
    }

    /// Starts a nonblocking collective with `start` (which returns the MPI code) and polls
    /// it until it completes, or until `timeout`, when the job is leaked and the
    /// communicator broken. Returns the completed job (its receive buffer filled).
    fn run_timed(
        &self,
        op: Op,
        call: &'static str,
        timeout: Duration,
        mut job: InFlight,
        start: impl FnOnce(&mut InFlight, ffi::MPI_Comm) -> c_int,
    ) -> Result<InFlight> {
        let begun = Instant::now();
        {
            let _guard = self.lock(op)?;
            self.with_roll(RollCall::begin);
            let code = start(&mut job, self.comm);
            if let Err(e) = check(op, call, code) {
                // Peers may have started this collective: a later one of this rank would
                // match their messages. Whether MPI kept a reference to the buffers is
                // unknown after an error: never free them.
                std::mem::forget(job);
                let _ = self
                    .broken
                    .set((None, format!("an earlier {call} failed to start")));
                return Err(e);
            }
        }
        let mut polls: u32 = 0;
        // The first part of the wait spins (see `back_off`), as long as the budget says.
        let spin = self.spin.get();
        // When the roll call is next serviced (at the first poll that finds the collective
        // incomplete, then every `SERVICE_EVERY`).
        let mut next_service = begun;
        // Peers found gone so far, in the order they were found: checked every tenth of the
        // timeout (at most every 100 ms) while waiting, so that a rank that died first is
        // named first even when other ranks exit after their own timeouts later.
        let mut gone: Vec<usize> = Vec::new();
        let check_every = (timeout / 10).min(Duration::from_millis(100));
        let mut next_check = begun + check_every;
        // When this rank calls the roll (if it still waits then).
        let roll_at = timeout.saturating_sub(grace(timeout));
        // When it called: its answers are awaited a grace long before anyone is named
        // silent, also when this process ran again only past its deadline (stopped, or not
        // scheduled): then the deadline moves to the call plus the grace.
        let mut rolled: Option<Instant> = None;
        let has_roll = self.roll.is_some();
        loop {
            let mut done: c_int = 0;
            let guard = match self.lock(op) {
                Ok(guard) => guard,
                Err(e) => {
                    // MPI is finalizing with this request in flight: its buffers can never
                    // be known free.
                    std::mem::forget(job);
                    let _ = self
                        .broken
                        .set((None, format!("MPI was finalized during an earlier {call}")));
                    return Err(e);
                }
            };
            // SAFETY: `job.request` is the active request `start` created on the live
            // `self.comm` (get_status neither frees nor changes it); `done` is a valid place
            // for one int; the status is ignored (`MPI_STATUS_IGNORE`, a constant read from
            // rsmpi's C shim). The buffers and tables the request uses are owned by `job`,
            // alive until it completes.
            let code = unsafe {
                ffi::MPI_Request_get_status(job.request, &mut done, ffi::RSMPI_STATUS_IGNORE)
            };
            let code = if code != MPI_SUCCESS {
                Some((code, "MPI_Request_get_status"))
            } else if done != 0 {
                // Under the same lock as the status read: MPI has not begun finalizing.
                match complete_returning_errors(&mut job.request) {
                    Ok(()) => {
                        self.learn_spin(spin, begun.elapsed());
                        return Ok(job);
                    }
                    Err(failed) => Some(failed),
                }
            } else {
                None
            };
            // The error is looked up (MPI calls too) before the lock goes.
            let failure = code.map(|(code, failed_call)| mpi_error(op, failed_call, code));
            // Calls of late peers are answered, answers to this rank's call taken in.
            let now = Instant::now();
            if now >= next_service {
                next_service = now + SERVICE_EVERY;
                self.with_roll(RollCall::service);
            }
            let waited = now - begun;
            if rolled.is_none() && waited >= roll_at && failure.is_none() {
                rolled = Some(Instant::now());
                let peers: Vec<usize> = (0..self.size)
                    .filter(|r| *r != self.rank && !gone.contains(r))
                    .collect();
                self.with_roll(|roll| roll.call(&peers));
            }
            drop(guard);
            if let Some(failure) = failure {
                // Whether MPI still uses the buffers is unknown: never free them.
                std::mem::forget(job);
                let _ = self
                    .broken
                    .set((None, format!("an earlier {call} failed to complete")));
                return Err(failure);
            }
            let waited = begun.elapsed();
            if Instant::now() >= next_check || waited >= timeout {
                next_check = Instant::now() + check_every;
                for rank in self.peer_report().0 {
                    if !gone.contains(&rank) {
                        gone.push(rank);
                    }
                }
            }
            let answered_in_time =
                !has_roll || rolled.is_some_and(|at| at.elapsed() >= grace(timeout));
            if waited >= timeout && answered_in_time {
                // MPI may still read and write these buffers: leak them.
                std::mem::forget(job);
                let others: Vec<usize> = (0..self.size)
                    .filter(|r| *r != self.rank && !gone.contains(r))
                    .collect();
                // Without a roll call (while it is being set up) nobody can be named silent:
                // the peers this rank cannot check through `/proc` are unchecked.
                let (silent, unchecked) = match self.with_roll(|roll| roll.silent(&others)) {
                    Some(silent) => (silent, Vec::new()),
                    None => (Vec::new(), self.peer_report().1),
                };
                let _ = self.broken.set((
                    gone.first().or(silent.first()).copied(),
                    format!(
                        "an earlier {op} timed out after {waited:?} (peers gone: {gone:?}, \
                         silent: {silent:?}); the communicator's state is undefined"
                    ),
                ));
                tracing::warn!(rank = self.rank, %op, ?waited, ?gone, ?silent, ?unchecked, "collective timed out");
                return Err(TransportError::Unresponsive {
                    op,
                    rank: self.rank,
                    waited,
                    gone: gone.into(),
                    silent: silent.into(),
                    unchecked: unchecked.into(),
                });
            }
            back_off(polls, waited, spin);
            if waited >= BUSY {
                polls = polls.saturating_add(1);
            }
        }
    }

    /// Tells the spin budget how a wait of `waited` with a budget of `spin` ended: within
    /// the spin, or after it (then the budget shrinks).
    fn learn_spin(&self, spin: Duration, waited: Duration) {
        if spin.is_zero() {
            return;
        }
        if waited < spin {
            self.spin.learn(true, false);
        } else {
            self.spin.shrink();
        }
    }

    /// Which peers' processes are gone, and which could not be checked.
    fn peer_report(&self) -> (Vec<usize>, Vec<usize>) {
        let (mut gone, mut unchecked) = (Vec::new(), Vec::new());
        let me = self.peers.get(self.rank);
        for rank in (0..self.size).filter(|&r| r != self.rank) {
            let liveness = match (me, self.peers.get(rank)) {
                (Some(me), Some(peer)) if me.same_host(peer) => peer.liveness(),
                _ => Liveness::Unknown,
            };
            match liveness {
                Liveness::Gone => gone.push(rank),
                Liveness::Unknown => unchecked.push(rank),
                Liveness::Alive => {}
            }
        }
        (gone, unchecked)
    }

    pub(super) fn timed_barrier(&self, timeout: Duration) -> Result<()> {
        self.timed_barrier_for(Op::Barrier, timeout)
    }

    /// A bounded `MPI_Ibarrier`, its errors reported as those of `op`.
    pub(super) fn timed_barrier_for(&self, op: Op, timeout: Duration) -> Result<()> {
        let job = InFlight::new(self, op, &[], RecvInit::Written(0), Vec::new())?;
        self.run_timed(op, "MPI_Ibarrier", timeout, job, |job, comm| {
            // SAFETY: `comm` is live; `job.request` is a valid place for the request.
            unsafe { ffi::MPI_Ibarrier(comm, &mut job.request) }
        })?
        .done(&self.spare);
        Ok(())
    }
}

impl Timed for AllGatherCall<'_> {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()> {
        let op = Op::AllGather;
        let AllGatherCall { send, recv, count } = self;
        let job = InFlight::new(mpi, op, send, RecvInit::Written(recv.len()), Vec::new())?;
        let job = mpi.run_timed(op, "MPI_Iallgather", timeout, job, |job, comm| {
            let byte = byte_type();
            // SAFETY: `job.send` holds `count` bytes (at least one: never MPI_IN_PLACE's
            // address), `job.recv` holds `size * count` bytes (the checked receive length)
            // and is a distinct allocation; both live in `job` until the request completes
            // or forever (leaked at the deadline). `comm` is live.
            unsafe {
                ffi::MPI_Iallgather(
                    job.send.as_ptr().cast(),
                    count,
                    byte,
                    job.recv.as_mut_ptr().cast(),
                    count,
                    byte,
                    comm,
                    &mut job.request,
                )
            }
        })?;
        job.copy_out(recv);
        job.done(&mpi.spare);
        Ok(())
    }
}

impl Timed for VarcountCall<'_> {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()> {
        let op = Op::AllGatherVarcount;
        let tables = self.tables();
        let VarcountCall {
            send,
            recv,
            send_count,
            ..
        } = self;
        let size = mpi.size;
        let job = InFlight::new(mpi, op, send, RecvInit::CopyOf(recv), tables)?;
        let job = mpi.run_timed(op, "MPI_Iallgatherv", timeout, job, |job, comm| {
            let byte = byte_type();
            let (counts, displs) = job.ints.split_at(size);
            // SAFETY: `VarcountArgs` checked one count and displacement per rank, each region
            // inside a receive buffer of `job.recv`'s length, and the send length equal to
            // this rank's count; `counts` and `displs` hold `size` ints each. Buffers and
            // tables are owned by `job` (at least one byte each, distinct allocations) and
            // live until the request completes or forever. `comm` is live.
            unsafe {
                ffi::MPI_Iallgatherv(
                    job.send.as_ptr().cast(),
                    send_count,
                    byte,
                    job.recv.as_mut_ptr().cast(),
                    counts.as_ptr(),
                    displs.as_ptr(),
                    byte,
                    comm,
                    &mut job.request,
                )
            }
        })?;
        job.copy_out(recv);
        job.done(&mpi.spare);
        Ok(())
    }
}

impl Timed for GatherCall<'_> {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()> {
        let op = Op::GatherVarcount;
        let GatherCall {
            send,
            send_count,
            root,
            recv: layout,
        } = self;
        let (recv_init, tables) = match &layout {
            Some(layout) => (&*layout.buf, layout.tables()),
            None => (&[][..], Vec::new()),
        };
        let at_root = layout.is_some();
        let size = mpi.size;
        let job = InFlight::new(mpi, op, send, RecvInit::CopyOf(recv_init), tables)?;
        let job = mpi.run_timed(op, "MPI_Igatherv", timeout, job, |job, comm| {
            let byte = byte_type();
            let (recv, counts, displs) = if at_root {
                let (counts, displs) = job.ints.split_at(size);
                (
                    job.recv.as_mut_ptr().cast(),
                    counts.as_ptr(),
                    displs.as_ptr(),
                )
            } else {
                (ptr::null_mut(), ptr::null(), ptr::null())
            };
            // SAFETY: `job.send` holds `send_count` bytes. At the root, `GatherArgs` checked
            // one in-bounds, non-overlapping region per rank within a receive buffer of
            // `job.recv`'s length, and the tables hold `size` ints each; elsewhere the
            // receive arguments are null, which MPI ignores. Everything is owned by `job`
            // until the request completes or forever. `root` is in range; `comm` is live.
            unsafe {
                ffi::MPI_Igatherv(
                    job.send.as_ptr().cast(),
                    send_count,
                    byte,
                    recv,
                    counts,
                    displs,
                    byte,
                    root,
                    comm,
                    &mut job.request,
                )
            }
        })?;
        if let Some(layout) = layout {
            job.copy_out(layout.buf);
        }
        job.done(&mpi.spare);
        Ok(())
    }
}

impl Timed for BroadcastCall<'_> {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()> {
        let op = Op::Broadcast;
        let BroadcastCall { buf, root, count } = self;
        // The root sends from its copy; elsewhere MPI writes every byte.
        let at_root = usize::try_from(root) == Ok(mpi.rank);
        let init = if at_root {
            RecvInit::CopyOf(buf)
        } else {
            RecvInit::Written(buf.len())
        };
        let job = InFlight::new(mpi, op, &[], init, Vec::new())?;
        let job = mpi.run_timed(op, "MPI_Ibcast", timeout, job, |job, comm| {
            // SAFETY: `job.recv` holds `count` bytes (at the root a copy of the caller's
            // buffer, which MPI reads; elsewhere MPI writes them), owned by `job` until the
            // request completes or forever (leaked at the deadline); `root` is in
            // range; `comm` is live.
            unsafe {
                ffi::MPI_Ibcast(
                    job.recv.as_mut_ptr().cast(),
                    count,
                    byte_type(),
                    root,
                    comm,
                    &mut job.request,
                )
            }
        })?;
        if !at_root {
            job.copy_out(buf);
        }
        job.done(&mpi.spare);
        Ok(())
    }
}

impl Timed for AllReduceCall<'_> {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()> {
        let op = Op::AllReduce;
        let (count, dtype, mpi_op, datatype) = (self.count, self.dtype, self.op, self.datatype());
        let send = match &self.wide {
            Some(wide) => bytemuck::cast_slice::<f32, u8>(wide),
            None => self.input(),
        };
        let len = send.len();
        let job = InFlight::new(mpi, op, send, RecvInit::Written(len), Vec::new())?;
        let job = mpi.run_timed(op, "MPI_Iallreduce", timeout, job, |job, comm| {
            // SAFETY: `job.send` and `job.recv` each hold `count` elements of `datatype`
            // (the input's bytes, widened to f32 for the half types; at least one byte, so
            // never MPI_IN_PLACE's address), distinct allocations owned by `job` until the
            // request completes or forever (leaked at the deadline). `comm` is live.
            unsafe {
                ffi::MPI_Iallreduce(
                    job.send.as_ptr().cast(),
                    job.recv.as_mut_ptr().cast(),
                    count,
                    datatype,
                    mpi_op,
                    comm,
                    &mut job.request,
                )
            }
        })?;
        if self.wide.is_some() {
            narrow_half(dtype, &job.recv.as_slice()[..len], self.recv);
        } else {
            job.copy_out(self.recv);
        }
        job.done(&mpi.spare);
        Ok(())
    }
}

impl Timed for AllToAllCall<'_> {
    fn timed(self, mpi: &MpiCommunicator, timeout: Duration) -> Result<()> {
        let op = Op::AllToAllVarcount;
        let tables = self.tables();
        let AllToAllCall { send, recv, .. } = self;
        let size = mpi.size;
        let job = InFlight::new(mpi, op, send, RecvInit::CopyOf(recv), tables)?;
        let job = mpi.run_timed(op, "MPI_Ialltoallv", timeout, job, |job, comm| {
            let byte = byte_type();
            let t = &job.ints;
            let (sc, sd, rc, rd) = (
                &t[..size],
                &t[size..2 * size],
                &t[2 * size..3 * size],
                &t[3 * size..],
            );
            // SAFETY: `AllToAllArgs` checked both layouts: `size` entries each, regions
            // inside send and receive buffers of `job.send`'s and `job.recv`'s lengths,
            // receive regions not overlapping; the four tables hold `size` ints. Buffers
            // and tables are owned by `job` (distinct allocations, at least one byte) until
            // the request completes or forever. `comm` is live.
            unsafe {
                ffi::MPI_Ialltoallv(
                    job.send.as_ptr().cast(),
                    sc.as_ptr(),
                    sd.as_ptr(),
                    byte,
                    job.recv.as_mut_ptr().cast(),
                    rc.as_ptr(),
                    rd.as_ptr(),
                    byte,
                    comm,
                    &mut job.request,
                )
            }
        })?;
        job.copy_out(recv);
        job.done(&mpi.spare);
        Ok(())
    }
}

/// How long a collective's wait polls without sleeping. MPI moves a nonblocking
/// collective's bytes only while the rank is inside an MPI call (Open MPI has no progress
/// thread for its shared-memory and TCP transports), so a sleep between polls stalls the
/// transfer: a blocking MPI call polls for its whole wait, the timed path for this long.
const BUSY: Duration = Duration::from_millis(10);

/// The most a wait spins (polls without giving up the core) before it yields between polls:
/// long enough for a small message between hosts over TCP (a few microseconds).
const SPIN: Duration = Duration::from_micros(20);

/// How often a waiting rank services the roll call (answers calls, takes in answers): far
/// more often than the grace a caller waits for answers (at least milliseconds), far less
/// often than it polls.
const SERVICE_EVERY: Duration = Duration::from_micros(50);

/// Waits between two polls of a collective that has waited `waited`: nothing but a spin hint
/// while it waits less than `spin` (the wait's budget: [`SPIN`] when this rank's core is its
/// own, nothing when spinning did not pay lately or the ranks outnumber the CPUs), a yield
/// while it waits less than [`BUSY`] (the core goes to a rank or thread that shares it, and
/// comes back at once when none does), then sleeps from 10 us up to 100 us, so that a rank
/// that waits long (for a late or lost peer) leaves the core to others.
fn back_off(polls: u32, waited: Duration, spin: Duration) {
    if waited < spin {
        std::hint::spin_loop();
    } else if waited < BUSY {
        std::thread::yield_now();
    } else {
        let shift = polls.min(3);
        std::thread::sleep(Duration::from_micros((10u64 << shift).min(100)));
    }
}

/// What a nonblocking collective works on, owned so that it can outlive the call: the
/// request, copies of the send and receive bytes, and the count/displacement tables.
/// Buffers hold at least one byte, so their address is never `MPI_IN_PLACE`'s (`0x1`).
/// The receive copy is a [`GuardedBuf`]. Both buffers come from the communicator's
/// [`Spare`] and go back to it once the request completed ([`InFlight::done`]); an
/// `InFlight` abandoned at a deadline, or whose request failed, is leaked (`mem::forget`):
/// MPI may still use it.
struct InFlight {
    request: ffi::MPI_Request,
    send: Vec<u8>,
    recv: GuardedBuf,
    ints: Vec<c_int>,
}

/// What a collective's receive copy holds when it starts.
enum RecvInit<'a> {
    /// A copy of the caller's receive buffer: bytes outside every region the collective
    /// writes (gaps of a varcount layout) must come back unchanged, and a broadcast's root
    /// sends from it.
    CopyOf(&'a [u8]),
    /// This many bytes, every one of which the collective writes (a peer that sends fewer
    /// bytes than agreed leaves the rest as an earlier call left them, as the blocking path
    /// leaves the caller's bytes there: no byte of another process's memory).
    Written(usize),
}

impl InFlight {
    fn new(
        mpi: &MpiCommunicator,
        op: Op,
        send: &[u8],
        recv: RecvInit<'_>,
        ints: Vec<c_int>,
    ) -> Result<Self> {
        let recv = match recv {
            RecvInit::CopyOf(init) => mpi.spare.recv_copy_of(op, init)?,
            RecvInit::Written(len) => mpi.spare.recv(op, len)?,
        };
        Ok(Self {
            // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
            request: unsafe { ffi::RSMPI_REQUEST_NULL },
            send: mpi.spare.send_copy(send),
            recv,
            ints,
        })
    }

    /// Copies the received bytes into the caller's buffer (of the length `new` was given).
    fn copy_out(&self, out: &mut [u8]) {
        let n = out.len();
        copy_slice(out, &self.recv.as_slice()[..n]);
    }

    /// Gives the buffers of a completed request (MPI is done with them) back to `spare`.
    fn done(self, spare: &Spare) {
        spare.keep(self.send, self.recv);
    }
}

/// Serializes the swaps of `MPI_COMM_WORLD`'s error handler in
/// [`complete_returning_errors`], so that concurrent swaps cannot leave the wrong one
/// installed.
static WORLD_HANDLER_SWAP: Mutex<()> = Mutex::new(());

/// Completes and frees a request that `MPI_Request_get_status` found complete, returning
/// its error code instead of raising it; `Err((code, call))` names the call that failed.
///
/// Open MPI 4.1 raises the error of a failed nonblocking collective (for example
/// `MPI_ERR_TRUNCATE`) in `MPI_Test`/`MPI_Wait` on `MPI_COMM_WORLD`'s error handler, not
/// on the handler of the request's communicator (whose `MPI_ERRORS_RETURN` is then
/// ignored): with the default `MPI_ERRORS_ARE_FATAL` the job aborted (exit code 15). And
/// `MPI_Request_get_status`, which invokes no handler, does not say whether the request
/// failed. So the request is completed by one `MPI_Wait` (which returns at once: the
/// request is complete) while `MPI_COMM_WORLD` has `MPI_ERRORS_RETURN`; its previous
/// handler is put back right after. (MPICH raises it on the request's communicator, whose
/// handler returns.) An error that *another thread* raises on `MPI_COMM_WORLD` during that
/// one call is returned to it instead of handled by the application's handler.
fn complete_returning_errors(
    request: &mut ffi::MPI_Request,
) -> std::result::Result<(), (c_int, &'static str)> {
    let _swap = WORLD_HANDLER_SWAP
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    // SAFETY: reading immutable handle constants exported by rsmpi's C shim.
    let (world, errors_return) = unsafe { (ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN) };
    let mut previous = std::mem::MaybeUninit::<ffi::MPI_Errhandler>::uninit();
    // SAFETY: MPI is initialized (a request exists); `previous` is a valid place for a
    // handle.
    let rc = unsafe { ffi::MPI_Comm_get_errhandler(world, previous.as_mut_ptr()) };
    if rc != MPI_SUCCESS {
        return Err((rc, "MPI_Comm_get_errhandler"));
    }
    // SAFETY: MPI_Comm_get_errhandler succeeded, so it wrote the handle.
    let mut previous = unsafe { previous.assume_init() };
    // SAFETY: `world` is live while MPI is; `errors_return` is a predefined handler.
    let rc = unsafe { ffi::MPI_Comm_set_errhandler(world, errors_return) };
    if rc != MPI_SUCCESS {
        // SAFETY: `previous` is the reference `MPI_Comm_get_errhandler` returned.
        let freed = unsafe { ffi::MPI_Errhandler_free(&mut previous) };
        if freed != MPI_SUCCESS {
            tracing::warn!(code = freed, "MPI_Errhandler_free failed");
        }
        return Err((rc, "MPI_Comm_set_errhandler"));
    }
    // SAFETY: `*request` is a complete, not yet freed request (get_status said so); MPI_Wait
    // frees it and sets it to MPI_REQUEST_NULL; the status is ignored.
    let code = unsafe { ffi::MPI_Wait(request, ffi::RSMPI_STATUS_IGNORE) };
    // SAFETY: `previous` is the handler `world` had, referenced by `previous`.
    let restored = unsafe { ffi::MPI_Comm_set_errhandler(world, previous) };
    // SAFETY: `previous` is the reference `MPI_Comm_get_errhandler` returned; `world` keeps
    // its own reference.
    let freed = unsafe { ffi::MPI_Errhandler_free(&mut previous) };
    if code != MPI_SUCCESS {
        return Err((code, "MPI_Wait"));
    }
    if restored != MPI_SUCCESS {
        return Err((restored, "MPI_Comm_set_errhandler"));
    }
    if freed != MPI_SUCCESS {
        return Err((freed, "MPI_Errhandler_free"));
    }
    Ok(())
}
