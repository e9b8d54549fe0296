//! The custom all-reduce on memory with stable addresses (`HostMemory::stable`, the CPU
//! twin of CUDA virtual memory): a suspend releases the Signal, staging and temp buffers'
//! memory, a resume maps fresh memory at the same addresses on every rank and every peer
//! mapping back where it was, so the stable tables are not written again, and a plan
//! captured before the suspend replays bit-identically after it. On plain host memory the
//! rewrite path stays: mappings that move are written into the tables.

use tpcomm_allreduce::{Algorithm, Config, CustomAllReduce, DType, HostBackend, Phase};
use tpcomm_ipc::{HostMemory, IpcError, PeerMemory};
use tpcomm_transport::Communicator;

mod common;
mod holds;
use common::{group, read_f32, unwrap_all, unwrap_world, R};

/// Every address the communicator's launches read: every rank's Signal, staging and temp
/// buffer as this rank sees them, the RankSignals table, and the RankData slots `slots`.
fn addresses(ar: &CustomAllReduce<HostBackend>, world: usize, slots: &[usize]) -> R<Vec<u64>> {
    let mut all = vec![ar.rank_signals_address()?];
    for rank in 0..world {
        for region in 0..3 {
            all.push(ar.base_address(rank, region)?);
        }
    }
    for &slot in slots {
        all.extend(ar.rank_data_slot(slot)?);
    }
    Ok(all)
}

#[test]
fn a_plan_captured_before_a_suspend_replays_bit_identically_with_every_address_and_table_kept() {
    for world in [2, 4] {
        let results = group(world).run(|comm| -> R<()> {
            let me = comm.rank();
            let memory = HostMemory::stable();
            let config = Config::default();
            let max = config.max_bytes;
            let mut ar = CustomAllReduce::new(HostBackend::new(), memory.clone(), &comm, config)?;
            let small_in = memory.allocate(4096)?;
            let big_in = memory.allocate(2 << 20)?;
            let small_out = memory.allocate(4096)?;
            let big_out = memory.allocate(2 << 20)?;
            // Values whose sums depend on the order of addition: bit-identical replays mean
            // the same reduction order on the same inputs.
            let value = |i: usize| (me as f32 + 1.0) / 3.0 + i as f32 * 1e-3;
            let small: Vec<f32> = (0..1024).map(value).collect();
            let big: Vec<f32> = (0..512 << 10).map(value).collect();
            memory.write(&small_in, 0, bytemuck::cast_slice(&small))?;
            memory.write(&big_in, 0, bytemuck::cast_slice(&big))?;
            let plan = ar.capture(|cap| {
                assert_eq!(
                    cap.all_reduce(&small_in, &small_out, DType::F32, 1024)?,
                    Algorithm::OneStage
                );
                assert_eq!(
                    cap.all_reduce(&big_in, &big_out, DType::F32, 512 << 10)?,
                    Algorithm::TwoStage
                );
                Ok(())
            })?;
            assert_eq!(ar.register_graph_buffers(&comm)?, 2);
            plan.replay(&mut ar)?;
            let first = (
                read_f32(&memory, &small_out, 1024),
                read_f32(&memory, &big_out, 512 << 10),
            );
            let before = addresses(&ar, world, &[1, 2])?;
            let writes = ar.table_writes();

            ar.prepare_for_suspend(&comm)?;
            assert_eq!(ar.phase(), Phase::Suspended);
            // The Signal block (one page), staging and temp (max_bytes each) gave their
            // memory back: nothing of them can be exported until the resume.
            assert_eq!(ar.released_bytes(), 4096 + 2 * max, "rank {me}");
            for region in 0..3 {
                let addr = ar.base_address(me, region)?;
                assert!(
                    matches!(memory.export(addr, 8), Err(IpcError::NotExportable { .. })),
                    "rank {me}: region {region} is still exportable while suspended"
                );
            }
            ar.reinit_after_resume(&comm)?;

            assert_eq!(ar.released_bytes(), 0);
            assert_eq!(addresses(&ar, world, &[1, 2])?, before, "rank {me}");
            assert_eq!(ar.table_writes(), writes, "no table was written again");
            let counters = ar.peer_mappings()?.counters();
            assert_eq!(counters.moved_addresses, 0);
            assert!(counters.kept_addresses >= 3 * (world as u64 - 1));

            memory.write(&small_out, 0, &vec![0u8; 4096])?;
            memory.write(&big_out, 0, &vec![0u8; 2 << 20])?;
            plan.replay(&mut ar)?;
            let again = (
                read_f32(&memory, &small_out, 1024),
                read_f32(&memory, &big_out, 512 << 10),
            );
            assert!(
                again
                    .0
                    .iter()
                    .zip(&first.0)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && again
                        .1
                        .iter()
                        .zip(&first.1)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {me}: the replay after the resume is not bit-identical"
            );
            // The eager path stages through the fresh staging buffer.
            let mut out = [0f32; 64];
            ar.all_reduce(&[1f32; 64], &mut out)?;
            assert_eq!(out, [world as f32; 64]);
            ar.close_with(&comm)?;
            Ok(())
        });
        unwrap_world(world, results);
    }
}

#[test]
fn repeated_suspends_and_resumes_keep_the_addresses_and_release_each_time() {
    let results = group(3).run(|comm| -> R<()> {
        let memory = HostMemory::stable();
        let mut ar = CustomAllReduce::new(HostBackend::new(), memory, &comm, Config::default())?;
        let before = addresses(&ar, 3, &[])?;
        let mut out = [0f32; 256];
        for round in 0..5 {
            ar.prepare_for_suspend(&comm)?;
            assert!(ar.released_bytes() > 0, "round {round}");
            ar.reinit_after_resume(&comm)?;
            assert_eq!(addresses(&ar, 3, &[])?, before, "round {round}");
            ar.all_reduce(&[round as f32; 256], &mut out)?;
            assert_eq!(out, [3.0 * round as f32; 256]);
        }
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn a_communicator_closed_while_its_memory_is_released_frees_everything_without_an_error() {
    let results = group(2).run(|comm| -> R<()> {
        let memory = HostMemory::stable();
        let mut ar = CustomAllReduce::new(HostBackend::new(), memory, &comm, Config::default())?;
        ar.prepare_for_suspend(&comm)?;
        assert!(ar.released_bytes() > 0);
        ar.close_with(&comm)?;
        assert_eq!(ar.phase(), Phase::Closed);
        Ok(())
    });
    unwrap_all(results);
}

#[test]
fn on_plain_host_memory_a_resume_that_moves_the_mappings_rewrites_the_tables() {
    let results = group(2).run(|comm| -> R<()> {
        let memory = HostMemory::new();
        let mut ar = CustomAllReduce::new(HostBackend::new(), memory, &comm, Config::default())?;
        let peer = 1 - comm.rank();
        let writes = ar.table_writes();
        let holds = holds::suspend_holding(&comm, &mut ar, |ar| {
            (0..3).map(|i| ar.base_address(peer, i)).collect()
        })?;
        assert_eq!(
            ar.released_bytes(),
            0,
            "plain host memory keeps its buffers"
        );
        ar.reinit_after_resume(&comm)?;
        drop(holds);
        assert_eq!(
            ar.table_writes(),
            writes + 1,
            "the moved addresses were written"
        );
        let mut out = [0f32; 16];
        ar.all_reduce(&[1f32; 16], &mut out)?;
        assert_eq!(out, [2f32; 16]);
        Ok(())
    });
    unwrap_all(results);
}
