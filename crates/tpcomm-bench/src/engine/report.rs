//! The JSON report: one document per run, its schema versioned by [`SCHEMA_VERSION`]
//! (documented in `bench/results/README.md`), written by every subcommand and read back by
//! `compare` and `plot`.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::error::BenchError;
use crate::engine::row::Row;
use crate::engine::targets::Verdict;

/// The version of the report's layout. Raised when a field changes meaning or goes away;
/// adding a field keeps it.
pub(crate) const SCHEMA_VERSION: u32 = 1;

/// The JSON document `--json` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Report {
    /// [`SCHEMA_VERSION`] of the writer.
    pub(crate) schema_version: u32,
    /// `"tpcomm-bench"`.
    pub(crate) tool: String,
    /// The bench's version.
    pub(crate) version: String,
    /// The subcommand (`"transport"`, ...).
    pub(crate) subcommand: String,
    /// The command line, program name first.
    pub(crate) command_line: Vec<String>,
    /// Seconds since the Unix epoch when the report was written.
    pub(crate) unix_time: u64,
    pub(crate) machine: Machine,
    /// Backend name (`"local"`, `"mpi"`).
    pub(crate) transport: String,
    /// Number of ranks.
    pub(crate) ranks: usize,
    /// The MPI library's version line, in MPI mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) mpi_library: Option<String>,
    /// The subcommand's options and what it found out about its environment.
    pub(crate) settings: Value,
    /// Every row of every table, in the order measured.
    pub(crate) rows: Vec<Row>,
    /// The summary lines printed below the tables.
    #[serde(default)]
    pub(crate) summary: Vec<String>,
    /// The targets checked against the rows.
    #[serde(default)]
    pub(crate) targets: Vec<Verdict>,
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut tmp = PathBuf::from(path);
    tmp.as_mut_os_string().push(".tmp");
    tmp
}

fn write_error(path: &Path) -> impl Fn(std::io::Error) -> BenchError + '_ {
    move |source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// Fails now, rather than after the whole run, when `path` cannot be written: creates (and
/// removes) the temporary file [`write()`] will use.
pub(crate) fn check_writable(path: &Path) -> Result<(), BenchError> {
    let tmp = tmp_path(path);
    std::fs::File::create(&tmp).map_err(write_error(path))?;
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

/// Writes `report` to `path` as pretty JSON, through a temporary file renamed into place,
/// so that an interrupted run never leaves a truncated report.
pub(crate) fn write(path: &Path, report: &Report) -> Result<(), BenchError> {
    let mut text = serde_json::to_string_pretty(report)?;
    text.push('\n');
    let tmp = tmp_path(path);
    std::fs::write(&tmp, text).map_err(write_error(path))?;
    std::fs::rename(&tmp, path).map_err(write_error(path))
}

/// Reads a report, refusing one of a newer schema than this bench knows.
pub(crate) fn read(path: &Path) -> Result<Report, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let report: Report = serde_json::from_str(&text).map_err(|source| BenchError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    if report.schema_version > SCHEMA_VERSION {
        return Err(BenchError::Usage(format!(
            "{}: schema_version {} is newer than this tpcomm-bench reads ({SCHEMA_VERSION})",
            path.display(),
            report.schema_version
        )));
    }
    Ok(report)
}

/// The machine the figures come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Machine {
    pub(crate) hostname: String,
    /// Logical CPUs online on the machine.
    pub(crate) nproc: usize,
    /// Logical CPUs this process may run on (its affinity mask: one under `mpirun`'s
    /// default binding to cores).
    pub(crate) cpus_usable: usize,
    pub(crate) os: String,
    pub(crate) os_release: Option<String>,
    pub(crate) arch: String,
    pub(crate) cpu_model: Option<String>,
}

