//! GPU memory as `nvidia-smi` sees it, read by the parent (another process: nothing of the
//! children's driver state is touched), within a time limit.

use std::time::{Duration, Instant};

/// Runs a command with a time limit; its stdout, or why not.
fn bounded_output(program: &str, args: &[&str], limit: Duration) -> Result<String, String> {
    use std::io::Read;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(mut s) = child.stdout.take() {
                    let _ = s.read_to_string(&mut out);
                }
                return if status.success() {
                    Ok(out)
                } else {
                    Err(format!("{program}: {status}"))
                };
            }
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{program}: no answer within {:.1} s (killed)",
                    limit.as_secs_f64()
                ));
            }
            Err(e) => return Err(format!("{program}: {e}")),
        }
    }
}

/// The device's used memory and each of `pids`' (not listed: no GPU memory) from
/// `nvidia-smi`.
pub(super) fn nvidia_smi(limit: Duration, pids: &[u32]) -> (bool, String, Vec<(String, String)>) {
    let started = Instant::now();
    let device = bounded_output(
        "nvidia-smi",
        &[
            "--query-gpu=memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ],
        limit,
    );
    let apps = bounded_output(
        "nvidia-smi",
        &[
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ],
        limit.saturating_sub(started.elapsed()),
    );
    let mut values = Vec::new();
    let mut parts = Vec::new();
    let ok = device.is_ok() && apps.is_ok();
    match device {
        Ok(text) => {
            let first = text.lines().next().unwrap_or("").trim().to_string();
            parts.push(format!("device memory.used, total (MiB): {first}"));
            values.push(("device_used_total_mib".into(), first));
        }
        Err(e) => parts.push(e),
    }
    match apps {
        Ok(text) => {
            for (i, pid) in pids.iter().enumerate() {
                let role = if i == 0 { "A" } else { "B" };
                let used = text.lines().find_map(|l| {
                    let mut f = l.split(',').map(str::trim);
                    (f.next() == Some(pid.to_string().as_str()))
                        .then(|| f.next().unwrap_or("").to_string())
                });
                let shown = used
                    .clone()
                    .map_or("not listed".to_string(), |u| format!("{u} MiB"));
                parts.push(format!("{role} (pid {pid}): {shown}"));
                values.push((
                    format!("{role}_used_mib"),
                    used.unwrap_or_else(|| "not listed".into()),
                ));
            }
        }
        Err(e) => parts.push(e),
    }
    (ok, parts.join("; "), values)
}
