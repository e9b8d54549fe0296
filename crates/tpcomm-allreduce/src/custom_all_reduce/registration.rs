//! Registered buffers: `register_buffer` (collective) shares a buffer so that its
//! all-reduces are zero-copy, until `unregister` (collective) hands it back; every
//! registration is agreed in a tagged step first.

use std::sync::Arc;

use tpcomm_ipc::{ExchangeId, MemoryRegion, Region};
use tpcomm_transport::Communicator;

use super::launch::check_no_alias;
use super::{open_mut, CustomAllReduce, SlotSource};
use crate::backend::{Backend, Buffer, RANK_DATA_BYTES};
use crate::dispatch::Algorithm;
use crate::dtype::Element;
use crate::error::{AllReduceError, Refused, Result};
use crate::lifecycle::Phase;

/// Which registration [`CustomAllReduce::agree_registration`] agrees on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Registering {
    Buffer = 1,
    Graph = 2,
}

impl Registering {
    fn name(self) -> &'static str {
        match self {
            Registering::Buffer => "register_buffer",
            Registering::Graph => "register_graph_buffers",
        }
    }
}

/// A buffer shared with every peer up front ([`CustomAllReduce::register_buffer`]):
/// all-reduces of it are zero-copy.
///
/// The communicator that registered the buffer keeps it alive for as long as it is
/// registered, also when this token is dropped: a registered buffer is never freed under
/// its peers' mappings, a resume re-exports live memory, and no other allocation can take
/// its address meanwhile (so an address lookup never takes a new buffer for it).
/// [`CustomAllReduce::unregister`] (collective) ends the registration and hands the buffer
/// back; otherwise it lives until the communicator is closed.
#[derive(Debug)]
pub struct RegisteredInput<B: Backend> {
    buffer: Arc<Buffer<B>>,
    slot: usize,
    owner: u64,
}

impl<B: Backend> RegisteredInput<B> {
    /// The registered buffer (write this rank's input into it before reducing).
    pub fn buffer(&self) -> &Buffer<B> {
        &self.buffer
    }

    /// Its RankData slot.
    pub fn slot(&self) -> usize {
        self.slot
    }
}

/// A registration as the communicator keeps it.
#[derive(Debug)]
pub(super) struct Registration<B: Backend> {
    pub(super) slot: usize,
    pub(super) exchange: ExchangeId,
    /// Keeps the buffer alive while registered (see [`RegisteredInput`]).
    pub(super) buffer: Arc<Buffer<B>>,
}

