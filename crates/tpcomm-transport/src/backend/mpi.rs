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

use std::ffi::{c_int, c_void};
use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use mpi::ffi;

use crate::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use crate::communicator::Communicator;
use crate::error::{ArgumentError, Op, Result, TransportError};
use crate::process::{Liveness, ProcessIdentity};
use crate::reduce::{narrow_half, widen_half, DataType, ReduceOp};

use super::copy::{copy_slice, to_vec};

/// The MPI standard fixes `MPI_SUCCESS` to 0; its binding's integer type differs between
/// implementations, so compare against a `c_int` constant checked here at compile time.
const MPI_SUCCESS: c_int = 0;
const _: () = assert!(ffi::MPI_SUCCESS == 0);

/// MPI-3 counts and displacements are `int`.
const MAX_COUNT: usize = c_int::MAX as usize;

/// What every rank sends first in a split (`"tpcsplit"`): bytes of another collective are
/// not taken for a split.
const SPLIT_WORD: u64 = u64::from_le_bytes(*b"tpcsplit");

/// Length of the buffer `MPI_Error_string` writes into.
const ERROR_STRING_LEN: usize = ffi::MPI_MAX_ERROR_STRING as usize;

/// Serializes this module's MPI calls when MPI does not provide `MPI_THREAD_MULTIPLE`.
static MPI_CALLS: Mutex<()> = Mutex::new(());

/// Set when `MPI_Finalize` begins, by the delete callback of an attribute that the first
/// communicator attaches to `MPI_COMM_SELF` ([`watch_finalize`]): MPI frees `MPI_COMM_SELF`
/// first thing in `MPI_Finalize`, running that callback. Every collective checks it holding
/// the lock (the callback takes the lock too), so nothing calls MPI once finalizing began:
/// rsmpi's `Universe` finalizes on drop, and nothing ties a communicator's life to it.
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// Whether the attribute of [`FINALIZING`] is attached (changed holding the lock).
static WATCHING: AtomicBool = AtomicBool::new(false);

/// The delete callback of the attribute on `MPI_COMM_SELF`: records that MPI is finalizing.
/// Takes the lock, so it waits for a serialized call in flight on another thread.
unsafe extern "C" fn on_finalize(
    _comm: ffi::MPI_Comm,
    _keyval: c_int,
    _value: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    let _guard = lock_mpi();
    FINALIZING.store(true, Ordering::Release);
    MPI_SUCCESS
}

/// The copy callback of that attribute: duplicates do not inherit it (what
/// `MPI_COMM_NULL_COPY_FN` does; Open MPI refuses a null callback).
unsafe extern "C" fn no_copy(
    _comm: ffi::MPI_Comm,
    _keyval: c_int,
    _extra: *mut c_void,
    _value_in: *mut c_void,
    _value_out: *mut c_void,
    flag: *mut c_int,
) -> c_int {
    // SAFETY: MPI passes a valid place for the flag.
    unsafe { *flag = 0 };
    MPI_SUCCESS
}

/// Attaches the attribute whose deletion sets [`FINALIZING`], once per process. The caller
/// holds the lock and has checked that MPI is live.
fn watch_finalize(op: Op) -> Result<()> {
    if WATCHING.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut keyval: c_int = 0;
    // SAFETY: MPI is live (checked by the caller); `no_copy` and `on_finalize` match
    // MPI's callback types and never unwind; `keyval` is a valid place for one int; no
    // extra state.
    let code = unsafe {
        ffi::MPI_Comm_create_keyval(
            Some(no_copy),
            Some(on_finalize),
            &mut keyval,
            ptr::null_mut(),
        )
    };
    check(op, "MPI_Comm_create_keyval", code)?;
    // SAFETY: MPI is live; `keyval` was just created for communicators; the value is never
    // read. Reading an immutable handle constant exported by rsmpi's C shim.
    let code = unsafe { ffi::MPI_Comm_set_attr(ffi::RSMPI_COMM_SELF, keyval, ptr::null_mut()) };
    check(op, "MPI_Comm_set_attr", code)?;
    WATCHING.store(true, Ordering::Release);
    Ok(())
}

/// Fails once `MPI_Finalize` began (see [`FINALIZING`]).
fn ensure_not_finalizing(op: Op) -> Result<()> {
    if FINALIZING.load(Ordering::Acquire) {
        return Err(TransportError::Setup(format!(
            "{op} after MPI_Finalize: drop every MpiCommunicator before the Universe"
        )));
    }
    Ok(())
}

