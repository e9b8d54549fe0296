//! The MPI backend (feature `mpi`): a [`Communicator`] over an MPI communicator.
//!
//! [`MpiCommunicator`] owns a *duplicate* of an MPI communicator (`MPI_COMM_WORLD` or any
//! communicator made with rsmpi, such as a split), so its traffic can never match messages
//! of the application's own calls on the original, and it frees that duplicate on drop.
//!
//! rsmpi (the `mpi` crate) is used for two things only: initialization (its `Universe`)
//! and its generated `ffi` bindings. Every operation calls the C functions directly,
//! because rsmpi's safe layer has traps that this crate's invariants forbid:
//!
//! - **Return codes are ignored.** rsmpi discards what MPI functions return and leaves
//!   communicators on the default `MPI_ERRORS_ARE_FATAL` handler, so a failure aborts the
//!   whole job. Here the duplicate is switched to `MPI_ERRORS_RETURN`, every return code is
//!   checked, and a failure becomes [`TransportError::Mpi`] with the call's name, the raw
//!   code, its class (`MPI_Error_class`) and its text (`MPI_Error_string`). If
//!   `MPI_Error_class` itself fails, the class is reported as `-1`.
//! - **Counts panic.** rsmpi converts slice lengths to MPI's 32-bit counts with
//!   `expect`, panicking on buffers over 2 GiB. Here [`Communicator::max_count`] is
//!   `i32::MAX` (the shared argument checks reject anything larger with a typed error),
//!   and every count, displacement and root is still converted with `try_from`, a failure
//!   being an [`InvalidArgument`](TransportError::InvalidArgument) error, never a panic or a
//!   truncating `as`.
//! - **Empty slices alias `MPI_IN_PLACE`.** An empty Rust slice of bytes points at the
//!   dangling address `0x1`, which is exactly Open MPI's `MPI_IN_PLACE`, and rsmpi passes
//!   `as_ptr()` through. An empty *receive* buffer then makes Open MPI fail with
//!   `MPI_ERR_ARG` (fatal under rsmpi: `all_gather_into` of two empty slices aborts the
//!   job); an empty *send* buffer silently turns the call into its in-place variant (an
//!   all-to-all-v then sends from the receive buffer with the receive counts). Here a
//!   zero-length buffer is replaced by the address of a local one-byte scratch array
//!   (distinct for send and receive, so the two never alias); MPI reads or writes nothing
//!   there.
//! - **Dropping panics.** rsmpi's communicator `Drop` asserts on `MPI_Comm_free`'s result.
//!   Here `Drop` checks the code and logs a failure with `tracing::warn`, and skips the free
//!   (with a warning) when MPI was already finalized, where freeing would be erroneous
//!   (see **Lifetime** below).
//!
//! Bytes travel as `MPI_UINT8_T` (rsmpi exposes no `MPI_BYTE` handle; both are one byte
//! and untranslated between homogeneous hosts). Ranks of a gather other than the root pass
//! null receive arguments, which MPI ignores there. On a communicator of one rank,
//! `all_gather_varcount` copies locally without calling MPI: MPICH 4.0 ignores the
//! displacement in that case (fixed later by pmodels/mpich#6374).
//!
//! # What MPI still requires of the caller
//!
//! - **Matching arguments on every rank.** The shared checks only see this rank's
//!   arguments. MPI requires the ranks' counts to match (the same broadcast length, the same
//!   block length, `recv.counts[j]` here equal to `send.counts[me]` on rank `j`...) and
//!   reports a message longer than its receive count as `MPI_ERR_TRUNCATE`. But Open MPI
//!   4.1's shared-memory transport (`btl/vader`), with its default single-copy mechanism
//!   (CMA), moves a message above its eager limit (4 KiB) with one copy of the *sender's*
//!   length before it reports the truncation: a peer that sends more than was agreed
//!   overwrites the receiver's memory past its buffer (a broadcast of 5000 bytes into
//!   10-byte buffers, a gather of 8 MiB into 16 bytes: SIGSEGV, corrupted heap; MPICH 4.0
//!   reported the broadcast as a truncation). What protects a rank from such a peer:
//!   - on the timed path ([`MpiCommunicator::with_timeout`]) every receive lands in an owned
//!     buffer that ends at a `PROT_NONE` guard page: the kernel copy stops there with
//!     `EFAULT`, Open MPI falls back to a bounded copy and the call returns
//!     `MPI_ERR_TRUNCATE` (with XPMEM, a user-space copy, the guard page would turn the
//!     overwrite into a SIGSEGV instead);
//!   - on the blocking path collectives receive into the caller's buffers, which this module
//!     cannot guard; [`MpiCommunicator::disable_single_copy_before_init`], called on every
//!     rank before `MPI_Init`, makes Open MPI copy every message bounded by the receive
//!     count.
//!
//!   Upper layers that exchange lengths first (as tpcomm-objects does) agree on the counts
//!   by construction; the two measures above are about peers that do not keep to them.
//! - **An error is not an abort.** After a failed collective MPI leaves the communicator's
//!   state undefined, and the other ranks are not told: with 4 ranks, a truncation error on
//!   two ranks of a broadcast left a third blocked in it. Treat [`TransportError::Mpi`] as
//!   fatal for the communicator (and usually the job).
//! - **Threads.** MPI handles are plain values, but MPI only allows concurrent calls from
//!   several threads when it provides `MPI_THREAD_MULTIPLE`. When it provides less
//!   (`MPI_Init` usually gives `MPI_THREAD_SINGLE`), every MPI call made by this module
//!   holds one process-wide lock, so calls through these communicators from several threads
//!   are serialized, as `MPI_THREAD_SERIALIZED` requires (`SINGLE` and `FUNNELED` formally
//!   also require a single calling thread; Open MPI 4.1 and MPICH 4.0 accepted serialized
//!   calls from another thread in tests, but initialize with at least
//!   `Threading::Serialized` to be conforming).
//!   Blocking collectives on *different* communicators from several threads of one rank
//!   can then deadlock (a thread blocked in one collective holds the lock while a peer
//!   waits for this rank in the other), exactly as under `MPI_THREAD_SERIALIZED`; that
//!   needs `MPI_THREAD_MULTIPLE`. Even then, two threads must not run collectives on the
//!   *same* communicator at once: every rank must issue a communicator's collectives in
//!   the same order. MPI calls made outside this module (through rsmpi directly) are not
//!   covered by the lock.
//! - **Lifetime.** Drop every `MpiCommunicator` before the rsmpi `Universe` (which
//!   finalizes MPI); `MPI_Comm_free` is collective in the standard (local in Open MPI and
//!   MPICH). A communicator kept longer cannot crash the process: the first one created
//!   attaches an attribute to `MPI_COMM_SELF` whose delete callback (run first thing in
//!   `MPI_Finalize`) marks MPI as finalizing, and from then on every collective and
//!   `split` returns [`TransportError::Setup`] without calling MPI (Open MPI aborts the
//!   process on a call after `MPI_Finalize`), and `Drop` skips the free. A collective in
//!   flight on another thread when `MPI_Finalize` starts is still the program's error, as
//!   MPI says; with MPI serialized here the callback waits for it. Creating one
//!   ([`MpiCommunicator::world`], [`MpiCommunicator::duplicate`], [`Communicator::split`])
//!   is collective over the parent.
//! - **Construction errors** of `MPI_Comm_dup` go to the *parent* communicator's error
//!   handler (by default `MPI_ERRORS_ARE_FATAL`); this module does not change the caller's
//!   communicator, except for one call on the timed path: Open MPI 4.1 raises the error of
//!   a failed nonblocking collective on `MPI_COMM_WORLD`'s handler (not on the handler of
//!   the request's communicator), so a finished request is completed by one `MPI_Wait`
//!   while `MPI_COMM_WORLD` has `MPI_ERRORS_RETURN`, its previous handler restored right
//!   after. Errors of `split` go to this module's duplicate and are returned.
//!
//! # Where things are
//!
//! This file holds [`MpiCommunicator`], its lifecycle (duplicate, free on drop) and the
//! [`Communicator`] impl that routes each collective. `args` converts a collective's
//! arguments to MPI's once, for either path: `blocking` (the MPI calls on the caller's
//! buffers) or `timed` (nonblocking calls on owned copies polled to a deadline, the receive
//! copies from `guarded`). `split`, `single_copy`, `process_state` (the process-wide lock
//! and finalize marker) and `conv` (return codes, predefined handles) hold the rest.

