//! Ranks that disagree: registered buffers of different sizes, different element counts or
//! types in one launch, plans and tokens passed to another communicator, captures in
//! different orders, a registration that fails half-way, registrations outliving their
//! buffers. Each case is played by rank threads of the local group behaving differently,
//! and each must end in a typed error (or the right result), never in an out-of-bounds
//! read or a silently wrong sum.

mod common;

use std::time::Duration;

use common::{cause, fill, forward_to_inner, group, new_ar, read, unwrap_all, R};
use tpcomm_allreduce::{AllReduceError, Config, CustomAllReduce, DType, HostBackend, Phase};
use tpcomm_ipc::{FaultInjection, FaultPoint, HostBuffer, HostMemory, MemoryRegion, PeerMemory};
use tpcomm_transport::{Communicator, LocalGroup};

#[test]
fn a_launch_past_the_smallest_registered_region_is_refused_before_reading() {
    // Rank 0 registers 4 KiB, rank 1 16 KiB; rank 1 reduces 16 KiB, which would read 12 KiB
    // past rank 0's region. Rank 1 refuses before anything is read (and stays usable);
    // rank 0, waiting for it at the start barrier, times out naming rank 1.
    let results = group(2).run(|comm| -> R<()> {
        let config = Config {
            timeout: Duration::from_secs(2),
            ..Config::default()
        };
        let mut ar = new_ar(&comm, config)?;
        let memory = ar.memory()?.clone();
        let len = if comm.rank() == 0 { 1024 } else { 4096 };
        let input = ar.register_buffer(&comm, memory.allocate(len * 4)?)?;
        fill(&memory, input.buffer(), 1.0, len)?;
        comm.barrier()?;
        let mut out = vec![0f32; len];
        let outcome = ar.all_reduce_registered(&input, &mut out);
        if comm.rank() == 1 {
            match outcome {
                Err(AllReduceError::RegionTooSmall {
                    buffer: "input",
                    slot,
                    bytes: 16384,
                    rank: 0,
                    region_bytes: 4096,
                }) if slot == input.slot() => {}
                other => panic!("rank 1: expected RegionTooSmall naming rank 0, got {other:?}"),
            }
            assert_eq!(ar.phase(), Phase::Active);
        } else {
            match outcome.as_ref().map_err(cause) {
                Err(AllReduceError::Timeout { peer: 1, .. }) => {}
                other => panic!("rank 0: expected a timeout naming rank 1, got {other:?}"),
            }
        }
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn registered_regions_of_different_sizes_reduce_up_to_the_smallest() {
    let results = group(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let len = if comm.rank() == 0 { 1024 } else { 4096 };
        let input = ar.register_buffer(&comm, memory.allocate(len * 4)?)?;
        fill(&memory, input.buffer(), comm.rank() as f32 + 1.0, len)?;
        comm.barrier()?;
        let mut out = vec![0f32; 1024];
        ar.all_reduce_registered(&input, &mut out)?;
        Ok(out)
    });
    for out in unwrap_all(results) {
        assert_eq!(out, vec![3.0f32; 1024]);
    }
}

/// Each rank reduces `counts[rank]` f32 elements (eager); returns each rank's outcome and
/// phase after it.
fn eager_with_counts(counts: &[usize]) -> Vec<(R<()>, Phase)> {
    let counts = counts.to_vec();
    let results = group(counts.len()).run(move |comm| -> R<(R<()>, Phase)> {
        let mut ar = new_ar(&comm, Config::default())?;
        let count = counts[comm.rank()];
        let input = vec![comm.rank() as f32 + 1.0; count];
        let mut out = vec![0f32; count];
        let outcome = ar.all_reduce(&input, &mut out).map(drop);
        Ok((outcome, ar.phase()))
    });
    unwrap_all(results)
}

#[test]
fn ranks_reducing_different_counts_fail_on_every_rank_naming_both_sizes() {
    // Before: Ok on both ranks, rank 1's second half holding stale peer data.
    let outcomes = eager_with_counts(&[1024, 2048]);
    for (rank, (outcome, phase)) in outcomes.iter().enumerate() {
        let (mine, theirs) = if rank == 0 {
            (4096, 8192)
        } else {
            (8192, 4096)
        };
        match outcome.as_ref().map_err(cause) {
            Err(AllReduceError::LaunchMismatch {
                rank: r,
                bytes,
                dtype: "f32",
                slot: Some(0),
                peer,
                peer_bytes,
                peer_dtype: "f32",
                peer_slot: Some(0),
            }) if *r == rank && *bytes == mine && *peer == 1 - rank && *peer_bytes == theirs => {}
            other => panic!("rank {rank}: expected a LaunchMismatch, got {other:?}"),
        }
        assert_eq!(*phase, Phase::Failed, "rank {rank}");
    }
}

#[test]
fn ranks_reducing_different_element_types_of_equal_bytes_fail_on_every_rank() {
    let results = group(2).run(|comm| -> R<R<()>> {
        let mut ar = new_ar(&comm, Config::default())?;
        Ok(if comm.rank() == 0 {
            ar.all_reduce(&[1f32; 1024], &mut [0f32; 1024]).map(drop)
        } else {
            let one = half::f16::from_f32(1.0);
            ar.all_reduce(&[one; 2048], &mut [one; 2048]).map(drop)
        })
    });
    for (rank, outcome) in unwrap_all(results).into_iter().enumerate() {
        let (dtype, peer_dtype) = if rank == 0 {
            ("f32", "f16")
        } else {
            ("f16", "f32")
        };
        match outcome.as_ref().map_err(cause) {
            Err(AllReduceError::LaunchMismatch {
                bytes: 4096,
                peer_bytes: 4096,
                dtype: d,
                peer_dtype: p,
                ..
            }) if **d == *dtype && **p == *peer_dtype => {}
            other => panic!("rank {rank}: expected a LaunchMismatch, got {other:?}"),
        }
    }
}

#[test]
fn ranks_whose_sizes_choose_different_algorithms_all_fail_without_waiting_out_the_timeout() {
    // Four ranks: 4 KiB is one-stage, 1 MiB two-stage. Without the shape check rank 0 would
    // wait in the end barrier and the others in the mid barrier until the 30 s timeout.
    let outcomes = eager_with_counts(&[1024, 256 << 10, 256 << 10, 256 << 10]);
    for (rank, (outcome, _)) in outcomes.iter().enumerate() {
        match outcome.as_ref().map_err(cause) {
            Err(AllReduceError::LaunchMismatch { rank: r, peer, .. })
                if *r == rank && (rank == 0) != (*peer == 0) => {}
            other => panic!("rank {rank}: expected a LaunchMismatch, got {other:?}"),
        }
    }
}

#[test]
fn an_eager_call_against_a_peers_registered_input_fails_on_both_ranks_without_a_timeout() {
    // 8 KiB on 2 ranks: the eager call (staging slot) takes two-stage, the registered input
    // one-stage. The slots differ, so the shape check refuses both before their barriers
    // differ: no rank waits in a mid barrier its peer never crosses (that would end in a
    // `Timeout` after 30 s, not a `LaunchMismatch`).
    let results = group(2).run(|comm| -> R<()> {
        let config = Config {
            timeout: Duration::from_secs(30),
            ..Config::default()
        };
        let mut ar = new_ar(&comm, config)?;
        let memory = ar.memory()?.clone();
        let input = ar.register_buffer(&comm, memory.allocate(8 << 10)?)?;
        let mut out = vec![0f32; 2048];
        let outcome = if comm.rank() == 0 {
            ar.all_reduce(&[1.0f32; 2048], &mut out)
        } else {
            ar.all_reduce_registered(&input, &mut out)
        };
        match outcome.as_ref().map_err(cause) {
            Err(AllReduceError::LaunchMismatch {
                slot, peer_slot, ..
            }) if (*slot == Some(0)) != (*peer_slot == Some(0)) => {}
            other => panic!("expected a LaunchMismatch naming both slots, got {other:?}"),
        }
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_plan_or_registered_input_used_on_another_communicator_is_refused() {
    // Before: the other communicator's slot is free (zero addresses): null dereference.
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let mut other = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(4096)?;
        let out = memory.allocate(4096)?;
        fill(&memory, &input, comm.rank() as f32 + 1.0, 1024)?;
        let plan = ar.capture(|cap| cap.all_reduce(&input, &out, DType::F32, 1024).map(drop))?;
        ar.register_graph_buffers(&comm)?;
        comm.barrier()?;
        match plan.replay(&mut other) {
            Err(AllReduceError::ForeignToken {
                what: "a captured plan",
                ..
            }) => {}
            got => panic!("expected a refusal, got {got:?}"),
        }
        let registered = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        match other.all_reduce_registered(&registered, &mut [0f32; 1024]) {
            Err(AllReduceError::ForeignToken {
                what: "a registered input",
                ..
            }) => {}
            got => panic!("expected a refusal, got {got:?}"),
        }
        assert_eq!(other.phase(), Phase::Active);
        // On its own communicator the plan replays.
        plan.replay(&mut ar)?;
        assert_eq!(read(&memory, &out, 1024)?, vec![3.0f32; 1024]);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn inputs_captured_in_different_orders_reduce_call_by_call() {
    // Rank 0 captures [a, b, a, d], rank 1 [a, b, c, b]. Deduplicating by address gave
    // rank 0 three slots and rank 1 three others, paired wrongly: call #2 returned 3 on one
    // rank and 30-odd on the other. One slot per call pairs call k with call k.
    let values = [[1.0f32, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]];
    let orders = [[0usize, 1, 0, 3], [0, 1, 2, 1]];
    let results = group(2).run(|comm| -> R<Vec<Vec<f32>>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let n = 256;
        let inputs: Vec<HostBuffer> = (0..4)
            .map(|_| memory.allocate(n * 4))
            .collect::<Result<_, _>>()?;
        let outs: Vec<HostBuffer> = (0..4)
            .map(|_| memory.allocate(n * 4))
            .collect::<Result<_, _>>()?;
        for (buf, &v) in inputs.iter().zip(&values[comm.rank()]) {
            fill(&memory, buf, v, n)?;
        }
        let order = orders[comm.rank()];
        let plan = ar.capture(|cap| {
            for (call, &input) in order.iter().enumerate() {
                cap.all_reduce(&inputs[input], &outs[call], DType::F32, n)?;
            }
            Ok(())
        })?;
        assert_eq!(ar.pending_graph_buffers(), 4, "one slot per captured call");
        assert_eq!(ar.register_graph_buffers(&comm)?, 4);
        comm.barrier()?;
        plan.replay(&mut ar)?;
        outs.iter().map(|o| read(&memory, o, n)).collect()
    });
    for (rank, outs) in unwrap_all(results).into_iter().enumerate() {
        for (call, out) in outs.iter().enumerate() {
            let want = values[0][orders[0][call]] + values[1][orders[1][call]];
            assert_eq!(out, &vec![want; 256], "rank {rank}, call #{call}");
        }
    }
}

#[test]
fn calls_captured_with_different_sizes_fail_registration_on_every_rank() {
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(8192)?;
        let out = memory.allocate(8192)?;
        let count = if comm.rank() == 0 { 1024 } else { 2048 };
        let plan = ar.capture(|cap| cap.all_reduce(&input, &out, DType::F32, count).map(drop))?;
        match ar.register_graph_buffers(&comm).as_ref().map_err(cause) {
            Err(AllReduceError::CaptureMismatch {
                call: 0,
                rank,
                bytes,
                peer,
                peer_bytes,
            }) if *rank == comm.rank()
                && *bytes == count * 4
                && *peer == 1 - comm.rank()
                && *peer_bytes == if comm.rank() == 0 { 8192 } else { 4096 } => {}
            other => panic!("expected a CaptureMismatch, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Failed);
        assert!(plan.replay(&mut ar).is_err());
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_failed_graph_registration_keeps_replays_refused_and_can_be_repeated() {
    // Before: the pending slots were emptied before the exchange failed, so check_replay
    // passed and replays read address 0.
    let results = group(2).run(|comm| -> R<()> {
        let memory = FaultInjection::new(HostMemory::new());
        let mut ar = CustomAllReduce::new(
            HostBackend::<FaultInjection<HostMemory>>::new(),
            memory.clone(),
            &comm,
            Config::default(),
        )?;
        let a = memory.allocate(4096)?;
        let b = memory.allocate(4096)?;
        let out_a = memory.allocate(4096)?;
        let out_b = memory.allocate(4096)?;
        fill(&memory, &a, comm.rank() as f32 + 1.0, 1024)?;
        fill(&memory, &b, 10.0 * (comm.rank() as f32 + 1.0), 1024)?;
        let plan = ar.capture(|cap| {
            cap.all_reduce(&a, &out_a, DType::F32, 1024)?;
            cap.all_reduce(&b, &out_b, DType::F32, 1024)?;
            Ok(())
        })?;
        if comm.rank() == 1 {
            memory.arm(FaultPoint::Open, 1);
        }
        match ar.register_graph_buffers(&comm) {
            Err(AllReduceError::Ipc(_)) => {}
            other => panic!("expected the injected open failure, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Active);
        assert_eq!(ar.pending_graph_buffers(), 2);
        assert!(matches!(
            ar.check_replay(),
            Err(AllReduceError::UnregisteredGraphBuffers)
        ));
        assert!(matches!(
            plan.replay(&mut ar),
            Err(AllReduceError::UnregisteredGraphBuffers)
        ));
        // Registration can be repeated; then the plan replays.
        assert_eq!(ar.register_graph_buffers(&comm)?, 2);
        ar.check_replay()?;
        comm.barrier()?;
        plan.replay(&mut ar)?;
        assert_eq!(read(&memory, &out_a, 1024)?, vec![3.0f32; 1024]);
        assert_eq!(read(&memory, &out_b, 1024)?, vec![30.0f32; 1024]);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_dropped_registration_keeps_its_buffer_alive_through_suspend_and_resume() {
    // Before: the registered buffer could be freed (the token only borrowed it) and the
    // resume re-exported freed memory: every rank Failed.
    let results = group(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        drop(input);
        ar.prepare_for_suspend(&comm)?;
        ar.reinit_after_resume(&comm)?;
        assert_eq!(ar.phase(), Phase::Active);
        let mut out = vec![0f32; 1024];
        ar.all_reduce(&[comm.rank() as f32 + 1.0; 1024], &mut out)?;
        Ok(out)
    });
    for out in unwrap_all(results) {
        assert_eq!(out, vec![3.0f32; 1024]);
    }
}

#[test]
fn an_unregistered_buffer_is_not_exported_again_nor_taken_for_a_new_buffer() {
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let out = memory.allocate(64 << 10)?;
        let open_before = ar.peer_mappings()?.counters().open;
        let input = ar.register_buffer(&comm, memory.allocate(64 << 10)?)?;
        let (slot, addr) = (input.slot(), input.buffer().addr());
        assert_eq!(ar.peer_mappings()?.counters().open, open_before + 1);
        fill(&memory, input.buffer(), comm.rank() as f32 + 1.0, 16 << 10)?;
        comm.barrier()?;
        ar.all_reduce_buffer(input.buffer(), &out, DType::F32, 16 << 10)?;
        assert_eq!(read(&memory, &out, 16 << 10)?, vec![3.0f32; 16 << 10]);

        let buffer = ar.unregister(&comm, input)?;
        assert_eq!(buffer.addr(), addr, "the registered buffer comes back");
        assert_eq!(ar.peer_mappings()?.counters().open, open_before);
        assert_eq!(ar.rank_data_slot(slot)?, vec![0; 2], "the slot is cleared");
        // Free it and allocate again, one rank at a time so that the allocator is likely to
        // hand the same address back; whether it does or not, the new buffer is an
        // ordinary (staged) input: the peers' old mappings are gone.
        let mut buffer = Some(buffer);
        let mut fresh = None;
        for turn in 0..comm.size() {
            if turn == comm.rank() {
                buffer = None;
                fresh = Some(memory.allocate(64 << 10)?);
            }
            comm.barrier()?;
        }
        assert!(buffer.is_none());
        let fresh = fresh.expect("allocated in this rank's turn");
        fill(&memory, &fresh, 10.0 * (comm.rank() as f32 + 1.0), 16 << 10)?;
        comm.barrier()?;
        ar.all_reduce_buffer(&fresh, &out, DType::F32, 16 << 10)?;
        assert_eq!(
            read(&memory, &out, 16 << 10)?,
            vec![30.0f32; 16 << 10],
            "new buffer at {:#x} (the unregistered one was at {addr:#x})",
            fresh.addr()
        );
        comm.barrier()?;
        // Nothing of the unregistered buffer is exported on resume.
        ar.prepare_for_suspend(&comm)?;
        ar.reinit_after_resume(&comm)?;
        ar.all_reduce_buffer(&fresh, &out, DType::F32, 16 << 10)?;
        assert_eq!(read(&memory, &out, 16 << 10)?, vec![30.0f32; 16 << 10]);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn ranks_unregistering_or_reducing_different_registrations_are_refused() {
    let results = group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let x = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let y = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let (kept, spent) = if comm.rank() == 0 { (y, x) } else { (x, y) };
        let spent_slot = spent.slot();
        match ar.unregister(&comm, spent).map_err(|r| r.into_error()) {
            Err(AllReduceError::Disagreement { values, .. }) => {
                assert_eq!(values.len(), 2);
                assert_ne!(values[0], values[1]);
            }
            other => panic!("expected a disagreement, got {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Active);
        assert!(ar.rank_data_slot(spent_slot)?.iter().all(|&p| p != 0));
        // Reducing different registrations (rank 0 `y`, rank 1 `x`: equal sizes, other
        // slots) would sum other buffers than each rank passed: the slot travels with the
        // launch's shape, so both ranks refuse.
        match ar
            .all_reduce_registered(&kept, &mut [0f32; 1024])
            .as_ref()
            .map_err(cause)
        {
            Err(AllReduceError::LaunchMismatch {
                slot, peer_slot, ..
            }) if *slot == Some(kept.slot()) && *peer_slot == Some(spent_slot) => {}
            other => panic!("expected a LaunchMismatch naming both slots, got {other:?}"),
        }
        Ok(())
    });
    unwrap_all(results);
}

/// The host backend with a Signal layout `extra` bytes larger: a rank built with another
/// layout.
#[derive(Debug, Default)]
struct LargerSignal {
    inner: HostBackend,
    extra: usize,
}

impl tpcomm_allreduce::Backend for LargerSignal {
    type Memory = HostMemory;

    forward_to_inner!(nonce_offset, reset_signal, stage);

    fn name(&self) -> &'static str {
        "host-larger-signal"
    }
    fn signal_bytes(&self) -> usize {
        self.inner.signal_bytes() + self.extra
    }
    fn launch(
        &self,
        _memory: &HostMemory,
        _launch: &tpcomm_allreduce::backend::Launch<'_, Self>,
    ) -> R<()> {
        unreachable!("the communicator is never created")
    }
}

#[test]
fn a_peer_with_another_signal_layout_is_refused_at_creation_on_every_rank() {
    let results = LocalGroup::new(2)
        .timeout(Duration::from_secs(10))
        .run(|comm| {
            let backend = LargerSignal {
                inner: HostBackend::new(),
                extra: if comm.rank() == 1 { 4096 } else { 0 },
            };
            CustomAllReduce::new(backend, HostMemory::new(), &comm, Config::default()).map(drop)
        });
    let outcomes: Vec<R<()>> = results
        .into_iter()
        .map(|r| r.expect("rank thread"))
        .collect();
    // The layouts are part of what `new` agrees on: both ranks refuse, naming the field,
    // before anything reads a peer's Signal block. (`write_tables` also refuses a peer Signal
    // region smaller than this backend's layout, `SignalTooSmall`, should a backend's
    // agreed size ever differ from what it maps.)
    for (rank, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Err(AllReduceError::ConfigMismatch { field, values })
                if field == "signal_bytes" && values[0].1 != values[1].1 => {}
            other => panic!("rank {rank}: expected a signal_bytes mismatch, got {other:?}"),
        }
    }
}

/// Host memory whose exports, once `shift` is set, announce the range 4 bytes further into
/// the same genuine segment: a peer forging its handles inside memory it owns.
#[derive(Debug, Clone, Default)]
struct ShiftedExports {
    inner: HostMemory,
    shift: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl PeerMemory for ShiftedExports {
    type Handle = tpcomm_ipc::HostHandle;
    type Buffer = HostBuffer;
    type Mapping = tpcomm_ipc::HostMapping;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn allocate(&self, bytes: usize) -> tpcomm_ipc::Result<HostBuffer> {
        self.inner.allocate(bytes)
    }
    fn export(&self, addr: u64, len: usize) -> tpcomm_ipc::Result<Self::Handle> {
        let mut handle = self.inner.export(addr, len)?;
        if self.shift.load(std::sync::atomic::Ordering::SeqCst) {
            handle.offset += 4;
            handle.len -= 4;
        }
        Ok(handle)
    }
    fn open(&self, handle: &Self::Handle) -> tpcomm_ipc::Result<Self::Mapping> {
        self.inner.open(handle)
    }
    fn close(&self, mapping: Self::Mapping) -> tpcomm_ipc::Result<()> {
        self.inner.close(mapping)
    }
    fn write<M: MemoryRegion>(
        &self,
        region: &M,
        offset: usize,
        src: &[u8],
    ) -> tpcomm_ipc::Result<()> {
        self.inner.write(region, offset, src)
    }
    fn read<M: MemoryRegion>(
        &self,
        region: &M,
        offset: usize,
        dst: &mut [u8],
    ) -> tpcomm_ipc::Result<()> {
        self.inner.read(region, offset, dst)
    }
}

#[test]
fn a_peer_sharing_a_misaligned_input_is_refused_before_any_launch_reads_it() {
    // Rank 1 shares its registered buffer 4 bytes into its segment: a valid range of a
    // genuine segment, but the reduction reads elements (and the kernels 16-byte packs)
    // where the table says. Rank 0 must refuse to write that address into its tables.
    let results = group(2).run(|comm| -> (usize, R<()>) {
        let memory = ShiftedExports::default();
        let outcome = (|| {
            let mut ar = CustomAllReduce::new(
                HostBackend::<ShiftedExports>::new(),
                memory.clone(),
                &comm,
                Config::default(),
            )?;
            let input = memory.allocate(4096)?;
            if comm.rank() == 1 {
                memory
                    .shift
                    .store(true, std::sync::atomic::Ordering::SeqCst);
            }
            match ar.register_buffer(&comm, input) {
                Ok(_) => Ok(()),
                Err(refused) => {
                    // Peers that accepted the exchange may map it: the communicator keeps it.
                    assert!(refused.value().is_none(), "{refused:?}");
                    Err(refused.into_error())
                }
            }
        })();
        (comm.rank(), outcome)
    });
    let outcomes: Vec<(usize, R<()>)> = results
        .into_iter()
        .map(|r| r.expect("rank thread"))
        .collect();
    let (_, rank0) = &outcomes[0];
    match rank0.as_ref().map_err(cause) {
        Err(AllReduceError::PeerMisaligned {
            rank: 1,
            region: "input",
            addr,
            align: 16,
        }) if addr % 16 == 4 => {}
        other => panic!("rank 0: expected rank 1's input refused as misaligned, got {other:?}"),
    }
}

/// A group whose waits end after 5 s: a rank left waiting alone fails the test soon.
fn short_group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(5))
}

#[test]
fn register_buffer_against_register_graph_buffers_fails_every_rank() {
    // Rank 0 registers its captured input while rank 1 registers a buffer into the same
    // slot: both exchanges carried one region, so each rank paired its input with another
    // kind of peer input, and both returned Ok.
    let results = short_group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(4096)?;
        let out = memory.allocate(4096)?;
        let outcome = if comm.rank() == 0 {
            let _plan =
                ar.capture(|cap| cap.all_reduce(&input, &out, DType::F32, 1024).map(drop))?;
            ar.register_graph_buffers(&comm).map(drop)
        } else {
            ar.register_buffer(&comm, memory.allocate(4096)?)
                .map(drop)
                .map_err(|refused| refused.into_error())
        };
        match outcome {
            Err(AllReduceError::Disagreement { what, values }) => {
                assert!(what.contains("registration"), "{what}");
                assert_eq!(values, [2, 1]);
            }
            other => panic!(
                "rank {}: expected a disagreement, got {other:?}",
                comm.rank()
            ),
        }
        assert_eq!(ar.phase(), Phase::Active);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_rank_without_a_free_slot_fails_register_buffer_on_every_rank() {
    // Slot 0 serves eager calls, slot 1 is the only other. Rank 0's capture takes it (not
    // registered yet); rank 1 has it free. Rank 0 refused alone and rank 1 waited in the
    // exchange until the group's timeout.
    let config = Config {
        slots: 2,
        ..Config::default()
    };
    let results = short_group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, config.clone())?;
        let memory = ar.memory()?.clone();
        let input = memory.allocate(4096)?;
        let out = memory.allocate(4096)?;
        let _plan = (comm.rank() == 0)
            .then(|| ar.capture(|cap| cap.all_reduce(&input, &out, DType::F32, 1024).map(drop)))
            .transpose()?;
        let refused = ar
            .register_buffer(&comm, memory.allocate(4096)?)
            .map(drop)
            .map_err(|refused| refused.into_error());
        match (comm.rank(), refused) {
            (0, Err(AllReduceError::SlotsExhausted(2))) => {}
            (1, Err(AllReduceError::Disagreement { values, .. })) => {
                assert_eq!(values, [u64::MAX, 1]);
            }
            (rank, other) => panic!("rank {rank}: {other:?}"),
        }
        // Both are still in step: a collective after it pairs.
        comm.barrier()?;
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_closed_rank_takes_the_transport_fallback_with_its_peers() {
    // 3 f32 (12 bytes) is a fallback size (with `AnyOrder`: `BitStable` pads it into one
    // custom launch instead). A rank whose communicator was closed returned WrongState
    // before deciding the route, while its peer waited in the transport's all-reduce until
    // the group's timeout.
    let results = short_group(2).run(|comm| -> R<()> {
        let config = Config {
            reproducibility: tpcomm_allreduce::dispatch::Reproducibility::AnyOrder,
            ..Config::default()
        };
        let mut ar = new_ar(&comm, config)?;
        if comm.rank() == 1 {
            ar.close()?;
        }
        let input = [comm.rank() as f32 + 1.0; 3];
        let mut out = [0f32; 3];
        let route = ar.all_reduce_or_transport(&comm, &input, &mut out)?;
        assert!(
            matches!(route, tpcomm_allreduce::HostRoute::Transport(_)),
            "{route:?}"
        );
        assert_eq!(out, [3.0; 3]);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn close_with_another_communicator_is_refused_and_closes_nothing() {
    let results = short_group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let alone = comm
            .split(Some(comm.rank() as u32), 0)?
            .expect("every rank has a color");
        if comm.rank() == 0 {
            match ar.close_with(&alone) {
                Err(AllReduceError::Ipc(e))
                    if matches!(*e, tpcomm_ipc::IpcError::WrongCommunicator { .. }) => {}
                other => panic!("expected WrongCommunicator, got {other:?}"),
            }
            assert_eq!(ar.phase(), Phase::Active);
        }
        ar.close_with(&comm)?;
        assert_eq!(ar.phase(), Phase::Closed);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_foreign_token_on_one_rank_fails_unregister_on_every_rank() {
    // Rank 0 passes the token of another communicator. It refused alone while rank 1
    // waited in the slot's all-gather until the group's timeout.
    let results = short_group(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let mut other = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let mine = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let foreign = other.register_buffer(&comm, memory.allocate(4096)?)?;
        let token = if comm.rank() == 0 { foreign } else { mine };
        match (
            comm.rank(),
            ar.unregister(&comm, token).map_err(|r| r.into_error()),
        ) {
            (0, Err(AllReduceError::ForeignToken { .. })) => {}
            (1, Err(AllReduceError::Disagreement { values, .. })) => {
                assert_eq!(values, [u64::MAX, 1]);
            }
            (rank, other) => panic!("rank {rank}: {other:?}"),
        }
        assert_eq!(ar.phase(), Phase::Active);
        comm.barrier()?;
        Ok(())
    });
    unwrap_all(results);
}
