//! Small host buffers carved out of shared chunks: one segment, one peer mapping per chunk,
//! freeing local until an extent is handed out again (then it reads as zeros), chunks
//! dropped with their last buffer, and the checks a handle of a mapped segment still passes.

use tpcomm_ipc::{HostMemory, IpcError, MemoryRegion, PeerMemory};

/// Lines of this process's memory map naming a segment peers may map.
fn segment_maps() -> usize {
    maps_named("/memfd:tpcomm-peer")
}

/// Lines of this process's memory map containing `name`.
fn maps_named(name: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(name))
        .count()
}

fn read(mem: &HostMemory, region: &impl MemoryRegion, len: usize) -> Vec<u8> {
    let mut got = vec![0u8; len];
    mem.read(region, 0, &mut got).unwrap();
    got
}

// The tests count this process's segment mappings: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn small_buffers_share_one_segment_and_a_peer_maps_it_once() {
    let _serial = serial();
    let owner = HostMemory::new();
    let buffers: Vec<_> = (0..100).map(|_| owner.allocate(4096).unwrap()).collect();
    assert_eq!(owner.chunks(), 1);
    for (i, b) in buffers.iter().enumerate() {
        assert!(b.is_carved());
        owner.write(b, 0, &[i as u8; 64]).unwrap();
    }
    let handles: Vec<_> = buffers
        .iter()
        .map(|b| owner.export(b.addr(), 4096).unwrap())
        .collect();
    assert!(handles.iter().all(|h| h.inode == handles[0].inode));
    let mut offsets: Vec<u64> = handles.iter().map(|h| h.offset).collect();
    offsets.dedup();
    assert_eq!(offsets.len(), 100, "distinct extents");

    let peer = HostMemory::new();
    let maps_before = segment_maps();
    let refs: Vec<_> = handles.iter().collect();
    let mappings = peer.open_all(&refs).unwrap();
    assert_eq!(peer.peer_segments_mapped(), 1);
    assert_eq!(segment_maps(), maps_before + 1, "one mmap for 100 handles");
    let single = peer.open(&handles[7]).unwrap();
    assert_eq!(segment_maps(), maps_before + 1, "open shares it too");
    for (i, m) in mappings.iter().enumerate() {
        assert_eq!(read(&peer, m, 64), vec![i as u8; 64]);
    }
    assert_eq!(single.addr(), mappings[7].addr());
    drop(single);
    for m in mappings {
        peer.close(m).unwrap();
    }
    assert_eq!(peer.peer_segments_mapped(), 0);
    assert_eq!(segment_maps(), maps_before, "the last close unmaps");
}

#[test]
fn a_large_buffer_gets_a_segment_of_its_own() {
    let _serial = serial();
    let mem = HostMemory::new();
    let small = mem.allocate(HostMemory::CARVE_MAX_BYTES).unwrap();
    let large = mem.allocate(HostMemory::CARVE_MAX_BYTES + 1).unwrap();
    assert!(small.is_carved());
    assert!(!large.is_carved());
    assert_eq!(mem.chunks(), 1);
    let h = mem.export(large.addr(), large.len()).unwrap();
    assert_eq!((h.offset, h.segment_len), (0, large.len() as u64));
}

/// An 8 KiB carved buffer filled with 0xab and opened by a peer, next to a 4 KiB buffer that
/// keeps the chunk alive while the first one comes and goes.
struct Shared {
    owner: HostMemory,
    _keep: tpcomm_ipc::HostBuffer,
    first: tpcomm_ipc::HostBuffer,
    peer: HostMemory,
    mapping: tpcomm_ipc::HostMapping,
}

fn shared_8k() -> Shared {
    let owner = HostMemory::new();
    let _keep = owner.allocate(4096).unwrap();
    let first = owner.allocate(8192).unwrap();
    owner.write(&first, 0, &[0xab; 8192]).unwrap();
    let h = owner.export(first.addr(), 8192).unwrap();
    let peer = HostMemory::new();
    let mapping = peer.open(&h).unwrap();
    Shared {
        owner,
        _keep,
        first,
        peer,
        mapping,
    }
}