mod args;
mod blocking;
mod conv;
mod guarded;
mod process_state;
mod roll_call;
mod single_copy;
mod split;
mod timed;

use std::ffi::c_int;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use mpi::ffi;

use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, Group, VarcountArgs,
};
use crate::communicator::Communicator;
use crate::error::{ArgumentError, Op, Result, TransportError};
use crate::process::ProcessIdentity;

use args::IntTable;
use blocking::Blocking;
use conv::{check, comm_null};
use process_state::{
    ensure_live, ensure_not_finalizing, finalized, lock_mpi, thread_multiple, watch_finalize,
    FINALIZING,
};
use timed::Timed;

/// MPI-3 counts and displacements are `int`.
const MAX_COUNT: usize = c_int::MAX as usize;

/// An MPI communicator (a duplicate this value owns) running tpcomm's collectives.
///
/// Create it with [`world`](Self::world) or [`duplicate`](Self::duplicate), make
/// sub-groups with [`Communicator::split`]. Errors are returned, never fatal: the owned
/// communicator uses `MPI_ERRORS_RETURN`. See the [module docs](self) for what this
/// backend does differently from rsmpi's safe layer.
///
/// ```no_run
/// use tpcomm_transport::{Communicator, MpiCommunicator};
///
/// let universe = mpi::initialize().expect("MPI initializes once");
/// let comm = MpiCommunicator::world(&universe)?;
/// let mut all = vec![0u8; comm.size()];
/// comm.all_gather(&[comm.rank() as u8], &mut all)?;
/// drop(comm); // before the universe, which finalizes MPI
/// # Ok::<(), tpcomm_transport::TransportError>(())
/// ```
pub struct MpiCommunicator {
    /// The owned duplicate, with `MPI_ERRORS_RETURN`; freed on drop.
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    /// Whether MPI calls must hold [`MPI_CALLS`] (MPI provides less than
    /// `MPI_THREAD_MULTIPLE`).
    serialize: bool,
    /// The bound on every collective's wait, set by [`MpiCommunicator::with_timeout`]; `None`
    /// runs the blocking MPI calls.
    timeout: Option<Duration>,
    /// Every rank's process identity (index = rank), gathered by `with_timeout`; empty
    /// without a timeout.
    peers: Vec<ProcessIdentity>,
    /// The roll call of the timed path (module `roll_call`), made by `with_timeout`.
    roll: Option<Mutex<roll_call::RollCall>>,
    /// Set when a collective was abandoned at its deadline: the communicator's state is
    /// undefined from then on, and every later collective fails with this text (and the
    /// first peer found gone, if any).
    broken: OnceLock<(Option<usize>, String)>,
    /// The timed path's buffers, kept between its collectives (module `guarded`).
    spare: guarded::Spare,
    /// How long the timed path's waits spin before they yield (set by `with_timeout`).
    spin: crate::spin::SpinBudget,
}

