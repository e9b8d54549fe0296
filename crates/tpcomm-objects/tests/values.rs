//! Object collectives on the local group: random sizes through the round path, zero-byte
//! values, the borrowed forms. (The classic value kinds through every collective and root
//! are in the conformance suite, `tests/src/objects.rs`, which also runs under MPI.)

use std::time::Duration;

use proptest::prelude::*;
use tpcomm_objects::{
    all_gather, all_gather_borrowed, all_gather_bytes, all_gather_bytes_with, all_gather_with,
    all_reduce_with, all_to_all_with, broadcast_with, gather, gather_with, scatter_with,
    ObjectError, Options,
};
use tpcomm_transport::{Communicator, LocalGroup, TransportError};

fn group(n: usize) -> LocalGroup {
    LocalGroup::new(n).timeout(Duration::from_secs(30))
}

type R<T> = Result<T, ObjectError>;

fn unwrap_all<T: std::fmt::Debug>(results: Vec<Result<R<T>, TransportError>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.unwrap_or_else(|e| panic!("rank {rank} died: {e}"))
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
        })
        .collect()
}

#[test]
fn unit_serializes_to_zero_bytes_and_still_gathers() {
    assert!(postcard::to_allocvec(&()).unwrap().is_empty());
    let out = unwrap_all(group(3).run(|comm| -> R<_> {
        let opts = Options {
            small_slot_bytes: 0,
            ..Options::default()
        };
        Ok((
            all_gather_with(&comm, &(), &opts)?,
            broadcast_with(&comm, 2, Some(&()), &opts)?,
        ))
    }));
    for (all, ()) in out {
        assert_eq!(all, vec![(), (), ()]);
    }
}

#[test]
fn borrowed_values_point_into_the_receive_buffer() {
    let out = unwrap_all(group(3).run(|comm| -> R<bool> {
        let text = "x".repeat(comm.rank() * 500);
        let gathered = all_gather_borrowed(&comm, &text.as_str())?;
        let views: Vec<&str> = gathered.decode()?;
        let range = gathered.buffer().as_ptr_range();
        let borrowed = views
            .iter()
            .all(|s| s.is_empty() || range.contains(&s.as_ptr()));
        for (r, s) in views.iter().enumerate() {
            assert_eq!(*s, "x".repeat(r * 500));
        }
        Ok(borrowed)
    }));
    assert!(
        out.into_iter().all(|b| b),
        "decoded &str values borrow from the Gathered buffer"
    );
}

/// Values of 2 KiB and more are received 64 bytes further into the (kept) receive buffer at
/// each call, modulo 4 KiB, so that no destination the values are copied to stays in
/// `memcpy`'s slow relation with them call after call (`buffers::receive_offset`).
#[test]
fn received_bytes_move_by_64_from_one_call_to_the_next() {
    let out = unwrap_all(group(2).run(|comm| -> R<Vec<usize>> {
        let mine = vec![comm.rank() as u8 + 1; 10_000];
        let mut starts = Vec::new();
        for _ in 0..70 {
            let g = all_gather_bytes(&comm, &mine)?;
            assert_eq!(g.bytes(1).unwrap(), &[2u8; 10_000][..]);
            assert_eq!(g.buffer().len(), 20_000, "the buffer's prefix is not shown");
            starts.push(g.bytes(0).unwrap().as_ptr() as usize);
        }
        Ok(starts)
    }));
    for starts in out {
        for pair in starts.windows(2) {
            assert_eq!(pair[1].wrapping_sub(pair[0]) % 4096, 64, "{starts:?}");
        }
    }
}

#[test]
fn bytes_form_returns_one_buffer_with_a_view_per_rank() {
    let out = unwrap_all(group(4).run(|comm| -> R<Vec<Vec<u8>>> {
        let mine = vec![comm.rank() as u8; comm.rank() * 1000];
        let g = all_gather_bytes_with(
            &comm,
            &mine,
            &Options {
                round_bytes: Some(777),
                ..Options::default()
            },
        )?;
        assert_eq!(g.len(), 4);
        assert_eq!(
            g.buffer().len(),
            6000,
            "one buffer holds every rank's bytes"
        );
        Ok(g.iter().map(<[u8]>::to_vec).collect())
    }));
    for views in out {
        for (r, v) in views.iter().enumerate() {
            assert_eq!(v, &vec![r as u8; r * 1000]);
        }
    }
}

