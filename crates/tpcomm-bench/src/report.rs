//! What every subcommand reports: statistics over iterations, nccl-tests-style tables on
//! stdout, and a JSON file with every figure.
//!
//! Conventions (nccl-tests, `doc/PERFORMANCE.md`): `time` is the median over iterations of
//! the slowest rank's time; `algbw = size / time`; `busbw = algbw * factor`, where the
//! factor (`(n-1)/n` for gathers and all-to-all, 1 for broadcast) makes the figure
//! comparable to the hardware's bandwidth whatever the number of ranks. GB/s are 10^9
//! bytes per second.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::error::BenchError;

/// Median, minimum and maximum of per-iteration times.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Stats {
    /// Median, in microseconds (mean of the two middle samples for an even count).
    pub(crate) median_us: f64,
    /// Fastest iteration, in microseconds.
    pub(crate) min_us: f64,
    /// Slowest iteration, in microseconds.
    pub(crate) max_us: f64,
}

impl Stats {
    /// Statistics of `samples_ns` (nanoseconds); `None` when there are no samples.
    pub(crate) fn of(samples_ns: &[u64]) -> Option<Self> {
        let mut sorted = samples_ns.to_vec();
        sorted.sort_unstable();
        let (&min, &max) = (sorted.first()?, sorted.last()?);
        let mid = sorted.len() / 2;
        let median_ns = if sorted.len() % 2 == 1 {
            sorted[mid] as f64
        } else {
            (sorted[mid - 1] as f64 + sorted[mid] as f64) / 2.0
        };
        Some(Self {
            median_us: median_ns / 1e3,
            min_us: min as f64 / 1e3,
            max_us: max as f64 / 1e3,
        })
    }
}

/// How bus bandwidth relates to algorithm bandwidth for an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BusModel {
    /// `busbw = algbw * (n-1)/n`: all-gather, gather, all-to-all, reduce-scatter.
    AllButOwnShare,
    /// `busbw = algbw`: broadcast, reduce.
    Same,
}

impl BusModel {
    fn factor(self, ranks: usize) -> f64 {
        match self {
            BusModel::AllButOwnShare if ranks > 0 => (ranks - 1) as f64 / ranks as f64,
            BusModel::AllButOwnShare => 0.0,
            BusModel::Same => 1.0,
        }
    }
}

/// Bandwidth in GB/s (10^9 bytes per second) of `bytes` moved in `us` microseconds.
fn gbps(bytes: usize, us: f64) -> f64 {
    if us > 0.0 {
        bytes as f64 / us / 1e3
    } else {
        0.0
    }
}

/// One line of a table: one operation at one size.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// Operation name (`all_gather`, ...).
    pub(crate) op: &'static str,
    /// Size in the nccl-tests convention of that operation.
    pub(crate) bytes: usize,
    /// Elements (`bytes` divided by the element size).
    pub(crate) count: usize,
    /// Element type.
    #[serde(rename = "type")]
    pub(crate) dtype: &'static str,
    /// Root rank of rooted operations.
    pub(crate) root: Option<usize>,
    /// Timed iterations.
    pub(crate) iters: usize,
    /// Untimed iterations before them.
    pub(crate) warmup: usize,
    /// Median over iterations of the slowest rank's time, in microseconds.
    pub(crate) median_us: f64,
    /// Fastest iteration, in microseconds.
    pub(crate) min_us: f64,
    /// Slowest iteration, in microseconds.
    pub(crate) max_us: f64,
    /// `bytes / median`, GB/s.
    pub(crate) algbw_gbps: f64,
    /// `algbw` times the operation's bus factor, GB/s.
    pub(crate) busbw_gbps: f64,
    /// The same operation timed through the underlying library directly (rsmpi), median.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) direct_median_us: Option<f64>,
    /// Direct path, fastest iteration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) direct_min_us: Option<f64>,
    /// Direct path, slowest iteration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) direct_max_us: Option<f64>,
    /// `median_us / direct_median_us`: what the wrapper costs (1.0 = nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ratio: Option<f64>,
    /// Every iteration's time (slowest rank), nanoseconds, in the order they ran.
    pub(crate) samples_ns: Vec<u64>,
    /// Same for the direct path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) direct_samples_ns: Option<Vec<u64>>,
}

