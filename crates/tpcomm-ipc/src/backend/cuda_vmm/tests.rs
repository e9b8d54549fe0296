//! Unit tests that need no GPU: the NVIDIA majors of `/proc/devices`, the checks of a handle
//! and of its descriptor, the lookup of owned ranges, the legacy checkpoint blocker.

use std::collections::BTreeMap;

use super::allocation::owned_range;
use super::handle_checks::{check_descriptor, check_fields, DescriptorProblem};
use super::*;
use crate::backend::cuda_region::vmm::Owned;
use crate::backend::descriptor::Identity;

const PROC_DEVICES: &str = "Character devices:\n  1 mem\n  4 tty\n195 nvidia-frontend\n\
    195 nvidia\n234 nvidia-uvm\n237 nvidia-caps\n510 nvidia-nvswitch\n\nBlock devices:\n\
    259 blkext\n195 nvidia-not-a-char-device\n";

fn handle() -> CudaVmmHandle {
    CudaVmmHandle {
        pid: 4242,
        fd: 7,
        dev: 5,
        inode: 99,
        rdev: rustix::fs::makedev(195, 255),
        base_len: 2 << 20,
        offset: 0,
        len: 4096,
        device: 0,
    }
}

fn char_device(rdev: u64) -> Identity {
    Identity {
        dev: 5,
        inode: 99,
        rdev,
        mode: 0o020_600,
    }
}

#[test]
fn nvidia_majors_are_the_character_devices_named_nvidia() {
    assert_eq!(nvidia_majors(PROC_DEVICES), vec![195, 234, 237, 510]);
    assert!(nvidia_majors("Character devices:\n  1 mem\n").is_empty());
}

#[test]
fn a_descriptor_of_the_nvidia_driver_with_the_handles_identity_is_accepted() {
    let h = handle();
    assert_eq!(
        check_descriptor(&h, &char_device(h.rdev), &[195, 234]),
        Ok(())
    );
}

#[test]
fn another_file_at_the_handles_number_is_stale() {
    let h = handle();
    let other = Identity {
        inode: 100,
        ..char_device(h.rdev)
    };
    assert_eq!(
        check_descriptor(&h, &other, &[195]),
        Err(DescriptorProblem::Stale)
    );
}

#[test]
fn an_ordinary_file_or_memfd_with_the_handles_identity_is_not_an_allocation() {
    let h = handle();
    let file = Identity {
        mode: 0o100_600,
        ..char_device(h.rdev)
    };
    match check_descriptor(&h, &file, &[195]) {
        Err(DescriptorProblem::Foreign(why)) => {
            assert!(why.contains("not a character"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_character_device_of_another_driver_is_not_an_allocation() {
    let h = CudaVmmHandle {
        rdev: rustix::fs::makedev(4, 1),
        ..handle()
    };
    match check_descriptor(&h, &char_device(h.rdev), &[195, 234]) {
        Err(DescriptorProblem::Foreign(why)) => assert!(why.contains("4:1"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn handle_fields_outside_the_allocation_or_off_its_granules_are_refused() {
    let g = 2 << 20;
    assert_eq!(check_fields(&handle(), g).unwrap(), 2 << 20);
    for bad in [
        CudaVmmHandle { len: 0, ..handle() },
        CudaVmmHandle {
            offset: (2 << 20) - 16,
            len: 32,
            ..handle()
        },
        CudaVmmHandle {
            offset: u64::MAX,
            ..handle()
        },
        CudaVmmHandle { fd: -1, ..handle() },
        CudaVmmHandle {
            base_len: (2 << 20) + 4096,
            ..handle()
        },
    ] {
        assert!(
            matches!(check_fields(&bad, g), Err(IpcError::InvalidHandle(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn ranges_are_found_inside_owned_allocations_only() {
    // The lookup on a table of two allocations (no driver: the entries are made up).
    let mut table = BTreeMap::new();
    let memfd = || rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let (a, b) = (memfd(), memfd());
    let id = char_device(0);
    for (base, fd) in [(0x1000_0000u64, a), (0x2000_0000u64, b)] {
        table.insert(
            base,
            Owned {
                size: 2 << 20,
                phys: 1,
                device: 0,
                exported: Some((fd, id)),
            },
        );
    }
    assert_eq!(
        owned_range(&table, 0x1000_0000, 16).map(|r| r.0),
        Some(0x1000_0000)
    );
    assert_eq!(
        owned_range(&table, 0x2000_0000 + (2 << 20) - 16, 16).map(|r| r.0),
        Some(0x2000_0000)
    );
    assert!(owned_range(&table, 0x2000_0000 + (2 << 20) - 16, 32).is_none());
    assert!(owned_range(&table, 0x0fff_ffff, 1).is_none());
    assert!(owned_range(&table, 0x1000_0000, 0).is_none());
    assert!(owned_range(&table, u64::MAX, 2).is_none());
}

#[test]
fn legacy_memory_of_another_process_blocks_a_checkpoint_and_says_why() {
    assert!(legacy_checkpoint_blocker(7, 7).is_none());
    let why = legacy_checkpoint_blocker(7, 8).unwrap();
    assert!(
        why.contains("process 7") && why.contains("NOT_PERMITTED"),
        "{why}"
    );
}
