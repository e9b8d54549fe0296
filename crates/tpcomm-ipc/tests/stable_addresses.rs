//! Stable addresses (`HostMemory::stable`, the CPU twin of the CUDA virtual-memory
//! backend): `close_all` detaches peer mappings and keeps their address ranges,
//! `reopen_all` maps each region's handle back into its range, fresh handles included
//! (buffers released and restored by their owner), and a handle that does not fit its range
//! opens elsewhere and is counted as moved. A detached mapping refuses copies; a forged or
//! dead owner's handle is refused by a reattach as by an open, and the range stays kept.

use std::os::fd::{AsFd, OwnedFd};

use tpcomm_ipc::{
    HostBuffer, HostHandle, HostMemory, IpcError, MemoryRegion, PeerMappings, PeerMemory, Region,
};
use tpcomm_transport::{Communicator, LocalGroup};

mod common;
use common::Holder;

/// Every rank's view after a suspend (close_all) and resume (reopen_all): the peer addresses
/// before and after, what it read from each peer after, and its counters.
#[derive(Debug)]
struct Seen {
    before: Vec<u64>,
    after: Vec<u64>,
    read: Vec<u8>,
    kept: u64,
    moved: u64,
}

/// `ranks` ranks each share one 64 KiB buffer of a stable backend filled with its rank + 1,
/// suspend and resume once; between the two, `between(memory, buffer)` runs on every rank
/// (it may release and restore the buffer, and must leave it filled again if it does).
fn suspend_and_resume(
    ranks: usize,
    between: impl Fn(&HostMemory, &mut HostBuffer, usize) + Sync,
) -> Vec<Seen> {
    LocalGroup::new(ranks)
        .run(|comm| -> tpcomm_ipc::Result<Seen> {
            let me = comm.rank();
            let memory = HostMemory::stable();
            let mut buffer = memory.allocate(64 << 10)?;
            memory.write(&buffer, 0, &[me as u8 + 1; 64])?;
            let mut peers = PeerMappings::new(memory.clone(), &comm)?;
            let region = Region {
                addr: buffer.addr(),
                len: 64 << 10,
            };
            let id = peers.exchange(&comm, &[region])?;
            let others: Vec<usize> = (0..comm.size()).filter(|&r| r != me).collect();
            let addresses = |peers: &PeerMappings<HostMemory>| -> tpcomm_ipc::Result<Vec<u64>> {
                others.iter().map(|&r| peers.address(id, r, 0)).collect()
            };
            let before = addresses(&peers)?;
            assert_eq!(peers.close_all()?, others.len());
            assert!(matches!(
                peers.peer(id, others[0], 0),
                Err(IpcError::Closed)
            ));
            // Every rank has detached before any owner releases its memory.
            comm.barrier()?;
            between(&memory, &mut buffer, me);
            comm.barrier()?;
            peers.reopen_all(&comm)?;
            let after = addresses(&peers)?;
            let mut read = Vec::new();
            for &r in &others {
                let mut byte = [0u8; 1];
                memory.read(peers.peer(id, r, 0)?, 0, &mut byte)?;
                read.push(byte[0]);
            }
            let counters = peers.counters();
            Ok(Seen {
                before,
                after,
                read,
                kept: counters.kept_addresses,
                moved: counters.moved_addresses,
            })
        })
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect()
}

fn expected_reads(ranks: usize, me: usize) -> Vec<u8> {
    (0..ranks)
        .filter(|&r| r != me)
        .map(|r| r as u8 + 1)
        .collect()
}

#[test]
fn a_stable_backend_reopens_every_peer_mapping_at_its_old_address() {
    let seen = suspend_and_resume(3, |_, _, _| {});
    for (me, s) in seen.iter().enumerate() {
        assert_eq!(s.after, s.before, "rank {me}");
        assert_eq!(s.read, expected_reads(3, me), "rank {me}");
        assert_eq!((s.kept, s.moved), (2, 0), "rank {me}");
    }
}

