//! Object-collective cases of the conformance suite: the classic values of the MPI world's
//! object tests through every collective and root, the round path, and failure agreement.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};
use tpcomm::objects::{self, ObjectError, Options};
use tpcomm::transport::Communicator;

use crate::{CaseResult, Rng};

/// Every kind of value the MPI world's object-collective tests send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value {
    /// `None` in Python.
    Unit,
    /// An optional, absent.
    Nothing(Option<u32>),
    /// A boolean.
    Bool(bool),
    /// A signed integer.
    I64(i64),
    /// An unsigned integer.
    U64(u64),
    /// A float, by bits so NaN compares equal.
    F64Bits(u64),
    /// A string.
    Text(String),
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Pair(Box<(Value, Value)>),
    /// A map.
    Map(BTreeMap<String, Value>),
}

/// The classic values as rank `rank` sends them, the last one a list of all the others.
pub fn classic_values(rank: usize) -> Vec<Value> {
    let mut map = BTreeMap::new();
    map.insert("rank".to_string(), Value::U64(rank as u64));
    map.insert("empty".to_string(), Value::Text(String::new()));
    let all = vec![
        Value::Unit,
        Value::Nothing(None),
        Value::Bool(rank.is_multiple_of(2)),
        Value::I64(i64::MIN),
        Value::I64(i64::MAX),
        Value::U64(u64::MAX),
        Value::F64Bits(f64::NAN.to_bits()),
        Value::F64Bits((-0.0f64).to_bits()),
        Value::F64Bits(1.5e300f64.to_bits()),
        Value::Text(format!("héllo from rank {rank} ✓")),
        Value::Pair(Box::new((Value::Bool(true), Value::I64(-(rank as i64))))),
        Value::Map(map),
    ];
    let mut v = all.clone();
    v.push(Value::List(all));
    v
}

fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> CaseResult {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

fn obj<T>(what: &str, r: Result<T, ObjectError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: unexpected error: {e}"))
}

/// `gather_into` of `value` to `root` over `out`: only the root reports `out` filled, its `out`
/// becomes `expected`, and every other rank's stays as it was.
fn gather_into_case<C, T>(
    what: &str,
    comm: &C,
    root: usize,
    value: &T,
    out: &mut Vec<T>,
    opts: &Options,
    expected: &[T],
) -> CaseResult
where
    C: Communicator,
    T: Serialize + DeserializeOwned + PartialEq + Clone + std::fmt::Debug,
{
    let is_root = comm.rank() == root;
    let before = out.clone();
    let filled = obj(
        what,
        objects::gather_into_with(comm, root, value, out, opts),
    )?;
    same(&format!("{what} (filled)"), filled, is_root)?;
    same(what, &out[..], if is_root { expected } else { &before[..] })
}

pub(crate) fn classic_values_everywhere<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    // Kept across the values, so that each `_into` call decodes over a value of another kind.
    let (mut into_all, mut into_one) = (Vec::new(), Value::Unit);
    let mut into_gathered = Vec::new();
    for (i, v) in classic_values(me).into_iter().enumerate() {
        let expected: Vec<Value> = (0..n).map(|r| classic_values(r)[i].clone()).collect();
        same(
            "all_gather",
            obj("all_gather", objects::all_gather(comm, &v))?,
            expected.clone(),
        )?;
        obj(
            "all_gather_into",
            objects::all_gather_into(comm, &v, &mut into_all),
        )?;
        same("all_gather_into", &into_all, &expected)?;
        for root in 0..n {
            let got = obj("gather", objects::gather(comm, root, &v))?;
            same("gather", got, (me == root).then(|| expected.clone()))?;
            gather_into_case(
                "gather_into",
                comm,
                root,
                &v,
                &mut into_gathered,
                &Options::default(),
                &expected,
            )?;
            let b = obj(
                "broadcast",
                objects::broadcast(comm, root, (me == root).then_some(&v)),
            )?;
            same("broadcast", b, classic_values(root)[i].clone())?;
            obj(
                "broadcast_into",
                objects::broadcast_into(comm, root, (me == root).then_some(&v), &mut into_one),
            )?;
            same("broadcast_into", &into_one, &classic_values(root)[i])?;
            let s = obj(
                "scatter",
                objects::scatter(comm, root, (me == root).then_some(&expected[..])),
            )?;
            same("scatter", s, classic_values(me)[i].clone())?;
        }
        let outgoing: Vec<(usize, Value)> = (0..n).map(|d| (d, v.clone())).collect();
        let incoming = obj("all_to_all", objects::all_to_all(comm, &outgoing))?;
        same(
            "all_to_all",
            incoming,
            (0..n).map(|s| (me, classic_values(s)[i].clone())).collect(),
        )?;
        let folded = obj(
            "all_reduce_with",
            objects::all_reduce_with(comm, &vec![v.clone()], |mut a, b| {
                a.extend(b);
                a
            }),
        )?;
        same("all_reduce_with", folded, expected)?;
    }
    Ok(())
}

