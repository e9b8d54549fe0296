//! The host and link faults of `cargo xtask multihost`: one `mpi-multihost fault KIND` job
//! per case, on hosts of its own, under `mpirun --enable-recovery`; this driver reads the
//! ranks' lines as they come and injects the fault from outside when they say so:
//!
//! - `host-kill-*`: once the victims said `victim R: stopped at ...`, the victim host's PID
//!   namespace is killed (every process of the host, its MPI daemon too);
//! - `link-down-short` / `link-down-long`: at `inject`, the victim host's link goes down for
//!   a sixth of the timeout (TCP retransmits within it) / three timeouts, then up again;
//! - `freeze`: at `inject`, every process of the victim host is stopped (SIGSTOP) for three
//!   timeouts, then continued.
//!
//! The verdict comes from the survivors' lines (see the `faults` module of
//! `tpcomm-conformance`): each names exactly the ranks of the other side, within the timeout
//! plus a margin, its new group of the ranks left works, it holds no more tpcomm memfds
//! than before, and it reaches its exit. Open MPI's `mpirun` does not end by itself once a
//! host's daemon is gone (the ranks it lost are never reported ended): once every expected
//! rank said it exits (or at the job limit), the driver ends mpirun, then tears the hosts
//! down and checks that nothing is left.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::cluster::Cluster;

/// One fault case.
#[derive(Debug, Clone, Copy)]
pub(super) struct Case {
    pub(super) kind: &'static str,
    hosts: usize,
    slots: usize,
    victim: usize,
}

/// The timeout every rank's communicator and queue is bounded by.
const TIMEOUT: Duration = Duration::from_secs(3);
/// How much later than the timeout a survivor may report (a loaded 2-core machine).
const MARGIN: Duration = Duration::from_secs(5);
/// Upper bound on one job.
const JOB_LIMIT: Duration = Duration::from_secs(90);
/// How long mpirun is given to end by itself once every rank said it exits.
const EXIT_GRACE: Duration = Duration::from_secs(3);

/// Every case, in the order they run.
pub(super) const CASES: [Case; 7] = [
    Case {
        kind: "host-kill-object",
        hosts: 2,
        slots: 2,
        victim: 1,
    },
    Case {
        kind: "host-kill-queue-readers",
        hosts: 2,
        slots: 2,
        victim: 1,
    },
    Case {
        kind: "host-kill-queue-writer",
        hosts: 2,
        slots: 2,
        victim: 0,
    },
    Case {
        kind: "host-kill-collective",
        hosts: 4,
        slots: 1,
        victim: 2,
    },
    Case {
        kind: "link-down-short",
        hosts: 2,
        slots: 2,
        victim: 1,
    },
    Case {
        kind: "link-down-long",
        hosts: 2,
        slots: 2,
        victim: 1,
    },
    Case {
        kind: "freeze",
        hosts: 2,
        slots: 2,
        victim: 1,
    },
];

/// Runs one case on fresh hosts; its figure (the survivors' times) or why it failed.
pub(super) fn run_case(exe: &Path, case: Case) -> Result<String, String> {
    let cluster = Cluster::create(case.hosts)?;
    let outcome = drive(&cluster, exe, case);
    let tag = cluster.tag().to_owned();
    let torn = cluster
        .teardown()
        .map_err(|e| format!("tearing down {tag}: {e}"));
    let (lines, injected) = outcome?;
    torn?;
    let verdict = judge(case, &lines, injected);
    if verdict.is_err() {
        eprintln!(
            "--- mpi-multihost fault {} lines:\n{}",
            case.kind,
            lines.join("\n")
        );
    }
    verdict
}

