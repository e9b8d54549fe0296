//! GPU memory figures read by another process: `nvidia-smi` (or the program
//! `TPCOMM_NVIDIA_SMI` names), run with a deadline. The figures matter while this process is
//! locked or checkpointed, and then nothing in it may talk to the GPU driver: on driver
//! 580.159.04 a checkpoint sequence whose pause read NVML inside the checkpointed process
//! never returned from that read (the step before, the checkpoint itself, had succeeded). A
//! separate process is unaffected by this one's lock: `nvidia-smi` run by another process
//! while this one was checkpointed was measured to answer, listing no memory for it.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one `nvidia-smi` query may take before it is killed.
const DEADLINE: Duration = Duration::from_secs(10);

/// GPU memory in use, summed over every GPU `nvidia-smi` sees (it reports MiB).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuMemory {
    /// Bytes in use on the devices (`memory.used`).
    pub device_used: u64,
    /// Bytes of every compute process listed (pid, bytes): a process whose GPU state is
    /// checkpointed is not listed. Empty when none are reported (some containers); pids are
    /// as the driver sees them (the host's pid namespace).
    pub processes: Vec<(u32, u64)>,
}

impl GpuMemory {
    /// The bytes listed for `pid` (0 when not listed).
    pub fn of_process(&self, pid: u32) -> u64 {
        self.processes
            .iter()
            .filter(|(p, _)| *p == pid)
            .fold(0u64, |sum, (_, b)| sum.saturating_add(*b))
    }

    /// Reads the figures now, from another process; why not, in words (no `nvidia-smi`, a
    /// failed or late query, output it cannot read). Safe to call while this process is
    /// locked or checkpointed.
    pub fn probe() -> Result<Self, String> {
        let device = query(&["--query-gpu=memory.used"])?;
        let device_used =
            device
                .lines()
                .filter(|l| !l.trim().is_empty())
                .try_fold(0u64, |sum, l| {
                    sum.checked_add(mib(l.trim())?)
                        .ok_or_else(|| "nvidia-smi's memory figures overflow 64 bits".to_string())
                })?;
        // The per-process list is best effort: the device figure stands without it.
        let processes = match query(&["--query-compute-apps=pid,used_memory"]) {
            Ok(text) => parse_processes(&text),
            Err(why) => {
                tracing::debug!(%why, "no per-process GPU memory figures");
                Vec::new()
            }
        };
        Ok(Self {
            device_used,
            processes,
        })
    }
}

/// `1234` MiB as bytes.
fn mib(field: &str) -> Result<u64, String> {
    field
        .parse::<u64>()
        .ok()
        .and_then(|m| m.checked_mul(1 << 20))
        .ok_or_else(|| format!("nvidia-smi printed {field:?} where a MiB figure belongs"))
}

/// `pid, MiB` lines; lines that are not (e.g. "[N/A]") are skipped.
fn parse_processes(text: &str) -> Vec<(u32, u64)> {
    text.lines()
        .filter_map(|l| {
            let (pid, used) = l.split_once(',')?;
            Some((pid.trim().parse().ok()?, mib(used.trim()).ok()?))
        })
        .collect()
}

/// Runs `nvidia-smi ARGS --format=csv,noheader,nounits` with [`DEADLINE`]; its stdout.
fn query(args: &[&str]) -> Result<String, String> {
    let program = std::env::var("TPCOMM_NVIDIA_SMI").unwrap_or_else(|_| "nvidia-smi".into());
    run_with_deadline(&program, args, DEADLINE)
}

/// Runs `program ARGS --format=csv,noheader,nounits`, killed after `deadline`; its stdout,
/// read while it runs (a child whose output fills the pipe would otherwise block and be
/// taken for a late one).
fn run_with_deadline(program: &str, args: &[&str], deadline: Duration) -> Result<String, String> {
    let mut child = Command::new(program)
        .args(args)
        .arg("--format=csv,noheader,nounits")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{program} cannot be run: {e}"))?;
    let reader = child.stdout.take().map(|mut stdout| {
        std::thread::spawn(move || {
            let mut out = String::new();
            stdout.read_to_string(&mut out).map(|_| out)
        })
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{program} did not answer within {deadline:?}"));
            }
            Err(e) => return Err(format!("waiting for {program} failed: {e}")),
        }
    };
    // The child has exited: its end of the pipe is closed, so the reader finishes.
    let out = match reader.map(|r| r.join()) {
        Some(Ok(Ok(out))) => out,
        Some(Ok(Err(e))) => return Err(format!("reading {program}'s output failed: {e}")),
        Some(Err(_)) => return Err(format!("reading {program}'s output panicked")),
        None => String::new(),
    };
    if !status.success() {
        return Err(format!("{program} {args:?} failed: {status}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_nvidia_smi_gets_a_reason_not_a_panic() {
        if let Err(why) = GpuMemory::probe() {
            assert!(why.contains("nvidia-smi"), "{why}");
        }
    }

    #[test]
    fn process_lines_are_parsed_and_unavailable_figures_skipped() {
        let text = "4242, 1542\n77, [N/A]\n\n9, 0\n";
        assert_eq!(parse_processes(text), vec![(4242, 1542 << 20), (9, 0)]);
        let m = GpuMemory {
            device_used: 0,
            processes: parse_processes(text),
        };
        assert_eq!(m.of_process(4242), 1542 << 20);
        assert_eq!(m.of_process(1), 0);
    }

    #[test]
    fn a_device_figure_that_is_not_a_number_or_too_large_is_an_error() {
        assert!(mib("[N/A]").unwrap_err().contains("MiB"));
        assert!(mib(&u64::MAX.to_string()).unwrap_err().contains("MiB"));
        assert_eq!(mib("3").unwrap(), 3 << 20);
    }

    #[test]
    fn an_answer_larger_than_a_pipe_is_read_whole_within_the_deadline() {
        // 1 MiB of output: more than a pipe holds, so a reader that waited for the exit
        // first would see the child block and report it late.
        let script = "head -c 1048576 /dev/zero | tr '\\0' x";
        let out = run_with_deadline("sh", &["-c", script], Duration::from_secs(30))
            .expect("the query answers");
        assert_eq!(out.len(), 1 << 20);
    }

    #[test]
    fn a_child_that_never_answers_is_killed_at_the_deadline() {
        let started = Instant::now();
        let why =
            run_with_deadline("sh", &["-c", "sleep 30"], Duration::from_millis(200)).unwrap_err();
        assert!(why.contains("did not answer"), "{why}");
        assert!(started.elapsed() < Duration::from_secs(20));
    }
}