fn blob(rank: usize, tag: usize, len: usize) -> serde_bytes::ByteBuf {
    serde_bytes::ByteBuf::from(crate::filled(rank, tag, len))
}

pub(crate) fn round_path_with_random_sizes<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let mut rng = Rng::new(77);
    for tag in 0..6 {
        // Rounds of 97 bytes and a 16-byte slot: most exchanges take several rounds.
        let opts = Options {
            round_bytes: Some(97),
            small_slot_bytes: 16,
            ..Options::default()
        };
        let lens: Vec<usize> = (0..n).map(|_| rng.size(700)).collect();
        let all: Vec<_> = (0..n).map(|r| blob(r, tag, lens[r])).collect();
        same(
            "all_gather (rounds)",
            obj(
                "all_gather",
                objects::all_gather_with(comm, &all[me], &opts),
            )?,
            all.clone(),
        )?;
        let mut into = vec![blob(me, tag + 100, 300); tag];
        obj(
            "all_gather_into",
            objects::all_gather_into_with(comm, &all[me], &mut into, &opts),
        )?;
        same("all_gather_into (rounds)", &into, &all)?;
        let root = rng.below(n);
        let got = obj("gather", objects::gather_with(comm, root, &all[me], &opts))?;
        same("gather (rounds)", got, (me == root).then(|| all.clone()))?;
        let mut gathered = vec![blob(me, tag + 300, 200); tag];
        gather_into_case(
            "gather_into (rounds)",
            comm,
            root,
            &all[me],
            &mut gathered,
            &opts,
            &all,
        )?;
        let b = obj(
            "broadcast",
            objects::broadcast_with(comm, root, (me == root).then_some(&all[root]), &opts),
        )?;
        same("broadcast (rounds)", b, all[root].clone())?;
        let mut one = blob(me, tag + 200, 500);
        obj(
            "broadcast_into",
            objects::broadcast_into_with(
                comm,
                root,
                (me == root).then_some(&all[root]),
                &mut one,
                &opts,
            ),
        )?;
        same("broadcast_into (rounds)", &one, &all[root])?;
        let s = obj(
            "scatter",
            objects::scatter_with(comm, root, (me == root).then_some(&all[..]), &opts),
        )?;
        same("scatter (rounds)", s, all[me].clone())?;
        let outgoing: Vec<_> = (0..n).map(|d| blob(me * 16 + d, tag, lens[d])).collect();
        let incoming = obj(
            "all_to_all",
            objects::all_to_all_with(comm, &outgoing, &opts),
        )?;
        same(
            "all_to_all (rounds)",
            incoming,
            (0..n).map(|s| blob(s * 16 + me, tag, lens[me])).collect(),
        )?;
    }
    Ok(())
}

/// Serializes as a `u32`, or fails when `fail` is set; reads back from a `u32`.
#[derive(Debug, Clone)]
pub(crate) struct FailOn(pub(crate) bool);

impl Serialize for FailOn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 {
            Err(serde::ser::Error::custom("refusing to serialize"))
        } else {
            s.serialize_u32(1)
        }
    }
}

impl<'de> serde::Deserialize<'de> for FailOn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u32::deserialize(d).map(|_| FailOn(false))
    }
}

