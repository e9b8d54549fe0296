//! What MPI state this module keeps per process: the lock that serializes MPI calls when
//! MPI lacks `MPI_THREAD_MULTIPLE`, and the marker of `MPI_Finalize` (an attribute on
//! `MPI_COMM_SELF` whose delete callback runs first in `MPI_Finalize`), so that a
//! communicator kept past the universe returns errors instead of calling MPI.

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use mpi::ffi;

use super::conv::{check, MPI_SUCCESS};
use crate::error::{Op, Result, TransportError};

/// Serializes this module's MPI calls when MPI does not provide `MPI_THREAD_MULTIPLE`.
static MPI_CALLS: Mutex<()> = Mutex::new(());

/// Set when `MPI_Finalize` begins, by the delete callback of an attribute that the first
/// communicator attaches to `MPI_COMM_SELF` ([`watch_finalize`]): MPI frees `MPI_COMM_SELF`
/// first thing in `MPI_Finalize`, running that callback. Every collective checks it holding
/// the lock (the callback takes the lock too), so nothing calls MPI once finalizing began:
/// rsmpi's `Universe` finalizes on drop, and nothing ties a communicator's life to it.
pub(super) static FINALIZING: AtomicBool = AtomicBool::new(false);

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
pub(super) fn watch_finalize(op: Op) -> Result<()> {
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
pub(super) fn ensure_not_finalizing(op: Op) -> Result<()> {
    if FINALIZING.load(Ordering::Acquire) {
        return Err(TransportError::Setup(format!(
            "{op} after MPI_Finalize: drop every MpiCommunicator before the Universe"
        )));
    }
    Ok(())
}

/// Takes the process-wide MPI lock. No code panics while holding it, so a poisoned lock is
/// still usable.
pub(super) fn lock_mpi() -> MutexGuard<'static, ()> {
    MPI_CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether MPI has been finalized.
pub(super) fn finalized() -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time, even before MPI_Init and after
    // MPI_Finalize; `flag` is a valid place for one int.
    let code = unsafe { ffi::MPI_Finalized(&mut flag) };
    check(Op::Setup, "MPI_Finalized", code)?;
    Ok(flag != 0)
}

/// Fails with [`TransportError::Setup`] unless MPI is initialized and not finalized.
pub(super) fn ensure_live() -> Result<()> {
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
pub(super) fn thread_multiple(op: Op) -> Result<bool> {
    let mut provided: c_int = 0;
    // SAFETY: MPI is initialized (callers check); `provided` is a valid place for one int.
    let code = unsafe { ffi::MPI_Query_thread(&mut provided) };
    check(op, "MPI_Query_thread", code)?;
    // SAFETY: reading an immutable constant exported by rsmpi's C shim.
    let multiple = unsafe { ffi::RSMPI_THREAD_MULTIPLE };
    Ok(provided >= multiple)
}