// SAFETY: an `MPI_Comm` is a plain handle value (a pointer in Open MPI, an integer in
// MPICH) naming library state that belongs to the process, not to the thread that created
// it; MPI lets any thread use it. Which threads may call MPI *concurrently* is the `Sync`
// question, answered below.
unsafe impl Send for MpiCommunicator {}

// SAFETY: `&MpiCommunicator` only exposes methods that pass the handle to MPI. When MPI
// provides `MPI_THREAD_MULTIPLE`, MPI allows concurrent calls from any thread. Otherwise
// (`serialize == true`) every MPI call of this module holds the process-wide `MPI_CALLS`
// lock, so this type never makes two MPI calls at once. What MPI leaves to the program at
// every thread level (ordering a communicator's collectives alike on all ranks, matching
// counts across ranks) is documented on the module, as for any MPI program.
unsafe impl Sync for MpiCommunicator {}

impl fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("comm", &self.comm)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("serialize", &self.serialize)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl MpiCommunicator {
    /// Duplicates `MPI_COMM_WORLD` of an initialized universe (`MPI_Comm_dup`) and sets
    /// `MPI_ERRORS_RETURN` on the duplicate. Collective: every rank calls it.
    pub fn world(universe: &mpi::environment::Universe) -> Result<Self> {
        Self::duplicate(&universe.world())
    }