pub(crate) fn serialization_failure_is_agreed<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let failing = n - 1;
    match objects::all_gather_borrowed(comm, &FailOn(me == failing)) {
        Err(ObjectError::PeerSerialization { ranks, source })
            if ranks == vec![failing] && source.is_some() == (me == failing) => {}
        other => {
            return Err(format!(
                "expected PeerSerialization naming rank {failing}, got {other:?}"
            ))
        }
    }
    // The communicator is still in step afterwards.
    same(
        "all_gather after the failure",
        obj("all_gather", objects::all_gather(comm, &me))?,
        (0..n).collect(),
    )
}

pub(crate) fn cap_violation_is_agreed<C: Communicator>(comm: &C) -> CaseResult {
    let n = comm.size();
    let opts = Options {
        max_total_bytes: 300 * n - 1,
        ..Options::default()
    };
    match objects::all_gather_with(comm, &serde_bytes::ByteBuf::from(vec![0u8; 298]), &opts) {
        Err(ObjectError::TooLarge { rank, .. }) if rank == n - 1 => Ok(()),
        other => Err(format!(
            "expected TooLarge naming rank {}, got {other:?}",
            n - 1
        )),
    }
}

pub(crate) fn work_on_split_sub_groups<C: Communicator>(comm: &C) -> CaseResult {
    let me = comm.rank();
    let sub = crate::ok("split", comm.split(Some((me % 2) as u32), 0))?.ok_or("no sub-group")?;
    let names = obj(
        "all_gather on a sub-group",
        objects::all_gather(&sub, &format!("parent-{me}")),
    )?;
    let want: Vec<String> = (0..comm.size())
        .filter(|r| r % 2 == me % 2)
        .map(|r| format!("parent-{r}"))
        .collect();
    same("sub-group names", names, want)
}

/// Values that take the payload path in several rounds of about 100 bytes.
fn payload_value(rank: usize) -> serde_bytes::ByteBuf {
    blob(rank, 9, 400 + 30 * rank)
}

/// Every rank but 0 passes a different `round_bytes` (unchecked, MPI would return wrong
/// values on some ranks and `MPI_ERR_TRUNCATE` on others): every rank of every collective
/// returns `OptionsMismatch` naming the option and the ranks, and the communicator is still
/// in step afterwards.
pub(crate) fn different_round_bytes_is_an_options_mismatch<C: Communicator>(
    comm: &C,
) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    if n == 1 {
        return Ok(());
    }
    let opts = Options {
        round_bytes: Some(97 + me),
        small_slot_bytes: 16,
        ..Options::default()
    };
    let others: Vec<usize> = (1..n).collect();
    let expect = |what: &str, r: Result<(), ObjectError>| match r {
        Err(ObjectError::OptionsMismatch {
            option: "round_bytes",
            reference: 0,
            ranks,
        }) if ranks == others => Ok(()),
        other => Err(format!(
            "{what}: expected OptionsMismatch on round_bytes naming {others:?}, got {other:?}"
        )),
    };
    let mine = payload_value(me);
    let all: Vec<_> = (0..n).map(payload_value).collect();
    expect(
        "all_gather",
        objects::all_gather_with(comm, &mine, &opts).map(drop),
    )?;
    expect(
        "gather",
        objects::gather_with(comm, 0, &mine, &opts).map(drop),
    )?;
    expect(
        "broadcast",
        objects::broadcast_with(comm, n - 1, (me == n - 1).then_some(&mine), &opts).map(drop),
    )?;
    expect(
        "scatter",
        objects::scatter_with(comm, 0, (me == 0).then_some(&all[..]), &opts).map(drop),
    )?;
    expect(
        "all_to_all",
        objects::all_to_all_with(comm, &all, &opts).map(drop),
    )?;
    same(
        "all_gather after the mismatch",
        obj("all_gather", objects::all_gather(comm, &me))?,
        (0..n).collect(),
    )
}