#[test]
fn freeing_is_local_until_the_extent_is_handed_out_again_then_it_reads_as_zeros() {
    let _serial = serial();
    let Shared {
        owner,
        _keep,
        first,
        peer,
        mapping,
    } = shared_8k();
    let addr = first.addr();
    drop(first);
    assert_eq!(
        read(&peer, &mapping, 8192),
        vec![0xab; 8192],
        "a peer keeps reading a freed buffer's bytes"
    );
    let second = owner.allocate(8192).unwrap();
    assert_eq!(second.addr(), addr, "first fit hands the extent out again");
    assert_eq!(
        read(&owner, &second, 8192),
        vec![0; 8192],
        "a new buffer is zeroed"
    );
    assert_eq!(read(&peer, &mapping, 8192), vec![0; 8192]);
}

/// `retire` instead of a drop: the extent is never handed out again, so a peer still mapping
/// it keeps reading the last bytes, and a new buffer lands elsewhere.
#[test]
fn a_retired_buffer_is_never_carved_again_and_a_peer_keeps_its_bytes() {
    let _serial = serial();
    let Shared {
        owner,
        _keep,
        first,
        peer,
        mapping,
    } = shared_8k();
    let range = first.addr()..first.addr() + 8192;
    owner.retire(first);
    let second = owner.allocate(8192).unwrap();
    owner.write(&second, 0, &[0xff; 8192]).unwrap();
    assert!(
        !range.contains(&second.addr()),
        "a new buffer was carved over the retired one"
    );
    assert_eq!(read(&peer, &mapping, 8192), vec![0xab; 8192]);
}

#[test]
fn a_chunk_goes_with_its_last_buffer_and_its_handles_go_stale() {
    let _serial = serial();
    let owner = HostMemory::new();
    let a = owner.allocate(4096).unwrap();
    let b = owner.allocate(4096).unwrap();
    let ha = owner.export(a.addr(), 4096).unwrap();
    let peer = HostMemory::new();
    let mapping = peer.open(&ha).unwrap();
    drop(a);
    // Another buffer still lives in the segment: the handle still opens (a handle names a
    // segment; whether the owner still uses that range is the owner's business).
    drop(peer.open(&ha).unwrap());
    drop(b);
    assert_eq!(owner.chunks(), 0);
    // The peer's mapping holds the memory, but no handle of the segment opens any more,
    // neither from that mapping nor afresh.
    assert!(matches!(peer.open(&ha), Err(IpcError::StaleHandle(_))));
    drop(mapping);
    assert!(matches!(peer.open(&ha), Err(IpcError::StaleHandle(_))));
}

#[test]
fn a_handle_of_a_mapped_segment_still_passes_every_check_of_its_own() {
    let _serial = serial();
    let owner = HostMemory::new();
    let buf = owner.allocate(4096).unwrap();
    let good = owner.export(buf.addr(), 4096).unwrap();
    let peer = HostMemory::new();
    let _mapping = peer.open(&good).unwrap();
    let cases = [
        tpcomm_ipc::HostHandle {
            segment_len: good.segment_len * 2,
            offset: good.segment_len,
            ..good.clone()
        },
        tpcomm_ipc::HostHandle {
            segment_len: good.segment_len / 2,
            ..good.clone()
        },
        tpcomm_ipc::HostHandle {
            offset: good.segment_len - 8,
            len: 16,
            ..good.clone()
        },
        tpcomm_ipc::HostHandle {
            len: 0,
            ..good.clone()
        },
        tpcomm_ipc::HostHandle {
            fd: -1,
            ..good.clone()
        },
    ];
    for bad in &cases {
        match peer.open(bad) {
            Err(IpcError::InvalidHandle(_)) => {}
            other => panic!("{bad:?}: expected InvalidHandle, got {other:?}"),
        }
        match peer.open_all(&[&good, bad]) {
            Err(IpcError::InvalidHandle(_)) => {}
            other => panic!("batch with {bad:?}: expected InvalidHandle, got {other:?}"),
        }
    }
}

#[test]
fn export_refuses_a_range_across_two_carved_buffers() {
    let _serial = serial();
    let mem = HostMemory::new();
    let a = mem.allocate(4096).unwrap();
    let b = mem.allocate(4096).unwrap();
    assert_eq!(b.addr(), a.addr() + 4096, "adjacent extents");
    assert!(matches!(
        mem.export(a.addr(), 4096 + 16),
        Err(IpcError::NotExportable { .. })
    ));
    assert!(matches!(
        mem.export(a.addr() + 4000, 200),
        Err(IpcError::NotExportable { .. })
    ));
    mem.export(b.addr(), 4096).unwrap();
}

