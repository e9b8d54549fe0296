//! `Reproducibility::BitStable`: a row's all-reduce has the same bits alone and inside a
//! batch of any size (up to and past `max_bytes`, at any position), on every dispatch table
//! the tuner can produce (bands of one-stage and two-stage cut anywhere), eager and
//! registered, and those bits are the rank-order f32 sum of `common::rank_order_sum`. And
//! the check sees the difference when a table sends part of the batches to a transport
//! whose order is another (`AnyOrder`).

mod common;

use std::time::Duration;

use common::{group, new_ar, rank_order_sum, R};
use half::{bf16, f16};
use proptest::prelude::*;
use tpcomm_allreduce::dispatch::{
    Band, Choice, DispatchTable, Input, Key, Reproducibility, MAX_RANKS,
};
use tpcomm_allreduce::{
    Algorithm, AllReduceError, Config, CustomAllReduce, DType, Element, FallbackReason, HostBackend,
};
use tpcomm_ipc::PeerMemory;
use tpcomm_transport::check::{
    AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, GatherArgs, VarcountArgs,
};
use tpcomm_transport::{Communicator, LocalCommunicator, Op, TransportError};

/// The staging buffers' size: small, so that batches go past it after a few rows.
const MAX_BYTES: usize = 512;
/// Elements of a row: 20 bytes of f32, 10 of f16 (batches of most sizes are not a multiple
/// of 16 bytes, so their last elements take a padded launch).
const ROW: usize = 5;
/// Elements of a row whose every batch is a multiple of 16 bytes (one launch up to
/// `max_bytes`, whatever the reproducibility setting).
const WHOLE_ROW: usize = 8;

/// A value whose magnitude spreads over 2^-12..2^12, so that summing in another order
/// changes the last bits of most sums.
fn spread(seed: u64, rank: usize, i: usize) -> f32 {
    let v = common::value(seed, rank, i);
    let e = (common::value(seed ^ 0x5a5a, rank, i) * 6.0) as i32;
    v * 2f32.powi(e)
}

/// Rank `rank`'s rows, `rows` of `row` elements.
fn rows<T: Element>(seed: u64, rank: usize, rows: usize, row: usize) -> Vec<T> {
    (0..rows * row)
        .map(|i| T::from_f32(spread(seed, rank, i)))
        .collect()
}

/// Where `got` differs from `want` bit for bit: "what, element i: got, want".
fn bits_differ<T: Element>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    let bytes = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    if bytes(got) == bytes(want) {
        return Ok(());
    }
    let i = (0..got.len())
        .find(|&i| bytes(&got[i..=i]) != bytes(&want[i..=i]))
        .unwrap_or(0);
    Err(format!(
        "{what}, {} element {i}: got {}, the rank-order sum is {}",
        T::DTYPE.name(),
        got[i].to_f32(),
        want[i].to_f32()
    ))
}

/// On this rank: every row alone, then batches of every row count (up to and past
/// `max_bytes`, at shifting positions) through `all_reduce_or_transport` on `transport`, and
/// the batches that fit through a registered buffer; every row's bits against the
/// rank-order sum. `Err` names the first difference.
fn check_rows<T: Element + tpcomm_transport::reduce::Element, C: Communicator>(
    ar: &mut CustomAllReduce<HostBackend>,
    comm: &LocalCommunicator,
    transport: &C,
    (seed, row_len): (u64, usize),
) -> R<Result<(), String>> {
    let world = comm.size();
    let n = 2 * MAX_BYTES / (row_len * <T as Element>::DTYPE.size()) + 3;
    let all: Vec<Vec<T>> = (0..world).map(|r| rows(seed, r, n, row_len)).collect();
    let want = rank_order_sum(&all);
    let mine = &all[comm.rank()];
    let mut out = vec![T::from_f32(f32::NAN); n * row_len];
    for row in 0..n {
        let at = row * row_len..(row + 1) * row_len;
        ar.all_reduce_or_transport(transport, &mine[at.clone()], &mut out[at.clone()])?;
        if let Err(e) = bits_differ(&format!("row {row} alone"), &out[at.clone()], &want[at]) {
            return Ok(Err(e));
        }
    }
    let memory = ar.memory()?.clone();
    let token = ar
        .register_buffer(comm, memory.allocate(MAX_BYTES)?)
        .map_err(|r| r.into_error())?;
    for k in 1..=n {
        let first = (k * 7) % (n - k + 1);
        let at = first * row_len..(first + k) * row_len;
        out.fill(T::from_f32(f32::NAN));
        ar.all_reduce_or_transport(transport, &mine[at.clone()], &mut out[at.clone()])?;
        let what = format!("rows {first}..{} in one eager call", first + k);
        if let Err(e) = bits_differ(&what, &out[at.clone()], &want[at.clone()]) {
            return Ok(Err(e));
        }
        let bytes = k * row_len * <T as Element>::DTYPE.size();
        if bytes <= MAX_BYTES && bytes.is_multiple_of(16) {
            memory.write(token.buffer(), 0, bytemuck::cast_slice(&mine[at.clone()]))?;
            out.fill(T::from_f32(f32::NAN));
            match ar.all_reduce_registered(&token, &mut out[at.clone()]) {
                // A size the table sends to the transport (`AnyOrder`): the eager call
                // above took it there.
                Err(AllReduceError::Fallback(FallbackReason::TableChoosesTransport { .. })) => {
                    continue
                }
                other => other?,
            };
            let what = format!("rows {first}..{} registered", first + k);
            if let Err(e) = bits_differ(&what, &out[at.clone()], &want[at]) {
                return Ok(Err(e));
            }
        }
    }
    drop(ar.unregister(comm, token)?);
    Ok(Ok(()))
}

