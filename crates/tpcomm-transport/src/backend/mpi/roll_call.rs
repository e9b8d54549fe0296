//! The roll call of the timed path: who is still there when a collective does not complete.
//!
//! `/proc` tells a rank whether a peer *on its own host* still exists; a peer on another host
//! (another kernel or PID namespace) cannot be checked that way, and neither can a peer that
//! lives but is stopped or stuck. So a timed communicator keeps a duplicate of itself for a
//! roll call, and every rank waiting in one of its timed collectives:
//!
//! - keeps a receive for a *call* posted on it (any source), and while it polls a collective
//!   answers every call that arrived (an *answer* echoing the caller's number), remembering
//!   which peers called it in the collective it waits in (a peer that calls is alive);
//! - when its own collective is still not complete at `timeout - grace` (see [`grace`]),
//!   calls every peer not known to be gone, and collects their answers until the deadline.
//!
//! At the deadline, the peers that neither answered nor called are *silent*: they are not
//! waiting in this communicator's collectives (dead with their host, stopped, cut off by the
//! network, or busy elsewhere). Every message carries the caller's collective number (the
//! count of timed collectives this communicator ran, the same on every rank in step), so a
//! late answer or call of an earlier collective is not taken for one of this one.
//!
//! The messages are 8 bytes on a communicator of their own; a send to a peer that is gone
//! never completes, so sends are tested while polling and, at the end, released with
//! `MPI_Request_free` and their 8-byte payloads leaked. Receives still posted when a
//! collective completes are cancelled (`MPI_Cancel`, then `MPI_Wait`).

use std::ffi::c_int;
use std::time::Duration;

use mpi::ffi;

use super::conv::{check, comm_null, mpi_error, MPI_SUCCESS};
use super::free_comm;
use crate::error::{Op, Result};

/// The tag of a call.
const CALL: c_int = 1;
/// The tag of an answer.
const ANSWER: c_int = 2;

/// How long before its deadline a waiting rank calls the roll: a quarter of the timeout, at
/// most one second (a peer that is polling answers within milliseconds, over TCP too).
pub(super) fn grace(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(1))
}

/// A posted receive and the 8 bytes it receives into (boxed: the address must stay put
/// while MPI owns it).
struct Posted {
    request: ffi::MPI_Request,
    word: Box<u64>,
}

/// A rank's roll-call state on one timed communicator (see the module docs).
pub(super) struct RollCall {
    /// The duplicate the messages travel on, with `MPI_ERRORS_RETURN`.
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    /// The receive of calls from any peer, always posted.
    standing: Posted,
    /// The number of the collective this rank waits in (or ran last).
    current: u64,
    /// Per peer: the number of the last collective it called this rank from.
    called: Vec<Option<u64>>,
    /// Per peer: the receive of its answer to this rank's call in the current collective.
    answers: Vec<Option<Posted>>,
    /// Per peer: whether it answered this rank's call in the current collective.
    answered: Vec<bool>,
    /// Sends not known complete, with their payloads.
    sends: Vec<(ffi::MPI_Request, Box<u64>)>,
}

impl RollCall {
    /// Duplicates `parent` (collective over it) and posts the receive of calls. The caller
    /// holds the MPI lock if one is needed.
    pub(super) fn new(parent: ffi::MPI_Comm, rank: usize, size: usize) -> Result<Self> {
        let op = Op::Setup;
        let mut comm = comm_null();
        // SAFETY: `parent` is a live communicator owned by the caller; `comm` is a valid
        // place for the new handle; every rank of `parent` makes this call (arming a
        // timeout is collective).
        let code = unsafe { ffi::MPI_Comm_dup(parent, &mut comm) };
        check(op, "MPI_Comm_dup", code)?;
        // SAFETY: `comm` was just created; `MPI_ERRORS_RETURN` is a predefined handler.
        let code = unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
        if let Err(e) = check(op, "MPI_Comm_set_errhandler", code) {
            let _ = free_comm(&mut comm);
            return Err(e);
        }
        let standing = match post(comm, any_source(), CALL) {
            Ok(posted) => posted,
            Err(code) => {
                let _ = free_comm(&mut comm);
                return Err(mpi_error(op, "MPI_Irecv", code));
            }
        };
        Ok(Self {
            comm,
            rank,
            size,
            standing,
            current: 0,
            called: vec![None; size],
            answers: (0..size).map(|_| None).collect(),
            answered: vec![false; size],
            sends: Vec::new(),
        })
    }

    /// A new collective begins: its number, the answers of the last one forgotten.
    pub(super) fn begin(&mut self) {
        self.cancel_answers();
        self.current += 1;
        self.answered.iter_mut().for_each(|a| *a = false);
    }

