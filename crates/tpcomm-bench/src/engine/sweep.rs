//! The size sweep and the iteration policy, shared by every subcommand.
//!
//! Sizes go from `--min-bytes` to `--max-bytes`, multiplied by `--factor` each step (as
//! nccl-tests' `-b`, `-e`, `-f`). Unless `--iters` fixes it, the number of timed iterations
//! adapts to the size: it is chosen from the warm-up times so that each size takes about
//! [`TARGET_TIME`] of collective time, between [`MIN_ITERS`] and [`MAX_ITERS`]. Every rank
//! derives it from the same gathered figures, so all ranks run the same number of
//! iterations.

use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::engine::error::BenchError;

/// Collective time aimed at per size (and per path) when `--iters` is not given.
pub(crate) const TARGET_TIME: Duration = Duration::from_millis(40);
/// Fewest timed iterations when `--iters` is not given.
pub(crate) const MIN_ITERS: usize = 20;
/// Most timed iterations when `--iters` is not given.
pub(crate) const MAX_ITERS: usize = 1000;
/// Sizes from this one up get [`WARMUP_LARGE`] warm-up iterations by default.
const LARGE: usize = 1 << 20;
const WARMUP_SMALL: usize = 5;
const WARMUP_LARGE: usize = 2;
/// The largest size accepted: MPI-3 counts are 32-bit, and rsmpi panics past them.
const MAX_SIZE: usize = i32::MAX as usize;

/// Options of the size sweep (flattened into each subcommand that sweeps sizes).
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct SweepArgs {
    /// Smallest size, in bytes; accepts the suffixes K/KiB, M/MiB, G/GiB (powers of 1024).
    #[arg(long, default_value = "8", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) min_bytes: usize,

    /// Largest size, in bytes, same syntax as `--min-bytes` (at most 2 GiB - 1).
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) max_bytes: usize,

    /// Each size is the previous one times this factor.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..))]
    pub(crate) factor: u32,
}

/// Buffer counts and sizes of the peer-memory subcommands (`ipc` renames `--buffers` to
/// `--regions`, `lifecycle` to `--graph-buffers`): one row group per count.
#[derive(Debug, Clone, Args, Serialize)]
pub(crate) struct BufferArgs {
    /// Buffers each rank registers, comma-separated; one row group per value.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,100,1000",
        value_parser = clap::value_parser!(u32).range(1..),
        value_name = "N,..."
    )]
    pub(crate) buffers: Vec<u32>,

    /// Bytes of each buffer.
    #[arg(long, default_value = "4096", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) buffer_bytes: usize,
}

/// Options of the iteration policy (flattened into every subcommand).
#[derive(Debug, Clone, Default, Args, Serialize)]
pub(crate) struct IterArgs {
    /// Timed iterations per case [default: adaptive, about 40 ms of collective time per
    /// case, between 20 and 1000].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) iters: Option<u32>,

    /// Untimed iterations per case before the timed ones [default: 5 below 1 MiB, 2 from
    /// 1 MiB].
    #[arg(long, value_name = "N")]
    pub(crate) warmup: Option<u32>,

    /// Time each iteration of a variant right after the other variants' iterations, without
    /// the untimed iteration of its own that otherwise runs just before it. By default a
    /// variant runs twice in a row and the second run is timed, so that it finds its buffers
    /// as its previous call left them (as a loop of the call does: a C benchmark loop, an
    /// engine's steps); `--cold` times it after other variants have evicted them instead,
    /// in half the run time.
    #[arg(long)]
    pub(crate) cold: bool,
}

