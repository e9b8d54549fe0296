//! Who a rank's process is, and whether it still runs: what a rank waiting on a peer checks
//! so that a peer that died is reported as gone instead of waited for until a timeout.
//!
//! The MPI backend's timed collectives use it to name the peers whose process is gone; the
//! broadcast queue uses it to tell a dead writer or reader from a slow one. A peer can only
//! be checked from its own host (the same kernel and PID namespace): elsewhere its PID means
//! nothing, and the liveness is [`Liveness::Unknown`].
//!
//! A *host*, for tpcomm, is a kernel boot and a PID namespace: processes in another PID
//! namespace (another container, another machine) cannot share memory descriptors or be
//! checked through `/proc`. The identity also carries the host's name (its UTS name), so that
//! errors about ranks on several hosts can say which host each rank is on.

/// Who a rank's process is, so that a peer on the same host can tell whether it still
/// exists: the kernel's boot id and PID namespace (the same on both sides means the PID
/// means the same process), the PID and the process's start time (so a reused PID is not
/// mistaken for the rank), and the host's name (for messages only: two hosts may share a
/// name). All zero where `/proc` cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    boot_id: [u8; 36],
    pid_namespace: u64,
    pid: u32,
    start_time: u64,
    host_name: [u8; HOST_NAME_BYTES],
}

/// The most bytes of a host name an identity carries (Linux's `HOST_NAME_MAX`).
const HOST_NAME_BYTES: usize = 64;

/// Whether a peer's process still exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It runs (or is stopped, but has not exited).
    Alive,
    /// It has exited, or its PID names another process now.
    Gone,
    /// It cannot be told from here (another host, `/proc` unreadable).
    Unknown,
}

impl ProcessIdentity {
    /// Encoded length: boot id, namespace, pid, start time (padded to 64 bytes), then the
    /// host name (64 bytes, padded with zeros).
    pub const LEN: usize = 128;

    /// This process's identity.
    pub fn current() -> Self {
        let mut boot_id = [0u8; 36];
        if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
            let text = text.trim().as_bytes();
            let n = text.len().min(boot_id.len());
            boot_id[..n].copy_from_slice(&text[..n]);
        }
        let pid_namespace = std::fs::read_link("/proc/self/ns/pid")
            .ok()
            .and_then(|link| {
                let link = link.to_string_lossy().into_owned();
                let digits: String = link.chars().filter(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .unwrap_or(0);
        let pid = std::process::id();
        let start_time = read_stat(pid).map_or(0, |(_, start)| start);
        let mut host_name = [0u8; HOST_NAME_BYTES];
        if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            let text = text.trim().as_bytes();
            let n = text.len().min(HOST_NAME_BYTES);
            host_name[..n].copy_from_slice(&text[..n]);
        }
        Self {
            boot_id,
            pid_namespace,
            pid,
            start_time,
            host_name,
        }
    }

    /// The fixed-width encoding that peers exchange.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..36].copy_from_slice(&self.boot_id);
        out[40..48].copy_from_slice(&self.pid_namespace.to_le_bytes());
        out[48..52].copy_from_slice(&self.pid.to_le_bytes());
        out[56..64].copy_from_slice(&self.start_time.to_le_bytes());
        out[64..].copy_from_slice(&self.host_name);
        out
    }

