//! What a program reaches through the facade alone: the error type of every layer at the
//! top, `half`, and rsmpi as `tpcomm::mpi` (feature `mpi`).

use std::error::Error;

#[test]
fn every_layers_error_type_is_at_the_top() {
    fn is_error<E: Error + Send + Sync + 'static>() {}
    is_error::<tpcomm::TransportError>();
    is_error::<tpcomm::ObjectError>();
    is_error::<tpcomm::IpcError>();
    is_error::<tpcomm::AllReduceError>();
}

#[test]
fn half_is_reexported_in_the_version_the_traits_are_implemented_for() {
    fn reducible<T: tpcomm::transport::Element>() {}
    reducible::<tpcomm::half::f16>();
    reducible::<tpcomm::half::bf16>();
}

#[cfg(feature = "mpi")]
#[test]
fn rsmpi_is_reexported_with_the_mpi_feature() {
    // Naming the function is enough: calling it would initialize MPI in the test process.
    let _initialize: fn() -> Option<tpcomm::mpi::environment::Universe> = tpcomm::mpi::initialize;
}

#[cfg(feature = "nccl")]
#[test]
fn cudarc_is_reexported_in_the_version_tpcomms_device_api_takes() {
    // A slice of the re-exported cudarc is what tpcomm's device collectives take.
    fn reducible<S: tpcomm::cudarc::driver::DevicePtrMut<f32>>() {}
    reducible::<tpcomm::cudarc::driver::CudaSlice<f32>>();
    fn takes_engine_slices<C: tpcomm::transport::DeviceCommunicator>(
        comm: &C,
        tensor: &mut tpcomm::cudarc::driver::CudaSlice<f32>,
    ) -> Result<(), tpcomm::TransportError> {
        comm.all_reduce_in_place(tensor, tpcomm::ReduceOp::Sum)
    }
    let _ = takes_engine_slices::<tpcomm::transport::NcclCommunicator>;
}
