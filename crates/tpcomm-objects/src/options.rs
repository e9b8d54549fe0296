//! Options shared by every object collective.

/// Tuning and safety limits of an object collective. All ranks must pass equal options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Largest total number of bytes a rank accepts to receive (the sum of the announced
    /// lengths it would allocate). Checked before allocating; default 8 GiB.
    pub max_total_bytes: usize,
    /// Largest number of bytes moved by one transport call in the round path; the
    /// effective limit is the smaller of this and the communicator's `max_count`.
    /// `None` (the default) uses `max_count`.
    pub round_bytes: Option<usize>,
    /// Size of the inline slot carried by the length exchange (default 248, so that a
    /// rank's header entry — the 8-byte length plus the slot — is exactly 256 bytes, the
    /// largest message Open MPI's shared-memory path sends inline). When every rank's value
    /// fits, the whole collective is one transport call; 0 disables the small path.
    pub small_slot_bytes: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_total_bytes: 8 << 30,
            round_bytes: None,
            small_slot_bytes: 248,
        }
    }
}

impl Options {
    /// The bytes one transport call may move, given the communicator's `max_count`.
    pub(crate) fn round_limit(&self, max_count: usize) -> usize {
        self.round_bytes
            .map_or(max_count, |r| r.min(max_count))
            .max(1)
    }
}
