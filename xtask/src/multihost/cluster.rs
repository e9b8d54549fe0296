//! The hosts of `cargo xtask multihost`, made of namespaces on this machine, and their
//! teardown.
//!
//! A host is a network, PID, UTS and mount namespace: its own interface and address, its own
//! PID namespace (so tpcomm's `ProcessIdentity` sees another host), its own host name, its own
//! `/proc`, `/etc/hosts` and `/dev/shm` (a tmpfs of its mount namespace: what the MPI library
//! leaves there when a host is killed goes with the host, and no host sees another's). Each host's network namespace holds one end of a veth pair whose
//! other end is a port of a bridge in a namespace of its own (the "switch", which also holds
//! the launcher's address). Addresses come from 198.18.0.0/15 (reserved for test networks)
//! and no namespace has a default route: traffic never leaves them.
//!
//! The host's PID namespace lives as long as its first process (`sleep infinity`, the
//! namespace's init): killing it kills every process of the host. Processes enter a host with
//! `nsenter -t INIT --net --pid --uts --mount` (the launch agent does, instead of ssh).
//!
//! Teardown: a watcher process in a session of its own waits for this process to end (however
//! it ends: return, panic, Ctrl-C, SIGKILL) and then runs the teardown script; `Drop` runs
//! the same script at once and stops the watcher. The script kills every process in the
//! switch's network namespace (mpirun and the agents) and every host's init, then deletes the
//! network namespaces (their veths go with them, their `/run/netns` mounts too).
//! [`leftovers`] checks that nothing is left.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::util;

/// The prefix of every namespace name this task makes.
pub(crate) const PREFIX: &str = "tpcomm-mh";

/// The launcher's address (on the switch's bridge).
const LAUNCHER_ADDRESS: &str = "198.18.0.254";

/// The test network.
pub(crate) const NETWORK: &str = "198.18.0.0/15";

/// One host.
#[derive(Debug, Clone)]
pub(crate) struct Host {
    /// Its host name (UTS), also its name in the host file.
    pub(crate) name: String,
    /// The bridge port of its link, in the switch namespace.
    pub(crate) port: String,
    /// Its address.
    pub(crate) address: String,
    /// The PID (here) of its PID namespace's init.
    pub(crate) init: u32,
    /// Its PID namespace (`pid:[inode]`).
    pub(crate) pid_namespace: String,
    /// Its network namespace (`net:[inode]`).
    pub(crate) net_namespace: String,
}

/// The hosts of one run, torn down on drop.
pub(crate) struct Cluster {
    /// The names' common part, `tpcomm-mh-PID-N`.
    tag: String,
    /// The folder of the scripts and files (`target/multihost/TAG`).
    dir: PathBuf,
    /// The switch's network namespace: its name, its `net:[inode]`.
    switch: String,
    switch_namespace: String,
    pub(crate) hosts: Vec<Host>,
    watcher: Option<Child>,
}

/// Why hosts cannot be made here (the run is skipped with this reason).
#[derive(Debug)]
pub(crate) struct Refused(pub(crate) String);

