//! Calls that take what they are given (`register_buffer` a buffer, `unregister` a token) and
//! are refused hand it back inside the error, so a refusal loses nothing; a failure past the
//! point where peers may map the buffer keeps it alive in the communicator instead of
//! freeing it. A failed capture leaves nothing pending. Played by rank threads of the local
//! group.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{cause, fill, new_ar, read, unwrap_all, R};
use tpcomm_allreduce::{AllReduceError, Config, CustomAllReduce, DType, HostBackend, Phase};
use tpcomm_ipc::{HostBuffer, HostMemory, MemoryRegion, PeerMemory};
use tpcomm_transport::testing::hooked::Hooked;
use tpcomm_transport::{Communicator, LocalGroup, Op, TransportError};

type Ar = CustomAllReduce<HostBackend>;

/// Whether `memory` still holds a live buffer at `addr` (a freed one cannot be exported).
fn alive(memory: &HostMemory, addr: u64, len: usize) -> bool {
    memory.export(addr, len).is_ok()
}

#[test]
fn a_refused_registration_hands_the_buffer_back() {
    // Slot 0 serves eager inputs: one slot is left for registrations.
    let config = Config {
        slots: 2,
        ..Config::default()
    };
    let results = LocalGroup::new(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, config.clone())?;
        let memory = ar.memory()?.clone();
        let first = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let extra = memory.allocate(4096)?;
        let addr = extra.addr();
        fill(&memory, &extra, comm.rank() as f32 + 1.0, 1024)?;

        let refused = ar.register_buffer(&comm, extra).unwrap_err();
        assert!(
            matches!(refused.error(), AllReduceError::SlotsExhausted(2)),
            "{refused:?}"
        );
        let extra = refused.into_value().expect("the buffer comes back");
        assert_eq!(extra.addr(), addr);

        ar.prepare_for_suspend(&comm)?;
        let refused = ar.register_buffer(&comm, extra).unwrap_err();
        assert!(
            matches!(
                refused.error(),
                AllReduceError::WrongState {
                    call: "register_buffer",
                    phase: Phase::Suspended
                }
            ),
            "{refused:?}"
        );
        let extra = refused.into_value().expect("the buffer comes back");
        assert_eq!(ar.phase(), Phase::Suspended);
        ar.reinit_after_resume(&comm)?;

        // Nothing was lost: with the slot free again the same buffer, contents intact,
        // registers and reduces.
        drop(ar.unregister(&comm, first)?);
        let extra = ar.register_buffer(&comm, extra)?;
        assert_eq!(extra.buffer().addr(), addr);
        let mut out = vec![0f32; 1024];
        ar.all_reduce_registered(&extra, &mut out)?;
        assert_eq!(out, vec![3.0f32; 1024]);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_refused_unregister_hands_the_token_back_and_the_registration_can_still_end() {
    let results = LocalGroup::new(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let mut other = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let x = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let y = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let (x_addr, y_addr) = (x.buffer().addr(), y.buffer().addr());

        // Wrong phase.
        ar.prepare_for_suspend(&comm)?;
        let refused = ar.unregister(&comm, x).unwrap_err();
        assert!(
            matches!(
                refused.error(),
                AllReduceError::WrongState {
                    call: "unregister",
                    phase: Phase::Suspended
                }
            ),
            "{refused:?}"
        );
        let x = refused.into_value().expect("the token comes back");
        ar.reinit_after_resume(&comm)?;

        // Another communicator's token.
        let refused = other.unregister(&comm, x).unwrap_err();
        assert!(
            matches!(refused.error(), AllReduceError::ForeignToken { .. }),
            "{refused:?}"
        );
        let x = refused.into_value().expect("the token comes back");

        // Ranks naming different registrations.
        let (mine, kept) = if comm.rank() == 0 { (x, y) } else { (y, x) };
        let refused = ar.unregister(&comm, mine).unwrap_err();
        assert!(
            matches!(refused.error(), AllReduceError::Disagreement { .. }),
            "{refused:?}"
        );
        let mine = refused.into_value().expect("the token comes back");
        let (x, y) = if comm.rank() == 0 {
            (mine, kept)
        } else {
            (kept, mine)
        };
        assert_eq!(ar.phase(), Phase::Active);

        // Every token still works, and both registrations end.
        let mut out = vec![0f32; 1024];
        fill(&memory, x.buffer(), 1.0, 1024)?;
        comm.barrier()?;
        ar.all_reduce_registered(&x, &mut out)?;
        assert_eq!(out, vec![2.0f32; 1024]);
        assert_eq!(ar.unregister(&comm, x)?.addr(), x_addr);
        assert_eq!(ar.unregister(&comm, y)?.addr(), y_addr);
        other.close_with(&comm)?;
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn an_unregister_whose_final_barrier_fails_keeps_the_buffer_and_fails_the_communicator() {
    // Rank 0's last barrier fails at once; rank 1 waits for it until the group's timeout.
    let group = LocalGroup::new(2).timeout(Duration::from_secs(2));
    let results = group.run(|inner| -> R<()> {
        // Rank 0's barriers fail once `fail_barrier` is set.
        let fail_barrier = AtomicBool::new(false);
        let comm = Hooked::new(&inner, |op| match op {
            Op::Barrier if fail_barrier.load(Ordering::SeqCst) => {
                Err(TransportError::Setup("the test failed this barrier".into()))
            }
            _ => Ok(()),
        });
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let input = ar.register_buffer(&comm, memory.allocate(4096)?)?;
        let addr = input.buffer().addr();
        fail_barrier.store(comm.rank() == 0, Ordering::SeqCst);

        let refused = ar.unregister(&comm, input).unwrap_err();
        assert!(
            matches!(refused.error(), AllReduceError::Failed { .. }),
            "{refused:?}"
        );
        assert!(
            matches!(cause(refused.error()), AllReduceError::Transport(_)),
            "{refused:?}"
        );
        assert_eq!(ar.phase(), Phase::Failed);
        // The token comes back, but dropping it does not free the buffer: a peer that
        // missed the barrier may still map it.
        drop(refused.into_value().expect("the token comes back"));
        assert!(
            alive(&memory, addr, 4096),
            "rank {}: the buffer was freed although a peer may map it",
            comm.rank()
        );
        // The communicator frees it when it goes (the observation above can fail).
        drop(ar);
        assert!(!alive(&memory, addr, 4096), "freed with the communicator");
        Ok(())
    });
    unwrap_all(results);
}

/// Captures an all-reduce of a fresh input (`rank + 1` everywhere) into `out`, registers
/// and replays it: what a communicator must still do after an abandoned capture.
fn capture_and_replay_a_fresh_input<C: Communicator>(
    ar: &mut Ar,
    comm: &C,
    out: &HostBuffer,
) -> R<Vec<f32>> {
    let memory = ar.memory()?.clone();
    let input = memory.allocate(4096)?;
    fill(&memory, &input, comm.rank() as f32 + 1.0, 1024)?;
    let plan = ar.capture(|cap| cap.all_reduce(&input, out, DType::F32, 1024).map(drop))?;
    assert_eq!(ar.register_graph_buffers(comm)?, 1);
    comm.barrier()?;
    plan.replay(ar)?;
    read(&memory, out, 1024)
}

#[test]
fn a_failed_capture_leaves_no_input_pending() {
    let results = LocalGroup::new(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let out = memory.allocate(4096)?;
        let abandoned = memory.allocate(4096)?;
        let failed = ar.capture(|cap| {
            cap.all_reduce(&abandoned, &out, DType::F32, 1024)?;
            Err(AllReduceError::InvalidArgument("the engine gave up".into()))
        });
        assert!(
            matches!(failed, Err(AllReduceError::InvalidArgument(_))),
            "{failed:?}"
        );
        assert_eq!(ar.pending_graph_buffers(), 0);
        ar.check_replay()?;
        // Its input may go: the next registration exports nothing of it.
        drop(abandoned);
        assert_eq!(ar.register_graph_buffers(&comm)?, 0);

        capture_and_replay_a_fresh_input(&mut ar, &comm, &out)
    });
    for out in unwrap_all(results) {
        assert_eq!(out, vec![3.0f32; 1024]);
    }
}

/// A capture whose closure panics (and the engine catches the panic) takes no slot either.
#[test]
fn a_capture_that_panics_leaves_no_input_pending() {
    let results = LocalGroup::new(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let out = memory.allocate(4096)?;
        let abandoned = memory.allocate(4096)?;
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = ar.capture(|cap| {
                cap.all_reduce(&abandoned, &out, DType::F32, 1024)?;
                panic!("the engine's capture code panicked");
            });
        }));
        assert!(panicked.is_err());
        assert_eq!(ar.pending_graph_buffers(), 0);
        ar.check_replay()?;
        drop(abandoned);
        assert_eq!(ar.register_graph_buffers(&comm)?, 0);
        Ok(())
    });
    unwrap_all(results);
}