impl IterArgs {
    /// Checks what clap cannot check option by option.
    pub(crate) fn validate(&self) -> Result<(), BenchError> {
        if self.warmup == Some(0) && self.iters.is_none() {
            return Err(BenchError::Usage(
                "--warmup 0 leaves nothing to choose the iteration count from: give --iters too"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Warm-up iterations for a case moving `bytes`.
    pub(crate) fn warmup_for(&self, bytes: usize) -> usize {
        match self.warmup {
            Some(n) => n as usize,
            None if bytes >= LARGE => WARMUP_LARGE,
            None => WARMUP_SMALL,
        }
    }

    /// Timed iterations, given an estimate of one iteration's time (the same on every rank).
    pub(crate) fn iters_for(&self, estimate: Duration) -> usize {
        if let Some(n) = self.iters {
            return n as usize;
        }
        let estimate_ns = estimate.as_nanos().max(1);
        let n = TARGET_TIME.as_nanos() / estimate_ns;
        usize::try_from(n)
            .unwrap_or(usize::MAX)
            .clamp(MIN_ITERS, MAX_ITERS)
    }

    /// One line describing the policy, for table headers.
    pub(crate) fn describe(&self) -> String {
        let iters = match self.iters {
            Some(n) => format!("{n}"),
            None => format!(
                "adaptive ({MIN_ITERS}..{MAX_ITERS}, ~{} ms per case)",
                TARGET_TIME.as_millis()
            ),
        };
        let warmup = match self.warmup {
            Some(n) => format!("{n}"),
            None => format!("{WARMUP_SMALL} (<1 MiB), {WARMUP_LARGE} (>=1 MiB)"),
        };
        let order = if self.cold {
            "cold: rotated variants run once per round"
        } else {
            "rotated variants run twice in a row per round, the second run timed"
        };
        format!("iters {iters}; warmup {warmup}; {order}")
    }
}

impl SweepArgs {
    /// Checks what clap cannot check option by option.
    pub(crate) fn validate(&self) -> Result<(), BenchError> {
        if self.min_bytes == 0 {
            return Err(BenchError::Usage("--min-bytes must be at least 1".into()));
        }
        if self.min_bytes > self.max_bytes {
            return Err(BenchError::Usage(format!(
                "--min-bytes ({}) is larger than --max-bytes ({})",
                format_bytes(self.min_bytes),
                format_bytes(self.max_bytes)
            )));
        }
        if self.max_bytes > MAX_SIZE {
            return Err(BenchError::Usage(format!(
                "--max-bytes ({}) is larger than {MAX_SIZE} bytes, the largest MPI-3 count",
                format_bytes(self.max_bytes)
            )));
        }
        Ok(())
    }

    /// The sizes of the sweep, smallest first.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        let mut sizes = Vec::new();
        let mut size = self.min_bytes;
        while size <= self.max_bytes {
            sizes.push(size);
            match size.checked_mul(self.factor as usize) {
                Some(next) => size = next,
                None => break,
            }
        }
        sizes
    }

    /// One line describing the sweep, for table headers.
    pub(crate) fn describe(&self) -> String {
        format!(
            "sizes {} .. {} x{}",
            format_bytes(self.min_bytes),
            format_bytes(self.max_bytes),
            self.factor,
        )
    }
}

/// Parses a byte count: digits with an optional binary suffix (`B`, `K`/`KiB`, `M`/`MiB`,
/// `G`/`GiB`, case-insensitive, optional space).
pub(crate) fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    if digits.is_empty() {
        return Err(format!("`{text}` does not start with a number"));
    }
    let value: usize = digits.parse().map_err(|e| format!("`{digits}`: {e}"))?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        other => {
            return Err(format!(
            "unknown size suffix `{other}` (use B, K or KiB, M or MiB, G or GiB: powers of 1024)"
        ))
        }
    };
    value
        .checked_mul(1usize << shift)
        .ok_or_else(|| format!("`{text}` overflows"))
}

/// `1024` -> `"1 KiB"`, `1536` -> `"1536 B"`: the largest binary unit that divides exactly.
pub(crate) fn format_bytes(bytes: usize) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        let unit_bytes = 1usize << shift;
        if bytes >= unit_bytes && bytes.is_multiple_of(unit_bytes) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

/// `1024` -> `1K`, `8 << 20` -> `8M`: compact sizes for summary lines.
pub(crate) fn short_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 20 && b.is_multiple_of(1 << 20) => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b.is_multiple_of(1 << 10) => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep(min: usize, max: usize, factor: u32) -> SweepArgs {
        SweepArgs {
            min_bytes: min,
            max_bytes: max,
            factor,
        }
    }

    #[test]
    fn byte_suffixes_are_powers_of_1024_and_bad_counts_are_rejected() {
        for (text, bytes) in [("8", 8), ("8B", 8), ("4K", 4096), ("4KiB", 4096)] {
            assert_eq!(parse_bytes(text), Ok(bytes));
        }
        assert_eq!(parse_bytes("64 mib"), Ok(64 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        for bad in [
            "",
            "MiB",
            "8MB",
            "-1",
            "99999999999999999999",
            "99999999999999G",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_sweep_multiplies_from_min_to_the_last_size_not_above_max() {
        let sizes = sweep(8, 64 << 20, 2).sizes();
        assert_eq!((sizes.len(), sizes[0], sizes[23]), (24, 8, 64 << 20));
        assert_eq!(sweep(3, 100, 4).sizes(), vec![3, 12, 48]);
        assert_eq!(sweep(5, 5, 2).sizes(), vec![5]);
    }

    #[test]
    fn adaptive_iterations_stay_within_bounds() {
        let s = IterArgs::default();
        assert_eq!(s.iters_for(Duration::from_nanos(1)), MAX_ITERS);
        assert_eq!(s.iters_for(Duration::from_secs(1)), MIN_ITERS);
        assert_eq!(s.iters_for(TARGET_TIME / 100), 100);
        let fixed = IterArgs {
            iters: Some(3),
            ..s
        };
        assert_eq!(fixed.iters_for(Duration::from_secs(1)), 3);
    }

    #[test]
    fn invalid_sweeps_are_usage_errors() {
        assert!(sweep(0, 8, 2).validate().is_err());
        assert!(sweep(16, 8, 2).validate().is_err());
        assert!(sweep(8, 1 << 31, 2).validate().is_err());
        let no_warmup = IterArgs {
            iters: None,
            warmup: Some(0),
            cold: false,
        };
        assert!(no_warmup.validate().is_err());
        assert!(sweep(8, 64 << 20, 2).validate().is_ok());
    }

    #[test]
    fn sizes_print_in_the_largest_exact_unit() {
        assert_eq!(format_bytes(8), "8 B");
        assert_eq!(format_bytes(1536), "1536 B");
        assert_eq!(format_bytes(64 << 20), "64 MiB");
    }
}
