//! Failure agreement and hostile bytes: serialization failures on chosen ranks, roots
//! without input, and a communicator that corrupts, truncates or inflates bytes and lengths
//! in flight. Every rank must get a typed error, nothing may panic or hang, and nothing may
//! be allocated past the cap.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{serial, PeakAlloc, Rewriting, LARGEST};

use serde::{Serialize, Serializer};
use tpcomm_objects::{
    all_gather, all_gather_with, all_to_all, broadcast, gather, scatter, scatter_with, DecodeError,
    ObjectError, Options,
};
use tpcomm_transport::{Communicator, LocalGroup};

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

/// A value whose serialization fails when `fail` is set.
struct FailOn {
    fail: bool,
}

impl Serialize for FailOn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.fail {
            Err(serde::ser::Error::custom("refusing to serialize"))
        } else {
            s.serialize_u32(7)
        }
    }
}

impl<'de> serde::Deserialize<'de> for FailOn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u32::deserialize(d).map(|_| FailOn { fail: false })
    }
}

fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(20))
}

#[test]
fn one_rank_failing_to_serialize_errors_on_every_rank() {
    for (n, failing) in [
        (2, vec![1]),
        (4, vec![0, 3]),
        (5, vec![0, 1, 2, 3, 4]),
        (1, vec![0]),
    ] {
        let results = group(n).run(|comm| {
            let v = FailOn {
                fail: failing.contains(&comm.rank()),
            };
            all_gather(&comm, &v).map(drop)
        });
        for (rank, r) in results.into_iter().enumerate() {
            match r.unwrap() {
                Err(ObjectError::PeerSerialization { ranks, source }) => {
                    assert_eq!(ranks, failing, "rank {rank} names every failing rank");
                    assert_eq!(
                        source.is_some(),
                        failing.contains(&rank),
                        "only a failing rank keeps a cause"
                    );
                }
                other => panic!("rank {rank}: expected PeerSerialization, got {other:?}"),
            }
        }
    }
}

#[test]
fn a_failing_rank_in_gather_errors_on_every_rank_including_non_roots() {
    let results = group(3).run(|comm| {
        gather(
            &comm,
            0,
            &FailOn {
                fail: comm.rank() == 2,
            },
        )
        .map(drop)
    });
    for r in results {
        assert!(
            matches!(r.unwrap(), Err(ObjectError::PeerSerialization { ranks, .. }) if ranks == vec![2])
        );
    }
}

#[test]
fn a_root_failing_to_serialize_fails_broadcast_and_scatter_everywhere() {
    let results = group(3).run(|comm| {
        let b = broadcast(&comm, 1, Some(&FailOn { fail: true })).map(drop);
        let values = [
            FailOn { fail: false },
            FailOn { fail: true },
            FailOn { fail: false },
        ];
        let s = scatter(&comm, 1, (comm.rank() == 1).then_some(&values[..])).map(drop);
        (b, s)
    });
    for r in results {
        let (b, s) = r.unwrap();
        assert!(
            matches!(b, Err(ObjectError::PeerSerialization { ref ranks, .. }) if ranks == &vec![1]),
            "{b:?}"
        );
        assert!(
            matches!(s, Err(ObjectError::PeerSerialization { ref ranks, .. }) if ranks == &vec![1]),
            "{s:?}"
        );
    }
}

#[test]
fn a_root_without_input_fails_every_rank_with_missing_input() {
    let results = group(3).run(|comm| {
        let b = broadcast::<_, u32>(&comm, 2, None);
        let too_few = [1u32, 2];
        let s = scatter(&comm, 0, (comm.rank() == 0).then_some(&too_few[..]));
        let short = vec![0u8; if comm.rank() == 1 { 2 } else { 3 }];
        let a = all_to_all(&comm, &short);
        (b, s, a)
    });
    for r in results {
        let (b, s, a) = r.unwrap();
        assert!(
            matches!(b, Err(ObjectError::MissingInput { rank: 2 })),
            "{b:?}"
        );
        assert!(
            matches!(s, Err(ObjectError::MissingInput { rank: 0 })),
            "{s:?}"
        );
        assert!(
            matches!(a, Err(ObjectError::MissingInput { rank: 1 })),
            "{a:?}"
        );
    }
}

