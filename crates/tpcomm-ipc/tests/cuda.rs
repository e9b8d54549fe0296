//! The CUDA backends (legacy IPC, `CudaMemory`; virtual memory, `CudaVmmMemory`). Tests
//! that need a GPU print why they skip on a machine without one
//! (`skipped: no CUDA device: ...`) and pass; with `TPCOMM_REQUIRE_GPU=1` a skip is a failure.
//! The tests of loading, handles and their bytes run everywhere.
#![cfg(feature = "cuda")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use cudarc::driver::sys;
use tpcomm_ipc::{
    CudaHandle, CudaMemory, CudaPeerHandle, CudaVmmHandle, CudaVmmMemory, IpcError, MemoryRegion,
    PeerMemory,
};
use tpcomm_transport::LocalGroup;

mod common;
use common::Holder;

fn require_gpu() -> bool {
    std::env::var("TPCOMM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The backend on device 0, or `None` after printing why the test skips.
fn gpu() -> Option<CudaMemory> {
    match CudaMemory::new(0) {
        Ok(mem) => Some(mem),
        Err(IpcError::NoDevice(why)) => {
            tpcomm_transport::testing::skip_without_gpu(&format!("no CUDA device: {why}"));
            None
        }
        Err(e) => panic!("CudaMemory::new(0) failed with something other than NoDevice: {e}"),
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7) ^ seed ^ (i >> 8) as u8)
        .collect()
}

/// The bytes of `h` exactly as they travel between ranks (tpcomm-objects' all-gather).
fn wire_bytes<H: serde::Serialize + Sync>(h: &H) -> Vec<u8> {
    let mut out = LocalGroup::new(1).run(|comm| {
        tpcomm_objects::all_gather_borrowed(&comm, h)
            .unwrap()
            .bytes(0)
            .unwrap()
            .to_vec()
    });
    out.pop().unwrap().unwrap()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn sample_handle() -> CudaHandle {
    CudaHandle {
        ipc: std::array::from_fn(|i| i as u8),
        base_len: 2 << 20,
        offset: 4096,
        len: 100,
        device: 1,
        pid: 300,
    }
}

// ---------------------------------------------------------------- runs everywhere

#[test]
fn new_without_a_usable_gpu_is_no_device_and_never_panics() {
    match CudaMemory::new(0) {
        Err(IpcError::NoDevice(why)) => {
            assert!(
                !require_gpu(),
                "TPCOMM_REQUIRE_GPU=1 but there is no CUDA device: {why}"
            );
            assert!(!why.is_empty());
            eprintln!("no CUDA device, as expected without a GPU: {why}");
        }
        Ok(mem) => {
            assert_eq!(mem.device_ordinal(), 0);
            eprintln!("a CUDA device is present: new(0) works");
        }
        Err(e) => panic!("expected NoDevice or a backend, got {e}"),
    }
}

#[test]
fn a_device_ordinal_that_does_not_exist_is_no_device() {
    for ordinal in [-1, 4096, i32::MAX] {
        match CudaMemory::new(ordinal) {
            Err(IpcError::NoDevice(why)) => assert!(!why.is_empty()),
            other => panic!("ordinal {ordinal}: expected NoDevice, got {other:?}"),
        }
    }
}

#[test]
fn the_result_layer_reports_a_missing_driver_as_no_device() {
    // Every checked call loads the driver first; none may panic without one.
    match tpcomm_ipc::backend::cuda::result::load() {
        Ok(()) => eprintln!("the CUDA driver library is present"),
        Err(IpcError::NoDevice(why)) => {
            assert!(why.contains("libcuda") || why.contains("lacks"), "{why}");
            assert!(matches!(
                tpcomm_ipc::backend::cuda::result::device_count(),
                Err(IpcError::NoDevice(_))
            ));
            assert!(matches!(
                tpcomm_ipc::backend::cuda::result::mem_alloc(1 << 20),
                Err(IpcError::NoDevice(_))
            ));
        }
        Err(e) => panic!("expected NoDevice, got {e}"),
    }
}

#[test]
fn handle_bytes_are_stable() {
    let h = sample_handle();
    let bytes = wire_bytes(&h);
    let mut expected = vec![64u8];
    expected.extend(0..64u8);
    expected.extend([0x80, 0x80, 0x80, 0x01]); // base_len 2 MiB, varint
    expected.extend([0x80, 0x20]); // offset 4096
    expected.push(100); // len
    expected.push(2); // device 1, zigzag varint
    expected.extend([0xac, 0x02]); // pid 300
    assert_eq!(bytes, expected);
    let back: CudaHandle = tpcomm_objects::decode_from(0, &bytes).unwrap();
    assert_eq!(back, h);
}

#[test]
fn an_ipc_handle_of_the_wrong_size_does_not_decode() {
    let mut bytes = wire_bytes(&sample_handle());
    bytes[0] = 63; // claims 63 IPC bytes
    assert!(tpcomm_objects::decode_from::<CudaHandle>(0, &bytes).is_err());
    assert!(tpcomm_objects::decode_from::<CudaHandle>(0, &bytes[..40]).is_err());
}

// ---------------------------------------------------------------- needs a GPU

#[test]
fn a_buffer_viewed_on_a_stream_of_another_device_is_refused() {
    let Some(mem) = gpu() else { return };
    let buf = mem.allocate(4096).unwrap();
    let own = cudarc::driver::CudaContext::new(0)
        .unwrap()
        .default_stream();
    let view = buf.view::<f32>(1024, &own).unwrap();
    assert_eq!(cudarc::driver::DeviceSlice::len(&view), 1024);
    let devices = tpcomm_ipc::backend::cuda::result::device_count().unwrap();
    if devices < 2 {
        // Not a GPU skip: one GPU is a full machine for every other test.
        tpcomm_transport::testing::skip(&format!(
            "needs a second CUDA device for a stream of another device; {devices} visible"
        ));
        return;
    }
    let other = cudarc::driver::CudaContext::new(1)
        .unwrap()
        .default_stream();
    match buf.view::<f32>(1024, &other) {
        Err(IpcError::WrongDevice { buffer, stream }) => assert_eq!((buffer, stream), (0, 1)),
        other => panic!("expected WrongDevice, got {other:?}"),
    }
}

#[test]
fn allocations_are_rounded_to_2_mib_zeroed_and_exported_as_base_plus_offset() {
    let Some(mem) = gpu() else { return };
    let buf = mem.allocate(100).unwrap();
    assert_eq!(buf.len(), 2 << 20);
    let mut got = vec![0xffu8; 4096];
    mem.read(&buf, (2 << 20) - 4096, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "fresh buffers are zeroed");

    let h = mem.export(buf.addr() + 4096, 100).unwrap();
    assert_eq!((h.offset, h.len, h.base_len), (4096, 100, 2 << 20));
    assert_eq!((h.pid, h.device), (std::process::id(), 0));
    let whole = mem.export(buf.addr(), 2 << 20).unwrap();
    assert_eq!(whole.ipc, h.ipc, "one allocation, one IPC handle");

    for (addr, len) in [
        (buf.addr() + (2 << 20) - 10, 100),
        (buf.addr(), 0),
        (buf.addr(), (2 << 20) + 1),
    ] {
        assert!(
            matches!(mem.export(addr, len), Err(IpcError::NotExportable { .. })),
            "{len} bytes at offset {}",
            addr - buf.addr()
        );
    }
    assert!(matches!(
        mem.write(&buf, (2 << 20) - 4, &[0; 8]),
        Err(IpcError::OutOfBounds { .. })
    ));
    assert!(matches!(
        mem.allocate(0),
        Err(IpcError::InvalidAllocation(_))
    ));
}

#[test]
fn host_memory_is_not_exportable() {
    let Some(mem) = gpu() else { return };
    let stack = [0u8; 64];
    match mem.export(stack.as_ptr() as u64, 64) {
        Err(IpcError::NotExportable { reason, .. }) => {
            assert!(reason.contains("device memory"), "{reason}")
        }
        other => panic!("expected NotExportable, got {other:?}"),
    }
}

#[test]
fn opening_a_handle_in_the_process_that_exported_it_is_refused() {
    let Some(mem) = gpu() else { return };
    let buf = mem.allocate(4096).unwrap();
    let h = mem.export(buf.addr(), 4096).unwrap();
    match mem.open(&h) {
        Err(IpcError::InvalidHandle(why)) => assert!(why.contains("exporting process"), "{why}"),
        other => panic!("expected InvalidHandle, got {other:?}"),
    }
}

#[test]
fn a_same_process_backend_opens_its_own_handles_as_aliases() {
    let Some(_) = gpu() else { return };
    let mem = CudaMemory::same_process(0).unwrap();
    assert!(mem.is_same_process());
    let buf = mem.allocate(8192).unwrap();
    mem.write(&buf, 0, &pattern(9, 8192)).unwrap();
    let h = mem.export(buf.addr() + 4096, 4096).unwrap();
    let m = mem.open(&h).unwrap();
    // The alias is the exporter's own address: no driver mapping was made.
    assert_eq!(m.addr(), buf.addr() + 4096);
    let mut back = vec![0u8; 4096];
    mem.read(&m, 0, &mut back).unwrap();
    assert_eq!(back, pattern(9, 8192)[4096..]);
    // Writes through the alias land in the buffer.
    mem.write(&m, 0, &[0xab; 16]).unwrap();
    let mut head = [0u8; 16];
    mem.read(&buf, 4096, &mut head).unwrap();
    assert_eq!(head, [0xab; 16]);
    mem.close(m).unwrap();
    // Reopening gives the same address; the buffer is untouched by the close.
    let again = mem.open(&h).unwrap();
    assert_eq!(again.addr(), buf.addr() + 4096);
    drop(again);
    // A handle naming this process but no allocation it exported is refused.
    let mut forged = h.clone();
    forged.ipc[0] ^= 0xff;
    assert!(matches!(mem.open(&forged), Err(IpcError::InvalidHandle(_))));
}

#[test]
fn memory_pool_allocations_are_not_exportable() {
    let Some(mem) = gpu() else { return };
    mem.bind_to_thread().unwrap();
    let stream: sys::CUstream = std::ptr::null_mut();
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer to a local; the legacy default stream of the current context.
    let r = unsafe { sys::cuMemAllocAsync(&mut ptr, 2 << 20, stream) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemAllocAsync");
    // SAFETY: no pointers.
    let r = unsafe { sys::cuStreamSynchronize(stream) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuStreamSynchronize");
    let result = mem.export(ptr, 4096);
    // SAFETY: frees the allocation made above, once.
    unsafe {
        sys::cuMemFreeAsync(ptr, stream);
        sys::cuStreamSynchronize(stream);
    }
    match result {
        Err(IpcError::NotExportable { reason, .. }) => {
            assert!(
                reason.contains("pool") && reason.contains("legacy-CUDA-IPC"),
                "{reason}"
            )
        }
        other => panic!("expected NotExportable, got {other:?}"),
    }
}

#[test]
fn vmm_allocations_are_not_exportable() {
    let Some(mem) = gpu() else { return };
    mem.bind_to_thread().unwrap();
    let ok = sys::CUresult::CUDA_SUCCESS;
    let location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: 0,
    };
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location,
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let access = sys::CUmemAccessDesc {
        location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let mut size = 0usize;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: out-pointers to locals; the reservation, allocation and mapping made here are
    // undone below, in reverse order.
    unsafe {
        assert_eq!(
            sys::cuMemGetAllocationGranularity(
                &mut size,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            ok
        );
        assert_eq!(sys::cuMemCreate(&mut handle, size, &prop, 0), ok);
        assert_eq!(sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0), ok);
        assert_eq!(sys::cuMemMap(ptr, size, 0, handle, 0), ok);
        assert_eq!(sys::cuMemSetAccess(ptr, size, &access, 1), ok);
    }
    let result = mem.export(ptr, 64);
    // SAFETY: undoes the mapping, reservation and allocation above, once each.
    unsafe {
        sys::cuMemUnmap(ptr, size);
        sys::cuMemAddressFree(ptr, size);
        sys::cuMemRelease(handle);
    }
    match result {
        Err(IpcError::NotExportable { reason, .. }) => {
            assert!(
                reason.contains("VMM") && reason.contains("legacy-CUDA-IPC"),
                "{reason}"
            )
        }
        other => panic!("expected NotExportable, got {other:?}"),
    }
}

const CHILD_OFFSET: usize = (1 << 20) + 100;
const CHILD_LEN: usize = 64 << 10;

/// Not a test on its own: the exporting process of the two-process test. It allocates,
/// writes a pattern, prints its handle, and on `CHECK` prints the first 16 bytes of the
/// range (written by the parent through its mapping). Exits at the end of its stdin.
#[test]
#[ignore = "helper process of a_peer_process_opens_reads_closes_and_reopens_a_handle"]
fn child_cuda_exporter() {
    if std::env::var_os("TPCOMM_CUDA_CHILD").is_none() {
        return;
    }
    let mem = CudaMemory::new(0).unwrap();
    let buf = mem.allocate(3 << 20).unwrap();
    mem.write(&buf, CHILD_OFFSET, &pattern(5, CHILD_LEN))
        .unwrap();
    let h = mem
        .export(buf.addr() + CHILD_OFFSET as u64, CHILD_LEN)
        .unwrap();
    println!("HANDLE {}", hex(&wire_bytes(&h)));
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(line)) = lines.next() {
        if line.trim() == "CHECK" {
            let mut got = [0u8; 16];
            mem.read(&buf, CHILD_OFFSET, &mut got).unwrap();
            println!("MARKER {}", hex(&got));
        }
    }
}

/// A helper process: this test executable running the ignored test `name`, talked to over
/// its stdin and stdout.
struct Helper {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Helper {
    fn spawn(name: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                name,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TPCOMM_CUDA_CHILD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// What follows `tag` in the next line that holds it (the harness may print "test NAME
    /// ... " on the same line).
    fn field(&mut self, tag: &str) -> String {
        self.lines
            .find_map(|l| {
                l.ok()
                    .and_then(|l| l.split_once(tag).map(|(_, rest)| rest.trim().to_string()))
            })
            .unwrap_or_else(|| panic!("the child prints {tag}"))
    }
}

#[test]
fn a_peer_process_opens_reads_closes_and_reopens_a_handle() {
    let Some(mem) = gpu() else { return };
    let mut helper = Helper::spawn("child_cuda_exporter");
    let wire = unhex(&helper.field("HANDLE "));
    let h: CudaHandle = tpcomm_objects::decode_from(0, &wire).unwrap();
    assert_eq!(h.pid, helper.child.id());
    assert_eq!((h.offset, h.len), (CHILD_OFFSET as u64, CHILD_LEN as u64));
    assert_eq!(h.base_len, 4 << 20, "3 MiB rounded up to 2 MiB multiples");

    let m = mem.open(&h).expect("another process opens the handle");
    assert_eq!(m.len(), CHILD_LEN);
    assert_eq!(m.addr(), m.allocation_base() + CHILD_OFFSET as u64);
    let mut got = vec![0u8; CHILD_LEN];
    mem.read(&m, 0, &mut got).unwrap();
    assert_eq!(got, pattern(5, CHILD_LEN), "cross-process read");
    let marker = [0xa5u8; 16];
    mem.write(&m, 0, &marker).unwrap();
    let first = m.addr();
    mem.close(m).expect("an explicit close reports success");

    let again = mem.open(&h).expect("a closed handle opens again");
    let mut got = vec![0u8; CHILD_LEN];
    mem.read(&again, 0, &mut got).unwrap();
    assert_eq!(got[..16], marker);
    assert_eq!(got[16..], pattern(5, CHILD_LEN)[16..]);
    eprintln!(
        "reopened at {:#x} (first at {first:#x}){}",
        again.addr(),
        if again.addr() == first {
            ", same address"
        } else {
            ", moved"
        }
    );
    // A second mapping of the same allocation shares the driver mapping.
    let twin = mem
        .open(&h)
        .expect("the same handle opens twice through the table");
    assert_eq!(twin.addr(), again.addr());
    drop(again);
    mem.read(&twin, 0, &mut got[..16]).unwrap();
    assert_eq!(got[..16], marker, "still mapped while one mapping remains");
    drop(twin);

    writeln!(helper.stdin, "CHECK").unwrap();
    assert_eq!(
        unhex(&helper.field("MARKER ")),
        marker,
        "the owner sees the peer's write"
    );

    helper.child.kill().unwrap();
    helper.child.wait().unwrap();
    match mem.open(&h) {
        Err(e) => eprintln!("after the owner died, open fails: {e}"),
        Ok(m) => {
            eprintln!("after the owner died, the driver still opened its handle");
            mem.close(m).unwrap();
        }
    }
}

/// A same-process handle of a freed allocation never opens as an alias of a new allocation
/// that the driver placed at the same address (with the same size).
#[test]
fn a_stale_same_process_handle_does_not_alias_a_new_allocation_at_its_address() {
    let Some(_) = gpu() else { return };
    let mem = CudaMemory::same_process(0).unwrap();
    let buf = mem.allocate(4096).unwrap();
    let old = buf.addr();
    let h = mem.export(old, 4096).unwrap();
    drop(buf);
    // Allocate until the driver hands the address out again (it usually does at once).
    let mut held = Vec::new();
    let reused = (0..16).any(|_| {
        let b = mem.allocate(4096).unwrap();
        let hit = b.addr() == old;
        held.push(b);
        hit
    });
    if !reused {
        eprintln!("note: the driver did not reuse {old:#x}; the handle is refused as gone");
    }
    match mem.open(&h) {
        Err(IpcError::StaleHandle(_) | IpcError::InvalidHandle(_)) => {}
        other => panic!("a stale handle opened: {other:?}"),
    }
}

// ------------------------------------------------------ virtual memory (CudaVmmMemory)

/// The virtual-memory backend on device 0, or `None` after printing why the test skips
/// (no device, or a device without virtual memory management: a skip with the reason).
fn vmm_gpu() -> Option<CudaVmmMemory> {
    match CudaVmmMemory::new(0) {
        Ok(mem) => Some(mem),
        Err(IpcError::NoDevice(why)) => {
            tpcomm_transport::testing::skip_without_gpu(&format!("no CUDA device: {why}"));
            None
        }
        Err(IpcError::Unsupported { what, .. }) => {
            tpcomm_transport::testing::skip_without_gpu(&format!(
                "the GPU does not support {what}"
            ));
            None
        }
        Err(e) => panic!("CudaVmmMemory::new(0) failed: {e}"),
    }
}

#[test]
fn a_vmm_backend_without_a_usable_gpu_is_no_device_and_never_panics() {
    match CudaVmmMemory::new(0) {
        Err(IpcError::NoDevice(why)) => {
            assert!(
                !require_gpu(),
                "TPCOMM_REQUIRE_GPU=1 but no CUDA device: {why}"
            );
        }
        Err(IpcError::Unsupported { what, .. }) => {
            assert!(
                !require_gpu(),
                "TPCOMM_REQUIRE_GPU=1 but VMM is unsupported: {what}"
            );
        }
        Ok(mem) => assert!(mem.granularity().is_power_of_two()),
        Err(e) => panic!("expected NoDevice, Unsupported or a backend, got {e}"),
    }
}

#[test]
fn vmm_handle_bytes_are_stable() {
    let h = CudaPeerHandle::Vmm(CudaVmmHandle {
        pid: 300,
        fd: 7,
        dev: 5,
        inode: 99,
        rdev: 195 << 8 | 255,
        base_len: 2 << 20,
        offset: 4096,
        len: 100,
        device: 1,
    });
    let wire = wire_bytes(&h);
    // Variant 1, then the fields in order as varints (zigzag for the signed fd and device).
    assert_eq!(hex(&wire), "01ac020e0563ff87038080800180206402");
    let back: CudaPeerHandle = tpcomm_objects::decode_from(0, &wire).unwrap();
    assert_eq!(back, h);
}

const VMM_LEN: usize = 64 << 10;
const VMM_OFFSET: usize = 4096 + 16;

/// Not a test on its own: the exporting process of the two-process VMM test. It allocates
/// with `CudaVmmMemory`, writes a pattern, prints its handle; on `RELEASE` it releases the
/// buffer's memory and on `RESTORE` maps fresh memory at the same address, writes another
/// pattern and prints the new handle and the address; on `CHECK` prints the first 16 bytes
/// of the range. Exits at the end of its stdin.
#[test]
#[ignore = "helper process of a_peer_process_keeps_the_address_of_a_vmm_mapping_through_a_release_and_restore"]
fn child_vmm_exporter() {
    if std::env::var_os("TPCOMM_CUDA_CHILD").is_none() {
        return;
    }
    let mem = CudaVmmMemory::new(0).unwrap();
    let mut buf = mem.allocate(3 << 20).unwrap();
    let export = |mem: &CudaVmmMemory, buf: &tpcomm_ipc::CudaBuffer, seed: u8| {
        mem.write(buf, VMM_OFFSET, &pattern(seed, VMM_LEN)).unwrap();
        let h = mem.export(buf.addr() + VMM_OFFSET as u64, VMM_LEN).unwrap();
        println!("HANDLE {} AT {:#x}", hex(&wire_bytes(&h)), buf.addr());
    };
    export(&mem, &buf, 5);
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(line)) = lines.next() {
        match line.trim() {
            "RELEASE" => {
                let freed = mem.release_backing(&mut buf).unwrap();
                println!("RELEASED {freed}");
            }
            "RESTORE" => {
                mem.restore_backing(&mut buf).unwrap();
                export(&mem, &buf, 9);
            }
            "CHECK" => {
                let mut got = [0u8; 16];
                mem.read(&buf, VMM_OFFSET, &mut got).unwrap();
                println!("MARKER {}", hex(&got));
            }
            _ => {}
        }
    }
}

#[test]
fn a_peer_process_keeps_the_address_of_a_vmm_mapping_through_a_release_and_restore() {
    let Some(mem) = vmm_gpu() else { return };
    let mut helper = Helper::spawn("child_vmm_exporter");
    let handle = |line: String| -> (CudaPeerHandle, String) {
        let (wire, at) = line.split_once(" AT ").expect("HANDLE <hex> AT <addr>");
        (
            tpcomm_objects::decode_from(0, &unhex(wire)).unwrap(),
            at.to_string(),
        )
    };
    let (h, owner_addr) = handle(helper.field("HANDLE "));
    let CudaPeerHandle::Vmm(v) = &h else {
        panic!("a VMM buffer exports a VMM handle: {h:?}")
    };
    assert_eq!(v.pid, helper.child.id());
    assert_eq!((v.offset, v.len), (VMM_OFFSET as u64, VMM_LEN as u64));
    assert_eq!(v.base_len as usize % mem.granularity(), 0);

    let mut m = mem.open(&h).expect("another process imports the handle");
    let addr = m.addr();
    let mut got = vec![0u8; VMM_LEN];
    mem.read(&m, 0, &mut got).unwrap();
    assert_eq!(got, pattern(5, VMM_LEN), "cross-process read");
    mem.write(&m, 0, &[0xa5; 16]).unwrap();
    writeln!(helper.stdin, "CHECK").unwrap();
    assert_eq!(
        unhex(&helper.field("MARKER ")),
        [0xa5; 16],
        "the owner sees the peer's write"
    );

    mem.detach(&mut m).unwrap();
    assert!(matches!(
        mem.read(&m, 0, &mut got[..16]),
        Err(IpcError::Unbacked { .. })
    ));
    writeln!(helper.stdin, "RELEASE").unwrap();
    assert_eq!(
        helper.field("RELEASED ").parse::<u64>().unwrap(),
        v.base_len
    );
    writeln!(helper.stdin, "RESTORE").unwrap();
    let (fresh, owner_again) = handle(helper.field("HANDLE "));
    assert_eq!(
        owner_again, owner_addr,
        "the owner's buffer kept its address"
    );
    assert_ne!(fresh, h, "fresh memory exports a fresh handle");
    mem.reattach(&mut m, &fresh)
        .expect("the fresh handle maps into the kept range");
    assert_eq!(m.addr(), addr, "the peer mapping kept its address");
    mem.read(&m, 0, &mut got).unwrap();
    assert_eq!(
        got,
        pattern(9, VMM_LEN),
        "the fresh memory, through the same address"
    );

    helper.child.kill().unwrap();
    helper.child.wait().unwrap();
    drop(m);
}

#[test]
fn a_vmm_buffer_released_and_restored_is_zeroed_at_the_same_address() {
    let Some(mem) = vmm_gpu() else { return };
    let mut buf = mem.allocate(1).unwrap();
    assert_eq!(buf.len(), mem.granularity(), "rounded to the granularity");
    let addr = buf.addr();
    mem.write(&buf, 0, &[7; 64]).unwrap();
    assert_eq!(mem.release_backing(&mut buf).unwrap(), mem.granularity());
    assert_eq!(mem.release_backing(&mut buf).unwrap(), 0);
    assert!(matches!(
        mem.write(&buf, 0, &[1]),
        Err(IpcError::Unbacked { .. })
    ));
    assert!(
        mem.export(addr, 64).is_err(),
        "a released buffer exports nothing"
    );
    mem.restore_backing(&mut buf).unwrap();
    assert_eq!(buf.addr(), addr);
    let mut got = [1u8; 64];
    mem.read(&buf, 0, &mut got).unwrap();
    assert_eq!(got, [0; 64]);
}

#[test]
fn cudamalloc_memory_travels_through_a_vmm_backend_as_legacy_ipc() {
    let Some(mem) = vmm_gpu() else { return };
    let legacy = mem.legacy().allocate(4096).unwrap();
    match mem.export(legacy.addr(), 4096).unwrap() {
        CudaPeerHandle::Legacy(h) => assert_eq!(h.pid, std::process::id()),
        other => panic!("{other:?}"),
    }
    let vmm = mem.allocate(4096).unwrap();
    assert!(matches!(
        mem.export(vmm.addr(), 4096).unwrap(),
        CudaPeerHandle::Vmm(_)
    ));
    // The legacy backend refuses virtual memory, naming it.
    assert!(matches!(
        mem.legacy().export(vmm.addr(), 4096),
        Err(IpcError::NotExportable { .. })
    ));
}

#[test]
fn a_same_process_vmm_backend_opens_its_own_handles_as_aliases_that_keep_their_address() {
    let Some(_) = vmm_gpu() else { return };
    let mem = CudaVmmMemory::same_process(0).unwrap();
    let mut buf = mem.allocate(4096).unwrap();
    let h = mem.export(buf.addr(), 4096).unwrap();
    let mut alias = mem.open(&h).unwrap();
    assert_eq!(alias.addr(), buf.addr());
    mem.detach(&mut alias).unwrap();
    mem.release_backing(&mut buf).unwrap();
    mem.restore_backing(&mut buf).unwrap();
    let fresh = mem.export(buf.addr(), 4096).unwrap();
    mem.reattach(&mut alias, &fresh).unwrap();
    assert_eq!(alias.addr(), buf.addr());
    mem.write(&alias, 0, &[3; 8]).unwrap();
    let mut got = [0u8; 8];
    mem.read(&buf, 0, &mut got).unwrap();
    assert_eq!(got, [3; 8]);
    // A plain backend refuses its own process's handle, as legacy IPC does.
    let plain = CudaVmmMemory::new(0).unwrap();
    assert!(matches!(
        plain.open(&fresh),
        Err(IpcError::InvalidHandle(_))
    ));
}

#[test]
fn a_vmm_handle_naming_an_ordinary_file_of_another_process_is_refused_before_the_driver_sees_it() {
    let Some(mem) = vmm_gpu() else { return };
    let path = std::env::temp_dir().join(format!("tpcomm-vmm-forged-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let meta = file.metadata().unwrap();
    let holder = Holder::new(file);
    use std::os::unix::fs::MetadataExt;
    let forged = CudaPeerHandle::Vmm(CudaVmmHandle {
        pid: holder.pid(),
        fd: 0,
        dev: meta.dev(),
        inode: meta.ino(),
        rdev: 0,
        base_len: mem.granularity() as u64,
        offset: 0,
        len: 64,
        device: 0,
    });
    match mem.open(&forged) {
        Err(IpcError::NotAnAllocation { found, .. }) => {
            assert!(found.contains("not a character device"), "{found}")
        }
        other => panic!("{other:?}"),
    }
}
