//! The NCCL device transport (feature `nccl`).
//!
//! Runs everywhere: creating a communicator on a machine without libnccl, libcuda or a GPU
//! returns a typed error and does not panic; the device argument checks. Needs a GPU and
//! libnccl (skipped with the reason otherwise, failed instead when `TPCOMM_REQUIRE_GPU=1`):
//! every collective on one rank against a host reference, the checks through a real
//! communicator, suspend/resume.
#![cfg(feature = "nccl")]

use std::fmt::Debug;

use half::{bf16, f16};
use tpcomm_transport::check::{device_count, DeviceCollective};
use tpcomm_transport::{
    ArgumentError, DeviceCommunicator, DeviceElement, LocalGroup, NcclCommunicator, NcclLibrary,
    Op, ReduceOp, TransportError,
};

fn one_rank_host() -> tpcomm_transport::LocalCommunicator {
    LocalGroup::new(1)
        .communicators()
        .expect("a one-rank group")
        .remove(0)
}

fn is_unavailable(e: &TransportError) -> bool {
    matches!(
        e,
        TransportError::LibraryMissing { .. } | TransportError::NoDevice(_)
    )
}

/// A one-rank communicator on device 0, or `None` (with the reason on stderr) when this
/// machine has no GPU or no NCCL; panics instead when `TPCOMM_REQUIRE_GPU=1`.
fn gpu_comm_or_skip(test: &str) -> Option<NcclCommunicator> {
    match NcclCommunicator::new(&one_rank_host(), 0) {
        Ok(comm) => Some(comm),
        Err(e) if is_unavailable(&e) => {
            tpcomm_transport::testing::skip_without_gpu(&format!(
                "{test} needs a GPU and libnccl: {e}"
            ));
            None
        }
        Err(e) => panic!("{test}: creating the NCCL communicator failed: {e}"),
    }
}

#[test]
fn new_on_a_machine_without_nccl_or_gpu_is_a_typed_error_not_a_panic() {
    let outcome = std::panic::catch_unwind(|| NcclCommunicator::new(&one_rank_host(), 0));
    let result = outcome.expect("NcclCommunicator::new must not panic");
    match (&result, NcclLibrary::load()) {
        (Err(e), _) if is_unavailable(e) => {
            eprintln!("typed error as expected on this machine: {e}");
            // The error stays typed and the same when asked again (the probe is memoized).
            let again = NcclCommunicator::new(&one_rank_host(), 0).unwrap_err();
            assert_eq!(again.to_string(), e.to_string());
        }
        (Ok(_), Ok(lib)) => eprintln!("this machine has a GPU and {lib:?}"),
        (Err(e), _) => panic!("expected LibraryMissing or NoDevice, got {e:?}"),
        (Ok(_), Err(e)) => panic!("communicator created although libnccl did not load: {e}"),
    }
}

#[test]
fn a_device_ordinal_out_of_range_is_no_device_or_missing_library() {
    let err = NcclCommunicator::new(&one_rank_host(), 1 << 20).unwrap_err();
    assert!(is_unavailable(&err), "{err:?}");
}

#[test]
fn device_checks_name_the_wrong_length_in_bytes() {
    let err = device_count(DeviceCollective::ReduceScatter, 2, 4, 10, 3, 4).unwrap_err();
    assert!(matches!(
        err,
        TransportError::InvalidArgument {
            op: Op::ReduceScatter,
            rank: 2,
            source: ArgumentError::SendLength {
                expected: 48,
                actual: 40
            },
        }
    ));
    assert_eq!(
        device_count(DeviceCollective::ReduceScatter, 2, 4, 12, 3, 4).unwrap(),
        3
    );
    assert_eq!(
        device_count(DeviceCollective::AllReduce, 0, 8, 0, 0, 2).unwrap(),
        0,
        "empty buffers are valid"
    );
}

/// Element types of the GPU tests, with the conversions the host reference needs.
trait TestElem: DeviceElement + PartialEq + Debug {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! test_elem {
    ($($t:ty: $from:expr, $to:expr;)*) => {$(
        impl TestElem for $t {
            fn from_f64(v: f64) -> Self {
                ($from)(v)
            }
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
        }
    )*};
}

test_elem! {
    f32: |v| v as f32, |x: f32| f64::from(x);
    f64: |v| v, |x| x;
    i32: |v| v as i32, |x: i32| f64::from(x);
    i64: |v| v as i64, |x: i64| x as f64;
    u8: |v| v as u8, |x: u8| f64::from(x);
    f16: f16::from_f64, |x: f16| x.to_f64();
    bf16: bf16::from_f64, |x: bf16| x.to_f64();
}

/// The host reference of a reduction over the ranks' inputs.
fn reduce_ref(inputs: &[Vec<f64>], op: ReduceOp) -> Vec<f64> {
    let mut out = inputs[0].clone();
    for input in &inputs[1..] {
        for (o, &x) in out.iter_mut().zip(input) {
            *o = match op {
                ReduceOp::Sum => *o + x,
                ReduceOp::Prod => *o * x,
                ReduceOp::Max => o.max(x),
                ReduceOp::Min => o.min(x),
            };
        }
    }
    out
}

/// Small integers (exact in every tested type, products included), varying by rank.
fn input(rank: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((i * 7 + rank * 3) % 5 + 1) as f64)
        .collect()
}