/// [`check_rows`] for f32, f16 and bf16 on `world` threads with `config` and `data` (the
/// seed, the row length), the transport's all-reduce (if taken) on the threads or, `reversed`,
/// on [`ReverseOrder`]; every rank's verdict.
fn check_every_dtype(
    world: usize,
    config: Config,
    data: (u64, usize),
    reversed: bool,
) -> Vec<Result<(), String>> {
    group(world)
        .run(|comm| -> R<Result<(), String>> {
            let mut ar = new_ar(&comm, config.clone())?;
            let reverse = ReverseOrder(&comm);
            let outcome = if reversed {
                check_rows::<f32, _>(&mut ar, &comm, &reverse, data)?
                    .and(check_rows::<f16, _>(&mut ar, &comm, &reverse, data)?)
                    .and(check_rows::<bf16, _>(&mut ar, &comm, &reverse, data)?)
            } else {
                check_rows::<f32, _>(&mut ar, &comm, &comm, data)?
                    .and(check_rows::<f16, _>(&mut ar, &comm, &comm, data)?)
                    .and(check_rows::<bf16, _>(&mut ar, &comm, &comm, data)?)
            };
            ar.close_with(&comm)?;
            Ok(outcome)
        })
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.expect("rank thread")
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
        })
        .collect()
}

/// Bands of one-stage and two-stage: one-stage up to the first cut, then alternating
/// (`first_two`: starting with two-stage), each cut a multiple of 16 bytes.
fn bands(cuts: &[usize], first_two: bool) -> Vec<Band> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c * 16).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut min = 0;
    let mut two = first_two;
    for max in cuts.into_iter().chain([usize::MAX]) {
        let algorithm = if two {
            Algorithm::TwoStage
        } else {
            Algorithm::OneStage
        };
        out.push(Band::new(min, max, Choice::Custom(algorithm)));
        two = !two;
        min = max.saturating_add(1);
    }
    out
}

/// A table of `world` ranks with `staged` and `registered` bands for every element type:
/// what `tpcomm-bench tune` writes in bit-stable mode (it never writes `transport` there).
fn table(world: usize, staged: Vec<Band>, registered: Vec<Band>) -> DispatchTable {
    let keys = [DType::F32, DType::F16, DType::Bf16]
        .into_iter()
        .flat_map(|dtype| {
            [(Input::Staged, &staged), (Input::Registered, &registered)]
                .into_iter()
                .map(move |(input, b)| {
                    let key = Key {
                        ranks: world,
                        dtype,
                        input,
                    };
                    (key, b.clone())
                })
        });
    DispatchTable::from_bands("host", "a generated table", keys).expect("valid bands")
}

