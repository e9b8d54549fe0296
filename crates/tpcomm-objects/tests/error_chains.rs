//! Error chains say each thing once: a message describes its own level, and its cause is
//! reachable through `source()` only (so anyhow, eyre or tracing print a clean chain).

use std::error::Error;

use serde::Serialize;
use tpcomm_objects::{decode_from, scatter_with, ObjectError, Options};
use tpcomm_transport::testing::assert_each_level_says_its_own_thing;
use tpcomm_transport::{Communicator, LocalGroup};

#[test]
fn a_decode_error_does_not_repeat_its_cause() {
    let err = decode_from::<String>(3, &[5, b'a']).unwrap_err();
    assert!(matches!(err, ObjectError::Decode { rank: 3, .. }));
    assert!(err.source().is_some());
    assert_each_level_says_its_own_thing(&err);
}

/// Fails to serialize on the rank that holds `true`.
struct FailsOn(bool);

impl Serialize for FailsOn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 {
            Err(serde::ser::Error::custom(
                "this rank's value cannot be serialized",
            ))
        } else {
            s.serialize_u8(1)
        }
    }
}

#[test]
fn a_serialization_failure_does_not_repeat_its_cause() {
    let results = LocalGroup::new(2).run(|comm| {
        tpcomm_objects::all_gather_borrowed(&comm, &FailsOn(comm.rank() == 1)).map(drop)
    });
    let err = results.into_iter().nth(1).unwrap().unwrap().unwrap_err();
    assert!(matches!(err, ObjectError::PeerSerialization { .. }));
    assert!(
        err.source().is_some(),
        "the failing rank keeps its own cause"
    );
    assert_each_level_says_its_own_thing(&err);
}

#[test]
fn a_transport_error_does_not_repeat_its_cause() {
    let results = LocalGroup::new(1).run(|comm| {
        let err = ObjectError::from(comm.broadcast(3, &mut [0u8]).unwrap_err());
        assert!(err.source().is_some(), "the argument error is reachable");
        assert_each_level_says_its_own_thing(&err);
    });
    results.into_iter().next().unwrap().unwrap();
}

#[test]
fn too_large_is_a_number_naming_the_scatter_root_that_announced_it() {
    let results = LocalGroup::new(3).run(|comm| {
        let opts = Options {
            max_total_bytes: 100,
            ..Options::default()
        };
        let values: Vec<Vec<u8>> = vec![vec![0; 10], vec![0; 10], vec![0; 500]];
        scatter_with(
            &comm,
            1,
            (comm.rank() == 1).then_some(values.as_slice()),
            &opts,
        )
    });
    for r in results {
        match r.unwrap() {
            Err(err @ ObjectError::TooLarge { .. }) => {
                let ObjectError::TooLarge {
                    announced,
                    cap,
                    rank,
                } = err
                else {
                    unreachable!()
                };
                assert_eq!((announced, cap, rank), (502, 100, 1));
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
}

#[test]
fn every_object_error_keeps_its_chain_clean() {
    let results = LocalGroup::new(2)
        .run(|comm| tpcomm_objects::all_gather_borrowed(&comm, &FailsOn(true)).map(drop));
    for r in results {
        let err = r.unwrap().unwrap_err();
        assert_each_level_says_its_own_thing(&err);
    }
}
