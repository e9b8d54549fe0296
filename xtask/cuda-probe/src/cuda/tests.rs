use std::os::fd::AsRawFd;

use super::descriptors::{fd_facts, fetch_by_pidfd};
use super::*;
use crate::protocol::Call;

fn calls(v: &mut Vec<Call>) -> Calls<'_> {
    Calls {
        calls: v,
        error_name: None,
    }
}

fn memfd(name: &str) -> OwnedFd {
    rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap()
}

/// The descriptor-passing fallback without a GPU: one side offers an exported
/// descriptor over a socket pair, the other takes it; the same file arrives.
#[test]
fn an_offered_descriptor_arrives_over_the_socket_pair() {
    let (a, b) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let mut exporter = Cuda::with_peer_socket(Some(a));
    let mut importer = Cuda::with_peer_socket(Some(b));
    let file = memfd("offered");
    let raw = file.as_raw_fd();
    let want = rustix::fs::fstat(&file).unwrap();
    exporter.own.fds.push(file);

    let mut v = Vec::new();
    exporter.vmm_offer(&mut calls(&mut v), raw);
    assert!(v.iter().all(|c| c.ok), "{v:?}");
    let mut v = Vec::new();
    let got = importer
        .receive_offered(&mut calls(&mut v), false)
        .expect("a descriptor");
    assert!(v.iter().all(|c| c.ok), "{v:?}");
    let st = rustix::fs::fstat(&got).unwrap();
    assert_eq!((st.st_dev, st.st_ino), (want.st_dev, want.st_ino));

    // Nothing offered: the receive gives up after its timeout, a failure only when
    // pidfd_getfd did not serve either.
    let mut v = Vec::new();
    assert!(importer.receive_offered(&mut calls(&mut v), true).is_none());
    assert!(v.iter().all(|c| c.ok), "{v:?}");
    let mut v = Vec::new();
    assert!(importer
        .receive_offered(&mut calls(&mut v), false)
        .is_none());
    assert!(v.iter().any(|c| !c.ok), "{v:?}");

    // A number that is not an exported descriptor is refused.
    let mut v = Vec::new();
    exporter.vmm_offer(&mut calls(&mut v), 9999);
    assert_eq!(v[0].name, "NOT_EXPORTED");
}

#[test]
fn pidfd_getfd_of_this_process_gives_the_same_file_and_facts_describe_it() {
    let file = memfd("fetched");
    let want = rustix::fs::fstat(&file).unwrap();
    let mut v = Vec::new();
    let got = fetch_by_pidfd(&mut calls(&mut v), std::process::id(), file.as_raw_fd());
    // Some sandboxes forbid pidfd_getfd even on the own process: then it is recorded.
    match got {
        Some(got) => {
            let st = rustix::fs::fstat(&got).unwrap();
            assert_eq!((st.st_dev, st.st_ino), (want.st_dev, want.st_ino));
            assert_eq!(v.last().unwrap().name, "OK");
        }
        None => assert!(v.iter().any(|c| c.name != "OK"), "{v:?}"),
    }
    assert!(
        v.iter().all(|c| c.ok),
        "never a failure of the import: {v:?}"
    );
    let mut values = std::collections::BTreeMap::new();
    let text = fd_facts(&file, &mut values);
    assert!(text.contains("memfd:fetched"), "{text}");
    assert_eq!(values["fd_type"], "regular file");
    assert_eq!(values["fd_ino"], want.st_ino.to_string());
    let mut v = Vec::new();
    assert!(fetch_by_pidfd(&mut calls(&mut v), 0, 1).is_none());
    assert_eq!(v[0].name, "BAD_PID");
}

/// Every operation but `Init` refuses to run before the driver is loaded: no cudarc
/// call (which would panic without a library) is reached.
#[test]
fn operations_before_init_are_refused_without_driver_calls() {
    let mut cuda = Cuda::default();
    for op in [
        Op::MemInfo,
        Op::LegacyExport,
        Op::CkptLock { timeout_ms: 1 },
        Op::State,
    ] {
        let r = cuda.run(&op);
        assert_eq!(r.calls.len(), 1);
        assert_eq!(r.calls[0].name, "NOT_INITIALIZED");
    }
}
