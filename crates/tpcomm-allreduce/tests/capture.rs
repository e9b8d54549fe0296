//! The device-graph bookkeeping of `CustomAllReduce`, without a GPU: a backend that records
//! launches while "capturing" (as CUDA stream capture does) and runs them on the host
//! otherwise. It checks slot assignment during a capture, the refusals before registration,
//! the table contents after registration and after a resume that moves every peer mapping,
//! and the results of the registered launches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tpcomm_allreduce::backend::{Backend, Launch};
use tpcomm_allreduce::{
    AllReduceError, Config, CustomAllReduce, DType, Element, HostBackend, Phase,
};
use tpcomm_ipc::{HostBuffer, HostMemory, MemoryRegion, PeerMemory};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
mod holds;
use common::{check, forward_to_inner, inputs, read, run_seed, unwrap_all, R};

/// The host backend, plus a capture switch: while on, launches are recorded (slot, count)
/// instead of run, and `CustomAllReduce` sees [`Backend::capturing`] true.
#[derive(Debug, Default)]
struct Recording {
    inner: HostBackend,
    capturing: AtomicBool,
    recorded: Mutex<Vec<(usize, usize)>>,
}

impl Backend for Recording {
    type Memory = HostMemory;

    forward_to_inner!(signal_bytes, nonce_offset, reset_signal);

    fn name(&self) -> &'static str {
        "recording"
    }
    fn launch(&self, memory: &HostMemory, l: &Launch<'_, Self>) -> R<()> {
        if self.capturing.load(Ordering::SeqCst) {
            self.recorded.lock().unwrap().push((l.slot, l.count));
            return Ok(());
        }
        l.run_on(&self.inner, memory)
    }
    fn stage(
        &self,
        memory: &HostMemory,
        input: &HostBuffer,
        staging: &HostBuffer,
        range: std::ops::Range<usize>,
    ) -> R<()> {
        assert!(
            !self.capturing.load(Ordering::SeqCst),
            "the driver staged (copied) an input during a capture"
        );
        self.inner.stage(memory, input, staging, range)
    }
    fn capturing(&self) -> R<bool> {
        Ok(self.capturing.load(Ordering::SeqCst))
    }
    fn synchronize(&self, memory: &HostMemory, own_signal: &HostBuffer) -> R<()> {
        // As a CUDA stream refuses to synchronize while it is being captured.
        if self.capturing.load(Ordering::SeqCst) {
            return Err(AllReduceError::InvalidArgument(
                "the stream is being captured".into(),
            ));
        }
        self.inner.synchronize(memory, own_signal)
    }
}

/// A communicator over the recording backend, and its memory.
fn recording<C: Communicator>(comm: &C) -> R<(CustomAllReduce<Recording>, HostMemory)> {
    let memory = HostMemory::new();
    let ar = CustomAllReduce::new(
        Recording::default(),
        memory.clone(),
        comm,
        Config::default(),
    )?;
    Ok((ar, memory))
}

fn fill<T: Element>(memory: &HostMemory, buf: &HostBuffer, v: &[T]) -> R<()> {
    Ok(memory.write(buf, 0, bytemuck::cast_slice(v))?)
}

#[test]
fn captured_inputs_take_slots_in_order_and_run_only_after_registration() {
    let seed = run_seed();
    let results = LocalGroup::new(3)
        .timeout(Duration::from_secs(60))
        .run(|comm| -> R<()> {
            let (mut ar, memory) = recording(&comm)?;
            let count = 4096;
            let a = memory.allocate(count * 4)?;
            let b = memory.allocate(count * 4)?;
            let out = memory.allocate(count * 4)?;

            ar.backend().capturing.store(true, Ordering::SeqCst);
            ar.all_reduce_buffer(&a, &out, DType::F32, count)?;
            ar.all_reduce_buffer(&b, &out, DType::F32, 1024)?;
            ar.all_reduce_buffer(&a, &out, DType::F32, count)?;
            // Registering writes the tables: refused during the capture, nothing changes.
            assert!(matches!(
                ar.register_graph_buffers(&comm),
                Err(AllReduceError::InvalidArgument(_))
            ));
            assert!(matches!(
                ar.prepare_for_suspend(&comm),
                Err(AllReduceError::InvalidArgument(_))
            ));
            ar.backend().capturing.store(false, Ordering::SeqCst);

            // Slot 0 is the staging buffer's; captured calls get 1, 2, 3: one slot per
            // call, `a` captured twice takes two.
            assert_eq!(
                *ar.backend().recorded.lock().unwrap(),
                vec![(1, count), (2, 1024), (3, count)]
            );
            assert_eq!(ar.pending_graph_buffers(), 3);
            assert_eq!(
                ar.rank_data_slot(1)?,
                vec![0; 3],
                "written before registration"
            );
            assert!(matches!(
                ar.check_replay(),
                Err(AllReduceError::UnregisteredGraphBuffers)
            ));
            // Outside the capture, a captured input is an ordinary eager input: staged, never
            // looked up by address (its slot is the captured call's, not the buffer's).
            let data = inputs::<f32>(seed + 2, comm.rank(), count);
            fill(&memory, &a, &data)?;
            comm.barrier()?;
            ar.all_reduce_buffer(&a, &out, DType::F32, count)?;
            check(seed + 2, comm.size(), &read(&memory, &out, count)?)
                .map_err(AllReduceError::InvalidArgument)?;
            comm.barrier()?;
            assert_eq!(ar.phase(), Phase::Active);

            assert_eq!(ar.register_graph_buffers(&comm)?, 3);
            ar.check_replay()?;
            let mut slot_a = ar.rank_data_slot(1)?;
            assert_eq!(
                slot_a[comm.rank()],
                a.addr(),
                "own entry is the local buffer"
            );
            assert!(slot_a.iter().all(|&p| p != 0));
            assert_eq!(ar.rank_data_slot(2)?[comm.rank()], b.addr());
            assert_eq!(ar.rank_data_slot(3)?, slot_a, "`a` again, in its own slot");

            // Suspend, hold every old peer address so the reopen must move, resume: the
            // slot's peer entries are rewritten in place, the own entry never moves.
            let holds = holds::suspend_holding(&comm, &mut ar, |ar| {
                slot_a = ar.rank_data_slot(1)?;
                Ok((slot_a.iter().enumerate())
                    .filter(|&(r, _)| r != comm.rank())
                    .map(|(_, &p)| p)
                    .collect())
            })?;
            ar.reinit_after_resume(&comm)?;
            drop(holds);
            let moved = ar.rank_data_slot(1)?;
            for (r, (&before, &after)) in slot_a.iter().zip(&moved).enumerate() {
                if r == comm.rank() {
                    assert_eq!(after, before);
                } else {
                    assert_ne!(after, before, "rank {r}'s mapping did not move");
                }
            }
            let data = inputs::<f32>(seed + 1, comm.rank(), count);
            fill(&memory, &a, &data)?;
            comm.barrier()?;
            ar.all_reduce_buffer(&a, &out, DType::F32, count)?;
            check(seed + 1, comm.size(), &read(&memory, &out, count)?)
                .map_err(AllReduceError::InvalidArgument)?;
            comm.barrier()?;
            Ok(())
        });
    unwrap_all(results);
}

