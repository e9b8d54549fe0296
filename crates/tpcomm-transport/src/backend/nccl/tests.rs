//! The bounded wait's loop, without a GPU.

use std::cell::Cell;
use std::time::{Duration, Instant};

use super::waits::poll_until;
use super::*;

#[test]
fn a_wait_whose_work_finishes_returns_at_the_look_that_sees_it() {
    let looks = Cell::new(0);
    let done = poll_until(Duration::from_secs(60), || {
        looks.set(looks.get() + 1);
        Ok(looks.get() == 3)
    });
    assert!(done.unwrap());
    assert_eq!(looks.get(), 3);
}

#[test]
fn a_wait_whose_work_never_finishes_ends_after_the_timeout() {
    let looks = Cell::new(0u32);
    let start = Instant::now();
    let done = poll_until(Duration::from_millis(200), || {
        looks.set(looks.get() + 1);
        Ok(false)
    });
    assert!(!done.unwrap());
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(looks.get() > 1, "looked {} times", looks.get());
}

#[test]
fn a_failed_look_ends_the_wait_with_its_error() {
    let looks = Cell::new(0);
    let done = poll_until(Duration::from_secs(60), || {
        looks.set(looks.get() + 1);
        if looks.get() == 2 {
            Err(TransportError::Setup("the look failed".into()))
        } else {
            Ok(false)
        }
    });
    assert!(matches!(done, Err(TransportError::Setup(m)) if m == "the look failed"));
    assert_eq!(looks.get(), 2);
}

#[test]
fn a_zero_timeout_looks_once() {
    let looks = Cell::new(0);
    let done = poll_until(Duration::ZERO, || {
        looks.set(looks.get() + 1);
        Ok(false)
    });
    assert!(!done.unwrap());
    assert_eq!(looks.get(), 1);
}