#[test]
fn freed_chunks_give_their_memory_back() {
    let _serial = serial();
    let mem = HostMemory::new();
    let maps_before = segment_maps();
    let buffers: Vec<_> = (0..40)
        .map(|_| mem.allocate(HostMemory::CARVE_MAX_BYTES).unwrap())
        .collect();
    let chunks = mem.chunks();
    assert_eq!(
        chunks,
        (40 * HostMemory::CARVE_MAX_BYTES).div_ceil(HostMemory::CHUNK_BYTES)
    );
    assert_eq!(segment_maps(), maps_before + chunks);
    drop(buffers);
    assert_eq!(mem.chunks(), 0);
    assert_eq!(segment_maps(), maps_before, "every chunk unmapped");
}

/// Whether the page at `addr` is mapped in this process's page tables now (`/proc/self/
/// pagemap`, bit 63; readable unprivileged).
fn page_present(addr: u64) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
    f.seek(SeekFrom::Start(addr / 4096 * 8)).unwrap();
    let mut entry = [0u8; 8];
    f.read_exact(&mut entry).unwrap();
    u64::from_le_bytes(entry) >> 63 == 1
}

#[test]
fn small_mappings_are_prefaulted_and_large_ones_fault_in_at_use() {
    let _serial = serial();
    let owner = HostMemory::new();
    let small: Vec<_> = (0..10).map(|_| owner.allocate(8192).unwrap()).collect();
    let large = owner.allocate(HostMemory::CARVE_MAX_BYTES * 2).unwrap();
    for b in small.iter().chain([&large]) {
        owner.write(b, 0, &[1; 64]).unwrap();
    }
    let handles: Vec<_> = small
        .iter()
        .chain([&large])
        .map(|b| owner.export(b.addr(), b.len()).unwrap())
        .collect();
    let peer = HostMemory::new();
    let refs: Vec<_> = handles.iter().collect();
    let mappings = peer.open_all(&refs).unwrap();
    for m in &mappings[..10] {
        assert!(page_present(m.addr()) && page_present(m.addr() + 4096));
    }
    let big = &mappings[10];
    assert!(
        !page_present(big.addr()),
        "a large mapping is not populated"
    );
    assert_eq!(read(&peer, big, 64), vec![1; 64]);
    assert!(page_present(big.addr()), "it faults in when read");
}

#[test]
fn a_private_buffer_has_a_segment_of_its_own_and_cannot_be_exported() {
    let _serial = serial();
    let owner = HostMemory::new();
    let shared = owner.allocate(4096).unwrap();
    let chunks = owner.chunks();
    let (maps_before, private_before) = (segment_maps(), maps_named("/memfd:tpcomm-private"));
    let private = owner.allocate_private(4096).unwrap();
    assert!(!private.is_carved());
    assert_eq!(owner.chunks(), chunks, "no chunk was carved for it");
    assert_eq!(segment_maps(), maps_before, "no segment peers may map");
    assert_eq!(
        maps_named("/memfd:tpcomm-private"),
        private_before + 1,
        "a private segment of its own"
    );
    assert_eq!(read(&owner, &private, 4096), vec![0; 4096], "zeroed");
    owner.write(&private, 100, &[7; 8]).unwrap();
    let mut got = [0u8; 8];
    owner.read(&private, 100, &mut got).unwrap();
    assert_eq!(got, [7; 8]);
    assert!(matches!(
        owner.export(private.addr(), 8),
        Err(IpcError::NotExportable { .. })
    ));
    let handle = owner.export(shared.addr(), 8).unwrap();
    let chunk = shared.addr() - handle.offset..shared.addr() - handle.offset + handle.segment_len;
    assert!(!chunk.contains(&private.addr()));
    drop(private);
    assert_eq!(
        maps_named("/memfd:tpcomm-private"),
        private_before,
        "unmapped when dropped"
    );
    assert!(
        owner.export(shared.addr(), 8).is_ok(),
        "the shared buffer is untouched"
    );
}