#[test]
fn all_reduce_folds_in_rank_order_on_every_rank() {
    let out = unwrap_all(
        group(5).run(|comm| all_reduce_with(&comm, &comm.rank().to_string(), |a, b| a + &b)),
    );
    assert!(out.iter().all(|s| s == "01234"));
}

#[test]
fn collectives_work_on_split_sub_groups() {
    let out = unwrap_all(group(6).run(|comm| -> R<Vec<String>> {
        let sub = comm
            .split(Some((comm.rank() % 2) as u32), 0)?
            .expect("colored");
        all_gather(&sub, &format!("parent-{}", comm.rank()))
    }));
    assert_eq!(out[0], vec!["parent-0", "parent-2", "parent-4"]);
    assert_eq!(out[5], vec!["parent-1", "parent-3", "parent-5"]);
}

#[test]
fn a_root_out_of_range_is_an_invalid_argument_on_every_rank() {
    let out = group(2).run(|comm| gather(&comm, 2, &1u8));
    for r in out {
        assert!(matches!(r.unwrap(), Err(ObjectError::InvalidArgument(_))));
    }
}

/// One rank's value for a random case: `len` bytes, distinct per rank and seed.
fn blob(rank: usize, len: usize, seed: u8) -> serde_bytes::ByteBuf {
    serde_bytes::ByteBuf::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ rank as u8 ^ seed)
            .collect::<Vec<u8>>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random sizes (0 and very uneven included) with `max_count` from 1 to 64, so the
    /// round path runs, through every collective and every root.
    #[test]
    fn random_sizes_and_tiny_max_count_round_trip_through_every_collective(
        lens in prop::collection::vec(prop_oneof![Just(0usize), 0usize..8, 0usize..300, 1000usize..3000], 1..=8),
        max_count in 1usize..=64,
        slot in prop_oneof![Just(0usize), 0usize..64, Just(Options::MAX_SMALL_SLOT_BYTES)],
        seed in any::<u8>(),
    ) {
        let n = lens.len();
        let opts = Options { small_slot_bytes: slot, ..Options::default() };
        let results = LocalGroup::new(n).max_count(max_count).timeout(Duration::from_secs(30)).run(|comm| -> R<()> {
            let me = comm.rank();
            let all: Vec<serde_bytes::ByteBuf> = (0..n).map(|r| blob(r, lens[r], seed)).collect();
            assert_eq!(all_gather_with(&comm, &all[me], &opts)?, all);
            let g = all_gather_bytes_with(&comm, &all[me], &opts)?;
            assert!(g.iter().zip(&all).all(|(a, b)| a == &b[..]));
            for root in 0..n {
                let got = gather_with(&comm, root, &all[me], &opts)?;
                assert_eq!(got, (me == root).then(|| all.clone()));
                assert_eq!(broadcast_with(&comm, root, (me == root).then_some(&all[root]), &opts)?, all[root]);
                let shards: Vec<_> = (0..n).map(|d| blob(d + root, lens[(d + root) % n], seed)).collect();
                let s = scatter_with(&comm, root, (me == root).then_some(&shards[..]), &opts)?;
                assert_eq!(&s, &shards[me]);
            }
            let outgoing: Vec<_> = (0..n).map(|d| blob(me * 8 + d, lens[(me + d) % n], seed)).collect();
            let incoming = all_to_all_with(&comm, &outgoing, &opts)?;
            for s in 0..n {
                assert_eq!(incoming[s], blob(s * 8 + me, lens[(s + me) % n], seed));
            }
            Ok(())
        });
        for (rank, r) in results.into_iter().enumerate() {
            prop_assert!(matches!(r, Ok(Ok(()))), "rank {}: {:?}", rank, r);
        }
    }
}