/// The last rank passes `round_bytes = Some(0)`: it returns `InvalidArgument`, every other
/// rank `PeerInvalidOptions` naming it, nobody waits, and the communicator stays in step.
pub(crate) fn invalid_options_on_one_rank_are_reported_by_every_rank<C: Communicator>(
    comm: &C,
) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let bad = n - 1;
    let opts = Options {
        round_bytes: if me == bad { Some(0) } else { None },
        ..Options::default()
    };
    match objects::all_gather_with(comm, &payload_value(me), &opts) {
        Err(ObjectError::InvalidArgument(_)) if me == bad => {}
        Err(ObjectError::PeerInvalidOptions { ranks }) if me != bad && ranks == vec![bad] => {}
        other => return Err(format!("rank {me}: got {other:?}")),
    }
    same(
        "all_gather after the invalid options",
        obj("all_gather", objects::all_gather(comm, &me))?,
        (0..n).collect(),
    )
}

/// A recursive value, as the hostile rank's crafted bytes claim to be.
#[derive(Debug, Serialize, Deserialize)]
enum Tree {
    Leaf,
    Node(Vec<Tree>),
}

/// Bytes that serialize verbatim (a tuple of `u8`: postcard writes no length).
struct Crafted(Vec<u8>);

impl Serialize for Crafted {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(self.0.len())?;
        for b in &self.0 {
            t.serialize_element(b)?;
        }
        t.end()
    }
}

/// The last rank sends a `Tree` nested 30,000 levels deep (60 KB, which overflowed even an
/// 8 MiB main-thread stack): every other rank returns `Decode { TooDeep }` naming it.
pub(crate) fn deep_nesting_from_a_peer_is_a_decode_error<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let hostile = n - 1;
    if me == hostile {
        let mut bytes = [1u8, 1].repeat(30_000);
        bytes.push(0);
        // The borrowed form sends the value's encoding without decoding anything back.
        objects::all_gather_borrowed(comm, &Crafted(bytes))
            .map(drop)
            .map_err(|e| format!("hostile rank: {e}"))
    } else {
        match objects::all_gather(comm, &Tree::Leaf) {
            Err(ObjectError::Decode {
                rank,
                source: objects::DecodeError::TooDeep { .. },
            }) if rank == hostile => Ok(()),
            other => Err(format!(
                "expected Decode(TooDeep) naming rank {hostile}, got {other:?}"
            )),
        }
    }
}

/// A `u32` whose serialization fails on one rank (decodes as a plain `u32`).
#[derive(Debug, Deserialize)]
struct Counted(u32);

impl Serialize for Counted {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == u32::MAX {
            Err(serde::ser::Error::custom("refusing to serialize"))
        } else {
            s.serialize_u32(self.0)
        }
    }
}

/// `reduce_with`, `scan_with` and `exscan_with` fold in rank order (string concatenation
/// shows the order), and a rank failing to serialize fails each of them on every rank.
pub(crate) fn folds_in_rank_order_with_agreed_failures<C: Communicator>(comm: &C) -> CaseResult {
    let (me, n) = (comm.rank(), comm.size());
    let concat = |a: String, b: String| a + "," + &b;
    let names = |upto: usize| {
        (0..upto)
            .map(|r| format!("r{r}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let mine = format!("r{me}");
    let root = n / 2;
    let reduced = obj(
        "reduce_with",
        objects::reduce_with(comm, root, &mine, concat),
    )?;
    same("reduce_with", reduced, (me == root).then(|| names(n)))?;
    let scanned = obj("scan_with", objects::scan_with(comm, &mine, concat))?;
    same("scan_with", scanned, names(me + 1))?;
    let exscanned = obj("exscan_with", objects::exscan_with(comm, &mine, concat))?;
    same("exscan_with", exscanned, (me > 0).then(|| names(me)))?;

    let failing = n - 1;
    let value = Counted(if me == failing { u32::MAX } else { 1 });
    let add = |a: Counted, b: Counted| Counted(a.0 + b.0);
    let results = [
        objects::reduce_with(comm, 0, &value, add).map(drop),
        objects::scan_with(comm, &value, add).map(drop),
        objects::exscan_with(comm, &value, add).map(drop),
    ];
    for (what, r) in ["reduce_with", "scan_with", "exscan_with"]
        .iter()
        .zip(results)
    {
        match r {
            Err(ObjectError::PeerSerialization { ranks, .. }) if ranks == vec![failing] => {}
            other => {
                return Err(format!(
                    "{what}: expected PeerSerialization naming rank {failing}, got {other:?}"
                ))
            }
        }
    }
    Ok(())
}