    /// Duplicates any rsmpi intra-communicator (for example a split made with rsmpi) and
    /// sets `MPI_ERRORS_RETURN` on the duplicate. The original is left untouched.
    /// Collective: every rank of `comm` calls it.
    ///
    /// Fails with [`TransportError::Setup`] when MPI is not initialized or already
    /// finalized, or when `comm` is `MPI_COMM_NULL` or an inter-communicator.
    pub fn duplicate<C: mpi::topology::Communicator>(comm: &C) -> Result<Self> {
        let op = Op::Setup;
        let _guard = lock_mpi();
        ensure_live()?;
        watch_finalize(op)?;
        let parent = comm.as_raw();
        if parent == comm_null() {
            return Err(TransportError::Setup(
                "the communicator is MPI_COMM_NULL".into(),
            ));
        }
        let mut inter: c_int = 0;
        // SAFETY: MPI is initialized and not finalized (checked above), `parent` is a live
        // communicator owned by `comm`, and `inter` is a valid place for one int.
        let code = unsafe { ffi::MPI_Comm_test_inter(parent, &mut inter) };
        check(op, "MPI_Comm_test_inter", code)?;
        if inter != 0 {
            return Err(TransportError::Setup(
                "inter-communicators are not supported; pass an intra-communicator".into(),
            ));
        }
        let serialize = !thread_multiple(op)?;
        let mut new = comm_null();
        // SAFETY: as above; `new` is a valid place for the new handle. Every rank of
        // `parent` makes this collective call (documented on the callers).
        let code = unsafe { ffi::MPI_Comm_dup(parent, &mut new) };
        check(op, "MPI_Comm_dup", code)?;
        let this = Self::adopt(new, serialize, op)?;
        tracing::debug!(
            rank = this.rank,
            size = this.size,
            serialize,
            "MPI communicator duplicated"
        );
        Ok(this)
    }

    /// The raw handle, for interop. It stays owned by `self`: do not free it, and do not
    /// use it after `self` is dropped.
    pub fn as_raw(&self) -> ffi::MPI_Comm {
        self.comm
    }

    /// Takes ownership of a freshly created communicator: sets `MPI_ERRORS_RETURN` and
    /// reads rank and size. On failure the handle is freed. The caller holds the MPI lock
    /// if one is needed.
    fn adopt(mut raw: ffi::MPI_Comm, serialize: bool, op: Op) -> Result<Self> {
        match configure(raw, op) {
            Ok((rank, size)) => Ok(Self {
                comm: raw,
                rank,
                size,
                serialize,
                timeout: None,
                peers: Vec::new(),
                roll: None,
                broken: OnceLock::new(),
                spare: guarded::Spare::default(),
                spin: crate::spin::SpinBudget::new(Duration::ZERO),
            }),
            Err(e) => {
                if let Err(free_err) = free_comm(&mut raw) {
                    tracing::warn!(error = %free_err, "freeing a half-built communicator failed");
                }
                Err(e)
            }
        }
    }

    /// The process-wide lock, when MPI needs calls serialized; fails once `MPI_Finalize`
    /// began, checked after the lock is taken.
    fn lock(&self, op: Op) -> Result<Option<MutexGuard<'static, ()>>> {
        let guard = self.serialize.then(lock_mpi);
        ensure_not_finalizing(op)?;
        Ok(guard)
    }
}