#[test]
fn memory_released_and_restored_by_its_owner_maps_again_at_the_same_peer_addresses() {
    let seen = suspend_and_resume(3, |memory, buffer, me| {
        let before = memory.export(buffer.addr(), 64).unwrap();
        assert_eq!(memory.release_backing(buffer).unwrap(), 64 << 10);
        memory.restore_backing(buffer).unwrap();
        // Fresh memory: zeroed, and another segment than the one peers had mapped.
        let mut byte = [9u8; 1];
        memory.read(buffer, 0, &mut byte).unwrap();
        assert_eq!(byte, [0]);
        assert_ne!(
            memory.export(buffer.addr(), 64).unwrap().inode,
            before.inode
        );
        memory.write(buffer, 0, &[me as u8 + 1; 64]).unwrap();
    });
    for (me, s) in seen.iter().enumerate() {
        assert_eq!(
            s.after, s.before,
            "rank {me}: fresh handles map at the kept addresses"
        );
        assert_eq!(
            s.read,
            expected_reads(3, me),
            "rank {me} reads the restored memory"
        );
        assert_eq!((s.kept, s.moved), (2, 0), "rank {me}");
    }
}

#[test]
fn a_fresh_handle_that_does_not_fit_its_kept_range_opens_elsewhere_and_counts_as_moved() {
    // Rank 1 shares a range of another length after the resume: its peers cannot map it
    // into the kept range, so they map it elsewhere, and say so.
    let results = LocalGroup::new(2).run(|comm| -> tpcomm_ipc::Result<(u64, u64, bool)> {
        let me = comm.rank();
        let memory = HostMemory::stable();
        let buffer = memory.allocate(64 << 10)?;
        let other = memory.allocate(128 << 10)?;
        memory.write(&other, 0, &[7; 64])?;
        memory.write(&buffer, 0, &[7; 8])?;
        let mut peers = PeerMappings::new(memory.clone(), &comm)?;
        let id = peers.exchange(
            &comm,
            &[Region {
                addr: buffer.addr(),
                len: 4096,
            }],
        )?;
        let before = peers.address(id, 1 - me, 0)?;
        peers.close_all()?;
        if me == 1 {
            // Same length, but starting 16 bytes into a page: another page span.
            peers.replace_region(
                id,
                0,
                Region {
                    addr: other.addr() + 16,
                    len: 4096,
                },
            )?;
        }
        peers.reopen_all(&comm)?;
        let after = peers.address(id, 1 - me, 0)?;
        let mut byte = [0u8; 1];
        memory.read(peers.peer(id, 1 - me, 0)?, 0, &mut byte)?;
        assert_eq!(byte, [7]);
        let c = peers.counters();
        Ok((c.kept_addresses, c.moved_addresses, after == before))
    });
    let r: Vec<_> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(
        r[0],
        (0, 1, false),
        "rank 0 maps rank 1's new range elsewhere"
    );
    assert_eq!(
        r[1],
        (1, 0, true),
        "rank 1 maps rank 0's unchanged range in place"
    );
}

/// This process's own segment `h` (of `buffer`), handed to a child as its descriptor 0: a
/// handle another process owns.
fn owned_by_child(h: &HostHandle) -> (Holder, HostHandle) {
    let link = format!("/proc/self/fd/{}", h.fd);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&link)
        .unwrap();
    let owner = Holder::new(OwnedFd::from(file));
    let handle = HostHandle {
        pid: owner.pid(),
        fd: 0,
        ..h.clone()
    };
    (owner, handle)
}