    /// Answers the calls that arrived, takes in the answers to this rank's call, and lets go
    /// of the sends that completed. A failing MPI call is logged and ends this pass: the
    /// roll call then names fewer peers as alive, never more.
    pub(super) fn service(&mut self) {
        if let Err((call, code)) = self.service_calls() {
            tracing::warn!(
                rank = self.rank,
                call,
                code,
                "the roll call's receive of calls failed"
            );
        }
        for peer in 0..self.size {
            if let Err((call, code)) = self.take_answer(peer) {
                tracing::warn!(
                    rank = self.rank,
                    peer,
                    call,
                    code,
                    "a roll-call answer failed"
                );
            }
        }
        let mut kept = Vec::with_capacity(self.sends.len());
        for (mut request, word) in self.sends.drain(..) {
            match completed(&mut request) {
                Ok(true) => {}
                Ok(false) => kept.push((request, word)),
                Err(code) => {
                    // Whether MPI is done with the payload is unknown: keep it valid.
                    tracing::warn!(code, "completing a roll-call send failed");
                    std::mem::forget(word);
                }
            }
        }
        self.sends = kept;
    }

    /// Calls every peer of `peers` (this rank's collective is late).
    pub(super) fn call(&mut self, peers: &[usize]) {
        let (rank, size) = (self.rank, self.size);
        for &peer in peers.iter().filter(|&&p| p != rank && p < size) {
            if self.answers[peer].is_none() {
                match post(self.comm, peer as c_int, ANSWER) {
                    Ok(posted) => self.answers[peer] = Some(posted),
                    Err(code) => {
                        tracing::warn!(
                            rank = self.rank,
                            peer,
                            code,
                            "posting a roll-call answer receive failed"
                        );
                        continue;
                    }
                }
            }
            if let Err(code) = self.send(peer, self.current, CALL) {
                tracing::warn!(rank = self.rank, peer, code, "a roll call failed to start");
            }
        }
    }

    /// The peers of `peers` that neither answered this rank's call nor called it, in this
    /// collective.
    pub(super) fn silent(&self, peers: &[usize]) -> Vec<usize> {
        peers
            .iter()
            .copied()
            .filter(|&p| p != self.rank && p < self.size)
            .filter(|&p| !self.answered[p] && self.called[p] != Some(self.current))
            .collect()
    }

    /// Takes every call that arrived: records its caller and answers it.
    fn service_calls(&mut self) -> std::result::Result<(), (&'static str, c_int)> {
        loop {
            let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
            let mut done: c_int = 0;
            // SAFETY: `standing.request` is an active receive on the live `self.comm` (or
            // MPI_REQUEST_NULL after a failed repost, for which get_status reports done
            // with an empty status); `done` and `status` are valid places.
            let code = unsafe {
                ffi::MPI_Request_get_status(self.standing.request, &mut done, status.as_mut_ptr())
            };
            if code != MPI_SUCCESS {
                return Err(("MPI_Request_get_status", code));
            }
            if done == 0 || self.standing.request == request_null() {
                return Ok(());
            }
            // SAFETY: get_status succeeded with `done` set, so it wrote the status.
            let source = unsafe { status.assume_init() }.MPI_SOURCE;
            // SAFETY: the request is complete: MPI_Wait frees it at once.
            let code =
                unsafe { ffi::MPI_Wait(&mut self.standing.request, ffi::RSMPI_STATUS_IGNORE) };
            if code != MPI_SUCCESS {
                return Err(("MPI_Wait", code));
            }
            let number = *self.standing.word;
            if let Some(peer) = usize::try_from(source).ok().filter(|&p| p < self.size) {
                self.called[peer] = Some(number);
                if let Err(code) = self.send(peer, number, ANSWER) {
                    tracing::warn!(
                        rank = self.rank,
                        peer,
                        code,
                        "a roll-call answer failed to start"
                    );
                }
            }
            match post(self.comm, any_source(), CALL) {
                Ok(posted) => self.standing = posted,
                Err(code) => {
                    self.standing.request = request_null();
                    return Err(("MPI_Irecv", code));
                }
            }
        }
    }

    /// Takes `peer`'s answer if it arrived: one to this collective's call counts, a late one
    /// to an earlier call is dropped and the receive posted again.
    fn take_answer(&mut self, peer: usize) -> std::result::Result<(), (&'static str, c_int)> {
        let Some(posted) = self.answers[peer].as_mut() else {
            return Ok(());
        };
        if !completed(&mut posted.request).map_err(|code| ("MPI_Wait", code))? {
            return Ok(());
        }
        let number = *posted.word;
        self.answers[peer] = None;
        if number == self.current {
            self.answered[peer] = true;
        } else {
            let posted = post(self.comm, peer as c_int, ANSWER).map_err(|c| ("MPI_Irecv", c))?;
            self.answers[peer] = Some(posted);
        }
        Ok(())
    }