impl Drop for MpiCommunicator {
    fn drop(&mut self) {
        let _guard = lock_mpi();
        // Its receives stay posted unless MPI is live and nothing is in flight: leaked on
        // the early returns below, so that MPI never writes freed memory.
        let roll = self
            .roll
            .take()
            .map(|r| r.into_inner().unwrap_or_else(PoisonError::into_inner));
        let finalized = if FINALIZING.load(Ordering::Acquire) {
            Ok(true)
        } else {
            finalized()
        };
        match finalized {
            Ok(false) => {}
            Ok(true) => {
                tracing::warn!(
                    rank = self.rank,
                    "MPI was finalized before this MpiCommunicator was dropped; not freeing it"
                );
                std::mem::forget(roll);
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "MPI_Finalized failed; not freeing the communicator");
                std::mem::forget(roll);
                return;
            }
        }
        if let Some((_, reason)) = self.broken.get() {
            // An abandoned collective may still be in flight on it: a late peer's messages
            // make MPI progress it later, and Open MPI 4.1 then sends on the freed
            // communicator (a segmentation fault inside `NBC_Progress`, seen with 3 ranks).
            // The handle is leaked with the collective's buffers.
            tracing::warn!(
                rank = self.rank,
                reason,
                "not freeing a broken MpiCommunicator: an abandoned collective may be in flight"
            );
            std::mem::forget(roll);
            return;
        }
        if let Some(roll) = roll {
            roll.close();
        }
        if let Err(e) = free_comm(&mut self.comm) {
            tracing::warn!(rank = self.rank, error = %e, "MPI_Comm_free failed");
        }
    }
}

/// Each collective checks the bundle's group and whether the communicator is broken
/// (`begin`), converts its arguments to MPI's once (module `args`) and hands them to the
/// blocking path (module `blocking`) or, with a timeout, to the timed one (module `timed`).
impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn max_count(&self) -> usize {
        MAX_COUNT
    }

    fn backend_name(&self) -> &'static str {
        "mpi"
    }

    fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Self>> {
        self.split_group(color, key)
    }

    /// The timed path ([`MpiCommunicator::with_timeout`]) on this communicator.
    fn bound_waits(&mut self, timeout: std::time::Duration) -> Result<bool> {
        self.arm_timeout(timeout)?;
        Ok(true)
    }

    fn raw_barrier(&self) -> Result<()> {
        if let Some(timeout) = self.timed(Op::Barrier)? {
            return self.timed_barrier(timeout);
        }
        self.blocking_barrier()
    }

    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> Result<()> {
        let timeout = self.begin(Op::AllGather, args.group())?;
        let call = self.all_gather_call(&mut args)?;
        self.run(timeout, call)
    }

    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        let op = Op::AllGatherVarcount;
        let timeout = self.begin(op, args.group())?;
        let (send, recv, counts, displs) = args.parts();
        if self.size == 1 {
            // MPICH 4.0 (fixed by pmodels/mpich#6374, 2023) copies a lone rank's bytes to
            // the start of the receive buffer, ignoring its displacement: copy here.
            return copy_own_region(op, self.rank, send, recv, displs[0]);
        }
        let mut tables = [IntTable::new(), IntTable::new()];
        let call = self.varcount_call(send, recv, counts, displs, &mut tables)?;
        self.run(timeout, call)
    }

    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> Result<()> {
        let timeout = self.begin(Op::GatherVarcount, args.group())?;
        let mut tables = [IntTable::new(), IntTable::new()];
        let call = self.gather_call(&mut args, &mut tables)?;
        self.run(timeout, call)
    }

    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        let timeout = self.begin(Op::Broadcast, args.group())?;
        let call = self.broadcast_call(&mut args)?;
        self.run(timeout, call)
    }

    /// `MPI_Allreduce`. `f16` and `bf16` (which MPI has no type for) are widened to
    /// `MPI_FLOAT`, reduced, and rounded back. In place, the input is copied first: rsmpi
    /// exports no `MPI_IN_PLACE` handle, and this module never passes an implementation's
    /// private constant.
    fn raw_all_reduce(&self, mut args: AllReduceArgs<'_>) -> Result<()> {
        let timeout = self.begin(Op::AllReduce, args.group())?;
        let call = self.all_reduce_call(&mut args)?;
        self.run(timeout, call)
    }

    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> Result<()> {
        let timeout = self.begin(Op::AllToAllVarcount, args.group())?;
        let mut tables = [
            IntTable::new(),
            IntTable::new(),
            IntTable::new(),
            IntTable::new(),
        ];
        let call = self.all_to_all_call(&mut args, &mut tables)?;
        self.run(timeout, call)
    }
}

