//! The payloads of the object and queue benchmarks (`blob:BYTES`, `records:N`, `step:N`)
//! and their Rust values, built the same way by every rank and by the mpi4py peer
//! (`objects_peer.py`), whose values are compared through [`fingerprint`].

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_bytes::{ByteBuf, Bytes};

use crate::data::pattern::{pattern, splitmix64};
use crate::engine::sweep::parse_bytes;

/// One value per rank, of one of three shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Payload {
    /// One byte string of this many bytes (`serde_bytes::ByteBuf`).
    Blob(usize),
    /// This many [`Record`]s.
    Records(usize),
    /// A [`SchedulerStep`] of this many requests.
    Step(usize),
}

impl fmt::Display for Payload {
    /// The name as `--payloads` takes it: `blob:64`, `blob:65536`, `blob:16MiB`, `records:1000`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Payload::Blob(n) if n >= 1 << 20 && n % (1 << 20) == 0 => {
                write!(f, "blob:{}MiB", n >> 20)
            }
            Payload::Blob(n) => write!(f, "blob:{n}"),
            Payload::Records(n) => write!(f, "records:{n}"),
            Payload::Step(n) => write!(f, "step:{n}"),
        }
    }
}

impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Parses `blob:BYTES`, `records:N` or `step:N`.
pub(crate) fn parse_payload(text: &str) -> Result<Payload, String> {
    let (kind, size) = text
        .trim()
        .split_once(':')
        .ok_or_else(|| format!("`{text}`: expected blob:BYTES, records:N or step:N"))?;
    let count = |make: fn(usize) -> Payload| {
        size.trim()
            .parse()
            .map(make)
            .map_err(|e| format!("`{size}`: {e}"))
    };
    match kind {
        "blob" => parse_bytes(size).map(Payload::Blob),
        "records" => count(Payload::Records),
        "step" => count(Payload::Step),
        other => Err(format!(
            "unknown payload kind `{other}` (use blob:BYTES, records:N or step:N)"
        )),
    }
}

/// A record of the `records:N` payloads (about 50 bytes of postcard). Its derive has
/// serde_derive's `deserialize_in_place` feature on (this crate's `Cargo.toml`), as a user
/// of `all_gather_into` would turn it on: `tpcomm into` decodes over its `name` and `tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) tokens: Vec<u32>,
    pub(crate) score: f64,
}

/// The borrowed form of [`Record`]: `name` points into the receive buffer.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordRef<'a> {
    pub(crate) id: u64,
    #[serde(borrow)]
    pub(crate) name: &'a str,
    pub(crate) tokens: Vec<u32>,
    pub(crate) score: f64,
}

/// Tokens per record.
pub(crate) const TOKENS: usize = 8;
/// Token ids are below this (a Llama-3-sized vocabulary), so most take 3 varint bytes.
pub(crate) const VOCABULARY: u64 = 128_256;

/// Record `i` of `rank`: deterministic, so that every rank can rebuild every rank's value.
pub(crate) fn record(rank: usize, i: usize) -> Record {
    let seed = ((rank as u64) << 40) ^ i as u64;
    Record {
        id: ((rank as u64) << 32) | i as u64,
        name: format!("r{rank}-rec-{i:09}"),
        tokens: (0..TOKENS as u64)
            .map(|t| (splitmix64(seed.wrapping_mul(31).wrapping_add(t)) % VOCABULARY) as u32)
            .collect(),
        score: (splitmix64(!seed) >> 11) as f64 / (1u64 << 53) as f64,
    }
}

/// The blob of `rank`: `bytes` bytes of the transport bench's pseudo-random pattern.
pub(crate) fn blob(rank: usize, bytes: usize) -> ByteBuf {
    let mut v = vec![0u8; bytes];
    pattern(&mut v, rank, 0x0b1e_c705, 0);
    ByteBuf::from(v)
}

/// A payload shape: its owned type, its borrowed type, and how to build and check values.
pub(crate) trait Shape: Sync {
    type Owned: Serialize + DeserializeOwned + PartialEq + Send + Sync;
    type Borrowed<'a>: Deserialize<'a>;

