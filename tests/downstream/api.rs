// The functions every downstream program compiles (included by each `src/lib.rs`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use tpcomm::transport::{
    Communicator, DeviceCommunicator, NcclCommunicator, ReduceOp, TransportError,
};

/// An NCCL communicator on the engine's own stream, bootstrapped over any host communicator.
pub fn nccl_on_engine_stream<C: Communicator>(
    host: &C,
    stream: Arc<CudaStream>,
) -> Result<NcclCommunicator, TransportError> {
    NcclCommunicator::with_stream(host, stream)
}

/// Sums an engine tensor (a `CudaSlice` allocated by the engine) over every rank, in place.
pub fn all_reduce_engine_tensor(
    comm: &NcclCommunicator,
    tensor: &mut CudaSlice<f32>,
) -> Result<(), TransportError> {
    comm.all_reduce_in_place(tensor, ReduceOp::Sum)
}

/// Sums a view of one engine tensor into another.
pub fn all_reduce_engine_view(
    comm: &NcclCommunicator,
    input: &CudaView<'_, f32>,
    output: &mut CudaSlice<f32>,
) -> Result<(), TransportError> {
    comm.all_reduce(input, output, ReduceOp::Sum)
}

/// The custom all-reduce (NCCL as its fallback) on the engine's stream, reducing an engine
/// tensor into another: zero-copy where the memory allows it, staged otherwise.
pub fn custom_all_reduce_engine_tensor(
    ar: &mut tpcomm::allreduce::DeviceAllReduce,
    input: &CudaSlice<f32>,
    output: &mut CudaSlice<f32>,
) -> Result<tpcomm::allreduce::Route, tpcomm::AllReduceError> {
    ar.all_reduce_device(input, output)
}

/// The same all-reduce built on the engine's own stream.
pub fn device_all_reduce_on_engine_stream<C: Communicator>(
    host: &C,
    stream: Arc<CudaStream>,
) -> Result<tpcomm::allreduce::DeviceAllReduce, tpcomm::AllReduceError> {
    let ordinal = i32::try_from(stream.context().ordinal()).unwrap_or(i32::MAX);
    let memory = tpcomm::ipc::CudaMemory::new(ordinal)?;
    tpcomm::allreduce::DeviceAllReduce::with_stream(
        host,
        memory,
        tpcomm::allreduce::CudaOptions::default(),
        tpcomm::allreduce::Config::default(),
        stream,
    )
}