/// What a [`Row`] is built from.
#[derive(Debug)]
pub(crate) struct Measurement<'a> {
    pub(crate) op: &'static str,
    pub(crate) bytes: usize,
    pub(crate) elem_size: usize,
    pub(crate) dtype: &'static str,
    pub(crate) root: Option<usize>,
    pub(crate) ranks: usize,
    pub(crate) bus: BusModel,
    pub(crate) warmup: usize,
    pub(crate) samples_ns: &'a [u64],
    pub(crate) direct_samples_ns: Option<&'a [u64]>,
}

impl Row {
    /// Computes the row's figures; `None` without samples.
    pub(crate) fn new(m: &Measurement<'_>) -> Option<Self> {
        let stats = Stats::of(m.samples_ns)?;
        let direct = m.direct_samples_ns.and_then(Stats::of);
        let algbw = gbps(m.bytes, stats.median_us);
        Some(Self {
            op: m.op,
            bytes: m.bytes,
            count: m.bytes / m.elem_size.max(1),
            dtype: m.dtype,
            root: m.root,
            iters: m.samples_ns.len(),
            warmup: m.warmup,
            median_us: stats.median_us,
            min_us: stats.min_us,
            max_us: stats.max_us,
            algbw_gbps: algbw,
            busbw_gbps: algbw * m.bus.factor(m.ranks),
            direct_median_us: direct.map(|d| d.median_us),
            direct_min_us: direct.map(|d| d.min_us),
            direct_max_us: direct.map(|d| d.max_us),
            ratio: direct
                .filter(|d| d.median_us > 0.0)
                .map(|d| stats.median_us / d.median_us),
            samples_ns: m.samples_ns.to_vec(),
            direct_samples_ns: m.direct_samples_ns.map(<[u64]>::to_vec),
        })
    }
}

/// One column of a printed table: right-aligned to `width` characters, with a name line
/// and a unit line above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Column {
    pub(crate) name: &'static str,
    pub(crate) unit: &'static str,
    pub(crate) width: usize,
}

impl Column {
    pub(crate) const fn new(name: &'static str, unit: &'static str, width: usize) -> Self {
        Self { name, unit, width }
    }
}

/// The nccl-tests columns of every table of `transport`.
const NCCL_COLUMNS: [Column; 9] = [
    Column::new("size", "(B)", 12),
    Column::new("count", "(elements)", 12),
    Column::new("type", "", 6),
    Column::new("root", "", 5),
    Column::new("iters", "", 6),
    Column::new("time", "(us)", 10),
    Column::new("min", "(us)", 10),
    Column::new("algbw", "(GB/s)", 8),
    Column::new("busbw", "(GB/s)", 8),
];

/// The columns of the direct path, after [`NCCL_COLUMNS`].
const DIRECT_COLUMNS: [Column; 3] = [
    Column::new("direct", "(us)", 10),
    Column::new("dir min", "(us)", 10),
    Column::new("ratio", "tp/dir", 7),
];

/// Joins `cells` right-aligned to the widths of `columns`, space-separated; with `comment`
/// the line starts with `#`, taken from the first column's width (as nccl-tests' headers).
fn line(columns: &[Column], cells: &[&str], comment: bool) -> String {
    let mut out = String::new();
    for (i, (col, cell)) in columns.iter().zip(cells).enumerate() {
        match i {
            0 if comment => {
                let width = col.width.saturating_sub(1);
                out.push_str(&format!("#{cell:>width$}"));
            }
            0 => out.push_str(&format!("{cell:>width$}", width = col.width)),
            _ => out.push_str(&format!(" {cell:>width$}", width = col.width)),
        }
    }
    out
}

/// Prints tables on stdout (nccl-tests' layout, or the columns a subcommand passes), one
/// row at a time as they are measured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Table {
    /// Adds the columns of the direct path (`direct`, `ratio`) to the nccl-tests layout.
    pub(crate) direct: bool,
}

