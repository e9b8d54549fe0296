//! What a handle and the descriptor fetched for it must be before the driver sees them: the
//! handle's own fields, and a descriptor that is the handle's file and a device file of the
//! NVIDIA driver (`/proc/devices`).

use std::sync::OnceLock;

use rustix::fs::FileType;

use super::CudaVmmHandle;
use crate::backend::descriptor::{self, Identity};
use crate::error::{IpcError, Result};

/// The major numbers of the character devices `/proc/devices` text lists under a name
/// starting with `nvidia` (`nvidia`, `nvidiactl`, `nvidia-uvm`, `nvidia-frontend`, ...).
pub fn nvidia_majors(proc_devices: &str) -> Vec<u32> {
    let mut majors = Vec::new();
    let mut in_chars = false;
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_chars = line == "Character devices:";
            continue;
        }
        if !in_chars {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(number), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if let (Ok(major), true) = (number.parse::<u32>(), name.starts_with("nvidia")) {
            if !majors.contains(&major) {
                majors.push(major);
            }
        }
    }
    majors
}

/// The NVIDIA majors of this machine (read once).
pub(super) fn machine_majors() -> &'static [u32] {
    static MAJORS: OnceLock<Vec<u32>> = OnceLock::new();
    MAJORS.get_or_init(|| {
        std::fs::read_to_string("/proc/devices")
            .map(|t| nvidia_majors(&t))
            .unwrap_or_default()
    })
}

/// Whether a descriptor fetched for `h`, of identity `id`, is what `h` names and an
/// allocation handle of the NVIDIA driver: `Err(Stale)` when it is another file than the
/// handle's, `Err(Foreign(what))` when it is the handle's but not a device file of one of
/// `majors`.
pub(super) fn check_descriptor(
    h: &CudaVmmHandle,
    id: &Identity,
    majors: &[u32],
) -> std::result::Result<(), DescriptorProblem> {
    if !id.is(h.dev, h.inode) {
        return Err(DescriptorProblem::Stale);
    }
    let kind = FileType::from_raw_mode(id.mode);
    if kind != FileType::CharacterDevice {
        return Err(DescriptorProblem::Foreign(format!(
            "a {kind:?}, not a character device"
        )));
    }
    let major = rustix::fs::major(id.rdev);
    let minor = rustix::fs::minor(id.rdev);
    if !majors.contains(&major) {
        return Err(DescriptorProblem::Foreign(format!(
            "character device {major}:{minor}, not one of the NVIDIA driver's (majors \
             {majors:?} in /proc/devices)"
        )));
    }
    if id.rdev != h.rdev {
        return Err(DescriptorProblem::Foreign(format!(
            "character device {major}:{minor}, the handle says {}:{}",
            rustix::fs::major(h.rdev),
            rustix::fs::minor(h.rdev)
        )));
    }
    Ok(())
}

/// Why a fetched descriptor is refused ([`check_descriptor`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum DescriptorProblem {
    Stale,
    Foreign(String),
}

/// The fields of a handle checkable without its descriptor: a non-empty range inside the
/// allocation, a descriptor number, an allocation size that is a whole number of
/// `granularity` and addressable here. Returns the allocation's size.
pub(super) fn check_fields(h: &CudaVmmHandle, granularity: usize) -> Result<usize> {
    let whole = "allocation (or empty)";
    descriptor::check_range_and_fd(h.offset, h.len, h.base_len, whole, h.fd)?;
    let size = usize::try_from(h.base_len)
        .map_err(|_| IpcError::InvalidHandle("allocation size out of range".into()))?;
    if size % granularity != 0 {
        return Err(IpcError::InvalidHandle(format!(
            "a {size}-byte allocation is not a whole number of {granularity}-byte granules"
        )));
    }
    Ok(size)
}