#[test]
fn a_total_over_the_cap_errors_on_every_rank_before_allocating() {
    let results = group(3).run(|comm| {
        let opts = Options {
            max_total_bytes: 1000,
            ..Options::default()
        };
        all_gather_with(&comm, &vec![1u8; 400], &opts).map(drop)
    });
    for r in results {
        assert!(matches!(
            r.unwrap(),
            Err(ObjectError::TooLarge {
                rank: 2,
                cap: 1000,
                ..
            })
        ));
    }
}

/// How the wrapper damages what a rank receives.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Sets rank 1's length word to this value in every header that arrives.
    LengthWord(u64),
    /// Overwrites every received payload byte (not headers) with 0xFF.
    PayloadFf,
    /// Overwrites the inline slot of rank 1 with 0xFF.
    SlotFf,
    /// Sets the length words of rank 0's block in a block exchange (the 24-byte options
    /// field, then one word per rank, as scatter announces its lengths): this value for
    /// every rank but rank 1, which gets 1.
    RootLens(u64),
}

impl Damage {
    /// Damages a received header exchange of `size` ranks (`entry` bytes per rank; `slot`
    /// the inline slot's size).
    fn header(self, size: usize, slot: usize, entry: usize, recv: &mut [u8]) {
        if let Damage::RootLens(w) = self {
            if entry == 24 + 8 * size {
                for d in 0..size {
                    let word = if d == 1 { 1 } else { w };
                    recv[24 + 8 * d..][..8].copy_from_slice(&word.to_le_bytes());
                }
            }
            return;
        }
        if size > 1 && entry >= 8 {
            let rank1 = &mut recv[entry..2 * entry];
            match self {
                Damage::LengthWord(w) => rank1[..8].copy_from_slice(&w.to_le_bytes()),
                // The slot follows the length word and the 24-byte options field.
                Damage::SlotFf if entry >= 32 + slot => rank1[32..].fill(0xFF),
                _ => {}
            }
        }
    }

    /// Damages a received payload.
    fn payload(self, recv: &mut [u8]) {
        if let Damage::PayloadFf = self {
            recv.fill(0xFF);
        }
    }
}

/// Runs `f` on `n` ranks over a communicator that applies `damage` identically on every
/// rank.
fn run_damaged<T: Send>(
    n: usize,
    damage: Damage,
    f: impl Fn(&Rewriting<'_>) -> T + Sync,
) -> Vec<T> {
    let slot = Options::default().small_slot_bytes;
    let headers = move |entry: usize, recv: &mut [u8]| damage.header(n, slot, entry, recv);
    let payloads = move |recv: &mut [u8]| damage.payload(recv);
    group(n)
        .timeout(Duration::from_secs(5))
        .run(|inner| {
            f(&Rewriting {
                inner,
                headers: &headers,
                payloads: &payloads,
            })
        })
        .into_iter()
        .map(|r| r.expect("no rank panics"))
        .collect()
}

#[test]
fn an_inflated_length_is_rejected_on_every_rank_without_allocating_it() {
    let _serial = serial();
    LARGEST.store(0, Ordering::Relaxed);
    let results = run_damaged(3, Damage::LengthWord(1 << 40), |c| {
        all_gather(c, &vec![5u8; 1000]).map(drop)
    });
    for r in results {
        assert!(
            matches!(r, Err(ObjectError::TooLarge { rank: 1, .. })),
            "{r:?}"
        );
    }
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest < 64 << 20,
        "largest allocation {largest} bytes: sized from a hostile length"
    );
}

#[test]
fn a_length_word_that_overflows_usize_sums_is_rejected() {
    let _serial = serial();
    let results = run_damaged(3, Damage::LengthWord(u64::MAX - 3), |c| {
        all_gather(c, &7u8).map(drop)
    });
    for r in results {
        assert!(matches!(r, Err(ObjectError::TooLarge { .. })), "{r:?}");
    }
}

