//! Every collective step of the registry carries a tag (operation, group, sequence): a peer
//! in another step is named by every rank in a tagged step, and nothing it sent is decoded
//! or opened.

use tpcomm_ipc::{
    tagged_all_gather, HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory, Region, Step,
    StepTag,
};
use tpcomm_transport::Communicator;

mod common;
use common::{done, group, region};

fn mismatch(e: IpcError) -> (usize, StepTag, Option<StepTag>) {
    match e {
        IpcError::StepMismatch {
            rank,
            expected,
            found,
        } => (rank, expected, found),
        other => panic!("not a step mismatch: {other:?}"),
    }
}

/// Rank 1 reopens while ranks 0 and 2 exchange a new region: all three fail the step, naming
/// the first rank elsewhere, and nothing was opened.
#[test]
fn a_peer_in_another_registry_step_is_named_and_nothing_is_opened() {
    let results = group(3).run(|comm| -> tpcomm_ipc::Result<()> {
        let mem = HostMemory::new();
        let a = mem.allocate(4096)?;
        let b = mem.allocate(4096)?;
        let mut peers = PeerMappings::new(mem, &comm)?;
        peers.exchange(&comm, &[region(&a)])?;
        let open_before = peers.counters().open;
        let outcome = if comm.rank() == 1 {
            peers.close_all()?;
            peers.reopen_all(&comm)
        } else {
            peers.exchange(&comm, &[region(&b)]).map(drop)
        };
        let (rank, expected, found) = mismatch(outcome.unwrap_err());
        let found = found.expect("a tagged step");
        if comm.rank() == 1 {
            assert_eq!(
                (rank, expected.step, found.step),
                (0, Step::Reopen, Step::Exchange)
            );
        } else {
            assert_eq!(
                (rank, expected.step, found.step),
                (1, Step::Exchange, Step::Reopen)
            );
            assert_eq!(peers.counters().open, open_before, "nothing was opened");
        }
        assert_eq!(found.group, expected.group, "same registry, same group");
        assert_eq!(found.sequence, expected.sequence, "same position");
        Ok(())
    });
    done(results);
}

/// The same operation at another position of the sequence (a rank that skipped a step) or
/// of another group (another registry on the same communicator) is refused too.
#[test]
fn the_same_operation_at_another_sequence_or_of_another_group_is_refused() {
    let results = group(2).run(|comm| {
        let me = comm.rank() as u64;
        let sequence = StepTag {
            step: Step::Exchange,
            group: 7,
            sequence: 3 + me,
        };
        let e = tagged_all_gather(&comm, sequence, &me).unwrap_err();
        let (rank, _, found) = mismatch(e);
        assert_eq!(rank, 1 - comm.rank());
        assert_eq!(found.unwrap().sequence, 4 - me);

        let group = StepTag {
            step: Step::Exchange,
            group: 7 + me,
            sequence: 3,
        };
        let e = tagged_all_gather(&comm, group, &me).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("step #3 of group {:#x}", 8 - me)),
            "{e}"
        );

        // Equal tags: the values come through.
        let same = StepTag {
            step: Step::Exchange,
            group: 7,
            sequence: 3,
        };
        assert_eq!(tagged_all_gather(&comm, same, &me).unwrap(), vec![0, 1]);
    });
    for r in results {
        r.unwrap();
    }
}

/// A registry step paired with an application's own object collective: the registry names
/// the rank as being in no tagged step instead of decoding its bytes as handles.
#[test]
fn an_untagged_collective_paired_with_a_registry_step_is_named_as_such() {
    let results = group(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let mem = HostMemory::new();
        let a = mem.allocate(4096)?;
        let mut peers = PeerMappings::new(mem, &comm)?;
        if comm.rank() == 0 {
            // The application's own collective: whatever it decodes is its business.
            let _ = tpcomm_objects::all_gather(&comm, &vec![0u8; 300]);
        } else {
            let e = peers
                .exchange(
                    &comm,
                    &[Region {
                        addr: a.addr(),
                        len: a.len(),
                    }],
                )
                .unwrap_err();
            assert!(
                e.to_string().starts_with(
                    "rank 0 is in a collective that is not a tagged tpcomm step, while this rank is in PeerMappings::exchange (handles)"
                ),
                "{e}"
            );
            assert_eq!(peers.counters().open, 0);
        }
        Ok(())
    });
    done(results);
}

/// A registry made for a group of 2 is passed a sub-communicator of one rank (every result
/// would be indexed past its end) or of the same size with the ranks swapped (every rank
/// would take a peer's handles for its own): refused on every rank before anything is sent.
#[test]
fn a_registry_passed_another_communicator_is_refused_without_a_panic() {
    let results = group(2).run(|comm| -> tpcomm_ipc::Result<()> {
        let mem = HostMemory::new();
        let buf = mem.allocate(4096)?;
        let regions = [Region {
            addr: buf.addr(),
            len: buf.len(),
        }];
        let mut peers = PeerMappings::new(mem, &comm)?;
        let alone = comm.split(Some(comm.rank() as u32), 0)?.expect("a color");
        let swapped = comm
            .split(Some(0), -(comm.rank() as i32))?
            .expect("a color");
        assert_eq!((alone.size(), swapped.rank()), (1, 1 - comm.rank()));
        for other in [&alone, &swapped] {
            match peers.exchange(other, &regions) {
                Err(IpcError::WrongCommunicator {
                    rank,
                    size: 2,
                    comm_rank,
                    comm_size,
                }) => {
                    assert_eq!(rank, comm.rank());
                    assert_eq!((comm_rank, comm_size), (other.rank(), other.size()));
                }
                got => panic!("expected WrongCommunicator, got {got:?}"),
            }
            assert!(matches!(
                peers.agree(other, Step::Close, &()),
                Err(IpcError::WrongCommunicator { .. })
            ));
            // Open, a reopen is a no-op, but only with the registry's own communicator.
            assert!(matches!(
                peers.reopen_all(other),
                Err(IpcError::WrongCommunicator { .. })
            ));
        }
        peers.close_all()?;
        assert!(matches!(
            peers.reopen_all(&alone),
            Err(IpcError::WrongCommunicator { .. })
        ));
        // Nothing was sent: the right communicator still pairs every rank's steps.
        peers.reopen_all(&comm)?;
        let id = peers.exchange(&comm, &regions)?;
        peers.peer(id, 1 - comm.rank(), 0)?;
        Ok(())
    });
    done(results);
}

/// A step passed as `Step::Unknown(code)` with the code of a known step (4, `Reopen`) is that
/// step on the wire: both ranks take the same decision (before, the tags were compared
/// decoded, and only the rank that passed `Unknown(4)` failed, the other went on).
#[test]
fn an_unknown_step_with_a_known_code_is_judged_alike_on_every_rank() {
    let results = group(2).run(|comm| {
        let step = if comm.rank() == 0 {
            Step::Unknown(4)
        } else {
            Step::Reopen
        };
        let tag = StepTag {
            step,
            group: 9,
            sequence: 1,
        };
        tagged_all_gather(&comm, tag, &comm.rank())
    });
    for (rank, r) in results.into_iter().enumerate() {
        let outcome = r.expect("rank thread");
        assert_eq!(outcome.ok(), Some(vec![0, 1]), "rank {rank}");
    }
}