    /// The value of `rank`.
    fn value(&self, rank: usize) -> Self::Owned;

    /// Whether a borrowed value equals the owned one.
    fn borrowed_eq(got: &Self::Borrowed<'_>, want: &Self::Owned) -> bool;

    /// The bytes the mpi4py peer's fingerprint is taken of (see `objects_peer.py`).
    fn canonical(value: &Self::Owned) -> Vec<u8>;
}

pub(crate) struct BlobShape(pub(crate) usize);

impl Shape for BlobShape {
    type Owned = ByteBuf;
    type Borrowed<'a> = &'a Bytes;

    fn value(&self, rank: usize) -> ByteBuf {
        blob(rank, self.0)
    }

    fn borrowed_eq(got: &&Bytes, want: &ByteBuf) -> bool {
        got[..] == want[..]
    }

    fn canonical(value: &ByteBuf) -> Vec<u8> {
        value.to_vec()
    }
}

pub(crate) struct RecordsShape(pub(crate) usize);

impl Shape for RecordsShape {
    type Owned = Vec<Record>;
    type Borrowed<'a> = Vec<RecordRef<'a>>;

    fn value(&self, rank: usize) -> Vec<Record> {
        (0..self.0).map(|i| record(rank, i)).collect()
    }

    fn borrowed_eq(got: &Vec<RecordRef<'_>>, want: &Vec<Record>) -> bool {
        got.len() == want.len()
            && got.iter().zip(want).all(|(g, w)| {
                g.id == w.id && g.name == w.name && g.tokens == w.tokens && g.score == w.score
            })
    }

    fn canonical(value: &Vec<Record>) -> Vec<u8> {
        let mut out = Vec::new();
        for r in value {
            out.extend(r.id.to_le_bytes());
            out.extend(r.name.as_bytes());
            out.push(0);
            r.tokens.iter().for_each(|t| out.extend(t.to_le_bytes()));
            out.extend(r.score.to_bits().to_le_bytes());
        }
        out
    }
}

/// A scheduler's output for one step, as an engine's scheduler rank sends it to the other
/// ranks before the model runs (the `step:N` payloads, N requests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SchedulerStep {
    pub(crate) step: u64,
    pub(crate) requests: Vec<ScheduledRequest>,
}

/// One request of a [`SchedulerStep`] (about 80 bytes of postcard).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ScheduledRequest {
    /// 16 characters.
    pub(crate) id: String,
    pub(crate) prompt_len: u32,
    /// The tokens to feed this step.
    pub(crate) tokens: Vec<u32>,
    /// The KV-cache block of each 16 tokens.
    pub(crate) block_table: Vec<u32>,
    pub(crate) temperature: f64,
    pub(crate) top_p: f64,
    pub(crate) max_tokens: u32,
}

/// The borrowed form of [`SchedulerStep`]: request ids point into the receive buffer.
#[derive(Debug, Deserialize)]
pub(crate) struct SchedulerStepRef<'a> {
    pub(crate) step: u64,
    #[serde(borrow)]
    pub(crate) requests: Vec<ScheduledRequestRef<'a>>,
}

/// The borrowed form of [`ScheduledRequest`].
#[derive(Debug, Deserialize)]
pub(crate) struct ScheduledRequestRef<'a> {
    pub(crate) id: &'a str,
    pub(crate) prompt_len: u32,
    pub(crate) tokens: Vec<u32>,
    pub(crate) block_table: Vec<u32>,
    pub(crate) temperature: f64,
    pub(crate) top_p: f64,
    pub(crate) max_tokens: u32,
}

/// Tokens a request feeds per step (a decode step of a few speculative tokens).
const STEP_TOKENS: usize = 4;
/// KV-cache blocks per request.
const BLOCKS: usize = 16;

