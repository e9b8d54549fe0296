//! A CUDA graph that may move to another thread: what a
//! [`DeviceGraph`](crate::DeviceGraph) holds.

use cudarc::driver::CudaGraph;

/// cudarc's [`CudaGraph`], `Send`.
pub(crate) struct SendGraph(pub(crate) CudaGraph);

// SAFETY: a SendGraph owns its CUgraph / CUgraphExec exclusively (cudarc's CudaGraph,
// which is not Send only because it holds raw driver handles) and an Arc of the stream
// (Send + Sync). CUDA graph objects are not tied to a thread: the driver only requires that
// calls on one graph object are serialized, which ownership gives (no `&self` method is
// shared across threads: SendGraph, and the DeviceGraph holding it, are deliberately not
// Sync), and every call binds the stream's context to the calling thread first (cudarc's
// `launch`, `Drop`).
unsafe impl Send for SendGraph {}