fn to_device<T: TestElem>(comm: &NcclCommunicator, v: &[f64]) -> cudarc::driver::CudaSlice<T> {
    let host: Vec<T> = v.iter().map(|&x| T::from_f64(x)).collect();
    comm.stream()
        .clone_htod(&host)
        .expect("host to device copy")
}

fn to_host<T: TestElem>(comm: &NcclCommunicator, d: &cudarc::driver::CudaSlice<T>) -> Vec<f64> {
    comm.synchronize().expect("synchronize");
    let host: Vec<T> = comm.stream().clone_dtoh(d).expect("device to host copy");
    host.into_iter().map(T::to_f64).collect()
}

fn check_every_collective<T: TestElem>(comm: &NcclCommunicator) {
    let (size, rank, len) = (comm.size(), comm.rank(), 1000);
    let inputs: Vec<Vec<f64>> = (0..size).map(|r| input(r, len)).collect();
    let poison = vec![-1.0; len];
    for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
        let expected = reduce_ref(&inputs, op);
        let send = to_device::<T>(comm, &inputs[rank]);
        let mut recv = to_device::<T>(comm, &poison);
        comm.all_reduce(&send, &mut recv, op).expect("all_reduce");
        assert_eq!(
            to_host(comm, &recv),
            expected,
            "{} all_reduce {op:?}",
            T::NAME
        );
        let mut buf = to_device::<T>(comm, &inputs[rank]);
        comm.all_reduce_in_place(&mut buf, op)
            .expect("all_reduce_in_place");
        assert_eq!(to_host(comm, &buf), expected, "{} in place {op:?}", T::NAME);

        // Reduce-scatter: rank r gets block r of the reduction of size * block elements.
        let block = len / size;
        let full: Vec<Vec<f64>> = inputs.iter().map(|v| v[..block * size].to_vec()).collect();
        let reduced = reduce_ref(&full, op);
        let send = to_device::<T>(comm, &full[rank]);
        let mut recv = to_device::<T>(comm, &poison[..block]);
        comm.reduce_scatter(&send, &mut recv, op)
            .expect("reduce_scatter");
        assert_eq!(
            to_host(comm, &recv),
            reduced[rank * block..][..block].to_vec(),
            "{} reduce_scatter {op:?}",
            T::NAME
        );
    }

    let send = to_device::<T>(comm, &inputs[rank]);
    let mut recv = to_device::<T>(comm, &vec![-1.0; len * size]);
    comm.all_gather(&send, &mut recv).expect("all_gather");
    assert_eq!(
        to_host(comm, &recv),
        inputs.concat(),
        "{} all_gather",
        T::NAME
    );

    for root in 0..size {
        let mut buf = to_device::<T>(comm, &inputs[rank]);
        comm.broadcast(root, &mut buf).expect("broadcast");
        assert_eq!(to_host(comm, &buf), inputs[root], "{} broadcast", T::NAME);
    }
}

#[test]
fn one_rank_every_collective_matches_the_host_reference() {
    let Some(comm) = gpu_comm_or_skip("one_rank_every_collective_matches_the_host_reference")
    else {
        return;
    };
    eprintln!("NCCL: {:?}", comm.library());
    check_every_collective::<f32>(&comm);
    check_every_collective::<f64>(&comm);
    check_every_collective::<i32>(&comm);
    check_every_collective::<i64>(&comm);
    check_every_collective::<u8>(&comm);
    check_every_collective::<f16>(&comm);
    check_every_collective::<bf16>(&comm);
}