impl MpiCommunicator {
    /// The start of every collective: the bundle checked for this communicator's rank and
    /// size, then `Some(timeout)` for the timed path; an error when the communicator is
    /// broken.
    fn begin(&self, op: Op, group: Group) -> Result<Option<Duration>> {
        group.expect(op, self.rank, self.size)?;
        self.timed(op)
    }

    /// Runs a prepared call on the blocking path, or on the timed one with `timeout`.
    fn run<C: Blocking + Timed>(&self, timeout: Option<Duration>, call: C) -> Result<()> {
        match timeout {
            None => call.blocking(self),
            Some(timeout) => call.timed(self, timeout),
        }
    }
}

/// Copies this rank's `send` into `recv` at `displ` (a communicator of one rank).
fn copy_own_region(op: Op, rank: usize, send: &[u8], recv: &mut [u8], displ: usize) -> Result<()> {
    let buffer_len = recv.len();
    let region = displ
        .checked_add(send.len())
        .and_then(|end| recv.get_mut(displ..end));
    let Some(region) = region else {
        return Err(TransportError::InvalidArgument {
            op,
            rank,
            source: ArgumentError::OutOfBounds {
                which: "receive",
                index: rank,
                displacement: displ,
                count: send.len(),
                buffer_len,
            },
        });
    };
    region.copy_from_slice(send);
    Ok(())
}

/// Sets `MPI_ERRORS_RETURN` on a new communicator and reads its rank and size.
fn configure(comm: ffi::MPI_Comm, op: Op) -> Result<(usize, usize)> {
    // SAFETY: `comm` is a live communicator just created by MPI; `MPI_ERRORS_RETURN` is a
    // predefined error handler read from rsmpi's C shim.
    let code = unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
    check(op, "MPI_Comm_set_errhandler", code)?;
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: `comm` is live; `rank` is a valid place for one int.
    let code = unsafe { ffi::MPI_Comm_rank(comm, &mut rank) };
    check(op, "MPI_Comm_rank", code)?;
    // SAFETY: `comm` is live; `size` is a valid place for one int.
    let code = unsafe { ffi::MPI_Comm_size(comm, &mut size) };
    check(op, "MPI_Comm_size", code)?;
    let rank = usize::try_from(rank)
        .map_err(|_| TransportError::Setup(format!("MPI_Comm_rank returned {rank}")))?;
    let size = usize::try_from(size)
        .ok()
        .filter(|&s| s > rank)
        .ok_or_else(|| TransportError::Setup(format!("MPI_Comm_size returned {size}")))?;
    Ok((rank, size))
}

/// `MPI_Comm_free` with its code checked; sets `*comm` to `MPI_COMM_NULL` on success.
fn free_comm(comm: &mut ffi::MPI_Comm) -> Result<()> {
    if *comm == comm_null() {
        return Ok(());
    }
    // SAFETY: `*comm` is a live communicator created by MPI and owned by the caller, MPI
    // is not finalized (callers check or just created it), and nothing uses the handle
    // after this call.
    let code = unsafe { ffi::MPI_Comm_free(comm) };
    check(Op::Setup, "MPI_Comm_free", code)
}