#[test]
fn scatter_lengths_whose_sum_overflows_are_refused_by_every_rank_without_a_panic() {
    // Each length is within the cap (the largest there is), but three of them add up past
    // usize: every rank, the root included, must refuse the announcement alike.
    let _serial = serial();
    let opts = Options {
        max_total_bytes: isize::MAX as usize,
        ..Options::default()
    };
    let results = run_damaged(4, Damage::RootLens(isize::MAX as u64), |c| {
        let values = [1u8, 2, 3, 4];
        let values = (c.rank() == 0).then_some(&values[..]);
        scatter_with(c, 0, values, &opts).map(drop)
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(
            matches!(r, Err(ObjectError::Corrupt(ref m)) if m.contains("add up past")),
            "rank {rank}: {r:?}"
        );
    }
}

#[test]
fn a_forged_failure_sentinel_is_agreed_as_a_serialization_failure() {
    let results = run_damaged(3, Damage::LengthWord(u64::MAX), |c| {
        all_gather(c, &7u8).map(drop)
    });
    for r in results {
        assert!(
            matches!(r, Err(ObjectError::PeerSerialization { ref ranks, source: None }) if ranks == &vec![1]),
            "{r:?}"
        );
    }
}

#[test]
fn a_truncated_length_is_caught_by_its_sender_and_nobody_hangs() {
    // Rank 1 sent 1000 bytes but every header now says 999: rank 1 sees its own length
    // corrupted and stops; the others fail when it leaves instead of waiting forever.
    let results = run_damaged(3, Damage::LengthWord(999), |c| {
        all_gather(c, &serde_bytes::ByteBuf::from(vec![1u8; 998])).map(drop)
    });
    assert!(
        matches!(results[1], Err(ObjectError::Corrupt(_))),
        "{:?}",
        results[1]
    );
    for rank in [0, 2] {
        assert!(
            matches!(results[rank], Err(ObjectError::Transport(_))),
            "rank {rank}: {:?}",
            results[rank]
        );
    }
}

#[test]
fn corrupted_payload_bytes_are_decode_errors_not_panics() {
    let _serial = serial();
    LARGEST.store(0, Ordering::Relaxed);
    let results = run_damaged(2, Damage::PayloadFf, |c| {
        all_gather(
            c,
            &vec![String::from("a string long enough to leave the small slot"); 20],
        )
        .map(drop)
    });
    for r in results {
        assert!(
            matches!(
                r,
                Err(ObjectError::Decode {
                    rank: 0,
                    source: DecodeError::Postcard(_)
                })
            ),
            "{r:?}"
        );
    }
    assert!(
        LARGEST.load(Ordering::Relaxed) < 64 << 20,
        "decoding hostile lengths must not preallocate them"
    );
}

#[test]
fn corrupted_inline_bytes_are_decode_errors_naming_the_rank() {
    let results = run_damaged(3, Damage::SlotFf, |c| {
        all_gather(c, &vec![1u64, 2, 3]).map(drop)
    });
    for r in results {
        assert!(
            matches!(r, Err(ObjectError::Decode { rank: 1, .. })),
            "{r:?}"
        );
    }
}

#[test]
fn trailing_bytes_are_rejected() {
    // A u8 sent where a unit is expected leaves one byte over.
    let results = group(2).run(|comm| {
        let g = tpcomm_objects::all_gather_borrowed(&comm, &9u8)?;
        g.decode::<()>().map(drop)
    });
    for r in results {
        assert!(matches!(
            r.unwrap(),
            Err(ObjectError::Decode {
                source: DecodeError::TrailingBytes(1),
                ..
            })
        ));
    }
}

#[test]
fn arbitrary_bytes_never_panic_the_decoder() {
    let mut state = 0x1234_5678_u64;
    for len in 0..2000 {
        let bytes: Vec<u8> = (0..len % 97)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 56) as u8
            })
            .collect();
        let _ = tpcomm_objects::decode_from::<Vec<String>>(0, &bytes);
        let _ = tpcomm_objects::decode_from::<(u64, Option<Vec<u8>>, String)>(0, &bytes);
        let _ = tpcomm_objects::decode_from::<std::collections::BTreeMap<u32, Vec<u64>>>(0, &bytes);
    }
}