#[test]
fn a_detached_mapping_refuses_copies_and_reattaches_at_its_address() {
    let memory = HostMemory::stable();
    let buffer = memory.allocate(8192).unwrap();
    memory.write(&buffer, 0, &[5; 8]).unwrap();
    let (_owner, h) = owned_by_child(&memory.export(buffer.addr(), 8192).unwrap());
    let mut mapping = memory.open(&h).unwrap();
    let addr = mapping.addr();
    memory.detach(&mut mapping).unwrap();
    assert_eq!(mapping.addr(), addr);
    let mut out = [0u8; 8];
    match memory.read(&mapping, 0, &mut out) {
        Err(IpcError::Unbacked {
            what: "a detached mapping",
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        memory.write(&mapping, 0, &out),
        Err(IpcError::Unbacked { .. })
    ));
    memory.reattach(&mut mapping, &h).unwrap();
    assert_eq!(mapping.addr(), addr);
    memory.read(&mapping, 0, &mut out).unwrap();
    assert_eq!(out, [5; 8]);
    // Reattaching a mapping that is attached is refused, and changes nothing.
    assert!(matches!(
        memory.reattach(&mut mapping, &h),
        Err(IpcError::AddressNotKept { .. })
    ));
}

#[test]
fn a_reattach_refuses_a_forged_descriptor_and_keeps_the_range() {
    let memory = HostMemory::stable();
    let buffer = memory.allocate(8192).unwrap();
    let (_owner, h) = owned_by_child(&memory.export(buffer.addr(), 8192).unwrap());
    let mut mapping = memory.open(&h).unwrap();
    let addr = mapping.addr();
    memory.detach(&mut mapping).unwrap();
    // A handle naming an ordinary file of another process, with that file's identity.
    let file = tempfile_with(8192);
    let stat = rustix::fs::fstat(file.as_fd()).unwrap();
    let forger = Holder::new(file);
    let forged = HostHandle {
        pid: forger.pid(),
        fd: 0,
        dev: stat.st_dev,
        inode: stat.st_ino,
        ..h.clone()
    };
    match memory.reattach(&mut mapping, &forged) {
        Err(IpcError::NotASegment { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(mapping.addr(), addr, "the range is still kept");
    memory.reattach(&mut mapping, &h).unwrap();
    assert_eq!(mapping.addr(), addr);
}

#[test]
fn a_reattach_of_a_dead_owners_handle_says_it_is_gone_and_keeps_the_range() {
    let memory = HostMemory::stable();
    let buffer = memory.allocate(8192).unwrap();
    let exported = memory.export(buffer.addr(), 8192).unwrap();
    let (owner, h) = owned_by_child(&exported);
    let mut mapping = memory.open(&h).unwrap();
    let addr = mapping.addr();
    memory.detach(&mut mapping).unwrap();
    let pid = owner.pid();
    drop(owner);
    match memory.reattach(&mut mapping, &h) {
        Err(IpcError::OwnerGone { pid: p }) => assert_eq!(p, pid),
        other => panic!("{other:?}"),
    }
    // The range is kept for a handle that does open.
    let (_owner, live) = owned_by_child(&exported);
    memory.reattach(&mut mapping, &live).unwrap();
    assert_eq!(mapping.addr(), addr);
}

#[test]
fn a_handle_of_another_size_is_not_mapped_into_a_kept_range() {
    let memory = HostMemory::stable();
    let buffer = memory.allocate(4 << 20).unwrap();
    let (_owner, h) = owned_by_child(&memory.export(buffer.addr(), 8192).unwrap());
    let mut mapping = memory.open(&h).unwrap();
    memory.detach(&mut mapping).unwrap();
    let bigger = HostHandle {
        len: 3 << 20,
        ..h.clone()
    };
    match memory.reattach(&mut mapping, &bigger) {
        Err(IpcError::AddressNotKept { addr, reason }) => {
            assert_eq!(addr, mapping.addr());
            assert!(reason.contains("kept range"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    memory.reattach(&mut mapping, &h).unwrap();
}

/// An ordinary (unlinked) file of `len` bytes.
fn tempfile_with(len: u64) -> OwnedFd {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("tpcomm-forged-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file.set_len(len).unwrap();
    OwnedFd::from(file)
}
