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
