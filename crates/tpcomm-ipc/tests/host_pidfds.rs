//! The host backend keeps a bounded number of owners' pidfds: none of an exited owner, none
//! for an open that failed, at most `HostMemory::PIDFD_CACHE_CAPACITY` in all. Counts are of
//! this process's open descriptors, so the tests of this binary run one at a time (a lock)
//! and no other test binary's tests share the process.

use std::process::Stdio;
use std::sync::{Mutex, PoisonError};

use tpcomm_ipc::{HostHandle, HostMemory, IpcError, PeerMemory};

mod common;
use common::{open_fds, Holder};

/// Held by each test while it counts descriptors.
static COUNTING: Mutex<()> = Mutex::new(());

#[test]
fn no_pidfd_of_an_exited_owner_is_kept() {
    let _counting = COUNTING.lock().unwrap_or_else(PoisonError::into_inner);
    let mem = HostMemory::new();
    let before = open_fds();
    for _ in 0..20 {
        let (owner, h) = Holder::with_segment(4096);
        mem.close(mem.open(&h).expect("a live owner's segment opens"))
            .unwrap();
        drop(owner); // exits: its cached pidfd polls readable from now on
    }
    let after = open_fds();
    // Each open drops the entries of exited owners; the last owner's stays until the next.
    assert!(
        after <= before + 1,
        "20 exited owners: descriptors {before} -> {after}"
    );
}

#[test]
fn a_failed_open_keeps_no_pidfd_of_the_process_it_named() {
    let _counting = COUNTING.lock().unwrap_or_else(PoisonError::into_inner);
    let mem = HostMemory::new();
    // Live processes that own no segment: forged handles name their descriptor 0
    // (/dev/null, another inode) and a descriptor they do not have.
    let live: Vec<Holder> = (0..40).map(|_| Holder::new(Stdio::null())).collect();
    let before = open_fds();
    for owner in &live {
        for fd in [0, 999] {
            let forged = HostHandle {
                pid: owner.child.id(),
                fd,
                dev: 1,
                inode: 2,
                segment_len: 4096,
                offset: 0,
                len: 4096,
            };
            match mem.open(&forged) {
                Err(IpcError::StaleHandle(_)) => {}
                other => panic!("expected StaleHandle, got {other:?}"),
            }
        }
    }
    let after = open_fds();
    assert_eq!(after, before, "80 failed opens of 40 live processes");
}

#[test]
fn live_owners_keep_at_most_the_cache_capacity_of_pidfds() {
    let _counting = COUNTING.lock().unwrap_or_else(PoisonError::into_inner);
    let mem = HostMemory::new();
    let owners: Vec<(Holder, HostHandle)> = (0..HostMemory::PIDFD_CACHE_CAPACITY + 10)
        .map(|_| Holder::with_segment(4096))
        .collect();
    let before = open_fds();
    for (_, h) in &owners {
        mem.close(mem.open(h).expect("a live owner's segment opens"))
            .unwrap();
    }
    let after = open_fds();
    assert_eq!(
        after,
        before + HostMemory::PIDFD_CACHE_CAPACITY,
        "{} live owners",
        owners.len()
    );
    // A clone shares the cache; dropping the last copy closes every pidfd.
    let clone = mem.clone();
    drop(mem);
    assert_eq!(open_fds(), after);
    drop(clone);
    assert_eq!(open_fds(), before);
}
