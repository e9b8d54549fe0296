//! Error chains say each thing once: a message describes its own level, and its cause is
//! reachable through `source()` only (so anyhow, eyre or tracing print a clean chain).

mod common;

use std::error::Error;

use common::rank_zero;
use tpcomm_transport::testing::assert_each_level_says_its_own_thing;
use tpcomm_transport::{Communicator, LocalGroup, Op, TransportError};

#[test]
fn an_invalid_argument_does_not_repeat_its_source() {
    let results = LocalGroup::new(2).run(|comm| comm.broadcast(5, &mut [0u8; 4]));
    let err = rank_zero(results).unwrap_err();
    assert!(matches!(err, TransportError::InvalidArgument { .. }));
    assert!(
        err.source().is_some(),
        "the argument error hangs off source()"
    );
    assert_each_level_says_its_own_thing(&err);
}

#[test]
fn an_os_error_does_not_repeat_its_source() {
    let err = TransportError::Os {
        op: Op::AllGather,
        call: "mmap",
        source: std::io::Error::from_raw_os_error(12),
    };
    assert!(err.source().is_some());
    assert_each_level_says_its_own_thing(&err);
}