impl Machine {
    /// Facts about this machine; unknown ones are empty or `None`, never an error.
    pub(crate) fn current() -> Self {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let hostname = read("/proc/sys/kernel/hostname")
            .or_else(|| read("/etc/hostname"))
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo").and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        let cpus_usable = std::thread::available_parallelism().map_or(1, |n| n.get());
        let nproc = read("/sys/devices/system/cpu/online")
            .and_then(|list| count_cpu_list(&list))
            .unwrap_or(cpus_usable);
        Self {
            hostname,
            nproc,
            cpus_usable,
            os: std::env::consts::OS.to_string(),
            os_release: read("/proc/sys/kernel/osrelease"),
            arch: std::env::consts::ARCH.to_string(),
            cpu_model,
        }
    }

    /// One line for table headers.
    pub(crate) fn describe(&self) -> String {
        let mut s = format!("host {}, {} CPUs", self.hostname, self.nproc);
        if self.cpus_usable != self.nproc {
            s.push_str(&format!(" ({} usable per process)", self.cpus_usable));
        }
        s.push_str(&format!(
            ", {} {}",
            self.os,
            self.os_release.as_deref().unwrap_or("")
        ));
        if let Some(cpu) = &self.cpu_model {
            s.push_str(", ");
            s.push_str(cpu);
        }
        s
    }
}

/// Number of CPUs in a Linux CPU list such as `0-3,8,10-11`; `None` if malformed.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => {
                b.parse::<usize>()
                    .ok()?
                    .checked_sub(a.parse::<usize>().ok()?)?
                    + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    Some(n)
}

/// A report of one all_gather table: tpcomm at `tpcomm_ns` per size, rsmpi at 1 us.
#[cfg(test)]
pub(crate) fn sample(tpcomm_ns: u64) -> Report {
    let mut rows = Vec::new();
    for bytes in [8usize, 64, 512] {
        for (variant, ns) in [("tpcomm", tpcomm_ns), ("rsmpi", 1000)] {
            let row = Row::new(
                "all_gather",
                &bytes.to_string(),
                variant,
                bytes,
                1,
                vec![ns; 3],
            );
            rows.push(
                row.unwrap()
                    .bus(crate::engine::row::Bus::AllButOwnShare, 2)
                    .with("type", "uint8"),
            );
        }
    }
    crate::engine::row::link_peers(&mut rows, |r| r.is("tpcomm").then(|| "rsmpi".into()));
    Report {
        schema_version: SCHEMA_VERSION,
        tool: "tpcomm-bench".into(),
        version: "0".into(),
        subcommand: "transport".into(),
        command_line: vec!["tpcomm-bench".into(), "transport".into()],
        unix_time: 1,
        machine: Machine::current(),
        transport: "local".into(),
        ranks: 2,
        mpi_library: None,
        settings: serde_json::json!({ "iters": 3 }),
        rows,
        summary: vec!["all_gather: avg busbw 0.1 GB/s".into()],
        targets: vec![crate::engine::targets::Verdict {
            target: "tpcomm within 1.10x of rsmpi".into(),
            reason: "a wrapper should cost next to nothing".into(),
            met: tpcomm_ns <= 1100,
            detail: String::new(),
            binding: false,
            line: crate::engine::targets::RatioLine::new("rsmpi", 1.1),
        }],
    }
}

/// A folder of its own for test `name` in the temporary directory.
#[cfg(test)]
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tpcomm-bench-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_ranges_and_singles() {
        assert_eq!(count_cpu_list("0-1\n"), Some(2));
        assert_eq!(count_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("x"), None);
        assert_eq!(count_cpu_list("3-1"), None);
    }

    #[test]
    fn a_report_written_reads_back_the_same_unless_its_schema_is_newer() {
        let path = scratch("roundtrip").join("r.json");
        let written = sample(1100);
        write(&path, &written).unwrap();
        let read = read(&path).unwrap();
        assert_eq!(read, written);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"schema_version\": 1"), "{text}");
        // A report of a newer schema is refused.
        let mut newer = sample(1000);
        newer.schema_version = SCHEMA_VERSION + 1;
        write(&path, &newer).unwrap();
        assert!(super::read(&path).is_err());
    }
}