/// Takes the process-wide MPI lock. No code panics while holding it, so a poisoned lock is
/// still usable.
fn lock_mpi() -> MutexGuard<'static, ()> {
    MPI_CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

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
    /// Set when a collective was abandoned at its deadline: the communicator's state is
    /// undefined from then on, and every later collective fails with this text (and the
    /// first peer found gone, if any).
    broken: OnceLock<(Option<usize>, String)>,
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

    /// Turns off Open MPI's shared-memory single-copy mechanism (CMA, XPMEM or KNEM) for
    /// this process, so that messages between ranks on one host go through shared-memory
    /// fragments that MPI copies into the receive buffer *bounded by its length*. Call it
    /// on every rank, before MPI is initialized (before `mpi::initialize()`); it sets the
    /// control variable `btl_vader_single_copy_mechanism` to `none` through the MPI tool
    /// interface (`MPI_T`), the same as `mpirun --mca btl_vader_single_copy_mechanism none`,
    /// and leaves the tool interface initialized (finalizing it before `MPI_Init` undoes
    /// the setting in Open MPI 4.1).
    ///
    /// Why: with single copy, Open MPI 4.1 moves a message above its eager limit (4 KiB)
    /// with one copy of the *sender's* length, even into a smaller receive buffer: a peer
    /// that sends more than was agreed overwrites the receiver's memory past the buffer.
    /// On the blocking path collectives receive into the caller's buffers, which tpcomm
    /// cannot guard (the timed path of [`with_timeout`](Self::with_timeout) receives into
    /// guarded buffers of its own). Without single copy, such a message is reported as
    /// `MPI_ERR_TRUNCATE` and nothing past the buffer is written. The cost is bandwidth:
    /// large messages between ranks of one host are copied twice.
    ///
    /// Every rank must agree: a rank with single copy turned off that receives from a rank
    /// that still uses it aborts (`pml_ob1_recvreq.c: invalid bml for rdma get`).
    ///
    /// Fails with [`TransportError::Setup`] when MPI is already initialized, and with
    /// [`TransportError::Unsupported`] when the MPI library has no such variable (it is
    /// Open MPI 4.x's; MPICH and Open MPI 5 have none).
    pub fn disable_single_copy_before_init() -> Result<()> {
        let op = Op::Setup;
        let _guard = lock_mpi();
        let mut initialized: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time; `initialized` is a valid place
        // for one int.
        let code = unsafe { ffi::MPI_Initialized(&mut initialized) };
        check_before_init(op, "MPI_Initialized", code)?;
        if initialized != 0 {
            return Err(TransportError::Setup(
                "the single-copy mechanism can only be disabled before MPI is initialized".into(),
            ));
        }
        let mut provided: c_int = 0;
        // SAFETY: the tool interface may be initialized before MPI_Init, any number of
        // times; `provided` is a valid place for one int. Reading an immutable constant
        // exported by rsmpi's C shim.
        let code = unsafe { ffi::MPI_T_init_thread(ffi::RSMPI_THREAD_SINGLE, &mut provided) };
        check_before_init(op, "MPI_T_init_thread", code)?;
        let mut index: c_int = 0;
        // SAFETY: MPI_T is initialized; the name is a NUL-terminated string; `index` is a
        // valid place for one int.
        let code = unsafe { ffi::MPI_T_cvar_get_index(SINGLE_COPY_CVAR.as_ptr(), &mut index) };
        if code == ffi::MPI_T_ERR_INVALID_NAME as c_int {
            return Err(TransportError::Unsupported {
                op,
                reason: format!(
                    "this MPI library has no control variable {SINGLE_COPY_CVAR:?} (Open MPI \
                     4.x's shared-memory transport)"
                ),
            });
        }
        check_before_init(op, "MPI_T_cvar_get_index", code)?;
        let none = single_copy_value(op, index, "none")?;
        let mut handle = std::mem::MaybeUninit::<ffi::MPI_T_cvar_handle>::uninit();
        let mut count: c_int = 0;
        // SAFETY: `index` names a control variable (just looked up); it is not bound to an
        // MPI object, so the object handle is null; `handle` and `count` are valid places.
        let code = unsafe {
            ffi::MPI_T_cvar_handle_alloc(index, ptr::null_mut(), handle.as_mut_ptr(), &mut count)
        };
        check_before_init(op, "MPI_T_cvar_handle_alloc", code)?;
        // SAFETY: MPI_T_cvar_handle_alloc succeeded, so it wrote the handle.
        let mut handle = unsafe { handle.assume_init() };
        let written = if count == 1 {
            let value = CvarValue::new(none);
            // SAFETY: the variable holds `count == 1` scalar of at most 16 bytes (an `int`
            // in Open MPI); `value` is 16 readable bytes.
            let code =
                unsafe { ffi::MPI_T_cvar_write(handle, (&value as *const CvarValue).cast()) };
            check_before_init(op, "MPI_T_cvar_write", code).and_then(|()| {
                let mut read = CvarValue::new(-1);
                // SAFETY: as above; `read` is 16 writable bytes.
                let code =
                    unsafe { ffi::MPI_T_cvar_read(handle, (&mut read as *mut CvarValue).cast()) };
                check_before_init(op, "MPI_T_cvar_read", code)?;
                let now = read.0[0];
                if now == none {
                    Ok(())
                } else {
                    Err(TransportError::Setup(format!(
                        "{SINGLE_COPY_CVAR:?} reads {now} after writing {none} (none)"
                    )))
                }
            })
        } else {
            Err(TransportError::Setup(format!(
                "{SINGLE_COPY_CVAR:?} holds {count} values, expected one"
            )))
        };
        // SAFETY: `handle` was allocated above and is not used after this call.
        let code = unsafe { ffi::MPI_T_cvar_handle_free(&mut handle) };
        written?;
        check_before_init(op, "MPI_T_cvar_handle_free", code)?;
        tracing::debug!("shared-memory single copy disabled before MPI_Init");
        Ok(())
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
                broken: OnceLock::new(),
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

    /// Converts a count, displacement or root to MPI's `int`.
    fn int(&self, op: Op, which: &'static str, index: usize, value: usize) -> Result<c_int> {
        c_int::try_from(value).map_err(|_| TransportError::InvalidArgument {
            op,
            rank: self.rank,
            source: ArgumentError::CountTooLarge {
                which,
                index,
                value,
                max: MAX_COUNT,
            },
        })
    }

    /// Converts a counts or displacements table to MPI's `int`s, written in place into
    /// `table` (which the caller keeps in its frame until the MPI call returns); the result
    /// borrows it.
    fn ints<'t>(
        &self,
        op: Op,
        which: &'static str,
        values: &[usize],
        table: &'t mut IntTable,
    ) -> Result<&'t [c_int]> {
        let out = table.slots(values.len());
        for (i, (slot, &v)) in out.iter_mut().zip(values).enumerate() {
            *slot = self.int(op, which, i, v)?;
        }
        Ok(out)
    }
}

/// Storage for a counts or displacements table converted to MPI's `int`: inline up to
/// [`IntTable::INLINE`] ranks, so that a varcount call on a typical group allocates
/// nothing.
///
/// The caller creates it and [`MpiCommunicator::ints`] fills it where it lies. Returning the
/// converted table by value instead (an 80-byte enum, as this module once did) made the
/// compiler copy it through the stack several times with stores and loads of mismatched
/// widths and offsets, which x86 cores cannot forward from store to load: that cost about
/// 20 ns per table on every varcount call (an all-to-all has four tables), more than the
/// rest of the wrapper.
struct IntTable {
    inline: [c_int; IntTable::INLINE],
    heap: Vec<c_int>,
}