impl Table {
    fn nccl_columns(&self) -> Vec<Column> {
        let mut columns = NCCL_COLUMNS.to_vec();
        if self.direct {
            columns.extend(DIRECT_COLUMNS);
        }
        columns
    }

    /// Prints the title and the two header lines of an nccl-tests-style table.
    pub(crate) fn header(&self, title: &str) {
        self.header_with(title, &self.nccl_columns());
    }

    /// Prints the title and the two header lines (names, units) of a table of `columns`.
    pub(crate) fn header_with(&self, title: &str, columns: &[Column]) {
        let names: Vec<&str> = columns.iter().map(|c| c.name).collect();
        let units: Vec<&str> = columns.iter().map(|c| c.unit).collect();
        println!("#");
        println!("# {title}");
        println!("{}", line(columns, &names, true));
        println!("{}", line(columns, &units, true));
        flush();
    }

    /// Prints one row of a table of `columns`, the cells already formatted.
    pub(crate) fn cells(&self, columns: &[Column], cells: &[String]) {
        let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
        println!("{}", line(columns, &cells, false));
        flush();
    }

    /// Prints one row of an nccl-tests-style table.
    pub(crate) fn row(&self, row: &Row) {
        let mut cells = vec![
            row.bytes.to_string(),
            row.count.to_string(),
            row.dtype.to_string(),
            row.root.map_or_else(|| "-".to_string(), |r| r.to_string()),
            row.iters.to_string(),
            format!("{:.3}", row.median_us),
            format!("{:.3}", row.min_us),
            format!("{:.3}", row.algbw_gbps),
            format!("{:.3}", row.busbw_gbps),
        ];
        if self.direct {
            match (row.direct_median_us, row.direct_min_us, row.ratio) {
                (Some(median), Some(min), Some(ratio)) => cells.extend([
                    format!("{median:.3}"),
                    format!("{min:.3}"),
                    format!("{ratio:.2}x"),
                ]),
                _ => cells.extend(["-".to_string(), "-".to_string(), "-".to_string()]),
            }
        }
        self.cells(&self.nccl_columns(), &cells);
    }

    /// Prints a comment line.
    pub(crate) fn note(&self, text: &str) {
        if text.is_empty() {
            println!("#");
        } else {
            println!("# {text}");
        }
        flush();
    }
}

fn flush() {
    // A closed stdout (`| head`) must not abort the run; the JSON file is still written.
    let _ = std::io::stdout().flush();
}

/// The machine the figures come from.
#[derive(Debug, Clone, Serialize)]
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

/// A performance target of an issue, checked against this run's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Verdict {
    /// The target, as the issue states it.
    pub(crate) target: String,
    /// Whether this run's figures meet it.
    pub(crate) met: bool,
    /// The figures it was decided from.
    pub(crate) detail: String,
    /// Whether this run is the configuration the target is stated for (for example
    /// "2 MPI ranks"); a verdict on another configuration is indicative only.
    pub(crate) binding: bool,
}

impl Verdict {
    /// Prints the verdict as a comment line: `target: MET|MISSED (detail)`.
    pub(crate) fn print(&self, table: &Table) {
        let state = if self.met { "MET" } else { "MISSED" };
        let scope = if self.binding {
            ""
        } else {
            " [indicative only]"
        };
        table.note(&format!(
            "target {}: {state}{scope} ({})",
            self.target, self.detail
        ));
    }
}

