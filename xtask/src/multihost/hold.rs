//! The teardown check: a child `cargo xtask multihost --hold` makes 2 hosts, starts a process
//! in each through the launch agent (as mpirun would), says `ready`, and waits; the check
//! interrupts it (SIGINT, as Ctrl-C does; then SIGKILL, which no handler sees) and requires
//! that nothing of its hosts is left: no network namespace, no `/run/netns` mount, no process
//! in any of its namespaces. The watcher of [`super::cluster`] is what tears down then.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::cluster::{self, Cluster};

/// The child: holds 2 hosts with a process in each until it is killed.
pub(super) fn hold() -> Result<(), String> {
    let cluster = Cluster::create(2)?;
    let mut inside = Vec::new();
    for h in &cluster.hosts {
        let child = Command::new(cluster.agent())
            .args([h.name.as_str(), "sleep 600"])
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start a process on {}: {e}", h.name))?;
        inside.push(child);
    }
    // Every host runs its process before `ready` is said.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cluster
        .hosts
        .iter()
        .any(|h| cluster::processes_in(&h.pid_namespace).len() < 2)
    {
        if std::time::Instant::now() > deadline {
            return Err("the hosts' processes did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("ready {} {}", cluster.tag(), cluster.namespaces().join(" "));
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// Each signal's verdict: nothing left, or what was.
type Verdicts = Vec<(&'static str, Result<(), String>)>;

/// Runs the child once per signal; each signal's verdict.
pub(super) fn check() -> Result<Verdicts, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let mut verdicts = Vec::new();
    for signal in ["INT", "KILL"] {
        let mut child = Command::new(&exe)
            .args(["multihost", "--hold"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{} multihost --hold`: {e}", exe.display()))?;
        let stdout = child.stdout.take().ok_or("the child has no stdout")?;
        let mut ready = String::new();
        BufReader::new(stdout)
            .read_line(&mut ready)
            .map_err(|e| format!("reading the child: {e}"))?;
        let words: Vec<String> = ready.split_whitespace().map(str::to_owned).collect();
        let verdict = match words.split_first() {
            Some((first, rest)) if first == "ready" && rest.len() > 1 => {
                let status = Command::new("kill")
                    .arg(format!("-{signal}"))
                    .arg(child.id().to_string())
                    .status();
                let ended = ends_within(&mut child, Duration::from_secs(10));
                match status {
                    Ok(s) if s.success() && ended => cluster::leftovers(&rest[0], &rest[1..]),
                    Ok(s) if s.success() => {
                        // SIGINT ignored (inherited from a shell that runs this in the
                        // background): killed now, its leftovers still checked.
                        let _ = child.kill();
                        let _ = child.wait();
                        Err(format!(
                            "the child did not end on SIG{signal} (ignored where it was started?); {}",
                            cluster::leftovers(&rest[0], &rest[1..])
                                .err()
                                .unwrap_or_else(|| "nothing was left after a kill".into())
                        ))
                    }
                    other => Err(format!("kill -{signal} failed: {other:?}")),
                }
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("the child did not get ready: `{}`", ready.trim()))
            }
        };
        verdicts.push((signal, verdict));
    }
    Ok(verdicts)
}

/// Whether `child` ends within `limit` (then it is reaped).
fn ends_within(child: &mut std::process::Child, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
