//! The ptxas resource report (`-Xptxas -v`): parsing, checking, printing.
//!
//! ptxas prints, for every entry function and target:
//!
//! ```text
//! ptxas info    : Compiling entry function 'tpcomm_ar_1stage_f16_w4' for 'sm_80'
//! ptxas info    : Function properties for tpcomm_ar_1stage_f16_w4
//!     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//! ptxas info    : Used 40 registers, used 1 barriers, 408 bytes cmem[0]
//! ```
//!
//! and `N bytes lmem` in the `Used` line when a kernel needs local memory.

use std::collections::BTreeMap;

use crate::BuildError;

/// Resources of one kernel compiled for one architecture, as ptxas reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    /// Entry point name.
    pub kernel: String,
    /// Target, e.g. `sm_90`.
    pub arch: String,
    /// Registers per thread.
    pub registers: u32,
    /// Per-thread stack frame in bytes.
    pub stack_frame_bytes: u32,
    /// Bytes stored by register spills.
    pub spill_store_bytes: u32,
    /// Bytes loaded by register spills.
    pub spill_load_bytes: u32,
    /// Local memory per thread (`lmem`) in bytes; 0 when ptxas did not mention it.
    pub local_memory_bytes: u32,
    /// Named barriers used.
    pub barriers: u32,
}

impl KernelResources {
    /// Whether this kernel spills or uses a stack frame or local memory.
    pub fn uses_local_memory(&self) -> bool {
        self.stack_frame_bytes != 0
            || self.spill_store_bytes != 0
            || self.spill_load_bytes != 0
            || self.local_memory_bytes != 0
    }
}

/// Parses everything nvcc printed with `-Xptxas -v` into one record per entry function
/// and target, in the order ptxas printed them. Lines that are not part of the report are
/// ignored; an entry whose `Used ... registers` line never came is dropped.
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out = Vec::new();
    let mut current: Option<KernelResources> = None;
    for line in log.lines() {
        let text = line
            .trim()
            .strip_prefix("ptxas info")
            .map(|rest| rest.trim_start().trim_start_matches(':').trim())
            .unwrap_or_else(|| line.trim());
        if let Some(rest) = text.strip_prefix("Compiling entry function") {
            let quoted: Vec<&str> = rest.split('\'').collect();
            // rest = " 'NAME' for 'ARCH'" -> ["", "NAME", " for ", "ARCH", ""]
            current = match (quoted.get(1), quoted.get(3)) {
                (Some(name), Some(arch)) => Some(KernelResources {
                    kernel: (*name).to_owned(),
                    arch: (*arch).to_owned(),
                    registers: 0,
                    stack_frame_bytes: 0,
                    spill_store_bytes: 0,
                    spill_load_bytes: 0,
                    local_memory_bytes: 0,
                    barriers: 0,
                }),
                _ => None,
            };
        } else if text.contains("bytes stack frame") {
            if let Some(k) = current.as_mut() {
                k.stack_frame_bytes = number_before(text, "bytes stack frame").unwrap_or(0);
                k.spill_store_bytes = number_before(text, "bytes spill stores").unwrap_or(0);
                k.spill_load_bytes = number_before(text, "bytes spill loads").unwrap_or(0);
            }
        } else if let Some(rest) = text.strip_prefix("Used") {
            if let Some(mut k) = current.take() {
                k.registers = number_before(rest, "registers").unwrap_or(0);
                k.local_memory_bytes = number_before(rest, "bytes lmem").unwrap_or(0);
                k.barriers = number_before(rest, "barriers").unwrap_or(0);
                out.push(k);
            }
        }
    }
    out
}

