//! Scaffolding shared by this crate's test files (each uses part of it).
#![allow(dead_code)]

use std::fmt::Debug;

use tpcomm_transport::{ArgumentError, Result, TransportError};

/// Rank 0's result of [`LocalGroup::run`](tpcomm_transport::LocalGroup::run), past the
/// layer that reports a panicking rank: what a test of a one-rank group, or of rank 0,
/// looks at.
pub(crate) fn rank_zero<T>(results: Vec<Result<T>>) -> T {
    results
        .into_iter()
        .next()
        .expect("a group has a rank 0")
        .expect("rank 0 did not panic")
}

/// Asserts that `result` is the argument error of a count `value` above `max_count` `max`.
pub(crate) fn assert_count_too_large<T: Debug>(result: Result<T>, value: usize, max: usize) {
    match result {
        Err(TransportError::InvalidArgument {
            source:
                ArgumentError::CountTooLarge {
                    value: v, max: m, ..
                },
            ..
        }) if (v, m) == (value, max) => {}
        other => panic!("expected CountTooLarge {{ value: {value}, max: {max} }}, got {other:?}"),
    }
}
