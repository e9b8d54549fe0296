//! Tagged collective steps: every all-gather of the registry (and of the custom all-reduce
//! and the broadcast queue built on it) carries what it is, so that a peer in another step
//! is reported by name instead of its bytes being decoded as something they are not.
//!
//! Collectives pair by call order only: when one rank skips a step (it failed locally, or
//! its communicator is Failed), its *next* collective pairs with its peers' current one.
//! Without a tag, a peer's unrelated bytes then decode as garbage (or worse, as a valid
//! value of the wrong step). With one, the pairing is detected from the exchanged bytes,
//! which every rank in a tagged step reads identically: they all fail the step together,
//! naming the first rank that is elsewhere and the step it is in.
//!
//! Wire format of a tagged value: a fixed 24-byte header, then the postcard encoding of the
//! value.
//!
//! | bytes | field |
//! |-------|-------|
//! | 0..4  | magic `tpS1` |
//! | 4..6  | [`Step`] code, little endian |
//! | 6..8  | zero |
//! | 8..16 | group id (0 before the group is agreed), little endian |
//! | 16..24 | sequence: tagged steps the group ran before this one, little endian |

use std::fmt;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_transport::Communicator;

use crate::error::{IpcError, Result};

const MAGIC: [u8; 4] = *b"tpS1";
/// Bytes of the header in front of every tagged value.
pub const TAG_BYTES: usize = 24;

/// The collective steps of the registry and of the custom all-reduce built on it.
///
/// A code received from a peer that this build does not know decodes to
/// [`Unknown`](Step::Unknown) (a peer of another version), still reported by number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Step {
    /// `PeerMappings::new`: the group id proposal (and the caller's agreement value).
    Create,
    /// `PeerMappings::exchange`: the handles.
    Exchange,
    /// `PeerMappings::exchange`: whether every rank opened every handle.
    ExchangeVerdict,
    /// `PeerMappings::reopen_all`: the fresh handles.
    Reopen,
    /// `PeerMappings::reopen_all`: whether every rank reopened every handle.
    ReopenVerdict,
    /// `CustomAllReduce::new`: every rank's tables are written.
    Ready,
    /// `prepare_for_suspend`: every rank drained its launches.
    SuspendDrained,
    /// `prepare_for_suspend`: every rank closed its mappings.
    SuspendClosed,
    /// `reinit_after_resume`: the nonces written for the proof of the new mappings.
    ResumeNonces,
    /// `reinit_after_resume`: every rank proved its new mappings.
    ResumeProved,
    /// `CustomAllReduce::close_with`: every rank drained and stops using its peers' memory.
    Close,
    /// `CustomAllReduce::new` (backends that ask for it, CUDA): the nonces of the one-time
    /// peer-to-peer data test, read by every peer through its new mappings.
    CreateNonces,
    /// `CustomAllReduce::register_buffer` / `register_graph_buffers`: which registration
    /// every rank makes, and the RankData slots it fills.
    Register,
    /// `CustomAllReduce::unregister`: the slot every rank ends, and whether its token is
    /// this communicator's.
    Unregister,
    /// `BroadcastQueue::create` (tpcomm-queue): every rank's settings and process identity.
    QueueCreate,
    /// `BroadcastQueue::create`: the writer's segment handle.
    QueueSegment,
    /// `BroadcastQueue::create`: whether each reader mapped the ring (the locality agreed).
    QueueJoined,
    /// `BroadcastQueue::suspend`: every rank stops using the ring.
    QueueSuspend,
    /// `BroadcastQueue::resume`: whether each reader mapped the ring again.
    QueueResume,
    /// `BroadcastQueue::close_with`: every rank's message count at the close.
    QueueClose,
    /// A code this build does not know.
    Unknown(u16),
}

impl Step {
    fn code(self) -> u16 {
        match self {
            Step::Create => 1,
            Step::Exchange => 2,
            Step::ExchangeVerdict => 3,
            Step::Reopen => 4,
            Step::ReopenVerdict => 5,
            Step::Ready => 6,
            Step::SuspendDrained => 7,
            Step::SuspendClosed => 8,
            Step::ResumeNonces => 9,
            Step::ResumeProved => 10,
            Step::Close => 11,
            Step::CreateNonces => 12,
            Step::Register => 13,
            Step::Unregister => 14,
            Step::QueueCreate => 15,
            Step::QueueSegment => 16,
            Step::QueueJoined => 17,
            Step::QueueSuspend => 18,
            Step::QueueResume => 19,
            Step::QueueClose => 20,
            Step::Unknown(c) => c,
        }
    }

    fn from_code(code: u16) -> Self {
        match code {
            1 => Step::Create,
            2 => Step::Exchange,
            3 => Step::ExchangeVerdict,
            4 => Step::Reopen,
            5 => Step::ReopenVerdict,
            6 => Step::Ready,
            7 => Step::SuspendDrained,
            8 => Step::SuspendClosed,
            9 => Step::ResumeNonces,
            10 => Step::ResumeProved,
            11 => Step::Close,
            12 => Step::CreateNonces,
            13 => Step::Register,
            14 => Step::Unregister,
            15 => Step::QueueCreate,
            16 => Step::QueueSegment,
            17 => Step::QueueJoined,
            18 => Step::QueueSuspend,
            19 => Step::QueueResume,
            20 => Step::QueueClose,
            c => Step::Unknown(c),
        }
    }