/// The unsigned number right before `phrase` in `text` (`"40 registers"` -> 40).
fn number_before(text: &str, phrase: &str) -> Option<u32> {
    let at = text.find(phrase)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// Fails when any kernel spills registers or uses a stack frame or local memory.
///
/// # Errors
/// [`BuildError::ResourceViolation`] listing the offenders and the whole report.
pub fn check_resources(report: &[KernelResources]) -> Result<(), BuildError> {
    let violations: Vec<KernelResources> = report
        .iter()
        .filter(|k| k.uses_local_memory())
        .cloned()
        .collect();
    if violations.is_empty() {
        Ok(())
    } else {
        Err(BuildError::ResourceViolation {
            violations,
            all: report.to_vec(),
        })
    }
}

/// One row per kernel, one column of registers per target, then what the kernel uses
/// of stack, spills and local memory across all targets (`none` when nothing).
pub fn format_table(report: &[KernelResources]) -> String {
    let mut archs: Vec<&str> = report.iter().map(|k| k.arch.as_str()).collect();
    archs.sort_by_key(|a| arch_number(a));
    archs.dedup();
    let mut rows: BTreeMap<&str, Vec<&KernelResources>> = BTreeMap::new();
    for k in report {
        rows.entry(k.kernel.as_str()).or_default().push(k);
    }
    let name_width = rows.keys().map(|k| k.len()).max().unwrap_or(6).max(6);
    let mut s = format!("{:<name_width$}", "kernel");
    for a in &archs {
        s.push_str(&format!("  {:>11}", format!("{a} regs")));
    }
    s.push_str("  stack/spill/lmem\n");
    for (name, entries) in &rows {
        s.push_str(&format!("{name:<name_width$}"));
        for a in &archs {
            let cell = entries
                .iter()
                .find(|k| k.arch == *a)
                .map(|k| k.registers.to_string())
                .unwrap_or_else(|| "-".to_owned());
            s.push_str(&format!("  {cell:>11}"));
        }
        let used: Vec<String> = entries
            .iter()
            .filter(|k| k.uses_local_memory())
            .map(|k| {
                format!(
                    "{}: stack {} B, spill st {} B, spill ld {} B, lmem {} B",
                    k.arch,
                    k.stack_frame_bytes,
                    k.spill_store_bytes,
                    k.spill_load_bytes,
                    k.local_memory_bytes
                )
            })
            .collect();
        if used.is_empty() {
            s.push_str("  none\n");
        } else {
            s.push_str(&format!("  {}\n", used.join("; ")));
        }
    }
    s
}

fn arch_number(arch: &str) -> u32 {
    arch.trim_start_matches(|c: char| !c.is_ascii_digit())
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verbatim excerpt of what nvcc 13.0 printed for kernels/allreduce.cu.
    const NVCC_13_LOG: &str = "\
ptxas info    : 160 bytes gmem, 8 bytes cmem[4]
ptxas info    : Compiling entry function 'tpcomm_ar_2stage_bf16_w8' for 'sm_80'
ptxas info    : Function properties for tpcomm_ar_2stage_bf16_w8
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 90 registers, used 1 barriers, 408 bytes cmem[0]
ptxas info    : Compile time = 19.115 ms
ptxas info    : 160 bytes gmem
ptxas info    : Compiling entry function 'tpcomm_ar_2stage_bf16_w8' for 'sm_90'
ptxas info    : Function properties for tpcomm_ar_2stage_bf16_w8
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
ptxas info    : Compile time = 20.000 ms
";

    #[test]
    fn nvcc_13_report_gives_one_record_per_kernel_and_arch() {
        let r = parse_ptxas_report(NVCC_13_LOG);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].kernel, "tpcomm_ar_2stage_bf16_w8");
        assert_eq!(r[0].arch, "sm_80");
        assert_eq!(r[0].registers, 90);
        assert_eq!(r[0].barriers, 1);
        assert_eq!(r[1].arch, "sm_90");
        assert_eq!(r[1].registers, 96);
        assert!(r.iter().all(|k| !k.uses_local_memory()));
        check_resources(&r).unwrap();
    }

    #[test]
    fn spills_and_local_memory_are_violations() {
        let log = "\
ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
    48 bytes stack frame, 44 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 255 registers, 48 bytes lmem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'fine' for 'sm_80'
ptxas info    : Function properties for fine
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, 360 bytes cmem[0]
";
        let r = parse_ptxas_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (
                r[0].stack_frame_bytes,
                r[0].spill_store_bytes,
                r[0].spill_load_bytes,
                r[0].local_memory_bytes,
                r[0].registers
            ),
            (48, 44, 40, 48, 255)
        );
        let err = check_resources(&r).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("k sm_80: 255 registers"), "{msg}");
        match err {
            BuildError::ResourceViolation { violations, .. } => {
                assert_eq!(violations.len(), 1);
                assert_eq!(violations[0].kernel, "k");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn local_memory_alone_is_a_violation() {
        let log = "\
ptxas info    : Compiling entry function 'k' for 'sm_90'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, 16 bytes lmem
";
        assert!(check_resources(&parse_ptxas_report(log)).is_err());
    }

    #[test]
    fn unrelated_lines_and_unfinished_entries_are_ignored() {
        let log = "\
nvcc warning : something
ptxas info    : Compiling entry function 'half' for 'sm_80'
ptxas info    : Function properties for half
";
        assert!(parse_ptxas_report(log).is_empty());
    }

    #[test]
    fn table_pivots_archs_in_numeric_order() {
        let log = NVCC_13_LOG.replace("sm_90", "sm_100");
        let table = format_table(&parse_ptxas_report(&log));
        let mut lines = table.lines();
        let header = lines.next().unwrap();
        assert!(header.find("sm_80").unwrap() < header.find("sm_100").unwrap());
        let row = lines.next().unwrap();
        assert!(row.starts_with("tpcomm_ar_2stage_bf16_w8"));
        assert!(row.contains("90") && row.contains("96") && row.ends_with("none"));
    }
}
