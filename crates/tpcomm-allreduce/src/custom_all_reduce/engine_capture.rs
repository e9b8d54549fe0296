//! Host-side tests of the capture bookkeeping of caller memory
//! ([`CustomAllReduce::all_reduce_external`], what `all_reduce_device` runs on CUDA) on a
//! *caller-owned* capture: a backend whose "stream" the test puts into capture mode, as an
//! engine's `cuStreamBeginCapture` does, and which then records stage copies and launches
//! into a graph instead of running them — a CUDA graph simulated on the host backend. No GPU
//! is needed: what is checked is which slot each captured call takes, what each rank exports
//! for it (the input, or its staging buffer when the input cannot be shared), and that
//! replaying the recorded graph gives the right sums, also after a suspend/resume.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tpcomm_ipc::{HostBuffer, HostMemory, MemoryRegion, PeerMemory};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

use super::*;
use crate::backend::host::HostBackend;
use crate::backend::Launch;
use crate::dispatch::{Algorithm, FallbackReason};
use crate::dtype::DType;

/// One recorded operation of the simulated graph.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    /// Copy `bytes` at `offset` of the caller's buffer at `src` to the same bytes of the
    /// staging buffer.
    Stage {
        src: u64,
        offset: usize,
        bytes: usize,
    },
    /// A launch reading RankData slot `slot`.
    Launch {
        slot: usize,
        dtype: DType,
        count: usize,
        algorithm: Algorithm,
        out: u64,
    },
}

/// The host backend on a "stream" the test captures.
#[derive(Debug, Default)]
struct GraphSim {
    inner: HostBackend,
    capturing: AtomicBool,
    graph: Mutex<Vec<Op>>,
}

impl GraphSim {
    fn begin_capture(&self) {
        self.capturing.store(true, Ordering::SeqCst);
    }

    fn end_capture(&self) -> Vec<Op> {
        self.capturing.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.graph.lock().unwrap())
    }
}