impl IntTable {
    const INLINE: usize = 16;

    fn new() -> Self {
        Self {
            inline: [0; Self::INLINE],
            heap: Vec::new(),
        }
    }

    /// `len` slots to write the table into.
    fn slots(&mut self, len: usize) -> &mut [c_int] {
        if len <= Self::INLINE {
            &mut self.inline[..len]
        } else {
            self.heap.resize(len, 0);
            &mut self.heap
        }
    }
}

impl Drop for MpiCommunicator {
    fn drop(&mut self) {
        let _guard = lock_mpi();
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
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "MPI_Finalized failed; not freeing the communicator");
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
            return;
        }
        if let Err(e) = free_comm(&mut self.comm) {
            tracing::warn!(rank = self.rank, error = %e, "MPI_Comm_free failed");
        }
    }
}

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

    fn raw_barrier(&self) -> Result<()> {
        if let Some(timeout) = self.timed(Op::Barrier)? {
            return self.timed_barrier(timeout);
        }
        let _guard = self.lock(Op::Barrier)?;
        // SAFETY: `self.comm` is a live communicator owned by `self`.
        let code = unsafe { ffi::MPI_Barrier(self.comm) };
        check(Op::Barrier, "MPI_Barrier", code)
    }

    fn raw_all_gather(&self, mut args: AllGatherArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGather, self.rank(), self.size())?;
        if let Some(timeout) = self.timed(Op::AllGather)? {
            return self.timed_all_gather(timeout, args);
        }
        let op = Op::AllGather;
        let count = self.int(op, "send count", self.rank, args.block_len())?;
        let mut scratch = Scratch::default();
        let send = send_ptr(args.send(), &scratch.send);
        let recv = recv_ptr(args.recv(), &mut scratch.recv);
        let byte = byte_type();
        let _guard = self.lock(op)?;
        // SAFETY: `send` is valid for `count` bytes (this rank's slice, or scratch when
        // empty); `recv` is valid for writes of `size * count` bytes (checked by
        // `AllGatherArgs`), and is a distinct, non-overlapping allocation from `send`
        // (a `&[u8]` and a `&mut [u8]` cannot overlap; the scratch bytes are distinct).
        // Both outlive the blocking call. `self.comm` is live.
        let code = unsafe { ffi::MPI_Allgather(send, count, byte, recv, count, byte, self.comm) };
        check(op, "MPI_Allgather", code)
    }

    fn raw_all_gather_varcount(&self, mut args: VarcountArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllGatherVarcount, self.rank(), self.size())?;
        if let Some(timeout) = self.timed(Op::AllGatherVarcount)? {
            return self.timed_all_gather_varcount(timeout, args);
        }
        let op = Op::AllGatherVarcount;
        let (send, recv, counts, displs) = args.parts();
        if self.size == 1 {
            // MPICH 4.0 (fixed by pmodels/mpich#6374, 2023) copies a lone rank's bytes to
            // the start of the receive buffer, ignoring its displacement: copy here.
            return copy_own_region(op, self.rank, send, recv, displs[0]);
        }
        let send_count = self.int(op, "send count", self.rank, send.len())?;
        let (mut counts_table, mut displs_table) = (IntTable::new(), IntTable::new());
        let counts = self.ints(op, "counts", counts, &mut counts_table)?;
        let displs = self.ints(op, "displacements", displs, &mut displs_table)?;
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        let recv = recv_ptr(recv, &mut scratch.recv);
        let byte = byte_type();
        let _guard = self.lock(op)?;
        // SAFETY: `VarcountArgs` guarantees one count and displacement per rank, each region
        // inside `recv` and non-overlapping, and `send.len() == counts[rank]`; `counts` and
        // `displs` hold `size` ints and outlive the call. `send` and `recv` point to
        // distinct memory (scratch bytes when empty) valid for the call. `self.comm` is
        // live.
        let code = unsafe {
            ffi::MPI_Allgatherv(
                send,
                send_count,
                byte,
                recv,
                counts.as_ptr(),
                displs.as_ptr(),
                byte,
                self.comm,
            )
        };
        check(op, "MPI_Allgatherv", code)
    }

    fn raw_gather_varcount(&self, mut args: GatherArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::GatherVarcount, self.rank(), self.size())?;
        if let Some(timeout) = self.timed(Op::GatherVarcount)? {
            return self.timed_gather_varcount(timeout, args);
        }
        let op = Op::GatherVarcount;
        let root = self.int(op, "root", self.rank, args.root())?;
        let (send, layout) = args.parts();
        let send_count = self.int(op, "send count", self.rank, send.len())?;
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        // Receive arguments are significant at the root only; elsewhere MPI ignores them
        // and null is allowed.
        let (mut counts_table, mut displs_table) = (IntTable::new(), IntTable::new());
        let (recv, counts_ptr, displs_ptr) = match layout {
            Some(layout) => (
                recv_ptr(layout.recv, &mut scratch.recv),
                self.ints(op, "counts", layout.counts, &mut counts_table)?
                    .as_ptr(),
                self.ints(op, "displacements", layout.displs, &mut displs_table)?
                    .as_ptr(),
            ),
            None => (ptr::null_mut(), ptr::null(), ptr::null()),
        };
        let byte = byte_type();
        let _guard = self.lock(op)?;
        // SAFETY: `send` is valid for `send_count` bytes. At the root, `GatherArgs`
        // guarantees a receive layout with one in-bounds, non-overlapping region per rank,
        // `counts_ptr`/`displs_ptr` point to `size` ints in `counts_table`/`displs_table`,
        // all outliving the call, and `recv` is distinct from `send`; at other ranks the
        // receive arguments are null, which MPI ignores there. `root` is in range
        // (checked). `self.comm` is live.
        let code = unsafe {
            ffi::MPI_Gatherv(
                send, send_count, byte, recv, counts_ptr, displs_ptr, byte, root, self.comm,
            )
        };
        check(op, "MPI_Gatherv", code)
    }

    fn raw_broadcast(&self, mut args: BroadcastArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::Broadcast, self.rank(), self.size())?;
        if let Some(timeout) = self.timed(Op::Broadcast)? {
            return self.timed_broadcast(timeout, args);
        }
        let op = Op::Broadcast;
        let root = self.int(op, "root", self.rank, args.root())?;
        let buf = args.buf();
        let count = self.int(op, "buffer length", self.rank, buf.len())?;
        let mut scratch = Scratch::default();
        let buf = recv_ptr(buf, &mut scratch.recv);
        let byte = byte_type();
        let _guard = self.lock(op)?;
        // SAFETY: `buf` is valid for reads and writes of `count` bytes (the caller's
        // slice, or a scratch byte when `count == 0`) for the whole blocking call; `root`
        // is in range (checked); `self.comm` is live.
        let code = unsafe { ffi::MPI_Bcast(buf, count, byte, root, self.comm) };
        check(op, "MPI_Bcast", code)
    }

    /// `MPI_Allreduce`. `f16` and `bf16` (which MPI has no type for) are widened to
    /// `MPI_FLOAT`, reduced, and rounded back. In place, the input is copied first: rsmpi
    /// exports no `MPI_IN_PLACE` handle, and this module never passes an implementation's
    /// private constant.
    fn raw_all_reduce(&self, mut args: AllReduceArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllReduce, self.rank(), self.size())?;
        if let Some(timeout) = self.timed(Op::AllReduce)? {
            return self.timed_all_reduce(timeout, args);
        }
        let op = Op::AllReduce;
        let count = self.int(op, "element count", self.rank, args.count())?;
        let (dtype, reduce) = (args.dtype(), args.op());
        let mpi_op = reduce_op(reduce);
        if let Some(wide) = widen_half(dtype, args.input()) {
            let mut out = vec![0f32; wide.len()];
            let mut scratch = Scratch::default();
            let send = send_ptr(bytemuck::cast_slice(&wide), &scratch.send);
            let recv = recv_ptr(bytemuck::cast_slice_mut(&mut out), &mut scratch.recv);
            let float = float_type();
            let guard = self.lock(op)?;
            // SAFETY: `send` and `recv` point to `count` f32 each (two distinct vectors, or
            // distinct scratch bytes when `count == 0`), properly aligned, alive for the
            // blocking call; `float` is the predefined `MPI_FLOAT`; `self.comm` is live.
            let code = unsafe { ffi::MPI_Allreduce(send, recv, count, float, mpi_op, self.comm) };
            // The error is looked up (MPI calls too) before the lock goes.
            let checked = check(op, "MPI_Allreduce", code);
            drop(guard);
            checked?;
            let (_, recv) = args.parts();
            narrow_half(dtype, bytemuck::cast_slice(&out), recv);
            return Ok(());
        }
        let datatype = mpi_type(dtype);
        let (send, recv) = args.parts();
        let copied;
        let send = match send {
            Some(send) => send,
            None => {
                copied = to_vec(recv);
                &copied
            }
        };
        let mut scratch = Scratch::default();
        let send = send_ptr(send, &scratch.send);
        let recv = recv_ptr(recv, &mut scratch.recv);
        let _guard = self.lock(op)?;
        // SAFETY: `AllReduceArgs` checked that send and receive hold the same `count`
        // elements of `dtype`, whose predefined MPI type `datatype` has the same size;
        // `send` and `recv` are distinct memory (the caller's two slices, a copy of the
        // input in place, or distinct scratch bytes when empty) alive for the blocking call.
        // `self.comm` is live.
        let code = unsafe { ffi::MPI_Allreduce(send, recv, count, datatype, mpi_op, self.comm) };
        check(op, "MPI_Allreduce", code)
    }

    fn raw_all_to_all_varcount(&self, mut args: AllToAllArgs<'_>) -> Result<()> {
        args.group()
            .expect(Op::AllToAllVarcount, self.rank(), self.size())?;
        if let Some(timeout) = self.timed(Op::AllToAllVarcount)? {
            return self.timed_all_to_all_varcount(timeout, args);
        }
        let op = Op::AllToAllVarcount;
        let (send, recv) = args.parts();
        let mut tables = [
            IntTable::new(),
            IntTable::new(),
            IntTable::new(),
            IntTable::new(),
        ];
        let [send_counts, send_displs, recv_counts, recv_displs] = &mut tables;
        let send_counts = self.ints(op, "send counts", send.counts, send_counts)?;
        let send_displs = self.ints(op, "send displacements", send.displs, send_displs)?;
        let recv_counts = self.ints(op, "counts", recv.counts, recv_counts)?;
        let recv_displs = self.ints(op, "displacements", recv.displs, recv_displs)?;
        let mut scratch = Scratch::default();
        let send = send_ptr(send.buf, &scratch.send);
        let recv = recv_ptr(recv.buf, &mut scratch.recv);
        let byte = byte_type();
        let _guard = self.lock(op)?;
        // SAFETY: `AllToAllArgs` guarantees both layouts have `size` entries whose regions
        // lie inside their buffers, receive regions not overlapping; the four int tables
        // hold `size` entries and outlive the call. `send` and `recv` point to distinct
        // memory (scratch bytes when empty) valid for the call. `self.comm` is live.
        let code = unsafe {
            ffi::MPI_Alltoallv(
                send,
                send_counts.as_ptr(),
                send_displs.as_ptr(),
                byte,
                recv,
                recv_counts.as_ptr(),
                recv_displs.as_ptr(),
                byte,
                self.comm,
            )
        };
        check(op, "MPI_Alltoallv", code)
    }
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
    /// `/proc` every tenth of the timeout, at most every 100 ms; others are listed as
    /// unchecked). The first one named is the rank that died first, as seen from here. After such a
    /// failure every collective of this communicator, and `split`, fails with
    /// [`TransportError::Aborted`]. `split` (`MPI_Comm_split`, which has no nonblocking
    /// form) is preceded by a bounded barrier and a bounded all-gather of a split word, so
    /// that an absent peer, or one in another collective, fails it within the timeout too.
    /// A broken communicator is not freed when dropped (its abandoned collective may still
    /// progress when a late peer arrives): the handle is leaked with that collective's
    /// buffers.
    ///
    /// Collective: every rank calls it (it all-gathers each rank's process identity, under
    /// the timeout already). The cost is copying each collective's send bytes in, and its
    /// receive buffer in and out, of owned buffers (the receive copy a fresh mapping that
    /// ends at a guard page: one `mmap`, `mprotect` and `munmap` per collective), and
    /// polling instead of blocking (with sleeps of up to 200 us between polls); without a
    /// timeout the blocking MPI calls run on the caller's buffers as before.
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
    fn arm_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.timeout = Some(timeout);
        let mine = ProcessIdentity::current().encode();
        let mut all = vec![0u8; self.size * ProcessIdentity::LEN];
        self.all_gather(&mine, &mut all)?;
        self.peers = all
            .chunks_exact(ProcessIdentity::LEN)
            .map(ProcessIdentity::decode)
            .collect();
        Ok(())
    }

    /// `Some(timeout)` when collectives are bounded; an error when an earlier one was
    /// abandoned.
    fn timed(&self, op: Op) -> Result<Option<Duration>> {
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
        // Peers found gone so far, in the order they were found: checked every tenth of the
        // timeout (at most every 100 ms) while waiting, so that a rank that died first is
        // named first even when other ranks exit after their own timeouts later.
        let mut gone: Vec<usize> = Vec::new();
        let check_every = (timeout / 10).min(Duration::from_millis(100));
        let mut next_check = begun + check_every;
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
                    Ok(()) => return Ok(job),
                    Err(failed) => Some(failed),
                }
            } else {
                None
            };
            // The error is looked up (MPI calls too) before the lock goes.
            let failure = code.map(|(code, failed_call)| mpi_error(op, failed_call, code));
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
            if waited >= timeout {
                // MPI may still read and write these buffers: leak them.
                std::mem::forget(job);
                let unchecked = self.peer_report().1;
                let _ = self.broken.set((
                    gone.first().copied(),
                    format!(
                        "an earlier {op} timed out after {waited:?} (peers gone: {gone:?}); \
                         the communicator's state is undefined"
                    ),
                ));
                tracing::warn!(rank = self.rank, %op, ?waited, ?gone, ?unchecked, "collective timed out");
                return Err(TransportError::Unresponsive {
                    op,
                    rank: self.rank,
                    waited,
                    gone,
                    unchecked,
                });
            }
            back_off(polls);
            polls = polls.saturating_add(1);
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

    fn timed_barrier(&self, timeout: Duration) -> Result<()> {
        self.timed_barrier_for(Op::Barrier, timeout)
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

    /// A bounded `MPI_Ibarrier`, its errors reported as those of `op`.
    fn timed_barrier_for(&self, op: Op, timeout: Duration) -> Result<()> {
        let job = InFlight::new(op, Vec::new(), &[], Vec::new())?;
        self.run_timed(op, "MPI_Ibarrier", timeout, job, |job, comm| {
            // SAFETY: `comm` is live; `job.request` is a valid place for the request.
            unsafe { ffi::MPI_Ibarrier(comm, &mut job.request) }
        })?;
        Ok(())
    }

    fn timed_all_gather(&self, timeout: Duration, mut args: AllGatherArgs<'_>) -> Result<()> {
        let op = Op::AllGather;
        let count = self.int(op, "send count", self.rank, args.block_len())?;
        let (send, recv) = args.parts();
        let job = InFlight::new(op, to_vec(send), recv, Vec::new())?;
        let job = self.run_timed(op, "MPI_Iallgather", timeout, job, |job, comm| {
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
        Ok(())
    }

    fn timed_all_gather_varcount(
        &self,
        timeout: Duration,
        mut args: VarcountArgs<'_>,
    ) -> Result<()> {
        let op = Op::AllGatherVarcount;
        let (send, recv, counts, displs) = args.parts();
        if self.size == 1 {
            return copy_own_region(op, self.rank, send, recv, displs[0]);
        }
        let send_count = self.int(op, "send count", self.rank, send.len())?;
        let (mut counts_table, mut displs_table) = (IntTable::new(), IntTable::new());
        let mut tables = self.ints(op, "counts", counts, &mut counts_table)?.to_vec();
        tables.extend_from_slice(self.ints(op, "displacements", displs, &mut displs_table)?);
        let size = self.size;
        let job = InFlight::new(op, to_vec(send), recv, tables)?;
        let job = self.run_timed(op, "MPI_Iallgatherv", timeout, job, |job, comm| {
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
        Ok(())
    }

    fn timed_gather_varcount(&self, timeout: Duration, mut args: GatherArgs<'_>) -> Result<()> {
        let op = Op::GatherVarcount;
        let root = self.int(op, "root", self.rank, args.root())?;
        let (send, layout) = args.parts();
        let send_count = self.int(op, "send count", self.rank, send.len())?;
        let (mut counts_table, mut displs_table) = (IntTable::new(), IntTable::new());
        let (recv_init, tables) = match &layout {
            Some(layout) => {
                let mut tables = self
                    .ints(op, "counts", layout.counts, &mut counts_table)?
                    .to_vec();
                tables.extend_from_slice(self.ints(
                    op,
                    "displacements",
                    layout.displs,
                    &mut displs_table,
                )?);
                (&*layout.recv, tables)
            }
            None => (&[][..], Vec::new()),
        };
        let at_root = layout.is_some();
        let size = self.size;
        let job = InFlight::new(op, to_vec(send), recv_init, tables)?;
        let job = self.run_timed(op, "MPI_Igatherv", timeout, job, |job, comm| {
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
            job.copy_out(layout.recv);
        }
        Ok(())
    }

    fn timed_broadcast(&self, timeout: Duration, mut args: BroadcastArgs<'_>) -> Result<()> {
        let op = Op::Broadcast;
        let root = self.int(op, "root", self.rank, args.root())?;
        let buf = args.buf();
        let count = self.int(op, "buffer length", self.rank, buf.len())?;
        let job = InFlight::new(op, Vec::new(), buf, Vec::new())?;
        let job = self.run_timed(op, "MPI_Ibcast", timeout, job, |job, comm| {
            // SAFETY: `job.recv` holds at least `count` bytes (a copy of the caller's
            // buffer), owned by `job` until the request completes or forever; `root` is in
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
        job.copy_out(buf);
        Ok(())
    }

    fn timed_all_reduce(&self, timeout: Duration, mut args: AllReduceArgs<'_>) -> Result<()> {
        let op = Op::AllReduce;
        let count = self.int(op, "element count", self.rank, args.count())?;
        let (dtype, mpi_op) = (args.dtype(), reduce_op(args.op()));
        let wide = widen_half(dtype, args.input());
        let (send, datatype) = match &wide {
            Some(wide) => (bytemuck::cast_slice::<f32, u8>(wide).to_vec(), float_type()),
            None => (to_vec(args.input()), mpi_type(dtype)),
        };
        let recv_init = send.clone();
        let job = InFlight::new(op, send, &recv_init, Vec::new())?;
        let job = self.run_timed(op, "MPI_Iallreduce", timeout, job, |job, comm| {
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
        let (_, recv) = args.parts();
        if wide.is_some() {
            narrow_half(dtype, &job.recv.as_slice()[..recv_init.len()], recv);
        } else {
            job.copy_out(recv);
        }
        Ok(())
    }

    fn timed_all_to_all_varcount(
        &self,
        timeout: Duration,
        mut args: AllToAllArgs<'_>,
    ) -> Result<()> {
        let op = Op::AllToAllVarcount;
        let (send, recv) = args.parts();
        let mut scratch = [
            IntTable::new(),
            IntTable::new(),
            IntTable::new(),
            IntTable::new(),
        ];
        let [a, b, c, d] = &mut scratch;
        let mut tables = self.ints(op, "send counts", send.counts, a)?.to_vec();
        tables.extend_from_slice(self.ints(op, "send displacements", send.displs, b)?);
        tables.extend_from_slice(self.ints(op, "counts", recv.counts, c)?);
        tables.extend_from_slice(self.ints(op, "displacements", recv.displs, d)?);
        let size = self.size;
        let job = InFlight::new(op, to_vec(send.buf), recv.buf, tables)?;
        let job = self.run_timed(op, "MPI_Ialltoallv", timeout, job, |job, comm| {
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
        job.copy_out(recv.buf);
        Ok(())
    }
}

/// What a nonblocking collective works on, owned so that it can outlive the call: the
/// request, copies of the send and receive bytes, and the count/displacement tables.
/// Buffers hold at least one byte, so their address is never `MPI_IN_PLACE`'s (`0x1`).
/// The receive copy is a [`GuardedBuf`]. An `InFlight` abandoned at a deadline, or whose
/// request failed, is leaked (`mem::forget`): MPI may still use it.
struct InFlight {
    request: ffi::MPI_Request,
    send: Vec<u8>,
    recv: GuardedBuf,
    ints: Vec<c_int>,
}

impl InFlight {
    /// `recv` is copied in too: bytes of the caller's receive buffer outside every region
    /// (gaps of a varcount layout) must come back unchanged.
    fn new(op: Op, mut send: Vec<u8>, recv: &[u8], ints: Vec<c_int>) -> Result<Self> {
        if send.is_empty() {
            send.push(0);
        }
        let recv = GuardedBuf::copy_of(op, if recv.is_empty() { &[0] } else { recv })?;
        Ok(Self {
            // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
            request: unsafe { ffi::RSMPI_REQUEST_NULL },
            send,
            recv,
            ints,
        })
    }

    /// Copies the received bytes into the caller's buffer (of the length `new` was given).
    fn copy_out(&self, out: &mut [u8]) {
        let n = out.len();
        copy_slice(out, &self.recv.as_slice()[..n]);
    }
}

/// A receive buffer whose last byte is followed by a `PROT_NONE` page: an anonymous
/// mapping of whole pages plus one guard page, the bytes placed so that they end exactly
/// where the guard begins.
///
/// Why: Open MPI 4.1's shared-memory transport (`btl/vader` with the CMA single-copy
/// mechanism, its default on Linux) moves a message larger than its eager limit (4 KiB)
/// with one `process_vm_readv` of the *sender's* length into the receive buffer, even when
/// the receive count is smaller (it reports `MPI_ERR_TRUNCATE`, after the copy). A peer
/// that sends more than was agreed then overwrote the honest rank's heap (SIGSEGV,
/// `malloc(): corrupted top size`). Into a guarded buffer the kernel copy stops at the
/// guard page with `EFAULT` instead: nothing outside this mapping is written, and MPI
/// reports the truncation as an error. (A user-space copy, as XPMEM does, would fault on
/// the guard page instead: a crash, still no silent corruption.)
struct GuardedBuf {
    /// Start of the mapping (page-aligned).
    map: *mut c_void,
    /// Length of the mapping: the data pages plus the guard page.
    map_len: usize,
    /// Offset of the first byte of data in the mapping.
    start: usize,
    /// Bytes of data (at least one).
    len: usize,
}

impl GuardedBuf {
    /// A guarded buffer holding a copy of `init` (which must not be empty).
    fn copy_of(op: Op, init: &[u8]) -> Result<Self> {
        let os = |call: &'static str| {
            move |e: rustix::io::Errno| TransportError::Os {
                op,
                call,
                source: e.into(),
            }
        };
        let len = init.len().max(1);
        let page = rustix::param::page_size();
        let data_len = len
            .div_ceil(page)
            .checked_mul(page)
            .and_then(|d| d.checked_add(page).map(|m| (d, m)));
        let Some((data_len, map_len)) = data_len else {
            return Err(TransportError::Os {
                op,
                call: "mmap",
                source: std::io::Error::other(format!("a {len}-byte guarded buffer")),
            });
        };
        // SAFETY: a fresh private anonymous mapping at an address the kernel chooses: no
        // existing memory is touched.
        let map = unsafe {
            rustix::mm::mmap_anonymous(
                ptr::null_mut(),
                map_len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(os("mmap"))?;
        let this = Self {
            map,
            map_len,
            start: data_len - len,
            len,
        };
        // SAFETY: `[map + data_len, map + map_len)` is the last page of the mapping just
        // created and owned by `this`; nothing refers to it.
        unsafe {
            rustix::mm::mprotect(
                map.cast::<u8>().add(data_len).cast(),
                page,
                rustix::mm::MprotectFlags::empty(),
            )
        }
        .map_err(os("mprotect"))?;
        // SAFETY: `start + len == data_len`: the data lies inside the readable and writable
        // pages of the mapping, which nothing else refers to yet.
        let data = unsafe { std::slice::from_raw_parts_mut(this.data(), len) };
        copy_slice(&mut data[..init.len()], init);
        Ok(this)
    }

    /// The first byte of data.
    fn data(&self) -> *mut u8 {
        // SAFETY: `start < map_len`: the offset stays inside the mapping.
        unsafe { self.map.cast::<u8>().add(self.start) }
    }

    /// Where MPI writes (valid for `len` bytes, followed by the guard page).
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.data()
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: the `len` data bytes are readable and owned by `self`; `&self` excludes
        // writes through `as_mut_ptr` for the slice's life. MPI writes only while the
        // request is active, and callers read only after it completed.
        unsafe { std::slice::from_raw_parts(self.data(), self.len) }
    }
}

impl Drop for GuardedBuf {
    fn drop(&mut self) {
        // SAFETY: `map`/`map_len` is the mapping created in `copy_of`, owned by `self`;
        // nothing refers to it after drop (an `InFlight` MPI may still use is leaked,
        // never dropped).
        if let Err(e) = unsafe { rustix::mm::munmap(self.map, self.map_len) } {
            tracing::warn!(error = %e, "munmap of a guarded receive buffer failed");
        }
    }
}

/// Waits between two `MPI_Test` polls: yields first, then sleeps from 10 us up to 200 us,
/// so that oversubscribed ranks leave the cores to the peers they wait for.
fn back_off(polls: u32) {
    if polls < 32 {
        std::thread::yield_now();
    } else {
        let shift = (polls - 32).min(5);
        std::thread::sleep(Duration::from_micros((10u64 << shift).min(200)));
    }
}

/// Stand-ins for empty buffers: an empty slice's dangling address (`0x1`) is Open MPI's
/// `MPI_IN_PLACE`, so MPI gets the address of one of these bytes instead.
#[derive(Default)]
struct Scratch {
    send: [u8; 1],
    recv: [u8; 1],
}

/// The address MPI gets for a send buffer.
fn send_ptr(buf: &[u8], scratch: &[u8; 1]) -> *const c_void {
    if buf.is_empty() {
        scratch.as_ptr().cast()
    } else {
        buf.as_ptr().cast()
    }
}

/// The address MPI gets for a receive buffer.
fn recv_ptr(buf: &mut [u8], scratch: &mut [u8; 1]) -> *mut c_void {
    if buf.is_empty() {
        scratch.as_mut_ptr().cast()
    } else {
        buf.as_mut_ptr().cast()
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

/// `MPI_COMM_NULL`.
fn comm_null() -> ffi::MPI_Comm {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_COMM_NULL }
}

/// The predefined MPI type of an element type (`f16` and `bf16`, which MPI lacks, travel
/// widened as [`float_type`]; they map to it here too).
fn mpi_type(dtype: DataType) -> ffi::MPI_Datatype {
    // SAFETY: reading immutable handle constants exported by rsmpi's C shim.
    unsafe {
        match dtype {
            DataType::I8 => ffi::RSMPI_INT8_T,
            DataType::U8 => ffi::RSMPI_UINT8_T,
            DataType::I16 => ffi::RSMPI_INT16_T,
            DataType::U16 => ffi::RSMPI_UINT16_T,
            DataType::I32 => ffi::RSMPI_INT32_T,
            DataType::U32 => ffi::RSMPI_UINT32_T,
            DataType::I64 => ffi::RSMPI_INT64_T,
            DataType::U64 => ffi::RSMPI_UINT64_T,
            DataType::F16 | DataType::Bf16 | DataType::F32 => ffi::RSMPI_FLOAT,
            DataType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

/// `MPI_FLOAT`.
fn float_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_FLOAT }
}

/// The predefined MPI reduction of a [`ReduceOp`].
fn reduce_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading immutable handle constants exported by rsmpi's C shim.
    unsafe {
        match op {
            ReduceOp::Sum => ffi::RSMPI_SUM,
            ReduceOp::Prod => ffi::RSMPI_PROD,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

/// The one-byte datatype bytes travel as (`MPI_UINT8_T`).
fn byte_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Maps a return code to `Ok` or to [`TransportError::Mpi`]; inline, so that success
/// costs one comparison after each MPI call.
#[inline(always)]
fn check(op: Op, call: &'static str, code: c_int) -> Result<()> {
    if code == MPI_SUCCESS {
        Ok(())
    } else {
        Err(mpi_error(op, call, code))
    }
}

/// [`check`] for calls made before `MPI_Init` (the tool interface): Open MPI 4.1 aborts the
/// process when `MPI_Error_class` or `MPI_Error_string` is called before `MPI_Init`, so the
/// code is kept without a class (`-1`) or a description from MPI.
fn check_before_init(op: Op, call: &'static str, code: c_int) -> Result<()> {
    if code == MPI_SUCCESS {
        Ok(())
    } else {
        Err(TransportError::Mpi {
            op,
            call,
            code,
            class: -1,
            message: "not described (MPI is not initialized)".into(),
        })
    }
}

/// Builds [`TransportError::Mpi`] from a failed call's code, with its class and text (off
/// the hot path).
#[cold]
#[inline(never)]
fn mpi_error(op: Op, call: &'static str, code: c_int) -> TransportError {
    let mut class: c_int = -1;
    // SAFETY: `code` was returned by MPI (so MPI is initialized); `class` is a valid place
    // for one int. MPI_Error_class may be called at any thread level for a valid code.
    let rc = unsafe { ffi::MPI_Error_class(code, &mut class) };
    if rc != MPI_SUCCESS {
        class = -1;
    }
    TransportError::Mpi {
        op,
        call,
        code,
        class,
        message: error_string(code),
    }
}

/// Open MPI 4.x's control variable selecting the shared-memory single-copy mechanism.
const SINGLE_COPY_CVAR: &std::ffi::CStr = c"btl_vader_single_copy_mechanism";

/// One control-variable value: an `int` in its first four bytes, zero-padded to 16 bytes.
#[repr(C, align(16))]
struct CvarValue([c_int; 4]);

impl CvarValue {
    fn new(value: c_int) -> Self {
        Self([value, 0, 0, 0])
    }
}

/// The integer value of the enumeration item `wanted` of control variable `index` (an
/// enumerated `int`, as Open MPI declares `btl_vader_single_copy_mechanism`).
fn single_copy_value(op: Op, index: c_int, wanted: &str) -> Result<c_int> {
    let mut name = [0u8; 256];
    let mut name_len = name.len() as c_int;
    let mut desc = [0u8; 1024];
    let mut desc_len = desc.len() as c_int;
    let (mut verbosity, mut bind, mut scope): (c_int, c_int, c_int) = (0, 0, 0);
    // The datatype is not checked: MPI_Type_size may not be called before MPI_Init. Open
    // MPI declares the variable an enumerated `int`; reads and writes go through a
    // zero-padded `CvarValue`, so that even a wider scalar stays in bounds.
    let mut datatype = std::mem::MaybeUninit::<ffi::MPI_Datatype>::uninit();
    let mut enumtype = std::mem::MaybeUninit::<ffi::MPI_T_enum>::uninit();
    // SAFETY: MPI_T is initialized and `index` is a valid control variable; the name and
    // description buffers hold `name_len` and `desc_len` bytes; every other argument is a
    // valid place for one value.
    let code = unsafe {
        ffi::MPI_T_cvar_get_info(
            index,
            name.as_mut_ptr().cast(),
            &mut name_len,
            &mut verbosity,
            datatype.as_mut_ptr(),
            enumtype.as_mut_ptr(),
            desc.as_mut_ptr().cast(),
            &mut desc_len,
            &mut bind,
            &mut scope,
        )
    };
    check_before_init(op, "MPI_T_cvar_get_info", code)?;
    // SAFETY: MPI_T_cvar_get_info succeeded, so it wrote the enumeration handle.
    let enumtype = unsafe { enumtype.assume_init() };
    let mut items: c_int = 0;
    let mut enum_name = [0u8; 256];
    let mut enum_name_len = enum_name.len() as c_int;
    // SAFETY: `enumtype` was returned for this variable; the buffer holds
    // `enum_name_len` bytes; `items` is a valid place for one int.
    let code = unsafe {
        ffi::MPI_T_enum_get_info(
            enumtype,
            &mut items,
            enum_name.as_mut_ptr().cast(),
            &mut enum_name_len,
        )
    };
    check_before_init(op, "MPI_T_enum_get_info", code)?;
    let mut names = Vec::new();
    for item in 0..items {
        let mut value: c_int = 0;
        let mut item_name = [0u8; 256];
        let mut item_len = item_name.len() as c_int;
        // SAFETY: `item < items`; the buffer holds `item_len` bytes; `value` is a valid
        // place for one int.
        let code = unsafe {
            ffi::MPI_T_enum_get_item(
                enumtype,
                item,
                &mut value,
                item_name.as_mut_ptr().cast(),
                &mut item_len,
            )
        };
        check_before_init(op, "MPI_T_enum_get_item", code)?;
        let text = item_name.split(|&b| b == 0).next().unwrap_or_default();
        let text = String::from_utf8_lossy(text).into_owned();
        if text == wanted {
            return Ok(value);
        }
        names.push(text);
    }
    Err(TransportError::Setup(format!(
        "{SINGLE_COPY_CVAR:?} has no value {wanted:?} (it has {names:?})"
    )))
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

/// `MPI_Error_string` of `code`, or a note when MPI cannot describe it.
fn error_string(code: c_int) -> String {
    let mut buf = [0u8; ERROR_STRING_LEN];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING bytes, as MPI_Error_string requires, and
    // `len` is a valid place for one int.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != MPI_SUCCESS {
        return format!("no description (MPI_Error_string failed with code {rc})");
    }
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    let text = &buf[..len];
    let text = text.split(|&b| b == 0).next().unwrap_or_default();
    String::from_utf8_lossy(text).trim_end().to_owned()
}

/// Whether MPI has been finalized.
fn finalized() -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time, even before MPI_Init and after
    // MPI_Finalize; `flag` is a valid place for one int.
    let code = unsafe { ffi::MPI_Finalized(&mut flag) };
    check(Op::Setup, "MPI_Finalized", code)?;
    Ok(flag != 0)
}

/// Fails with [`TransportError::Setup`] unless MPI is initialized and not finalized.
fn ensure_live() -> Result<()> {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Initialized may be called at any time, even before MPI_Init; `flag` is a
    // valid place for one int.
    let code = unsafe { ffi::MPI_Initialized(&mut flag) };
    check(Op::Setup, "MPI_Initialized", code)?;
    if flag == 0 {
        return Err(TransportError::Setup("MPI is not initialized".into()));
    }
    if finalized()? {
        return Err(TransportError::Setup(
            "MPI has already been finalized".into(),
        ));
    }
    Ok(())
}

/// Whether MPI provides `MPI_THREAD_MULTIPLE`.
fn thread_multiple(op: Op) -> Result<bool> {
    let mut provided: c_int = 0;
    // SAFETY: MPI is initialized (callers check); `provided` is a valid place for one int.
    let code = unsafe { ffi::MPI_Query_thread(&mut provided) };
    check(op, "MPI_Query_thread", code)?;
    // SAFETY: reading an immutable constant exported by rsmpi's C shim.
    let multiple = unsafe { ffi::RSMPI_THREAD_MULTIPLE };
    Ok(provided >= multiple)
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