/// Runs `program args`, failing with its stderr.
fn sh(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether namespaces for hosts can be made here; the reason when not.
pub(crate) fn probe() -> Result<(), Refused> {
    if !util::is_root() {
        return Err(Refused(
            "not root: namespaces and veth links need root".into(),
        ));
    }
    for tool in ["ip", "unshare", "nsenter", "mpirun"] {
        if !util::on_path(tool) {
            return Err(Refused(format!("`{tool}` is not on PATH")));
        }
    }
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--uts", "--net", "true"])
        .output()
        .map_err(|e| Refused(format!("cannot run unshare: {e}")))?;
    if !out.status.success() {
        return Err(Refused(format!(
            "`unshare --pid --fork --mount-proc --uts --net` is refused here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

impl Cluster {
    /// Makes `count` hosts (1 to 9) joined by one switch; `Refused` when the first namespace
    /// cannot be made, an error for a failure after that.
    pub(crate) fn create(count: usize) -> Result<Self, String> {
        static SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{PREFIX}-{}-{n}", std::process::id());
        let dir = util::root().join("target/multihost").join(&tag);
        fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut cluster = Cluster {
            switch: format!("{tag}-sw"),
            switch_namespace: String::new(),
            tag,
            dir,
            hosts: Vec::new(),
            watcher: None,
        };
        cluster.write_teardown()?;
        cluster.start_watcher()?;
        cluster.make_switch()?;
        for i in 0..count {
            cluster.make_host(i)?;
        }
        cluster.write_launch_files()?;
        Ok(cluster)
    }

    /// The teardown script: kills the processes of the switch's network namespace and of
    /// every host, deletes every network namespace named after the tag. Idempotent.
    fn write_teardown(&self) -> Result<(), String> {
        let script = format!(
            r#"#!/bin/sh
# Tears down the hosts of {tag} (idempotent).
dir={dir}
sw=$(readlink /proc/self/ns/net)
for ns in $(ip netns list | awk '{{print $1}}' | grep '^{tag}-'); do
  net=$(ip netns exec "$ns" readlink /proc/self/ns/net 2>/dev/null)
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$net" ] && [ "$net" != "$sw" ] && kill -9 "${{p#/proc/}}" 2>/dev/null
  done
done
[ -f "$dir/inits" ] && for pid in $(cat "$dir/inits"); do kill -9 "$pid" 2>/dev/null; done
sleep 0.2
for ns in $(ip netns list | awk '{{print $1}}' | grep '^{tag}-'); do
  ip netns delete "$ns" 2>/dev/null
done
exit 0
"#,
            tag = self.tag,
            dir = self.dir.display(),
        );
        write_script(&self.dir.join("teardown"), &script)
    }

    /// The watcher: in a process group of its own (Ctrl-C does not reach it), it waits for
    /// this process to end and then tears down.
    fn start_watcher(&mut self) -> Result<(), String> {
        let me = std::process::id();
        let teardown = self.dir.join("teardown");
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; exec sh {}",
                teardown.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the teardown watcher: {e}"))?;
        self.watcher = Some(child);
        Ok(())
    }

    fn make_switch(&mut self) -> Result<(), String> {
        let sw = self.switch.clone();
        let sw = sw.as_str();
        sh("ip", &["netns", "add", sw])?;
        self.switch_namespace = fs::metadata(format!("/run/netns/{sw}"))
            .map(|m| format!("net:[{}]", std::os::unix::fs::MetadataExt::ino(&m)))
            .map_err(|e| format!("the switch's namespace: {e}"))?;
        sh("ip", &["-n", sw, "link", "set", "lo", "up"])?;
        sh("ip", &["-n", sw, "link", "add", "br0", "type", "bridge"])?;
        sh(
            "ip",
            &[
                "-n",
                sw,
                "addr",
                "add",
                &format!("{LAUNCHER_ADDRESS}/15"),
                "dev",
                "br0",
            ],
        )?;
        sh("ip", &["-n", sw, "link", "set", "br0", "up"])?;
        Ok(())
    }

    fn make_host(&mut self, i: usize) -> Result<(), String> {
        let name = format!("{}-h{i}", self.tag.trim_start_matches("tpcomm-"));
        let netns = format!("{}-h{i}", self.tag);
        let port = format!("port{i}");
        let address = format!("198.18.0.{}", i + 1);
        sh("ip", &["netns", "add", &netns])?;
        sh(
            "ip",
            &[
                "link",
                "add",
                "eth0",
                "netns",
                &netns,
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                &self.switch,
            ],
        )?;
        sh(
            "ip",
            &[
                "-n",
                &self.switch,
                "link",
                "set",
                &port,
                "master",
                "br0",
                "up",
            ],
        )?;
        sh(
            "ip",
            &[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{address}/15"),
                "dev",
                "eth0",
            ],
        )?;
        sh("ip", &["-n", &netns, "link", "set", "eth0", "up"])?;
        sh("ip", &["-n", &netns, "link", "set", "lo", "up"])?;
        // The init: PID, UTS and mount namespaces of its own inside the host's network one;
        // `/etc/hosts` names every host (bound in its private mount namespace); `/dev/shm` is
        // the host's own tmpfs, freed with its mount namespace.
        let hosts_file = self.dir.join("hosts");
        let unshare = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .args([
                "--",
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                "--uts",
                "--mount",
            ])
            .args(["--", "sh", "-c"])
            .arg(format!(
                "hostname {name} && touch {hosts} && mount --bind {hosts} /etc/hosts \
                 && mount -t tmpfs -o mode=1777,size=1g tmpfs /dev/shm && exec sleep infinity",
                hosts = hosts_file.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start host {name}: {e}"))?;
        let parent = unshare.id();
        // The child is reaped by the watcher's teardown (kill) and by init; drop the handle.
        drop(unshare);
        let init = wait_for_init(parent).ok_or_else(|| format!("host {name} did not start"))?;
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("inits"))
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, format!("{init} {parent}\n").as_bytes())
            })
            .map_err(|e| format!("recording host {name}: {e}"))?;
        let pid_namespace = namespace_of(init, "pid")?;
        let net_namespace = namespace_of(init, "net")?;
        self.hosts.push(Host {
            name,
            port,
            address,
            init,
            pid_namespace,
            net_namespace,
        });
        Ok(())
    }

    /// `/etc/hosts` of every host, the launch agent and the host file.
    fn write_launch_files(&self) -> Result<(), String> {
        let mut hosts = format!(
            "127.0.0.1 localhost\n{LAUNCHER_ADDRESS} {}-launcher\n",
            self.tag
        );
        let mut cases = String::new();
        for h in &self.hosts {
            hosts.push_str(&format!("{} {}\n", h.address, h.name));
            cases.push_str(&format!("  {}) pid={} ;;\n", h.name, h.init));
        }
        // Written in place: the hosts' bind mounts follow the file's inode.
        fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(self.dir.join("hosts"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, hosts.as_bytes()))
            .map_err(|e| format!("writing the hosts file: {e}"))?;
        let agent = format!(
            r#"#!/bin/sh
# Open MPI's launch agent (plm_rsh_agent) for the hosts of {tag}: `agent HOST COMMAND...`
# runs COMMAND in HOST's namespaces, as ssh would run it on HOST.
host="$1"; shift
case "$host" in
{cases}  *) echo "launch agent: unknown host $host" >&2; exit 1 ;;
esac
exec nsenter -t "$pid" --net --pid --uts --mount -- sh -c "$*"
"#,
            tag = self.tag
        );
        write_script(&self.agent(), &agent)
    }

    /// The launch agent's path.
    pub(crate) fn agent(&self) -> PathBuf {
        self.dir.join("agent")
    }

    /// Writes a host file of the first `hosts` hosts with `slots` ranks each; its path.
    pub(crate) fn host_file(&self, hosts: usize, slots: usize) -> Result<PathBuf, String> {
        let path = self.dir.join(format!("hostfile-{hosts}x{slots}"));
        let text: String = self.hosts[..hosts]
            .iter()
            .map(|h| format!("{} slots={slots}\n", h.name))
            .collect();
        fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path)
    }

    /// `mpirun` in the switch's network namespace, launching `hosts × slots` ranks over TCP
    /// between hosts and shared memory inside one.
    pub(crate) fn mpirun(&self, hosts: usize, slots: usize) -> Result<Command, String> {
        let host_file = self.host_file(hosts, slots)?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.switch));
        cmd.args(["--", "mpirun", "--allow-run-as-root", "--oversubscribe"]);
        cmd.args(["--bind-to", "none", "--map-by", "slot"]);
        cmd.arg("-np").arg((hosts * slots).to_string());
        cmd.arg("--hostfile").arg(host_file);
        cmd.args(["--mca", "plm_rsh_agent"]).arg(self.agent());
        // The agent runs where mpirun runs (it enters the hosts from outside): no tree spawn.
        cmd.args(["--mca", "plm_rsh_no_tree_spawn", "1"]);
        cmd.args(["--mca", "btl", "self,vader,tcp"]);
        cmd.args(["--mca", "btl_tcp_if_include", NETWORK]);
        cmd.args(["--mca", "oob_tcp_if_include", NETWORK]);
        cmd.current_dir(util::root());
        Ok(cmd)
    }

    /// Kills every process of host `i` (its PID namespace's init, and so the namespace).
    pub(crate) fn kill_host(&self, i: usize) -> Result<(), String> {
        sh("kill", &["-KILL", &self.hosts[i].init.to_string()]).map(drop)
    }

    /// Sets host `i`'s link up or down (its port on the switch).
    pub(crate) fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        sh(
            "ip",
            &[
                "-n",
                &self.switch,
                "link",
                "set",
                &self.hosts[i].port,
                state,
            ],
        )
        .map(drop)
    }

    /// Sends `signal` (`STOP`, `CONT`) to every process of host `i` but its init.
    pub(crate) fn signal_host(&self, i: usize, signal: &str) -> Result<usize, String> {
        let host = &self.hosts[i];
        let pids: Vec<String> = processes_in(&host.pid_namespace)
            .into_iter()
            .filter(|&p| p != host.init)
            .map(|p| p.to_string())
            .collect();
        if !pids.is_empty() {
            let mut args = vec![format!("-{signal}")];
            args.extend(pids.iter().cloned());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            sh("kill", &args)?;
        }
        Ok(pids.len())
    }

    /// Tears down now and checks that nothing is left; the leftovers otherwise.
    pub(crate) fn teardown(mut self) -> Result<(), String> {
        self.teardown_now();
        leftovers(&self.tag, &self.namespaces())
    }

    /// Every namespace of the hosts and the switch (`pid:[..]`, `net:[..]`), for
    /// [`leftovers`].
    pub(crate) fn namespaces(&self) -> Vec<String> {
        let mut all = vec![self.switch_namespace.clone()];
        for h in &self.hosts {
            all.push(h.pid_namespace.clone());
            all.push(h.net_namespace.clone());
        }
        all
    }

    fn teardown_now(&mut self) {
        let _ = Command::new("sh")
            .arg(self.dir.join("teardown"))
            .stdin(Stdio::null())
            .status();
        if let Some(mut watcher) = self.watcher.take() {
            let _ = watcher.kill();
            let _ = watcher.wait();
        }
    }

    /// The tag naming this cluster's namespaces.
    pub(crate) fn tag(&self) -> &str {
        &self.tag
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.watcher.is_some() {
            self.teardown_now();
        }
    }
}

fn write_script(path: &Path, text: &str) -> Result<(), String> {
    fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Command::new("chmod")
        .arg("+x")
        .arg(path)
        .status()
        .map_err(|e| format!("chmod {}: {e}", path.display()))
        .map(drop)
}

/// The init of the PID namespace `unshare` (`parent`) made: its child running `sleep`.
fn wait_for_init(parent: u32) -> Option<u32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let children = fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        if let Some(child) = children
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
        {
            let comm = fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
            if comm.trim() == "sleep" {
                return Some(child);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The namespace `kind` (`pid`, `net`) of process `pid`, as `kind:[inode]`.
fn namespace_of(pid: u32, kind: &str) -> Result<String, String> {
    fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .map(|l| l.to_string_lossy().into_owned())
        .map_err(|e| format!("the {kind} namespace of process {pid}: {e}"))
}

/// Every process id here.
fn pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The processes in namespace `namespace` (`pid:[inode]`, `net:[inode]`).
pub(crate) fn processes_in(namespace: &str) -> Vec<u32> {
    let kind = namespace.split(':').next().unwrap_or("pid");
    pids()
        .into_iter()
        .filter(|p| {
            fs::read_link(format!("/proc/{p}/ns/{kind}"))
                .is_ok_and(|l| l.to_string_lossy() == namespace)
        })
        .collect()
}

/// What is left of the cluster `tag` whose hosts and switch had the namespaces
/// `namespaces` (`pid:[..]`, `net:[..]`): a network namespace or `/run/netns` mount named
/// after the tag, a process in one of those namespaces.
pub(crate) fn leftovers(tag: &str, namespaces: &[String]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut left = Vec::new();
        let netns = sh("ip", &["netns", "list"]).unwrap_or_default();
        left.extend(
            netns
                .lines()
                .filter(|l| l.contains(tag))
                .map(|l| format!("network namespace {l}")),
        );
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        left.extend(
            mounts
                .lines()
                .filter(|l| l.contains(tag))
                .map(|l| format!("mount {l}")),
        );
        for ns in namespaces {
            let procs = processes_in(ns);
            if !procs.is_empty() {
                left.push(format!("processes {procs:?} in {ns}"));
            }
        }
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("left behind: {}", left.join("; ")));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
