//! Test support shared by the suites of every crate (not part of the API): the GPU skip
//! rule, the error-chain check ([`assert_each_level_says_its_own_thing`]),
//! [`hooked::Hooked`] (a wrapper that counts or fails calls) and [`pair::Pair`] (two
//! processes over a socket, the second one optionally on another host:
//! [`pair::run_pair_on_another_host`]).
//!
//! A test that needs a GPU and finds none calls [`skip_without_gpu`]: under
//! `TPCOMM_REQUIRE_GPU=1` that is a failure; otherwise (and for a test that needs something
//! else the machine lacks: [`skip`]) the reason goes to stderr and, when `TPCOMM_SKIP_LOG`
//! names a file, one line (the test's name and the reason) is appended to it, so that
//! `cargo xtask test` counts the test as skipped rather than passed.

use std::error::Error;
use std::io::Write;

pub mod hooked;
pub mod pair;

/// True when `TPCOMM_REQUIRE_GPU=1`.
pub fn gpu_required() -> bool {
    std::env::var("TPCOMM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// True when `TPCOMM_REQUIRE_MULTIHOST=1`: a test that needs namespaces for another host
/// (root) fails instead of skipping where it cannot make them.
pub fn multihost_required() -> bool {
    std::env::var("TPCOMM_REQUIRE_MULTIHOST").is_ok_and(|v| v == "1")
}

/// Records that the calling test skips because `why` (no GPU, no driver, no NCCL); panics
/// instead when [`gpu_required`].
pub fn skip_without_gpu(why: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("unnamed test");
    assert!(
        !gpu_required(),
        "{test}: TPCOMM_REQUIRE_GPU=1 but the GPU is unusable: {why}"
    );
    skip(why);
}

/// Records that the calling test skips because the machine lacks what it needs (`why`):
/// the reason goes to stderr and to `TPCOMM_SKIP_LOG`, so that `cargo xtask test` counts the
/// test as skipped rather than passed.
pub fn skip(why: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("unnamed test");
    eprintln!("skipped: {test}: {why}");
    if let Some(path) = std::env::var_os("TPCOMM_SKIP_LOG") {
        let line = format!("{test}\t{}\n", why.replace('\n', " "));
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            panic!("{test}: cannot record the skip in {path:?}: {e}");
        }
    }
}

/// Walks `err`'s chain of sources and asserts that no level's message contains the text of
/// its source: each level describes itself, and its cause hangs off `source()` only (the
/// workspace's rule for error chains, checked by the `error_chains` tests of every crate).
pub fn assert_each_level_says_its_own_thing(err: &(dyn Error + 'static)) {
    let mut level: &(dyn Error + 'static) = err;
    while let Some(source) = level.source() {
        let (outer, inner) = (level.to_string(), source.to_string());
        assert!(
            !outer.contains(&inner),
            "{outer:?} repeats its source's text {inner:?}"
        );
        level = source;
    }
}