    /// What the step is, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Step::Create => "PeerMappings::new (group agreement)",
            Step::Exchange => "PeerMappings::exchange (handles)",
            Step::ExchangeVerdict => "PeerMappings::exchange (open verdicts)",
            Step::Reopen => "PeerMappings::reopen_all (handles)",
            Step::ReopenVerdict => "PeerMappings::reopen_all (open verdicts)",
            Step::Ready => "CustomAllReduce::new (tables written)",
            Step::SuspendDrained => "prepare_for_suspend (launches drained)",
            Step::SuspendClosed => "prepare_for_suspend (mappings closed)",
            Step::ResumeNonces => "reinit_after_resume (nonces)",
            Step::ResumeProved => "reinit_after_resume (mappings proved)",
            Step::Close => "close_with (final barrier)",
            Step::CreateNonces => "CustomAllReduce::new (peer-to-peer data test)",
            Step::Register => "register_buffer / register_graph_buffers (the registration)",
            Step::Unregister => "unregister (the slot)",
            Step::QueueCreate => "BroadcastQueue::create (settings)",
            Step::QueueSegment => "BroadcastQueue::create (the ring's handle)",
            Step::QueueJoined => "BroadcastQueue::create (readers joined)",
            Step::QueueSuspend => "BroadcastQueue::suspend",
            Step::QueueResume => "BroadcastQueue::resume (readers mapped again)",
            Step::QueueClose => "BroadcastQueue::close_with",
            Step::Unknown(_) => "an unknown step",
        }
    }
}

/// What one rank says it is doing in a tagged collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StepTag {
    /// The operation.
    pub step: Step,
    /// The group (a registry's id; 0 while the group is being created).
    pub group: u64,
    /// How many tagged steps the group ran before this one on this rank.
    pub sequence: u64,
}

impl fmt::Display for StepTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.step {
            Step::Unknown(code) => write!(f, "unknown step code {code}")?,
            step => f.write_str(step.name())?,
        }
        write!(f, ", step #{} of group {:#x}", self.sequence, self.group)
    }
}

impl StepTag {
    fn encode(&self) -> [u8; TAG_BYTES] {
        let mut h = [0u8; TAG_BYTES];
        h[..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&self.step.code().to_le_bytes());
        h[8..16].copy_from_slice(&self.group.to_le_bytes());
        h[16..24].copy_from_slice(&self.sequence.to_le_bytes());
        h
    }

    /// The tag at the front of `bytes`, or `None` when they do not start with one.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let h = bytes.get(..TAG_BYTES)?;
        if h[..4] != MAGIC || h[6..8] != [0, 0] {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        Some(Self {
            step: Step::from_code(u16::from_le_bytes([h[4], h[5]])),
            group: u64_at(8),
            sequence: u64_at(16),
        })
    }
}

/// How a peer's step is described in [`IpcError::StepMismatch`].
pub(crate) fn describe(found: &Option<StepTag>) -> String {
    match found {
        Some(tag) => tag.to_string(),
        None => "a collective that is not a tagged tpcomm step".into(),
    }
}

/// All-gathers `value` behind `tag`. Every rank's tag must equal this rank's; otherwise
/// every rank in a tagged step fails with [`IpcError::StepMismatch`] naming the first rank
/// that is elsewhere (they all read the same bytes), and no payload is decoded.
pub fn tagged_all_gather<C, T>(comm: &C, tag: StepTag, value: &T) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    tagged_all_gather_as(comm, tag, value)
}

/// [`tagged_all_gather`] sending an `S` that decodes as an `R` (a borrowed form of it).
pub(crate) fn tagged_all_gather_as<C, S, R>(comm: &C, tag: StepTag, value: &S) -> Result<Vec<R>>
where
    C: Communicator + ?Sized,
    S: Serialize + ?Sized,
    R: DeserializeOwned,
{
    // postcard writes a `[u8; N]` as its N bytes: the header leads the encoding unchanged.
    let gathered = tpcomm_objects::all_gather_borrowed(comm, &(tag.encode(), value))?;
    let mine = tag.encode();
    for (rank, bytes) in gathered.iter().enumerate() {
        // The bytes, not the decoded tags: `Step::Unknown(4)` decodes as `Step::Reopen`, so
        // comparing decoded tags would pass on one rank and fail on the other.
        if bytes.get(..TAG_BYTES) != Some(&mine[..]) {
            return Err(IpcError::StepMismatch {
                rank,
                expected: tag,
                found: StepTag::decode(bytes),
            });
        }
    }
    gathered
        .iter()
        .enumerate()
        .map(|(rank, bytes)| Ok(tpcomm_objects::decode_from(rank, &bytes[TAG_BYTES..])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_round_trips_and_garbage_is_no_tag() {
        let tag = StepTag {
            step: Step::ResumeNonces,
            group: 0xdead_beef,
            sequence: 7,
        };
        assert_eq!(StepTag::decode(&tag.encode()), Some(tag));
        assert_eq!(StepTag::decode(b"short"), None);
        assert_eq!(StepTag::decode(&[0u8; 64]), None);
        let mut unknown = tag.encode();
        unknown[4] = 200;
        assert_eq!(StepTag::decode(&unknown).unwrap().step, Step::Unknown(200));
    }

    #[test]
    fn every_known_code_decodes_to_its_step() {
        for code in 1..=20 {
            assert_eq!(Step::from_code(code).code(), code);
            assert!(!matches!(Step::from_code(code), Step::Unknown(_)));
        }
    }
}
