//! Error chains say each thing once: a message describes its own level, and its cause is
//! reachable through `source()` only (so anyhow, eyre or tracing print a clean chain).

use std::error::Error;

use tpcomm_ipc::IpcError;
use tpcomm_objects::ObjectError;
use tpcomm_transport::testing::assert_each_level_says_its_own_thing;
use tpcomm_transport::{Communicator, LocalGroup};

fn os_error() -> IpcError {
    IpcError::Os {
        call: "memfd_create",
        source: rustix::io::Errno::NOMEM,
    }
}

#[test]
fn an_os_error_keeps_its_errno_and_not_its_cause_text() {
    let err = os_error();
    assert!(err.to_string().contains("errno 12"), "{err}");
    assert!(err.source().is_some());
    assert_each_level_says_its_own_thing(&err);
}

#[test]
fn a_peer_open_failure_hangs_this_ranks_cause_off_source() {
    let err = IpcError::PeerOpenFailed {
        ranks: vec![0, 2],
        local: Some(Box::new(os_error())),
    };
    let source = err.source().expect("this rank's own error is the source");
    assert!(source.to_string().contains("memfd_create"));
    assert_each_level_says_its_own_thing(&err);
}

#[test]
fn an_exchange_failure_does_not_repeat_its_cause() {
    let results = LocalGroup::new(1).run(|comm| {
        let err = IpcError::from(ObjectError::from(
            comm.broadcast(7, &mut [0u8]).unwrap_err(),
        ));
        assert!(err.source().is_some());
        assert_each_level_says_its_own_thing(&err);
    });
    results.into_iter().next().unwrap().unwrap();
}
