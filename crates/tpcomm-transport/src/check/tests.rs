use proptest::prelude::*;

use super::*;
use crate::error::ArgumentError;

fn shape(size: usize, rank: usize, max_count: usize) -> Shape {
    Shape {
        op: Op::AllGatherVarcount,
        rank,
        size,
        max_count,
    }
}

/// The specification of a valid varcount layout, written the slow obvious way.
fn valid_by_model(
    size: usize,
    rank: usize,
    max: usize,
    send_len: usize,
    recv_len: usize,
    counts: &[usize],
    displs: &[usize],
) -> bool {
    if counts.len() != size || displs.len() != size {
        return false;
    }
    for i in 0..size {
        if counts[i] > max || displs[i] > max {
            return false;
        }
        match displs[i].checked_add(counts[i]) {
            Some(end) if end <= recv_len => {}
            _ => return false,
        }
    }
    for i in 0..size {
        for j in 0..size {
            let both = i != j && counts[i] > 0 && counts[j] > 0;
            if both && displs[i] < displs[j] + counts[j] && displs[j] < displs[i] + counts[i] {
                return false;
            }
        }
    }
    send_len == counts[rank]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn varcount_check_accepts_exactly_the_valid_layouts(
        size in 1usize..6,
        rank_pick in any::<usize>(),
        max in 1usize..64,
        send_len in 0usize..40,
        recv_len in 0usize..100,
        counts in prop::collection::vec(0usize..40, 0..7),
        displs in prop::collection::vec(0usize..80, 0..7),
    ) {
        let rank = rank_pick % size;
        let send = vec![0u8; send_len];
        let mut recv = vec![0u8; recv_len];
        let accepted =
            VarcountArgs::check(shape(size, rank, max), &send, &mut recv, &counts, &displs).is_ok();
        prop_assert_eq!(
            accepted,
            valid_by_model(size, rank, max, send_len, recv_len, &counts, &displs)
        );
    }

    #[test]
    fn layout_fast_path_agrees_with_the_full_check(
        (size, counts, displs) in (1usize..6).prop_flat_map(|size| (
            Just(size),
            prop::collection::vec(prop_oneof![Just(0usize), 0usize..20], size),
            prop::collection::vec(0usize..60, size),
        )),
        max in 1usize..64,
        buffer_len in 0usize..100,
        reject_overlap in any::<bool>(),
        send_side in any::<bool>(),
    ) {
        let s = shape(size, 0, max);
        let which = if send_side { "send" } else { "receive" };
        let fits = s.layout_fits(&counts, &displs, buffer_len, reject_overlap);
        let full = s.layout_detail(which, &counts, &displs, buffer_len, reject_overlap);
        if fits {
            prop_assert!(full.is_ok(), "accepted by the fast path, rejected by the full check: {:?}", full);
        }
        let checked = s.layout(which, &counts, &displs, buffer_len, reject_overlap);
        prop_assert_eq!(format!("{checked:?}"), format!("{full:?}"));
    }

    #[test]
    fn all_gather_check_requires_size_times_send(
        size in 1usize..9,
        send_len in 0usize..50,
        recv_len in 0usize..400,
    ) {
        let send = vec![0u8; send_len];
        let mut recv = vec![0u8; recv_len];
        let accepted = AllGatherArgs::check(shape(size, 0, 1 << 20), &send, &mut recv).is_ok();
        prop_assert_eq!(accepted, recv_len == size * send_len);
    }
}

#[test]
fn device_broadcast_root_must_be_a_rank() {
    let err = device_count(DeviceCollective::Broadcast { root: 3 }, 0, 3, 0, 8, 4);
    assert!(matches!(
        err,
        Err(TransportError::InvalidArgument {
            op: Op::Broadcast,
            source: ArgumentError::RootOutOfRange { root: 3, size: 3 },
            ..
        })
    ));
    assert_eq!(
        device_count(DeviceCollective::Broadcast { root: 2 }, 0, 3, 0, 8, 4).unwrap(),
        8
    );
}

#[test]
fn device_lengths_are_reported_in_bytes() {
    let err = device_count(DeviceCollective::AllReduce, 1, 2, 4, 5, 2).unwrap_err();
    assert!(matches!(
        err,
        TransportError::InvalidArgument {
            op: Op::AllReduce,
            rank: 1,
            source: ArgumentError::RecvLength {
                expected: 8,
                actual: 10
            },
        }
    ));
}

#[test]
fn device_size_times_length_overflow_is_an_error() {
    let err = device_count(DeviceCollective::AllGather, 0, 2, usize::MAX, 0, 1).unwrap_err();
    assert!(matches!(
        err,
        TransportError::InvalidArgument {
            source: ArgumentError::Overflow { .. },
            ..
        }
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn device_check_accepts_exactly_the_matching_lengths(
        size in 1usize..9,
        send_len in 0usize..64,
        recv_len in 0usize..512,
        root in 0usize..10,
        which in 0usize..4,
    ) {
        let (kind, valid, count) = match which {
            0 => (DeviceCollective::AllReduce, send_len == recv_len, send_len),
            1 => (DeviceCollective::AllGather, recv_len == size * send_len, send_len),
            2 => (DeviceCollective::ReduceScatter, send_len == size * recv_len, recv_len),
            _ => (DeviceCollective::Broadcast { root }, root < size, recv_len),
        };
        let checked = device_count(kind, 0, size, send_len, recv_len, 2);
        prop_assert_eq!(checked.is_ok(), valid);
        if let Ok(c) = checked {
            prop_assert_eq!(c, count);
        }
    }
}