    /// A peer's identity from its encoding; bytes of another length decode as the all-zero
    /// identity, which is on no host and never checked.
    pub fn decode(bytes: &[u8]) -> Self {
        let mut id = Self {
            boot_id: [0; 36],
            pid_namespace: 0,
            pid: 0,
            start_time: 0,
            host_name: [0; HOST_NAME_BYTES],
        };
        if bytes.len() == Self::LEN {
            id.boot_id.copy_from_slice(&bytes[..36]);
            let word = |r: std::ops::Range<usize>| {
                let mut w = [0u8; 8];
                w[..r.len()].copy_from_slice(&bytes[r]);
                u64::from_le_bytes(w)
            };
            id.pid_namespace = word(40..48);
            id.pid = u32::try_from(word(48..52)).unwrap_or(0);
            id.start_time = word(56..64);
            id.host_name.copy_from_slice(&bytes[64..]);
        }
        id
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The host's name as the process saw it (its UTS name; empty where unknown), for
    /// messages: a peer's bytes, shown as text with anything that is not UTF-8 replaced.
    pub fn host_name(&self) -> String {
        let end = self
            .host_name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(HOST_NAME_BYTES);
        String::from_utf8_lossy(&self.host_name[..end]).into_owned()
    }

    /// Whether the kernel boot and PID namespace are known (`/proc` was readable).
    pub fn host_known(&self) -> bool {
        self.boot_id != [0; 36] && self.pid_namespace != 0
    }

    /// Same kernel and PID namespace, both known: a PID of one names the same process on
    /// the other.
    pub fn same_host(&self, other: &Self) -> bool {
        self.host_known()
            && self.boot_id == other.boot_id
            && self.pid_namespace == other.pid_namespace
    }

    /// Both hosts known and different (another kernel boot or another PID namespace): the
    /// other process's PIDs, descriptors and `/proc` entries mean nothing here. Where either
    /// is unknown this is false (and [`same_host`](Self::same_host) is false too).
    pub fn on_another_host(&self, other: &Self) -> bool {
        self.host_known() && other.host_known() && !self.same_host(other)
    }

    /// How messages name the host of this identity: its name, or `"an unknown host"`.
    pub fn describe_host(&self) -> String {
        match self.host_name() {
            name if name.is_empty() => "an unknown host".to_string(),
            name => format!("host `{name}`"),
        }
    }

    /// The same process as `other` (threads of one process share an identity).
    pub fn same_process(&self, other: &Self) -> bool {
        self.same_host(other) && self.pid == other.pid && self.start_time == other.start_time
    }

    /// Whether this process (seen from the same host) still exists.
    pub fn liveness(&self) -> Liveness {
        if self.pid == 0 || self.start_time == 0 {
            return Liveness::Unknown;
        }
        match read_stat(self.pid) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Liveness::Gone,
            Err(_) => Liveness::Unknown,
            Ok((state, start)) if start != self.start_time || matches!(state, 'Z' | 'X') => {
                Liveness::Gone
            }
            Ok(_) => Liveness::Alive,
        }
    }
}

/// The state letter and start time (field 22, in clock ticks since boot) of
/// `/proc/<pid>/stat`.
fn read_stat(pid: u32) -> std::io::Result<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is parenthesized and may hold spaces: parse after it.
    let rest = text.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().and_then(|f| f.chars().next()).unwrap_or('?');
    let start = fields
        .get(19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| std::io::Error::other("unexpected /proc/<pid>/stat format"))?;
    Ok((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_round_trips_and_names_a_live_process() {
        let me = ProcessIdentity::current();
        let back = ProcessIdentity::decode(&me.encode());
        assert_eq!(back, me);
        assert!(me.same_process(&back));
        assert_eq!(me.liveness(), Liveness::Alive);
    }

    #[test]
    fn an_exited_process_is_gone_and_garbage_is_on_no_host() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let mut id = ProcessIdentity::current();
        id.pid = pid;
        id.start_time = read_stat(pid).map_or(1, |(_, start)| start);
        child.wait().unwrap();
        assert_eq!(id.liveness(), Liveness::Gone);
        let garbage = ProcessIdentity::decode(b"short");
        assert!(!garbage.same_host(&ProcessIdentity::current()));
        assert!(!garbage.on_another_host(&ProcessIdentity::current()));
        assert_eq!(garbage.liveness(), Liveness::Unknown);
    }

    #[test]
    fn the_host_name_travels_and_another_pid_namespace_is_another_host() {
        let me = ProcessIdentity::current();
        let expected = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(me.host_name(), expected.trim());
        let mut other = me;
        other.pid_namespace += 1;
        assert!(me.on_another_host(&other) && !me.same_host(&other));
        let mut rebooted = me;
        rebooted.boot_id[0] ^= 1;
        assert!(me.on_another_host(&rebooted));
        assert!(!me.on_another_host(&me));
        // A name of 64 bytes (no terminating zero) and one that is not UTF-8.
        let mut bytes = me.encode();
        bytes[64..].fill(b'x');
        assert_eq!(ProcessIdentity::decode(&bytes).host_name(), "x".repeat(64));
        bytes[64..66].copy_from_slice(&[0xff, 0]);
        assert_eq!(ProcessIdentity::decode(&bytes).host_name(), "\u{fffd}");
    }
}
