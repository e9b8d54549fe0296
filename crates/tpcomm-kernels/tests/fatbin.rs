//! The embedded fatbin, read back with tpcomm-kernel-build's parser: every entry point for
//! every architecture, and the CUDA compiler's view of the shared layout equal to the
//! Rust mirror's.

use tpcomm_kernel_build::fatbin::{EntryKind, Fatbin, FatbinEntry};
use tpcomm_kernel_build::TARGETS;
use tpcomm_kernels::layout::{expected_layout, LAYOUT_NAMES, LAYOUT_SYMBOL};
use tpcomm_kernels::{FATBIN, KERNELS, RESOURCE_REPORT};

fn fatbin() -> Fatbin<'static> {
    Fatbin::parse(FATBIN).expect("the embedded fatbin parses")
}

/// Every entry the build asked for: a cubin per SASS target, PTX per PTX target.
fn expected_entries(fb: &Fatbin<'static>) -> Vec<FatbinEntry<'static>> {
    let mut out = Vec::new();
    for t in TARGETS {
        if t.sass {
            out.push(
                *fb.cubin(t.arch)
                    .unwrap_or_else(|| panic!("no cubin for sm_{}", t.arch)),
            );
        }
        if t.ptx {
            out.push(
                *fb.ptx(t.arch)
                    .unwrap_or_else(|| panic!("no PTX for compute_{}", t.arch)),
            );
        }
    }
    out
}

#[test]
fn fatbin_holds_sass_for_sm80_sm90_sm100_and_ptx_for_compute80_only() {
    let fb = fatbin();
    let mut targets: Vec<String> = fb.entries().iter().map(|e| e.target_name()).collect();
    targets.sort();
    assert_eq!(targets, ["compute_80", "sm_100", "sm_80", "sm_90"]);
}

#[test]
fn every_entry_point_exists_for_every_architecture() {
    let fb = fatbin();
    for entry in expected_entries(&fb) {
        let mut found = entry.entry_points().unwrap();
        found.sort();
        let mut want: Vec<String> = KERNELS.iter().map(|k| (*k).to_owned()).collect();
        want.sort();
        assert_eq!(found, want, "entry points of {}", entry.target_name());
    }
}

#[test]
fn cuda_layout_equals_the_rust_mirror_in_every_cubin_and_the_ptx() {
    let fb = fatbin();
    let want = expected_layout();
    for entry in expected_entries(&fb) {
        let bytes = entry
            .global_bytes(LAYOUT_SYMBOL)
            .unwrap()
            .unwrap_or_else(|| panic!("no {LAYOUT_SYMBOL} in {}", entry.target_name()));
        let got: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got.len(), want.len(), "{} entries", entry.target_name());
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert_eq!(
                g,
                w,
                "{}: {} is {g} on the CUDA side, {w} in Rust",
                entry.target_name(),
                LAYOUT_NAMES[i]
            );
        }
    }
}

#[test]
fn cubins_are_elf_and_ptx_is_text() {
    for e in fatbin().entries() {
        match e.kind {
            EntryKind::Cubin => assert!(e.payload.starts_with(b"\x7fELF")),
            EntryKind::Ptx => assert!(e.ptx_text().unwrap().contains(".version")),
        }
    }
}

#[test]
fn embedded_fatbin_is_16_byte_aligned() {
    assert_eq!(FATBIN.as_ptr() as usize % 16, 0);
}

#[test]
fn resource_report_lists_every_kernel_without_spills() {
    for k in KERNELS {
        let row = RESOURCE_REPORT
            .lines()
            .find(|l| l.split_whitespace().next() == Some(k))
            .unwrap_or_else(|| panic!("{k} missing from\n{RESOURCE_REPORT}"));
        assert!(row.ends_with("none"), "{row}");
    }
}