impl Backend for GraphSim {
    type Memory = HostMemory;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn signal_bytes(&self) -> usize {
        self.inner.signal_bytes()
    }
    fn nonce_offset(&self) -> usize {
        self.inner.nonce_offset()
    }
    fn reset_signal(&self, memory: &HostMemory, signal: &HostBuffer) -> Result<()> {
        self.inner.reset_signal(memory, signal)
    }
    fn launch(&self, memory: &HostMemory, l: &Launch<'_, Self>) -> Result<()> {
        if self.capturing.load(Ordering::SeqCst) {
            self.graph.lock().unwrap().push(Op::Launch {
                slot: l.slot,
                dtype: l.dtype,
                count: l.count,
                algorithm: l.algorithm,
                out: l.out,
            });
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
    ) -> Result<()> {
        // The stage copy (of caller memory too): recorded while capturing, run otherwise.
        if self.capturing.load(Ordering::SeqCst) {
            self.graph.lock().unwrap().push(Op::Stage {
                src: input.addr(),
                offset: range.start,
                bytes: range.len(),
            });
            Ok(())
        } else {
            self.inner.stage(memory, input, staging, range)
        }
    }
    fn capturing(&self) -> Result<bool> {
        Ok(self.capturing.load(Ordering::SeqCst))
    }
    // As the CUDA backend: every creation runs the one-time data test of the mappings.
    fn prove_at_creation(&self) -> bool {
        true
    }
}

type Ar = CustomAllReduce<GraphSim>;

fn new_ar<C: Communicator>(comm: &C) -> Ar {
    CustomAllReduce::new(
        GraphSim::default(),
        HostMemory::new(),
        comm,
        Config::default(),
    )
    .expect("new")
}

/// What `all_reduce_device` does with a caller's view, on the host: `input` is caller
/// memory that is shareable with peers or not, as the test says.
fn reduce(
    ar: &mut Ar,
    input: &HostBuffer,
    shareable: bool,
    out: &HostBuffer,
    count: usize,
) -> Result<Algorithm> {
    let memory = ar.memory()?.clone();
    ar.all_reduce_external(
        "all_reduce_device",
        input.addr(),
        || Ok(shareable),
        |backend: &GraphSim, staging: &HostBuffer, bytes: usize| {
            backend.stage(&memory, input, staging, 0..bytes)
        },
        out.addr(),
        DType::F32,
        count,
    )
}

/// Replays a simulated graph: the recorded stage copies run, every launch goes through the
/// replay checks of `CustomAllReduce`.
fn replay(ar: &mut Ar, graph: &[Op], inputs: &[&HostBuffer]) -> Result<()> {
    ar.check_replay()?;
    for op in graph {
        match *op {
            Op::Stage { src, offset, bytes } => {
                let input = inputs
                    .iter()
                    .find(|b| b.addr() == src)
                    .expect("a recorded input");
                let res = ar.resources("replay")?;
                let mut raw = vec![0u8; bytes];
                res.peers.backend().read(*input, offset, &mut raw)?;
                res.peers.backend().write(&res.staging, offset, &raw)?;
            }
            Op::Launch {
                slot,
                dtype,
                count,
                algorithm,
                out,
            } => ar.launch("replay", slot, dtype, count, algorithm, out, false, None)?,
        }
    }
    Ok(())
}

fn fill(ar: &Ar, buf: &HostBuffer, value: f32, count: usize) {
    let v = vec![value; count];
    ar.memory()
        .unwrap()
        .write(buf, 0, bytemuck::cast_slice(&v))
        .unwrap();
}

fn read(ar: &Ar, buf: &HostBuffer, count: usize) -> Vec<f32> {
    let mut raw = vec![0u8; count * 4];
    ar.memory().unwrap().read(buf, 0, &mut raw).unwrap();
    bytemuck::cast_slice(&raw).to_vec()
}

/// Runs `f` on 2 ranks (threads), each with a fresh communicator and its peer memory;
/// a rank that panics fails the test.
fn on_two_ranks(f: impl Fn(&LocalCommunicator, &mut Ar, &HostMemory) + Sync) {
    let results = LocalGroup::new(2).run(|comm| {
        let mut ar = new_ar(&comm);
        let memory = ar.memory().expect("memory").clone();
        f(&comm, &mut ar, &memory);
    });
    for r in results {
        r.expect("rank thread");
    }
}

#[test]
fn eager_calls_of_caller_memory_are_staged_and_read_slot_zero() {
    on_two_ranks(|comm, ar, memory| {
        let (input, out) = (
            memory.allocate(4096).unwrap(),
            memory.allocate(4096).unwrap(),
        );
        fill(ar, &input, comm.rank() as f32 + 1.0, 1024);
        // Shareable or not makes no difference eagerly: the input is copied into staging.
        let shareable = comm.rank() == 0;
        assert_eq!(
            reduce(ar, &input, shareable, &out, 1024).unwrap(),
            Algorithm::OneStage
        );
        assert_eq!(read(ar, &out, 1024), vec![3.0; 1024]);
        assert_eq!(ar.pending_graph_buffers(), 0);
        assert_eq!(ar.recorded_launches(), 0);
    });
}

#[test]
fn captured_calls_take_one_slot_each_whether_their_input_is_shared_or_staged() {
    // Rank 0's inputs can be exported (zero-copy), rank 1's cannot (cudarc pool memory):
    // both ranks still take one slot per call, in the same order; rank 1's graph holds the
    // staging copies and its entry in each slot names its staging buffer.
    on_two_ranks(|comm, ar, memory| {
        let shareable = comm.rank() == 0;
        let a = memory.allocate(4096).unwrap();
        let b = memory.allocate(1 << 20).unwrap();
        let (out_a, out_b) = (
            memory.allocate(4096).unwrap(),
            memory.allocate(1 << 20).unwrap(),
        );
        let (small, large) = (1024, (1 << 20) / 4);
        let mark = ar.recorded_launches();
        ar.backend().begin_capture();
        reduce(ar, &a, shareable, &out_a, small).unwrap();
        reduce(ar, &b, shareable, &out_b, large).unwrap();
        // The same input again: a slot of its own (never deduplicated).
        reduce(ar, &a, shareable, &out_a, small).unwrap();
        // Tables are not written while the caller's stream is capturing.
        assert!(matches!(
            ar.register_graph_buffers(comm),
            Err(AllReduceError::InvalidArgument(_))
        ));
        let graph = ar.backend().end_capture();
        assert_eq!(ar.recorded_slots(mark), vec![1, 2, 3]);
        let stages = graph
            .iter()
            .filter(|op| matches!(op, Op::Stage { .. }))
            .count();
        assert_eq!(stages, if shareable { 0 } else { 3 });
        assert_eq!(ar.pending_graph_buffers(), 3);
        assert!(matches!(
            replay(ar, &graph, &[&a, &b]),
            Err(AllReduceError::UnregisteredGraphBuffers)
        ));
        assert_eq!(ar.register_graph_buffers(comm).unwrap(), 3);
        for slot in 1..=3 {
            let entries = ar.rank_data_slot(slot).unwrap();
            // This rank's own entry: its input when shared, its staging buffer otherwise
            // (peers' entries are their mappings of those, at addresses of their own).
            let input = if slot == 2 { b.addr() } else { a.addr() };
            let staging = ar.base_address(comm.rank(), STAGING).unwrap();
            let own = if shareable { input } else { staging };
            assert_eq!(entries[comm.rank()], own);
        }
        let check = |ar: &mut Ar, shift: f32| {
            fill(ar, &a, comm.rank() as f32 + 1.0 + shift, small);
            fill(ar, &b, 2.0 * (comm.rank() as f32 + 1.0 + shift), large);
            comm.barrier().unwrap();
            replay(ar, &graph, &[&a, &b]).unwrap();
            assert_eq!(read(ar, &out_a, small), vec![3.0 + 2.0 * shift; small]);
            assert_eq!(read(ar, &out_b, large), vec![6.0 + 4.0 * shift; large]);
            comm.barrier().unwrap();
        };
        check(ar, 0.0);
        // The graph survives a suspend/resume: the tables are rewritten in place.
        ar.prepare_for_suspend(comm).unwrap();
        ar.reinit_after_resume(comm).unwrap();
        check(ar, 10.0);
        ar.close_with(comm).unwrap();
    });
}

#[test]
fn a_registered_input_is_zero_copy_inside_a_caller_capture() {
    on_two_ranks(|comm, ar, memory| {
        let registered = ar
            .register_buffer(comm, memory.allocate(4096).unwrap())
            .unwrap();
        let out = memory.allocate(4096).unwrap();
        ar.backend().begin_capture();
        // Not shareable as caller memory, but found by address: its own slot, no copy.
        reduce(ar, registered.buffer(), false, &out, 1024).unwrap();
        let graph = ar.backend().end_capture();
        assert_eq!(ar.pending_graph_buffers(), 0);
        assert_eq!(
            graph,
            vec![Op::Launch {
                slot: registered.slot(),
                dtype: DType::F32,
                count: 1024,
                algorithm: Algorithm::OneStage,
                out: out.addr(),
            }]
        );
        fill(ar, registered.buffer(), comm.rank() as f32 + 1.0, 1024);
        comm.barrier().unwrap();
        replay(ar, &graph, &[]).unwrap();
        assert_eq!(read(ar, &out, 1024), vec![3.0; 1024]);
    });
}

#[test]
fn caller_memory_that_no_kernel_serves_falls_back_before_anything_is_recorded() {
    on_two_ranks(|_comm, ar, memory| {
        let (input, out) = (
            memory.allocate(4096).unwrap(),
            memory.allocate(4096).unwrap(),
        );
        ar.backend().begin_capture();
        assert!(matches!(
            reduce(ar, &input, true, &out, 3),
            Err(AllReduceError::Fallback(
                FallbackReason::SizeNotMultipleOf16 { bytes: 12 }
            ))
        ));
        assert!(ar.backend().end_capture().is_empty());
        assert_eq!(ar.pending_graph_buffers(), 0);
        assert_eq!(ar.phase(), Phase::Active);
    });
}

#[test]
fn an_in_place_call_inside_a_capture_is_staged_even_when_its_input_could_be_shared() {
    on_two_ranks(|comm, ar, memory| {
        let x = memory.allocate(4096).unwrap();
        ar.backend().begin_capture();
        reduce(ar, &x, true, &x, 1024).unwrap();
        let graph = ar.backend().end_capture();
        assert!(matches!(graph[0], Op::Stage { .. }), "{graph:?}");
        ar.register_graph_buffers(comm).unwrap();
        let staging = ar.base_address(comm.rank(), STAGING).unwrap();
        assert_eq!(ar.rank_data_slot(1).unwrap()[comm.rank()], staging);
        fill(ar, &x, comm.rank() as f32 + 1.0, 1024);
        comm.barrier().unwrap();
        replay(ar, &graph, &[&x]).unwrap();
        assert_eq!(read(ar, &x, 1024), vec![3.0; 1024]);
    });
}

/// The route is decided from the call's shape alone: a rank whose communicator failed, or
/// whose output is not 16-byte aligned, still gets `Fallback` for a size the kernels do not
/// serve (its peers take the fallback, and with NCCL a rank that stays out leaves them
/// waiting for good); the refusals local to a rank come only for sizes the kernels serve.
#[test]
fn a_fallback_shape_is_a_fallback_whatever_the_ranks_phase_or_output_alignment() {
    on_two_ranks(|_comm, ar, memory| {
        let input = memory.allocate(4096).expect("input");
        let out = memory.allocate(4096).expect("output");
        let call = |ar: &mut Ar, out: u64, count: usize| {
            ar.all_reduce_external(
                "all_reduce_device",
                input.addr(),
                || Ok(false),
                |backend: &GraphSim, staging: &HostBuffer, bytes: usize| {
                    backend.stage(memory, &input, staging, 0..bytes)
                },
                out,
                DType::F32,
                count,
            )
        };
        // 3 f32: 12 bytes, not a multiple of 16.
        let misaligned = out.addr() + 4;
        assert!(matches!(
            call(ar, misaligned, 3),
            Err(AllReduceError::Fallback(_))
        ));
        assert!(matches!(
            call(ar, misaligned, 64),
            Err(AllReduceError::Misaligned { .. })
        ));
        let _ = ar.fail("a test", AllReduceError::InvalidArgument("injected".into()));
        assert!(matches!(
            call(ar, out.addr(), 3),
            Err(AllReduceError::Fallback(_))
        ));
        let served = call(ar, out.addr(), 64);
        assert!(
            matches!(served, Err(AllReduceError::Failed { .. })),
            "{served:?}"
        );
    });
}