    /// Starts an 8-byte send of `number` to `peer` with `tag`, kept until it completes.
    fn send(&mut self, peer: usize, number: u64, tag: c_int) -> std::result::Result<(), c_int> {
        let word = Box::new(number);
        let mut request = request_null();
        // SAFETY: `word` is 8 bytes that stay at their address until the send completes
        // (kept in `self.sends`, or leaked); `peer` is a rank of the live `self.comm`;
        // `request` is a valid place for the request.
        let code = unsafe {
            ffi::MPI_Isend(
                (&*word as *const u64).cast(),
                1,
                ffi::RSMPI_UINT64_T,
                peer as c_int,
                tag,
                self.comm,
                &mut request,
            )
        };
        if code != MPI_SUCCESS {
            return Err(code);
        }
        self.sends.push((request, word));
        Ok(())
    }

    /// Cancels the receives of answers still posted.
    fn cancel_answers(&mut self) {
        for posted in self.answers.iter_mut().filter_map(Option::take) {
            cancel(posted);
        }
    }

    /// The end of a communicator that is not broken: the receives are cancelled, the sends
    /// released (one to a peer that is gone may never complete: its payload is leaked), and
    /// the duplicate freed.
    pub(super) fn close(mut self) {
        self.cancel_answers();
        let standing = std::mem::replace(
            &mut self.standing,
            Posted {
                request: request_null(),
                word: Box::new(0),
            },
        );
        cancel(standing);
        for (mut request, word) in self.sends.drain(..) {
            if matches!(completed(&mut request), Ok(true)) {
                continue;
            }
            // SAFETY: `request` is an active send request; freeing it lets the send complete
            // on its own, reading `word`, which is leaked below so that it stays valid.
            let code = unsafe { ffi::MPI_Request_free(&mut request) };
            if code != MPI_SUCCESS {
                tracing::warn!(code, "MPI_Request_free of a roll-call send failed");
            }
            std::mem::forget(word);
        }
        if let Err(e) = free_comm(&mut self.comm) {
            tracing::warn!(error = %e, "freeing the roll call's communicator failed");
        }
    }
}

/// `MPI_ANY_SOURCE`.
fn any_source() -> c_int {
    // SAFETY: reading an immutable constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_ANY_SOURCE }
}

/// `MPI_REQUEST_NULL`.
fn request_null() -> ffi::MPI_Request {
    // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// Posts an 8-byte receive from `source` with `tag` on `comm`; the MPI code on failure.
fn post(comm: ffi::MPI_Comm, source: c_int, tag: c_int) -> std::result::Result<Posted, c_int> {
    let mut posted = Posted {
        request: request_null(),
        word: Box::new(0),
    };
    // SAFETY: `posted.word` is 8 writable bytes that stay at their address while the
    // receive is active (the box moves with `posted`, its heap block does not); `comm` is
    // live; `posted.request` is a valid place for the request.
    let code = unsafe {
        ffi::MPI_Irecv(
            (&mut *posted.word as *mut u64).cast(),
            1,
            ffi::RSMPI_UINT64_T,
            source,
            tag,
            comm,
            &mut posted.request,
        )
    };
    if code == MPI_SUCCESS {
        Ok(posted)
    } else {
        Err(code)
    }
}

/// Whether `request` completed (then it is freed and set to `MPI_REQUEST_NULL`).
fn completed(request: &mut ffi::MPI_Request) -> std::result::Result<bool, c_int> {
    if *request == request_null() {
        return Ok(true);
    }
    let mut done: c_int = 0;
    // SAFETY: `*request` is an active point-to-point request of this module; `done` is a
    // valid place; the status is ignored.
    let code =
        unsafe { ffi::MPI_Request_get_status(*request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
    if code != MPI_SUCCESS {
        return Err(code);
    }
    if done == 0 {
        return Ok(false);
    }
    // SAFETY: the request is complete: MPI_Wait frees it at once. Errors of point-to-point
    // requests go to their communicator's handler, `MPI_ERRORS_RETURN` here.
    let code = unsafe { ffi::MPI_Wait(request, ffi::RSMPI_STATUS_IGNORE) };
    if code == MPI_SUCCESS {
        Ok(true)
    } else {
        Err(code)
    }
}

/// Cancels a posted receive and completes it (matched or cancelled); its buffer is freed
/// only once MPI is done with it, and leaked if completing fails.
fn cancel(mut posted: Posted) {
    if posted.request == request_null() {
        return;
    }
    // SAFETY: `posted.request` is an active receive of this module.
    let code = unsafe { ffi::MPI_Cancel(&mut posted.request) };
    if code != MPI_SUCCESS {
        tracing::warn!(code, "MPI_Cancel of a roll-call receive failed");
        std::mem::forget(posted);
        return;
    }
    // SAFETY: a cancelled receive completes (cancelled, or matched just before): MPI_Wait
    // returns and frees it, after which MPI no longer writes `posted.word`.
    let code = unsafe { ffi::MPI_Wait(&mut posted.request, ffi::RSMPI_STATUS_IGNORE) };
    if code != MPI_SUCCESS {
        tracing::warn!(code, "completing a cancelled roll-call receive failed");
        std::mem::forget(posted);
    }
}