impl<B: Backend> CustomAllReduce<B> {
    /// Tagged step before a registration's exchange: every rank makes the same registration
    /// (`register_buffer` against `register_graph_buffers` would pair one rank's input with
    /// another kind of peer input) into the same RankData slots (`None`: this rank has no
    /// free slot). A difference fails every rank alike, and nothing has changed.
    pub(super) fn agree_registration<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        call: Registering,
        slots: Option<&[usize]>,
    ) -> Result<()> {
        let res = open_mut(&mut self.res, call.name())?;
        let mine: (u8, Option<Vec<u64>>) = (
            call as u8,
            slots.map(|s| s.iter().map(|&s| s as u64).collect()),
        );
        let all: Vec<(u8, Option<Vec<u64>>)> =
            res.peers.agree(comm, tpcomm_ipc::Step::Register, &mine)?;
        let calls: Vec<u64> = all.iter().map(|(c, _)| u64::from(*c)).collect();
        if calls.iter().any(|&c| c != calls[0]) {
            return Err(AllReduceError::Disagreement {
                what: "the registration (1: register_buffer, 2: register_graph_buffers)",
                values: calls,
            });
        }
        if mine.1.is_none() {
            return Err(AllReduceError::SlotsExhausted(self.slots.len()));
        }
        // Every rank's slots, compared at the first position where any differs (u64::MAX:
        // none there, or no free slot at all).
        let at = |r: &(u8, Option<Vec<u64>>), i: usize| {
            r.1.as_ref()
                .and_then(|s| s.get(i))
                .copied()
                .unwrap_or(u64::MAX)
        };
        let longest = all.iter().map(|r| r.1.as_ref().map_or(1, Vec::len)).max();
        if let Some(i) =
            (0..longest.unwrap_or(0)).find(|&i| all.iter().any(|r| at(r, i) != at(&all[0], i)))
        {
            return Err(AllReduceError::Disagreement {
                what: "the RankData slots of the registration (u64::MAX: none)",
                values: all.iter().map(|r| at(r, i)).collect(),
            });
        }
        Ok(())
    }

    /// Collective: shares `buffer` (backend memory, e.g. from [`memory`](Self::memory)) with
    /// every peer so that all-reduces of it are zero-copy
    /// ([`all_reduce_registered`](Self::all_reduce_registered), or
    /// [`all_reduce_buffer`](Self::all_reduce_buffer) of [`RegisteredInput::buffer`]).
    ///
    /// Takes the buffer: the communicator keeps it alive until
    /// [`unregister`](Self::unregister) hands it back (or until close), so a registration
    /// never outlives its memory. Ranks may register buffers of different sizes; a launch
    /// reads at most the smallest, and a larger one is refused with
    /// [`AllReduceError::RegionTooSmall`].
    ///
    /// A refusal hands the buffer back inside the [`Refused`]: the wrong phase, a capture in
    /// progress, no free slot, or a failed exchange (rolled back on every rank). The one
    /// exception: peers' regions that cannot be written into the tables (a forged handle,
    /// [`AllReduceError::PeerMisaligned`]) leave the communicator Failed, and it keeps the
    /// buffer until it is dropped, since peers that accepted the exchange may map it.
    pub fn register_buffer<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        buffer: Buffer<B>,
    ) -> Result<RegisteredInput<B>, Refused<Buffer<B>>> {
        let exchanged = self.exchange_registration(comm, &buffer);
        let (slot, id) = match exchanged {
            Ok(exchanged) => exchanged,
            Err(e) => return Err(Refused::returning(e, buffer)),
        };
        self.slots[slot] = Some(SlotSource::Exchanged(id, 0));
        let buffer = Arc::new(buffer);
        self.buffers.insert(
            buffer.addr(),
            Registration {
                slot,
                exchange: id,
                buffer: buffer.clone(),
            },
        );
        if let Err(e) = self.write_tables() {
            return Err(Refused::keeping(self.lifecycle.fail("register_buffer", e)));
        }
        Ok(RegisteredInput {
            buffer,
            slot,
            owner: self.id,
        })
    }

    /// The checks of [`register_buffer`](Self::register_buffer) and its exchange: the free
    /// slot it takes and the exchange. Changes nothing when it fails.
    fn exchange_registration<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        buffer: &Buffer<B>,
    ) -> Result<(usize, ExchangeId)> {
        self.check_communicator(comm)?;
        self.lifecycle.check_operation("register_buffer")?;
        self.refuse_while_capturing("register_buffer")?;
        // No free slot is agreed like the rest: every rank refuses, nobody waits alone.
        let slot = self.free_slot().ok();
        let slots = slot.map(|s| vec![s]);
        self.agree_registration(comm, Registering::Buffer, slots.as_deref())?;
        let slot = slot.ok_or(AllReduceError::SlotsExhausted(self.slots.len()))?;
        let res = open_mut(&mut self.res, "register_buffer")?;
        let id = res.peers.exchange(
            comm,
            &[Region {
                addr: buffer.addr(),
                len: buffer.len(),
            }],
        )?;
        Ok((slot, id))
    }

    /// Collective: ends the registration of `input` on every rank (every rank passes its
    /// token of the same registration) and hands the buffer back. Every rank first drains
    /// its launches; the ranks agree on the slot (a disagreement is
    /// [`AllReduceError::Disagreement`] on every rank and changes nothing); every rank closes
    /// its mappings of the peers' buffers and zeroes the slot; a final barrier keeps any
    /// rank from freeing its buffer while a peer still maps it. A later resume no longer
    /// exports the buffer, and a new buffer at its address is not taken for it.
    ///
    /// Every refusal hands the token back inside the [`Refused`], so the registration can
    /// still be ended (after a disagreement, a wrong phase, a transport failure) or used.
    /// When a step after the agreement fails (closing the mappings, zeroing the slot, the
    /// final barrier) the communicator is Failed and keeps the buffer until it is dropped:
    /// a peer that missed the barrier may still map it.
    pub fn unregister<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        input: RegisteredInput<B>,
    ) -> Result<Buffer<B>, Refused<RegisteredInput<B>>> {
        let registration = match self.end_registration(comm, &input) {
            Ok(registration) => registration,
            Err(e) => return Err(Refused::returning(e, input)),
        };
        drop(registration);
        match Arc::try_unwrap(input.buffer) {
            Ok(buffer) => Ok(buffer),
            // Unreachable while tokens are not `Clone`: only the token and the registration
            // held the buffer. Kept (not freed) if that ever changes.
            Err(buffer) => {
                let e =
                    AllReduceError::InvalidArgument("the registered buffer is still shared".into());
                Err(Refused::returning(
                    e,
                    RegisteredInput {
                        buffer,
                        slot: input.slot,
                        owner: input.owner,
                    },
                ))
            }
        }
    }

    /// Every step of [`unregister`](Self::unregister) but handing the buffer back: the
    /// registration removed from the communicator, or why not. Past the agreement, a
    /// failure leaves the communicator Failed and the registration kept in `retired`.
    fn end_registration<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        input: &RegisteredInput<B>,
    ) -> Result<Registration<B>> {
        self.check_communicator(comm)?;
        self.lifecycle.check_operation("unregister")?;
        self.refuse_while_capturing("unregister")?;
        // This rank's refusals past the phase checks are agreed with the rest (a tagged
        // step): a token of another communicator or a failed drain fails every rank.
        let owned = self.check_owner("a registered input", input.owner);
        let drained = {
            let res = self.resources("unregister")?;
            self.backend.synchronize(res.peers.backend(), &res.signal)
        };
        let mine = (owned.is_ok() && drained.is_ok()).then_some(input.slot as u64);
        let res = open_mut(&mut self.res, "unregister")?;
        let slots: Vec<Option<u64>> = res.peers.agree(comm, tpcomm_ipc::Step::Unregister, &mine)?;
        owned?;
        if let Err(e) = drained {
            return Err(self.lifecycle.fail("unregister", e));
        }
        let slots: Vec<u64> = slots.iter().map(|s| s.unwrap_or(u64::MAX)).collect();
        if slots.iter().any(|&s| s != slots[0]) {
            return Err(AllReduceError::Disagreement {
                what: "the RankData slot to unregister (u64::MAX: a rank that refused)",
                values: slots,
            });
        }
        let addr = input.buffer.addr();
        let registration = match self.buffers.remove(&addr) {
            Some(r) if r.slot == input.slot => r,
            other => {
                if let Some(r) = other {
                    self.buffers.insert(addr, r);
                }
                return Err(AllReduceError::InvalidArgument(
                    "the input is not registered here".into(),
                ));
            }
        };
        // A slot a capture recorded is retired, never reused: a plan or graph naming it is
        // refused instead of reading whichever buffer took the slot next.
        self.slots[registration.slot] = if self.captured[registration.slot] {
            Some(SlotSource::Retired)
        } else {
            None
        };
        self.slot_limits[registration.slot] = (0, self.rank);
        let Some(res) = self.res.as_mut() else {
            self.retired.push(registration);
            return Err(AllReduceError::WrongState {
                call: "unregister",
                phase: Phase::Closed,
            });
        };
        let released = res.peers.release(registration.exchange);
        let entry = registration.slot * RANK_DATA_BYTES..(registration.slot + 1) * RANK_DATA_BYTES;
        let zeroed = self.backend.write_table(
            res.peers.backend(),
            &res.rank_data,
            entry.start,
            &[0u8; RANK_DATA_BYTES],
        );
        // The slot holds zeros now (or, after a failed write, something unknown): the next
        // rewrite must not take a new registration whose peers' addresses equal the old
        // ones (a buffer at a freed address, in segments peers still map) for written.
        match (&zeroed, self.written.as_mut()) {
            (Ok(()), Some((_, pool))) => {
                if let Some(written) = pool.get_mut(entry) {
                    written.fill(0);
                }
            }
            _ => self.written = None,
        }
        // Every rank closed its mappings of this rank's buffer before it may be freed.
        let barrier = comm.barrier().map_err(AllReduceError::from);
        if let Err(e) = released
            .map_err(AllReduceError::from)
            .and(zeroed)
            .and(barrier)
        {
            self.retired.push(registration);
            return Err(self.lifecycle.fail("unregister", e));
        }
        Ok(registration)
    }

    /// Zero-copy all-reduce of the first `output.len()` elements of a registered input.
    pub fn all_reduce_registered<T: Element>(
        &mut self,
        input: &RegisteredInput<B>,
        output: &mut [T],
    ) -> Result<Algorithm> {
        self.lifecycle.check_operation("all_reduce_registered")?;
        self.check_host_addressable("all_reduce_registered")?;
        self.check_owner("a registered input", input.owner)?;
        let bytes = self.checked_bytes(
            T::DTYPE,
            output.len(),
            input.buffer.len(),
            std::mem::size_of_val(output),
        )?;
        let algorithm = self.choose(T::DTYPE, bytes, false)?;
        let out = output.as_mut_ptr() as u64;
        check_no_alias(algorithm, input.buffer.addr(), out, bytes)?;
        self.launch(
            "all_reduce_registered",
            input.slot,
            T::DTYPE,
            output.len(),
            algorithm,
            out,
            false,
            None,
        )?;
        Ok(algorithm)
    }

    /// The slot of a registered buffer at `addr` holding at least `bytes`, if any. Sound by
    /// address because the communicator keeps every registered buffer alive: no other live
    /// allocation can start there. Captured inputs are never looked up (their buffers may be
    /// freed and their addresses reused; vLLM does not reuse their slots either).
    pub(super) fn slot_of(&self, addr: u64, bytes: usize) -> Option<usize> {
        self.buffers
            .get(&addr)
            .filter(|r| bytes <= r.buffer.len())
            .map(|r| r.slot)
    }
}
