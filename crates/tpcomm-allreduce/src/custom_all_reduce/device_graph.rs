//! CUDA graphs of the all-reduce ([`DeviceGraph`]): `capture_graph`, an engine's own capture
//! adopted (`capture_mark`, `adopt_graph`), and `replay_graph` under the checks of a replay.

use cudarc::driver::{sys, CudaGraph};
use tpcomm_ipc::DevicePeerMemory;

use super::capture::{CaptureGuard, CaptureOwner};
use super::CustomAllReduce;
use crate::backend::cuda::{driver_error, CudaBackend, SendGraph};
use crate::error::{AllReduceError, Result};

/// A CUDA graph of all-reduce launches captured by [`CustomAllReduce::capture_graph`], or
/// an engine's own graph adopted with [`CustomAllReduce::adopt_graph`].
pub struct DeviceGraph {
    /// `Send`, not `Sync` (see [`SendGraph`]).
    graph: SendGraph,
    launches: usize,
    owner: u64,
    /// The RankData slots its launches read.
    slots: Vec<usize>,
    /// For a graph from `capture_graph`: its inputs are shared while it lives (see
    /// `CaptureOwner`); an adopted graph's inputs must live as long as their slots.
    _alive: Option<CaptureOwner>,
}

/// Where a caller's capture starts, in the communicator's record of captured launches
/// ([`CustomAllReduce::capture_mark`]); [`CustomAllReduce::adopt_graph`] takes it back to
/// know which launches (and so which RankData slots) the graph holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureMark {
    owner: u64,
    recorded: usize,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGraph")
            .field("launches", &self.launches)
            .finish()
    }
}

impl DeviceGraph {
    /// The all-reduces recorded.
    pub fn launches(&self) -> usize {
        self.launches
    }
}

impl<M: DevicePeerMemory> CustomAllReduce<CudaBackend<M>> {
    /// Captures the all-reduces `f` issues (through
    /// [`all_reduce_buffer`](Self::all_reduce_buffer)) on the backend's stream into a CUDA
    /// graph (thread-local capture mode) and instantiates it. Inputs not registered yet take
    /// the next RankData slots: call [`register_graph_buffers`](Self::register_graph_buffers)
    /// (collective) before the first [`replay_graph`](Self::replay_graph).
    pub fn capture_graph<F>(&mut self, f: F) -> Result<DeviceGraph>
    where
        F: FnOnce(&mut Self) -> Result<()>,
    {
        self.check_operation("capture_graph")?;
        let before = self.recorded_launches();
        let stream = self.backend().stream().clone();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_error("cuStreamBeginCapture_v2", e))?;
        // A capture that ends without a graph gives back the slots its calls took.
        let alive = CaptureOwner::default();
        let mut guard = CaptureGuard::new(self, &alive);
        let recorded = f(&mut guard);
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded?;
        let launches = guard.recorded_launches() - before;
        let graph = ended
            .map_err(|e| driver_error("cuStreamEndCapture", e))?
            .ok_or_else(|| {
                AllReduceError::InvalidArgument("the capture recorded nothing".into())
            })?;
        let graph = DeviceGraph {
            graph: SendGraph(graph),
            launches,
            owner: guard.id(),
            slots: guard.recorded_slots(before),
            _alive: Some(alive),
        };
        guard.keep();
        Ok(graph)
    }

    /// Marks the start of a capture the caller runs on the backend's stream (an engine
    /// capturing its whole step, [`CudaBackend::with_stream`]): call it before
    /// `cuStreamBeginCapture` and hand it to [`adopt_graph`](Self::adopt_graph) with the
    /// graph the capture made.
    pub fn capture_mark(&self) -> CaptureMark {
        CaptureMark {
            owner: self.id(),
            recorded: self.recorded_launches(),
        }
    }

    /// Takes an engine's own graph (captured on the backend's stream after `mark`) under the
    /// communicator's replay checks: [`replay_graph`](Self::replay_graph) then refuses to
    /// launch it while captured inputs are unregistered, while the communicator is not
    /// Active, or once a registered buffer it reads was unregistered. An engine that keeps
    /// and launches its `CudaGraph` itself must call [`check_replay`](Self::check_replay)
    /// before every launch instead.
    ///
    /// Fails with [`AllReduceError::ForeignToken`] for a mark of another communicator.
    pub fn adopt_graph(&self, graph: CudaGraph, mark: CaptureMark) -> Result<DeviceGraph> {
        if mark.owner != self.id() {
            return Err(AllReduceError::ForeignToken {
                what: "a capture mark",
                owner: mark.owner,
                communicator: self.id(),
            });
        }
        Ok(DeviceGraph {
            graph: SendGraph(graph),
            launches: self.recorded_launches().saturating_sub(mark.recorded),
            owner: self.id(),
            slots: self.recorded_slots(mark.recorded),
            _alive: None,
        })
    }

    /// Launches a captured graph on the backend's stream (asynchronously; see
    /// [`synchronize`](Self::synchronize)). Refused while captured inputs are unregistered
    /// or the communicator is not Active, since the graph's launches would read unwritten
    /// table slots or closed mappings, for a graph another communicator captured
    /// ([`AllReduceError::ForeignToken`]), and for a graph reading a registered buffer
    /// unregistered since ([`AllReduceError::UnregisteredInput`]).
    ///
    /// The graph writes the outputs (and reads the zero-copy inputs) its calls named when
    /// they were captured: a `DeviceGraph` borrows no buffer, as a cudarc `CudaGraph` does
    /// not, so they must still be allocated when it replays. This is not checked.
    pub fn replay_graph(&mut self, graph: &DeviceGraph) -> Result<()> {
        if graph.owner != self.id() {
            return Err(AllReduceError::ForeignToken {
                what: "a device graph",
                owner: graph.owner,
                communicator: self.id(),
            });
        }
        self.check_replay()?;
        self.check_slots_live(&graph.slots)?;
        graph
            .graph
            .0
            .launch()
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }
}