/// A plan borrows its inputs only while it lives: dropped, its input may be freed while the
/// communicator still has it pending. Registration then shares this rank's staging bytes in
/// its place (nobody can replay the plan any more) instead of failing on every rank for good.
#[test]
fn a_plan_dropped_with_its_input_before_registration_does_not_block_registration() {
    let results = LocalGroup::new(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let out = memory.allocate(4096)?;
        let abandoned = memory.allocate(4096)?;
        let plan =
            ar.capture(|cap| cap.all_reduce(&abandoned, &out, DType::F32, 1024).map(drop))?;
        drop(plan);
        drop(abandoned);
        assert_eq!(ar.register_graph_buffers(&comm)?, 1);

        capture_and_replay_a_fresh_input(&mut ar, &comm, &out)
    });
    for out in unwrap_all(results) {
        assert_eq!(out, vec![3.0f32; 1024]);
    }
}

/// The same after registration: the next resume re-exports this rank's regions, and shares
/// its staging bytes for the dropped plan's input instead of failing every rank.
#[test]
fn a_plan_dropped_with_its_input_after_registration_does_not_fail_the_next_resume() {
    let results = LocalGroup::new(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let out = memory.allocate(4096)?;
        let kept_input = memory.allocate(4096)?;
        fill(&memory, &kept_input, comm.rank() as f32 + 1.0, 1024)?;
        let kept = ar.capture(|cap| {
            cap.all_reduce(&kept_input, &out, DType::F32, 1024)
                .map(drop)
        })?;
        let abandoned = memory.allocate(4096)?;
        let plan =
            ar.capture(|cap| cap.all_reduce(&abandoned, &out, DType::F32, 1024).map(drop))?;
        assert_eq!(ar.register_graph_buffers(&comm)?, 2);
        drop(plan);
        drop(abandoned);
        ar.prepare_for_suspend(&comm)?;
        ar.reinit_after_resume(&comm)?;
        assert_eq!(ar.phase(), Phase::Active);
        kept.replay(&mut ar)?;
        read(&memory, &out, 1024)
    });
    for out in unwrap_all(results) {
        assert_eq!(out, vec![3.0f32; 1024]);
    }
}