fn bit_stable(table: DispatchTable) -> Config {
    Config {
        max_bytes: MAX_BYTES,
        dispatch: Some(table),
        timeout: Duration::from_secs(30),
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn a_rows_sum_has_the_same_bits_alone_and_in_every_batch_on_every_tuned_table(
        staged_cuts in prop::collection::vec(1..=MAX_BYTES / 16 + 4, 0..4),
        staged_two in any::<bool>(),
        registered_cuts in prop::collection::vec(1..=MAX_BYTES / 16 + 4, 0..4),
        registered_two in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let t = table(
            3,
            bands(&staged_cuts, staged_two),
            bands(&registered_cuts, registered_two),
        );
        for verdict in check_every_dtype(3, bit_stable(t), (seed, ROW), false) {
            prop_assert!(verdict.is_ok(), "{}", verdict.unwrap_err());
        }
    }
}

#[test]
fn the_built_in_and_single_algorithm_tables_give_the_rank_order_sum_on_2_to_4_ranks() {
    let seed = common::run_seed();
    for world in 2..=4 {
        let one = bands(&[], false);
        let two = bands(&[], true);
        for t in [
            DispatchTable::host(),
            table(world, one.clone(), one),
            table(world, two.clone(), two),
        ] {
            let origin = t.origin().to_string();
            for verdict in check_every_dtype(world, bit_stable(t), (seed, ROW), false) {
                assert_eq!(verdict, Ok(()), "{world} ranks, {origin}, seed {seed}");
            }
        }
    }
}

#[test]
fn the_check_sees_other_bits_when_the_transport_serves_the_larger_batches() {
    // Sizes above 64 bytes go to a transport that sums in reverse rank order, as an
    // `MPI_Allreduce` may: the rows of those batches get other bits than alone (3 ranks:
    // (a + b) + c against (c + b) + a), which a bit-stable table never lets happen. Rows of
    // 8 elements: every batch is a multiple of 16 bytes, so only the table sends it there.
    let mut bands = bands(&[4], false);
    bands[1].choice = Choice::Transport;
    let t = table(3, bands.clone(), bands);
    let config = Config {
        reproducibility: Reproducibility::AnyOrder,
        ..bit_stable(t)
    };
    let seed = common::run_seed();
    for verdict in check_every_dtype(3, config, (seed, WHOLE_ROW), true) {
        let e = verdict.expect_err("the transport's order shows in the bits");
        assert!(e.contains("in one eager call"), "{e}");
    }
}

#[test]
fn a_table_naming_the_transport_is_refused_in_bit_stable_mode_naming_its_line() {
    let text = "tpcomm-dispatch 1\nbackend host\n\
                * * * 0 64KiB 1stage\n* * * 65537 inf transport\n";
    let t = DispatchTable::parse(text, "tuned.txt").expect("valid");
    for r in group(2).run(|comm| new_ar(&comm, bit_stable(t.clone())).map(drop)) {
        match r.expect("rank thread") {
            Err(AllReduceError::DispatchTable(e)) => {
                assert_eq!((e.origin.as_str(), e.line), ("tuned.txt", Some(4)));
                assert!(e.to_string().contains("Reproducibility::AnyOrder"), "{e}");
            }
            other => panic!("expected the table refused, got {other:?}"),
        }
    }
}

#[test]
fn a_table_for_another_backend_is_refused_at_creation() {
    let t = DispatchTable::cuda();
    for r in group(2).run(|comm| new_ar(&comm, bit_stable(t.clone())).map(drop)) {
        let e = r.expect("rank thread").expect_err("refused");
        assert!(
            e.to_string()
                .contains("for the cuda backend, not the host backend"),
            "{e}"
        );
    }
}

#[test]
fn the_communicator_reports_its_table_for_its_world_size() {
    let file = table(2, bands(&[256], false), bands(&[], true));
    for r in group(2).run(|comm| -> R<()> {
        let ar = new_ar(&comm, bit_stable(file.clone()))?;
        let used = ar.dispatch_table();
        assert_eq!(used.origin(), "a generated table");
        assert!(used.keys().all(|k| k.ranks == 2));
        let registered_f32 = Key {
            ranks: 2,
            dtype: DType::F32,
            input: Input::Registered,
        };
        assert_eq!(used.bands(&registered_f32).map(<[Band]>::len), Some(1));
        assert_eq!(used.for_ranks(MAX_RANKS).keys().count(), 0);
        Ok(())
    }) {
        r.expect("rank thread").expect("created");
    }
}

/// A communicator that forwards everything to a threads communicator but sums its
/// all-reduces in reverse rank order (as an MPI library's tree may), in f32 for halves.
struct ReverseOrder<'c>(&'c LocalCommunicator);

impl Communicator for ReverseOrder<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn max_count(&self) -> usize {
        self.0.max_count()
    }
    fn backend_name(&self) -> &'static str {
        "reverse-order"
    }
    fn split(&self, _color: Option<u32>, _key: i32) -> tpcomm_transport::Result<Option<Self>> {
        Err(TransportError::Unsupported {
            op: Op::Split,
            reason: "a test wrapper".into(),
        })
    }
    fn raw_barrier(&self) -> tpcomm_transport::Result<()> {
        self.0.raw_barrier()
    }
    fn raw_all_gather(&self, args: AllGatherArgs<'_>) -> tpcomm_transport::Result<()> {
        self.0.raw_all_gather(args)
    }
    fn raw_all_gather_varcount(&self, args: VarcountArgs<'_>) -> tpcomm_transport::Result<()> {
        self.0.raw_all_gather_varcount(args)
    }
    fn raw_gather_varcount(&self, args: GatherArgs<'_>) -> tpcomm_transport::Result<()> {
        self.0.raw_gather_varcount(args)
    }
    fn raw_broadcast(&self, args: BroadcastArgs<'_>) -> tpcomm_transport::Result<()> {
        self.0.raw_broadcast(args)
    }
    fn raw_all_to_all_varcount(&self, args: AllToAllArgs<'_>) -> tpcomm_transport::Result<()> {
        self.0.raw_all_to_all_varcount(args)
    }
    fn raw_all_reduce(&self, mut args: AllReduceArgs<'_>) -> tpcomm_transport::Result<()> {
        let mine = args.input().to_vec();
        let mut all = vec![0u8; mine.len() * self.size()];
        self.0.all_gather(&mine, &mut all)?;
        let mut inputs: Vec<&[u8]> = all.chunks_exact(mine.len().max(1)).collect();
        inputs.reverse();
        let (dtype, op) = (args.dtype(), args.op());
        tpcomm_transport::reduce::reduce_into(dtype, op, &inputs, args.parts().1);
        Ok(())
    }
}