#[test]
fn a_captured_registered_buffer_keeps_its_slot_retired_after_unregister() {
    // A device graph does not borrow its inputs: after the registered buffer it captured is
    // unregistered, the slot must never go to another registration (the graph would then
    // silently reduce that buffer); replay_graph refuses it (tests/cuda.rs).
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(60))
        .run(|comm| -> R<()> {
            let (mut ar, memory) = recording(&comm)?;
            let out = memory.allocate(4096)?;
            let captured = ar.register_buffer(&comm, memory.allocate(4096)?)?;
            let never_captured = ar.register_buffer(&comm, memory.allocate(4096)?)?;
            let (captured_slot, free_slot) = (captured.slot(), never_captured.slot());
            ar.backend().capturing.store(true, Ordering::SeqCst);
            ar.all_reduce_buffer(captured.buffer(), &out, DType::F32, 1024)?;
            ar.backend().capturing.store(false, Ordering::SeqCst);
            assert_eq!(
                *ar.backend().recorded.lock().unwrap(),
                vec![(captured_slot, 1024)],
                "a registered input is recorded with its own slot"
            );
            drop(ar.unregister(&comm, captured)?);
            drop(ar.unregister(&comm, never_captured)?);
            let next = ar.register_buffer(&comm, memory.allocate(4096)?)?;
            assert_eq!(next.slot(), free_slot, "an uncaptured slot is reused");
            let after = ar.register_buffer(&comm, memory.allocate(4096)?)?;
            assert_ne!(after.slot(), captured_slot, "a captured slot is retired");
            assert_eq!(ar.rank_data_slot(captured_slot)?, vec![0; 2]);
            Ok(())
        });
    unwrap_all(results);
}

/// Calls refused during a capture change nothing: the next call takes the slot the refused
/// one would have taken (every rank's `k`-th captured call must name slot `k`), nothing is
/// pending for it, and the communicator stays Active.
#[test]
fn a_call_refused_during_a_capture_takes_no_slot_and_leaves_the_communicator_active() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(60))
        .run(|comm| -> R<()> {
            let (mut ar, memory) = recording(&comm)?;
            let count = 64;
            let a = memory.allocate(count * 4)?;
            let out = memory.allocate(count * 4)?;
            ar.backend().capturing.store(true, Ordering::SeqCst);
            // In place, one-stage: peers would read the input while it is overwritten.
            assert!(matches!(
                ar.all_reduce_buffer(&a, &a, DType::F32, count),
                Err(AllReduceError::InvalidArgument(_))
            ));
            assert_eq!(
                ar.pending_graph_buffers(),
                0,
                "the refused call took a slot"
            );
            assert!(matches!(
                ar.synchronize(),
                Err(AllReduceError::InvalidArgument(_))
            ));
            assert_eq!(ar.phase(), Phase::Active);
            ar.all_reduce_buffer(&a, &out, DType::F32, count)?;
            ar.backend().capturing.store(false, Ordering::SeqCst);
            assert_eq!(*ar.backend().recorded.lock().unwrap(), vec![(1, count)]);
            assert_eq!(ar.pending_graph_buffers(), 1);
            ar.register_graph_buffers(&comm)?;
            ar.synchronize()?;
            Ok(())
        });
    unwrap_all(results);
}