/// The JSON document `--json` writes.
#[derive(Debug, Serialize)]
pub(crate) struct Report<'a, S: Serialize, R: Serialize = Row> {
    /// `"tpcomm-bench"`.
    pub(crate) tool: &'static str,
    /// The bench's version.
    pub(crate) version: &'static str,
    /// The subcommand (`"transport"`, ...).
    pub(crate) subcommand: &'static str,
    /// The command line, program name first.
    pub(crate) command_line: Vec<String>,
    /// Seconds since the Unix epoch when the report was written.
    pub(crate) unix_time: u64,
    pub(crate) machine: Machine,
    /// Backend name (`"local"`, `"mpi"`).
    pub(crate) transport: &'static str,
    /// Number of ranks.
    pub(crate) ranks: usize,
    /// The MPI library's version string, in MPI mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) mpi_library: Option<String>,
    /// The subcommand's settings.
    pub(crate) settings: &'a S,
    /// Every row of every table, in the order printed.
    pub(crate) rows: &'a [R],
    /// The targets checked against the rows.
    #[serde(skip_serializing_if = "<[Verdict]>::is_empty")]
    pub(crate) targets: &'a [Verdict],
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Fails now, rather than after the whole run, when `path` cannot be written: creates (and
/// removes) the temporary file [`write_json`] will use.
/// Rank 0's table of a subcommand without the direct-path columns, once `json` (if any) is
/// known to be writable and `start` has printed the head of the report; `None` on every other
/// rank (which prints nothing).
pub(crate) fn rank0_table(
    rank: usize,
    json: Option<&Path>,
    start: impl FnOnce(&Table),
) -> Result<Option<Table>, BenchError> {
    if rank != 0 {
        return Ok(None);
    }
    if let Some(path) = json {
        check_writable(path)?;
    }
    let table = Table { direct: false };
    start(&table);
    Ok(Some(table))
}

pub(crate) fn check_writable(path: &Path) -> Result<(), BenchError> {
    let tmp = tmp_path(path);
    std::fs::File::create(&tmp).map_err(|source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut tmp = PathBuf::from(path);
    tmp.as_mut_os_string().push(".tmp");
    tmp
}

/// Writes `report` to `path` as pretty JSON, through a temporary file renamed into place,
/// so that an interrupted run never leaves a truncated report.
pub(crate) fn write_json<S: Serialize, R: Serialize>(
    path: &Path,
    report: &Report<'_, S, R>,
) -> Result<(), BenchError> {
    let mut text = serde_json::to_string_pretty(report)?;
    text.push('\n');
    let tmp = tmp_path(path);
    let write_err = |source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, text).map_err(write_err)?;
    std::fs::rename(&tmp, path).map_err(write_err)
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
    fn median_of_odd_and_even_counts() {
        let s = Stats::of(&[3000, 1000, 2000]).unwrap();
        assert_eq!((s.median_us, s.min_us, s.max_us), (2.0, 1.0, 3.0));
        let s = Stats::of(&[4000, 1000, 2000, 3000]).unwrap();
        assert_eq!(s.median_us, 2.5);
        assert!(Stats::of(&[]).is_none());
    }

    fn measurement(samples: &[u64], bus: BusModel) -> Measurement<'_> {
        Measurement {
            op: "all_gather",
            bytes: 1_000_000,
            elem_size: 1,
            dtype: "uint8",
            root: None,
            ranks: 4,
            bus,
            warmup: 0,
            samples_ns: samples,
            direct_samples_ns: None,
        }
    }

    #[test]
    fn bandwidths_follow_nccl_tests() {
        // 1 MB in 1 ms: 1 GB/s algorithm bandwidth.
        let row = Row::new(&measurement(&[1_000_000], BusModel::AllButOwnShare)).unwrap();
        assert!((row.algbw_gbps - 1.0).abs() < 1e-12);
        assert!((row.busbw_gbps - 0.75).abs() < 1e-12);
        let row = Row::new(&measurement(&[1_000_000], BusModel::Same)).unwrap();
        assert!((row.busbw_gbps - 1.0).abs() < 1e-12);
    }

    #[test]
    fn header_lines_start_with_a_hash_inside_the_first_column() {
        let columns = [Column::new("size", "(B)", 6), Column::new("t", "(us)", 5)];
        assert_eq!(line(&columns, &["size", "t"], true), "# size     t");
        assert_eq!(line(&columns, &["64", "1.5"], false), "    64   1.5");
    }

    #[test]
    fn ratio_is_wrapper_over_direct_median() {
        let direct = [1000, 1000, 1000];
        let m = Measurement {
            direct_samples_ns: Some(&direct),
            ..measurement(&[1100, 1100, 1100], BusModel::Same)
        };
        let row = Row::new(&m).unwrap();
        assert!((row.ratio.unwrap() - 1.1).abs() < 1e-12);
    }
}
