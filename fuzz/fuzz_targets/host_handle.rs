//! Handle parsing and validation in `tpcomm-ipc`: arbitrary bytes decoded into a
//! `HostHandle` (or a real handle with fuzzed fields) and opened with `HostMemory::open`.
//!
//! Opening must fail with an error, never panic, unless the handle names exactly the one
//! live segment this process exported (same pid, descriptor, device, inode and size, range
//! inside it): nothing else may ever be mapped.
//!
//! The harness never lets a handle name another live process: fetching descriptors from
//! arbitrary processes of the machine is what the validation refuses, and libFuzzer's
//! comparison tracing could learn a real inode. A pid of another process is moved past
//! `pid_max` (a process that cannot exist), so the "owner gone" path is still exercised.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tpcomm_ipc::{HostBuffer, HostHandle, HostMemory, MemoryRegion, PeerMemory};

struct Fixture {
    mem: HostMemory,
    /// The one live segment, kept alive for the whole run.
    _buffer: HostBuffer,
    exported: HostHandle,
    pid_max: u32,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let mem = HostMemory::new();
        let buffer = mem.allocate(3 * 4096).expect("allocate a segment");
        let exported = mem.export(buffer.addr(), buffer.len()).expect("export it");
        let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 22);
        Fixture {
            mem,
            _buffer: buffer,
            exported,
            pid_max,
        }
    })
}

/// XORs up to 8 bytes of `delta` into `v`.
fn mutate(v: u64, delta: &mut &[u8]) -> u64 {
    let n = delta.len().min(8);
    let mut b = [0u8; 8];
    b[..n].copy_from_slice(&delta[..n]);
    *delta = &delta[n..];
    v ^ u64::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let mut h = if mode & 1 == 0 {
        // Bytes as they arrive from a peer.
        match tpcomm_objects::decode_from::<HostHandle>(1, rest) {
            Ok(h) => h,
            Err(_) => return,
        }
    } else {
        // The real handle with some fields changed: reaches the checks past the pid.
        let e = &f.exported;
        let mut h = e.clone();
        if mode & 2 != 0 {
            h.fd = mutate(e.fd as u64, &mut rest) as i32;
        }
        if mode & 4 != 0 {
            h.inode = mutate(e.inode, &mut rest);
            h.dev = mutate(e.dev, &mut rest);
        }
        if mode & 8 != 0 {
            h.segment_len = mutate(e.segment_len, &mut rest);
        }
        h.offset = mutate(e.offset, &mut rest);
        h.len = mutate(e.len, &mut rest);
        if mode & 16 != 0 {
            h.pid = mutate(u64::from(e.pid), &mut rest) as u32;
        }
        h
    };
    let me = std::process::id();
    if h.pid != me && h.pid != 0 && h.pid <= f.pid_max {
        h.pid = f.pid_max.saturating_add(1).saturating_add(h.pid);
    }
    match f.mem.open(&h) {
        Err(_) => {}
        Ok(mapping) => {
            let e = &f.exported;
            assert_eq!(
                (h.pid, h.fd, h.dev, h.inode, h.segment_len),
                (e.pid, e.fd, e.dev, e.inode, e.segment_len),
                "a handle that does not name the live segment was mapped: {h:?}"
            );
            assert!(h
                .offset
                .checked_add(h.len)
                .is_some_and(|end| end <= h.segment_len));
            assert_eq!(mapping.len() as u64, h.len);
            f.mem.close(mapping).expect("close the mapping");
        }
    }
});
