//! [`QueueConfig`]: the settings of a queue, their ranges, and the agreed part of them
//! ([`Settings`]) as it travels at creation.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tpcomm_objects::Options;

/// Settings of a queue.
///
/// `writer`, `depth`, `chunk_bytes`, `options.max_total_bytes` and `options.max_depth` are
/// *agreed*: every rank passes the same values, checked at creation
/// ([`QueueError::ConfigMismatch`] on every rank otherwise). `timeout`, `spin` and
/// `via_transport` are this rank's own.
///
/// [`QueueError::ConfigMismatch`]: crate::QueueError::ConfigMismatch
#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// The rank that sends (default 0). Valid range: `0..comm.size()`.
    pub writer: usize,
    /// Chunks in the ring (default 16): how far the writer may run ahead of the slowest
    /// reader on its host, in chunks. Valid range: `1..=`[`QueueConfig::MAX_DEPTH`].
    pub depth: usize,
    /// Payload bytes per chunk (default 256 KiB: a 4 MiB ring, which stays in a server CPU's
    /// last-level cache, and a message of 1 MiB streams through 4 chunks, the readers copying
    /// one while the writer fills the next). A message takes
    /// `max(1, ceil(len / chunk_bytes))` consecutive chunks: a message larger than the
    /// whole ring streams through it, the writer filling chunks as the readers free them.
    /// Valid range: `1..=`[`QueueConfig::MAX_CHUNK_BYTES`].
    pub chunk_bytes: usize,
    /// The encoding limits: `max_total_bytes` is the largest message (its postcard bytes)
    /// the writer sends and a reader accepts, `max_depth` the nesting bound of the writer's
    /// encoding and the readers' decoding. The other fields are not used. Validated as
    /// [`Options::validate`] does.
    pub options: Options,
    /// Longest time one wait on a peer may take (default 60 s): a reader for the writer's
    /// next chunk, the writer for the slowest reader to free one, and each broadcast of the
    /// transport path (through `Communicator::bound_waits`, on backends that can bound
    /// their waits: the local one and MPI). Not agreed.
    pub timeout: Duration,
    /// Longest time a wait spins before it parks (default 50 us; adapted per rank as the
    /// local transport's budget is; none when the ring's ranks in this process outnumber the
    /// CPUs it may use, or the ring's ranks the machine's online CPUs).
    /// Not agreed.
    pub spin: Duration,
    /// This reader receives through the transport even when it could map the ring (the
    /// transport path of readers on other hosts, on this one). Not agreed; ignored on the
    /// writer.
    pub via_transport: bool,
}

impl QueueConfig {
    /// The largest `depth`.
    pub const MAX_DEPTH: usize = 1 << 16;
    /// The largest `chunk_bytes`: 1 GiB.
    pub const MAX_CHUNK_BYTES: usize = 1 << 30;

    /// The default settings with `writer` as the writer.
    pub fn with_writer(writer: usize) -> Self {
        Self {
            writer,
            ..Self::default()
        }
    }

    /// Checks every field against its range for a group of `size` ranks.
    pub(super) fn validate(&self, size: usize) -> std::result::Result<(), String> {
        if self.writer >= size {
            return Err(format!(
                "writer {} is not a rank of a group of {size}",
                self.writer
            ));
        }
        if !(1..=Self::MAX_DEPTH).contains(&self.depth) {
            return Err(format!(
                "depth {} is outside 1..={}",
                self.depth,
                Self::MAX_DEPTH
            ));
        }
        if !(1..=Self::MAX_CHUNK_BYTES).contains(&self.chunk_bytes) {
            return Err(format!(
                "chunk_bytes {} is outside 1..={}",
                self.chunk_bytes,
                Self::MAX_CHUNK_BYTES
            ));
        }
        self.options.validate().map_err(|e| e.to_string())
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            writer: 0,
            depth: 16,
            chunk_bytes: 256 << 10,
            options: Options::default(),
            timeout: Duration::from_secs(60),
            spin: Duration::from_micros(50),
            via_transport: false,
        }
    }
}

/// The agreed settings, as they travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Settings {
    pub(super) writer: u64,
    pub(super) depth: u64,
    pub(super) chunk_bytes: u64,
    pub(super) max_message_bytes: u64,
    pub(super) max_depth: u64,
}

/// Names of [`Settings`]' fields, in [`Settings::fields`] order.
pub(super) const SETTING_NAMES: [&str; 5] = [
    "writer",
    "depth",
    "chunk_bytes",
    "options.max_total_bytes",
    "options.max_depth",
];

impl Settings {
    pub(super) fn of(c: &QueueConfig) -> Self {
        Self {
            writer: c.writer as u64,
            depth: c.depth as u64,
            chunk_bytes: c.chunk_bytes as u64,
            max_message_bytes: c.options.max_total_bytes as u64,
            max_depth: c.options.max_depth as u64,
        }
    }

    pub(super) fn fields(&self) -> [u64; 5] {
        [
            self.writer,
            self.depth,
            self.chunk_bytes,
            self.max_message_bytes,
            self.max_depth,
        ]
    }
}