/// Runs the job, injecting the fault; every stdout line, and whether the fault was injected.
fn drive(cluster: &Cluster, exe: &Path, case: Case) -> Result<(Vec<String>, bool), String> {
    let mpirun = cluster.mpirun(case.hosts, case.slots)?;
    let mut cmd = Command::new(mpirun.get_program());
    cmd.args(mpirun.get_args())
        .arg("--enable-recovery")
        .arg(exe)
        .args([
            "fault",
            case.kind,
            &case.victim.to_string(),
            &TIMEOUT.as_millis().to_string(),
        ])
        .current_dir(crate::util::root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("$ {}", crate::util::show(&cmd));
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start mpirun: {e}"))?;
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().ok_or("mpirun has no stdout")?;
    let stderr = child.stderr.take().ok_or("mpirun has no stderr")?;
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // Open MPI's help texts about lost peers are expected; they are kept for a failure.
    let errors = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let ranks = case.hosts * case.slots;
    let victims = case.slots;
    let stops_needed = if case.kind == "host-kill-queue-writer" {
        1
    } else {
        victims
    };
    let started = Instant::now();
    let mut lines = Vec::new();
    let mut injected = false;
    let mut stops = 0;
    let mut exits = 0;
    let mut all_exited: Option<Instant> = None;
    let mut restore: Option<(Instant, bool)> = None;
    loop {
        if started.elapsed() > JOB_LIMIT || all_exited.is_some_and(|t| t.elapsed() > EXIT_GRACE) {
            break;
        }
        if let Some((at, link)) = restore {
            if Instant::now() >= at {
                if link {
                    cluster.set_link(case.victim, true)?;
                } else {
                    cluster.signal_host(case.victim, "CONT")?;
                }
                eprintln!("  {}: restored after {:?}", case.kind, at.elapsed());
                restore = None;
            }
        }
        let expected = match case.kind {
            "link-down-short" | "link-down-long" => ranks,
            _ => ranks - victims,
        };
        if all_exited.is_none() && exits >= expected && restore.is_none() {
            all_exited = Some(Instant::now());
        }
        let line = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => line,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        if line.starts_with("victim ") && line.contains(": stopped at ") {
            stops += 1;
            if stops == stops_needed && !injected {
                // The other victims (a writer's ring readers) go with their host.
                std::thread::sleep(Duration::from_millis(200));
                cluster.kill_host(case.victim)?;
                injected = true;
                eprintln!("  {}: host {} killed", case.kind, case.victim);
            }
        }
        if line == "inject" && !injected {
            injected = true;
            let now = Instant::now();
            match case.kind {
                "link-down-short" => {
                    cluster.set_link(case.victim, false)?;
                    restore = Some((now + TIMEOUT / 6, true));
                }
                "link-down-long" => {
                    cluster.set_link(case.victim, false)?;
                    restore = Some((now + TIMEOUT * 3, true));
                }
                "freeze" => {
                    let n = cluster.signal_host(case.victim, "STOP")?;
                    eprintln!("  freeze: {n} processes of host {} stopped", case.victim);
                    restore = Some((now + TIMEOUT * 3, false));
                }
                other => return Err(format!("`inject` from a {other} job")),
            }
            eprintln!(
                "  {}: injected at {:.1} s",
                case.kind,
                started.elapsed().as_secs_f64()
            );
        }
        if line.contains(": exiting without MPI_Finalize") {
            exits += 1;
        }
        println!("  | {line}");
        lines.push(line);
    }
    if let Some((_, link)) = restore {
        let _ = if link {
            cluster.set_link(case.victim, true)
        } else {
            cluster.signal_host(case.victim, "CONT").map(drop)
        };
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    if let Ok(errors) = errors.join() {
        let noise = |l: &&String| !l.contains("PMIX ERROR: BAD-PARAM");
        let kept: Vec<&String> = errors.iter().filter(noise).collect();
        if !kept.is_empty() && lines.iter().any(|l| l.contains("FAILED")) {
            eprintln!(
                "--- stderr:\n{}",
                kept.iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
    Ok((lines, injected))
}

/// The ranks on `host` of `case`'s layout (mpirun places them by slot).
fn ranks_on(case: Case, host: usize) -> Vec<usize> {
    (host * case.slots..(host + 1) * case.slots).collect()
}

/// Checks the lines of one job; the figure on success.
fn judge(case: Case, lines: &[String], injected: bool) -> Result<String, String> {
    if !injected {
        return Err("the fault was never injected (the ranks did not reach it)".into());
    }
    if let Some(bad) = lines.iter().find(|l| l.contains("FAILED")) {
        return Err(bad.clone());
    }
    let ranks = case.hosts * case.slots;
    let victims = ranks_on(case, case.victim);
    if case.kind == "link-down-short" {
        let mut longest = 0f64;
        for r in 0..ranks {
            let prefix = format!("rank {r}: link-down-short: ");
            let line = lines
                .iter()
                .find(|l| l.starts_with(&prefix))
                .ok_or_else(|| format!("rank {r} did not finish the stream"))?;
            longest = longest.max(seconds_after(line, "the longest ")?);
        }
        return Ok(format!(
            "every rank completed every all-gather; the longest took {longest:.2} s \
             (link down {:.1} s)",
            (TIMEOUT / 6).as_secs_f64()
        ));
    }
    // Whose verdict is judged, and which ranks each must name.
    let judged: Vec<(usize, Vec<usize>)> = (0..ranks)
        .filter(|r| case.kind == "link-down-long" || !victims.contains(r))
        .map(|r| {
            // A transport reader waits for its writer only: it names the writer (rank 0).
            if case.kind == "host-kill-queue-writer" {
                return (r, vec![0]);
            }
            let other_side = if victims.contains(&r) {
                (0..ranks).filter(|x| !victims.contains(x)).collect()
            } else {
                victims.clone()
            };
            (r, other_side)
        })
        .collect();
    let mut times = Vec::new();
    let mut reports = Vec::new();
    for (r, named) in &judged {
        let prefix = format!("survivor {r}: {} failed after ", case.kind);
        let line = lines
            .iter()
            .find(|l| l.starts_with(&prefix))
            .ok_or_else(|| format!("rank {r} reported no failure"))?;
        let secs = seconds_after(line, &prefix)?;
        if secs > (TIMEOUT + MARGIN).as_secs_f64() {
            return Err(format!(
                "rank {r} reported after {secs} s, past the {TIMEOUT:?} timeout plus {MARGIN:?}"
            ));
        }
        let said = named_in(line);
        // A ring reader learns of a lost transport reader through its writer, which records
        // one culprit: it names one of the lost ranks; or its own wait for the next message,
        // as long as the writer's bounded send, ends first and names the writer (rank 0).
        // Every other rank names all of them.
        let ring_reader = case.kind == "host-kill-queue-readers" && *r != 0;
        let right = if ring_reader {
            said == [0] || (!said.is_empty() && said.iter().all(|x| named.contains(x)))
        } else {
            said == *named
        };
        if !right {
            return Err(format!("rank {r} names {said:?}, not {named:?}: {line}"));
        }
        times.push(secs);
        reports.push(format!("rank {r} named {said:?} after {secs:.2} s"));
        let works = format!("survivor {r}: new group of ranks ");
        let groups = lines
            .iter()
            .filter(|l| l.starts_with(&works) && l.contains(" works ("))
            .count();
        let wanted = if case.kind == "link-down-long" { 2 } else { 1 };
        if groups < wanted {
            return Err(format!(
                "rank {r}: {groups} of its {wanted} new groups worked"
            ));
        }
        let leaks = format!("survivor {r}: leaks: ");
        let leak = lines
            .iter()
            .find(|l| l.starts_with(&leaks))
            .ok_or_else(|| format!("rank {r} gave no leak line"))?;
        let memfds = leak
            .split("tpcomm memfds ")
            .nth(1)
            .and_then(|t| t.split_once(" -> "))
            .and_then(|(a, b)| Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?)))
            .ok_or_else(|| format!("rank {r}: unreadable leak line `{leak}`"))?;
        if memfds.1 > memfds.0 {
            return Err(format!(
                "rank {r} holds more tpcomm memfds after the fault: {leak}"
            ));
        }
        if !lines
            .iter()
            .any(|l| *l == format!("rank {r}: exiting without MPI_Finalize"))
        {
            return Err(format!("rank {r} did not reach its exit"));
        }
    }
    // A thawed rank (frozen with its host) never names a rank of its own host: those ran
    // again with it.
    for r in &victims {
        let prefix = format!("thawed {r}: freeze failed after ");
        if let Some(line) = lines.iter().find(|l| l.starts_with(&prefix)) {
            let said = named_in(line);
            if said.iter().any(|x| victims.contains(x)) {
                return Err(format!(
                    "thawed rank {r} names a rank of its own host: {line}"
                ));
            }
        }
    }
    let max = times.iter().copied().fold(0f64, f64::max);
    Ok(format!(
        "{} (timeout {:.1} s, slowest {max:.2} s); new groups work; no tpcomm memfd left",
        reports.join(", "),
        TIMEOUT.as_secs_f64()
    ))
}

/// The number of seconds right after `marker` in `line` (`... marker 3.02 s ...`).
fn seconds_after(line: &str, marker: &str) -> Result<f64, String> {
    line.split(marker)
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no time in `{line}`"))
}

/// The ranks a verdict line names (`... naming ranks [2, 3]: ...`).
fn named_in(line: &str) -> Vec<usize> {
    line.split_once("naming ranks [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list.split(", ").filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kill_object_lines(named: &str, secs: &str) -> Vec<String> {
        let mut lines = Vec::new();
        for r in [0, 1] {
            lines.push(format!(
                "survivor {r}: host-kill-object failed after {secs} s naming ranks {named}: x"
            ));
            lines.push(format!(
                "survivor {r}: new group of ranks [0, 1] works (0.01 s)"
            ));
            lines.push(format!(
                "survivor {r}: leaks: descriptors 20 -> 18, mappings 1 -> 3, tpcomm memfds 0 -> 0"
            ));
            lines.push(format!("rank {r}: exiting without MPI_Finalize"));
        }
        lines
    }

    #[test]
    fn a_kill_is_passed_when_every_survivor_names_the_lost_host_in_time() {
        let case = CASES[0];
        let figure = judge(case, &kill_object_lines("[2, 3]", "3.01"), true).unwrap();
        assert!(
            figure.contains("rank 1 named [2, 3] after 3.01 s"),
            "{figure}"
        );
    }

    #[test]
    fn a_survivor_naming_other_ranks_or_reporting_late_fails_the_case() {
        let case = CASES[0];
        assert!(judge(case, &kill_object_lines("[2]", "3.01"), true).is_err());
        assert!(judge(case, &kill_object_lines("[2, 3]", "9.50"), true).is_err());
        assert!(judge(case, &kill_object_lines("[2, 3]", "3.01"), false).is_err());
        let mut leaked = kill_object_lines("[2, 3]", "3.01");
        leaked[2] =
            "survivor 0: leaks: descriptors 20 -> 18, mappings 1 -> 3, tpcomm memfds 0 -> 1".into();
        assert!(judge(case, &leaked, true).is_err());
    }
}