/// A close without the ranks' agreement (`close`, or a drop) retires the buffers peers map
/// (Signal, staging, temp; carved when `max_bytes` is small): a peer still copying a
/// two-stage result from this rank's temp buffer, or late with its start flag, finds the
/// old buffers, never a new buffer of this process carved over them.
#[test]
fn a_non_collective_close_never_hands_the_buffers_peers_map_to_a_new_allocation() {
    let config = Config {
        max_bytes: 64 << 10,
        ..Config::default()
    };
    let results = LocalGroup::new(2).run(|comm| -> R<()> {
        let mut ar = new_ar(&comm, config.clone())?;
        let memory = ar.memory()?.clone();
        // Keeps the chunk alive after the close, so that its extents could be handed out.
        let _keep = memory.allocate(4096)?;
        let mut old = Vec::new();
        for (index, len) in [(0, 4096), (1, 64 << 10), (2, 64 << 10)] {
            let addr = ar.base_address(comm.rank(), index)?;
            old.push(addr..addr + len);
        }
        comm.barrier()?;
        ar.close()?;
        let mut held = Vec::new();
        for _ in 0..3 {
            let fresh = memory.allocate(64 << 10)?;
            let range = fresh.addr()..fresh.addr() + fresh.len() as u64;
            assert!(
                old.iter().all(|o| o.end <= range.start || range.end <= o.start),
                "rank {}: a new buffer {range:x?} was carved over the closed communicator's {old:x?}",
                comm.rank()
            );
            held.push(fresh);
        }
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_communicator_of_another_group_is_refused_and_changes_nothing() {
    let results = LocalGroup::new(2).run(|comm| -> R<Vec<f32>> {
        let mut ar = new_ar(&comm, Config::default())?;
        let memory = ar.memory()?.clone();
        let alone = comm.split(Some(comm.rank() as u32), 0)?.expect("a color");
        let wrong = |e: &AllReduceError| {
            matches!(e, AllReduceError::Ipc(e) if matches!(**e, tpcomm_ipc::IpcError::WrongCommunicator { size: 2, comm_size: 1, .. }))
        };
        let refused = ar
            .register_buffer(&alone, memory.allocate(4096)?)
            .unwrap_err();
        assert!(wrong(refused.error()), "{refused:?}");
        let input = ar.register_buffer(&comm, refused.into_value().expect("handed back"))?;
        let refused = ar.unregister(&alone, input).unwrap_err();
        assert!(wrong(refused.error()), "{refused:?}");
        let input = refused.into_value().expect("handed back");
        for outcome in [
            ar.prepare_for_suspend(&alone),
            ar.reinit_after_resume(&alone),
            ar.register_graph_buffers(&alone).map(drop),
        ] {
            assert!(matches!(&outcome, Err(e) if wrong(e)), "{outcome:?}");
        }
        assert_eq!(ar.phase(), Phase::Active);
        ar.prepare_for_suspend(&comm)?;
        ar.reinit_after_resume(&comm)?;
        fill(&memory, input.buffer(), comm.rank() as f32 + 1.0, 1024)?;
        comm.barrier()?;
        let mut out = vec![0f32; 1024];
        ar.all_reduce_registered(&input, &mut out)?;
        drop(ar.unregister(&comm, input)?);
        Ok(out)
    });
    for out in unwrap_all(results) {
        assert_eq!(out, vec![3.0f32; 1024]);
    }
}