#[test]
fn bad_device_arguments_are_refused_before_nccl_is_called() {
    let Some(comm) = gpu_comm_or_skip("bad_device_arguments_are_refused_before_nccl_is_called")
    else {
        return;
    };
    let send = to_device::<f32>(&comm, &[1.0; 4]);
    let mut short = to_device::<f32>(&comm, &[0.0; 3]);
    let err = comm.all_gather(&send, &mut short).unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::InvalidArgument {
                op: Op::AllGather,
                source: ArgumentError::RecvLength {
                    expected: 16,
                    actual: 12
                },
                ..
            }
        ),
        "{err:?}"
    );
    let err = comm
        .all_reduce(&send, &mut short, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::InvalidArgument {
                op: Op::AllReduce,
                ..
            }
        ),
        "{err:?}"
    );
    let mut buf = to_device::<f32>(&comm, &[0.0; 4]);
    let err = comm.broadcast(1, &mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::InvalidArgument {
                source: ArgumentError::RootOutOfRange { root: 1, size: 1 },
                ..
            }
        ),
        "{err:?}"
    );
    // The communicator still works after refused calls.
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
}

#[test]
fn suspend_resume_where_nccl_has_it_and_unsupported_otherwise() {
    let Some(comm) = gpu_comm_or_skip("suspend_resume_where_nccl_has_it_and_unsupported_otherwise")
    else {
        return;
    };
    if !comm.library().supports_suspend() {
        let err = comm.suspend().unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Unsupported {
                    op: Op::Suspend,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(!comm.is_suspended());
        eprintln!("suspend unsupported as expected: {err}");
        return;
    }
    let mut buf = to_device::<f32>(&comm, &[1.0, 2.0, 3.0]);
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.suspend().expect("suspend");
    comm.suspend().expect("suspending twice is a no-op");
    assert!(comm.is_suspended());
    let err = comm
        .all_reduce_in_place(&mut buf, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Suspended {
                op: Op::AllReduce,
                rank: 0
            }
        ),
        "{err:?}"
    );
    comm.resume().expect("resume");
    comm.resume().expect("resuming twice is a no-op");
    comm.all_reduce_in_place(&mut buf, ReduceOp::Max).unwrap();
    assert_eq!(to_host(&comm, &buf), vec![1.0, 2.0, 3.0]);
}

#[test]
fn a_bounded_communicator_runs_collectives_and_drains_before_it_is_dropped() {
    let Some(comm) =
        gpu_comm_or_skip("a_bounded_communicator_runs_collectives_and_drains_before_it_is_dropped")
    else {
        return;
    };
    let comm = comm.with_timeout(std::time::Duration::from_secs(30));
    assert_eq!(comm.timeout(), Some(std::time::Duration::from_secs(30)));
    check_every_collective::<f32>(&comm);
    comm.synchronize().unwrap();
    assert!(!comm.is_aborted());
    drop(comm);
}

#[test]
fn a_peer_that_never_launches_times_out_the_wait_and_aborts_the_communicator() {
    let test = "a_peer_that_never_launches_times_out_the_wait_and_aborts_the_communicator";
    if gpu_comm_or_skip(test).is_none() {
        return;
    }
    let devices = cudarc::driver::CudaContext::device_count().unwrap_or(0);
    if devices < 2 {
        // NCCL refuses two ranks on one GPU: one GPU is a full machine for the other tests.
        tpcomm_transport::testing::skip(&format!(
            "{test} needs two CUDA devices (NCCL ranks on distinct GPUs); {devices} visible"
        ));
        return;
    }
    let timeout = std::time::Duration::from_millis(500);
    type Seen = (Result<(), TransportError>, Result<(), TransportError>, bool);
    let results = LocalGroup::new(2).run(|host| -> Result<Option<Seen>, TransportError> {
        use tpcomm_transport::Communicator as _;
        let rank = tpcomm_transport::Communicator::rank(&host);
        let comm = NcclCommunicator::new(&host, rank)?.with_timeout(timeout);
        if rank == 1 {
            // Rank 1 never launches its part; it waits until rank 0 is done.
            host.barrier()?;
            return Ok(None);
        }
        let mut x = comm.stream().clone_htod(&[1.0f32; 1024]).unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        let waited = comm.synchronize();
        let later = comm.all_reduce_in_place(&mut x, ReduceOp::Sum);
        let aborted = comm.is_aborted();
        host.barrier()?;
        Ok(Some((waited, later, aborted)))
    });
    let mut results = results.into_iter().map(|r| r.unwrap().unwrap());
    let (waited, later, aborted) = results.next().unwrap().expect("rank 0 reports");
    assert!(results.next().unwrap().is_none());
    match waited {
        Err(TransportError::Unresponsive { unchecked, .. }) => assert_eq!(&*unchecked, &[1]),
        other => panic!("expected Unresponsive, got {other:?}"),
    }
    assert!(aborted);
    assert!(
        matches!(later, Err(TransportError::Aborted { .. })),
        "{later:?}"
    );
}