/// Request `i` of the step of `rank`: deterministic, as `objects_peer.py` builds it.
fn scheduled_request(rank: usize, i: usize) -> ScheduledRequest {
    let seed = ((rank as u64) << 40) ^ i as u64;
    let r = |k: u64| splitmix64(seed.wrapping_mul(37).wrapping_add(k));
    ScheduledRequest {
        id: format!("q{rank}-req-{i:09}"),
        prompt_len: (r(0) % 8192) as u32,
        tokens: (0..STEP_TOKENS as u64)
            .map(|t| (r(1 + t) % VOCABULARY) as u32)
            .collect(),
        block_table: (0..BLOCKS as u64)
            .map(|b| (r(100 + b) % 16_384) as u32)
            .collect(),
        temperature: (r(200) >> 11) as f64 / (1u64 << 53) as f64,
        top_p: (r(201) >> 11) as f64 / (1u64 << 53) as f64,
        max_tokens: (r(202) % 4096) as u32,
    }
}

pub(crate) struct StepShape(pub(crate) usize);

impl Shape for StepShape {
    type Owned = SchedulerStep;
    type Borrowed<'a> = SchedulerStepRef<'a>;

    fn value(&self, rank: usize) -> SchedulerStep {
        SchedulerStep {
            step: rank as u64 * 1000 + 7,
            requests: (0..self.0).map(|i| scheduled_request(rank, i)).collect(),
        }
    }

    fn borrowed_eq(got: &SchedulerStepRef<'_>, want: &SchedulerStep) -> bool {
        got.step == want.step
            && got.requests.len() == want.requests.len()
            && got.requests.iter().zip(&want.requests).all(|(g, w)| {
                g.id == w.id
                    && g.prompt_len == w.prompt_len
                    && g.tokens == w.tokens
                    && g.block_table == w.block_table
                    && g.temperature == w.temperature
                    && g.top_p == w.top_p
                    && g.max_tokens == w.max_tokens
            })
    }

    fn canonical(value: &SchedulerStep) -> Vec<u8> {
        let mut out = value.step.to_le_bytes().to_vec();
        for r in &value.requests {
            out.extend(r.id.as_bytes());
            out.push(0);
            out.extend(r.prompt_len.to_le_bytes());
            r.tokens.iter().for_each(|t| out.extend(t.to_le_bytes()));
            r.block_table
                .iter()
                .for_each(|b| out.extend(b.to_le_bytes()));
            out.extend(r.temperature.to_bits().to_le_bytes());
            out.extend(r.top_p.to_bits().to_le_bytes());
            out.extend(r.max_tokens.to_le_bytes());
        }
        out
    }
}

/// FNV-1a 64 of the canonical values, in order (as `objects_peer.py`).
pub(crate) fn fingerprint<S: Shape>(values: &[S::Owned]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in S::canonical(v) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_names_round_trip() {
        for name in "blob:64,blob:65536,blob:16MiB,records:1000,step:12".split(',') {
            assert_eq!(parse_payload(name).unwrap().to_string(), name);
        }
        assert_eq!(parse_payload("blob:16MiB"), Ok(Payload::Blob(16 << 20)));
        assert_eq!(
            parse_payload("blob:64KiB").unwrap().to_string(),
            "blob:65536"
        );
        assert!(parse_payload("records:x").is_err());
        assert!(parse_payload("tensor:4").is_err());
        assert!(parse_payload("64").is_err());
    }

    #[test]
    fn records_have_16_character_names_and_8_tokens() {
        let r = record(1, 99_999);
        assert_eq!(r.name.len(), 16);
        assert_eq!(r.tokens.len(), TOKENS);
        assert!(r.tokens.iter().all(|&t| u64::from(t) < VOCABULARY));
        assert!((0.0..1.0).contains(&r.score));
        assert_ne!(record(0, 5), record(1, 5));
    }

    #[test]
    fn fingerprints_cover_every_rank_value() {
        let shape = RecordsShape(3);
        let values: Vec<Vec<Record>> = (0..2).map(|r| shape.value(r)).collect();
        let one = fingerprint::<RecordsShape>(&values);
        assert_eq!(one.len(), 16);
        assert_ne!(one, fingerprint::<RecordsShape>(&values[..1]));
        assert_eq!(BlobShape::canonical(&blob(0, 5)).len(), 5);
    }
}
