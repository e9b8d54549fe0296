//! Facts read from the system (no driver calls): the NVIDIA device majors of
//! `/proc/devices`, the kernel driver's version, and the data pattern the probe writes and
//! checks.

use serde::{Deserialize, Serialize};

/// One device major of `/proc/devices` whose name starts with `nvidia`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeviceMajor {
    /// `character` or `block`.
    pub(crate) kind: String,
    pub(crate) major: u32,
    pub(crate) name: String,
}

/// The majors named `nvidia*` in the text of `/proc/devices` ("Character devices:", then
/// "major name" lines, a blank line, "Block devices:", ...). Lines that do not parse are
/// skipped.
pub(crate) fn nvidia_majors(text: &str) -> Vec<DeviceMajor> {
    let mut kind = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(section) = line.strip_suffix(" devices:") {
            kind = section.to_ascii_lowercase();
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(major), Some(name), None) = (words.next(), words.next(), words.next()) else {
            continue;
        };
        let Ok(major) = major.parse::<u32>() else {
            continue;
        };
        if name.starts_with("nvidia") {
            out.push(DeviceMajor {
                kind: kind.clone(),
                major,
                name: name.to_string(),
            });
        }
    }
    out
}

/// The kernel driver's version in the first line of `/proc/driver/nvidia/version`
/// ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue ..."): the first word of
/// two or more dot-separated numbers.
pub(crate) fn kernel_driver_version(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| w.split('.').count() >= 2 && w.split('.').all(|p| p.parse::<u32>().is_ok()))
        .map(str::to_string)
}

/// The first release of the driver with the job-file path (`CUDA_CHECKPOINT_JOB_FILE`).
pub(crate) const JOB_FILE_DRIVER: (u32, u32) = (590, 44);

/// Whether a kernel driver version ("580.95.05") is `JOB_FILE_DRIVER` or newer; `None`
/// when it does not parse.
pub(crate) fn has_job_file_path(version: &str) -> Option<bool> {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    Some((major, minor) >= JOB_FILE_DRIVER)
}

/// The bytes the probe writes for `seed`: different for every seed at every offset, so a
/// read of other memory or of older contents does not match.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let i = i as u32;
            (i.wrapping_mul(31) ^ (i >> 8).wrapping_mul(7)) as u8 ^ seed
        })
        .collect()
}

/// Checks `got` against the pattern of `seed`: `Ok(description)` or `Err(the first
/// mismatch)`.
pub(crate) fn check_pattern(seed: u8, got: &[u8]) -> Result<String, String> {
    let want = pattern(seed, got.len());
    match got.iter().zip(&want).position(|(g, w)| g != w) {
        None => Ok(format!(
            "{} bytes match the pattern of seed {seed:#04x}",
            got.len()
        )),
        Some(at) => {
            let also = (0..=255u8)
                .filter(|&s| s != seed)
                .find(|&s| pattern(s, got.len()) == got)
                .map(|s| format!(" (the bytes are the pattern of seed {s:#04x})"))
                .unwrap_or_default();
            let zeros = if got.iter().all(|&b| b == 0) {
                " (all zero)"
            } else {
                ""
            };
            Err(format!(
                "byte {at} is {:#04x}, expected {:#04x} (seed {seed:#04x}){also}{zeros}",
                got[at], want[at]
            ))
        }
    }
}

/// An error and its sources, `: `-separated (libloading puts dlerror's text in the
/// source).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        text.push_str(&format!(": {s}"));
        next = s.source();
    }
    text
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string of exactly `len` bytes.
pub(crate) fn unhex(text: &str, len: usize) -> Option<Vec<u8>> {
    if text.len() != 2 * len || !text.is_ascii() {
        return None;
    }
    (0..len)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// A byte count for people: `4 MiB`, `1.5 GiB`, `4096 B`.
pub(crate) fn bytes(n: u64) -> String {
    const MIB: u64 = 1 << 20;
    if n >= 1 << 30 {
        format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= MIB && n.is_multiple_of(MIB) {
        format!("{} MiB", n / MIB)
    } else if n >= MIB {
        format!("{:.1} MiB", n as f64 / MIB as f64)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICES: &str = "Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
 10 misc
195 nvidia-frontend
226 drm
234 nvidia-nvswitch
235 nvidia-uvm
236 nvidia-caps
237 nvidia-caps-imex-channels
511 weird extra words
abc nvidia-not-a-number

Block devices:
  7 loop
  8 sd
259 blkext
 42 nvidia-blockish
";

    #[test]
    fn proc_devices_yields_the_nvidia_majors_with_their_section() {
        let got = nvidia_majors(DEVICES);
        let names: Vec<(&str, u32, &str)> = got
            .iter()
            .map(|d| (d.kind.as_str(), d.major, d.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("character", 195, "nvidia-frontend"),
                ("character", 234, "nvidia-nvswitch"),
                ("character", 235, "nvidia-uvm"),
                ("character", 236, "nvidia-caps"),
                ("character", 237, "nvidia-caps-imex-channels"),
                ("block", 42, "nvidia-blockish"),
            ]
        );
        assert!(nvidia_majors("").is_empty());
        assert!(nvidia_majors("Character devices:\n  1 mem\n").is_empty());
    }

    #[test]
    fn the_kernel_driver_version_and_the_job_file_cut_off() {
        let text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Sep 25 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(kernel_driver_version(text).as_deref(), Some("580.95.05"));
        assert_eq!(kernel_driver_version("no numbers here\n"), None);
        assert_eq!(kernel_driver_version(""), None);
        assert_eq!(has_job_file_path("580.95.05"), Some(false));
        assert_eq!(has_job_file_path("590.43.99"), Some(false));
        assert_eq!(has_job_file_path("590.44"), Some(true));
        assert_eq!(has_job_file_path("590.44.01"), Some(true));
        assert_eq!(has_job_file_path("610"), Some(true));
        assert_eq!(has_job_file_path("x.1"), None);
    }

    #[test]
    fn patterns_tell_seeds_and_stale_bytes_apart() {
        let p = pattern(0x11, 4096);
        assert!(check_pattern(0x11, &p).is_ok());
        let other = pattern(0x82, 4096);
        let err = check_pattern(0x11, &other).unwrap_err();
        assert!(err.contains("the pattern of seed 0x82"), "{err}");
        let err = check_pattern(0x11, &[0u8; 64]).unwrap_err();
        assert!(err.contains("all zero"), "{err}");
        for seed in 0..=255u8 {
            assert_ne!(pattern(seed, 512), pattern(seed.wrapping_add(1), 512));
        }
    }

    #[test]
    fn hex_round_trips_and_refuses_wrong_lengths() {
        let b: Vec<u8> = (0..64).collect();
        assert_eq!(unhex(&hex(&b), 64).unwrap(), b);
        assert!(unhex(&hex(&b), 63).is_none());
        assert!(unhex("zz", 1).is_none());
        assert_eq!(bytes(4 << 20), "4 MiB");
        assert_eq!(bytes(4096), "4 KiB");
        assert_eq!(bytes(100), "100 B");
    }
}
