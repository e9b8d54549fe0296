//! `tpcomm-bench tune`: measures every algorithm of the host custom all-reduce on the
//! machine it runs on, and the transport's own all-reduce as a candidate, and writes a
//! dispatch table file (`tpcomm_allreduce::dispatch`, format in `docs/all-reduce.md`,
//! "Dispatch") that `Config::dispatch` or `TPCOMM_DISPATCH_TABLE` hands to the all-reduce.
//!
//! Per element type and size, five variants are timed interleaved (the engine's loop, each
//! iteration lined up by the spinning 16-byte all-reduce), every one verified first on
//! exact integer data:
//!
//! - `staged 1stage`, `staged 2stage`: eager `all_reduce` of a slice (the input copied into
//!   the staging buffer), forced to one algorithm: the rows of `staged` inputs;
//! - `registered 1stage`, `registered 2stage`: `all_reduce_registered` of a registered
//!   buffer (zero-copy, what captured plans replay too): the rows of `registered` inputs;
//! - `transport` (the peer): the transport's all-reduce, as `all_reduce_or_transport` would
//!   call it (`Communicator::all_reduce`); under MPI for f32 the plain `MPI_Allreduce` on
//!   `MPI_COMM_WORLD`, timed as a C loop times it (an `MPI_Barrier`, then the call).
//!
//! Each measured size picks the fastest candidate, or the previous size's pick when that
//! one is within [`TIE`] of the fastest (so that noise does not cut bands); a size's pick
//! serves the sizes from just above the previous measured size up to it, the smallest
//! size's from 0, the largest size's to no bound. By default the candidates are the two
//! custom algorithms, which give the same bits (`Reproducibility::BitStable`);
//! `--allow-transport` adds the transport for staged inputs, and a table that uses it
//! needs `Reproducibility::AnyOrder`. The file holds rows for this run's world size and
//! element types only: the backend's built-in rows serve the rest.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;
use tpcomm::allreduce::dispatch::{Band, Choice, DispatchTable, Input, Key, Reproducibility};
use tpcomm::allreduce::HostBackend;
use tpcomm::allreduce::{Algorithm, Config, DType, Element, RegisteredInput};
use tpcomm::ipc::PeerMemory;
use tpcomm::Communicator;

use crate::data::elements::{check, expected, input, with_element};
use crate::engine::error::BenchError;
use crate::engine::launch::{Bench, RunArgs};
use crate::engine::lineup::{new_all_reduce, new_sync, time_synced, HostAllReduce};
use crate::engine::options::DTypeArg;
use crate::engine::report::Machine;
use crate::engine::row::{Bus, Row};
use crate::engine::session::Session;
use crate::engine::sweep::{format_bytes, SweepArgs};
use crate::engine::table::{col, Column};
use crate::engine::timing::{elapsed_ns, Spec};
use crate::peers::mpi_world::MpiWorld;

/// The variants, in table order: (input, algorithm), then the transport.
const VARIANTS: [&str; 5] = [
    "staged 1stage",
    "staged 2stage",
    "registered 1stage",
    "registered 2stage",
    TRANSPORT,
];
/// The transport's all-reduce: the peer of every row.
const TRANSPORT: &str = "transport";
/// A size keeps the previous size's pick while that one is within this fraction of the
/// fastest candidate (medians closer than that are noise on a shared machine).
const TIE: f64 = 0.02;

/// Options of `tpcomm-bench tune`.
#[derive(Debug, Clone, Args, Serialize)]
#[command(mut_arg("min_bytes", |a| a.default_value("1KiB")))]
#[command(mut_arg("max_bytes", |a| a.default_value("8MiB")))]
pub(crate) struct TuneArgs {
    /// Ranks at most 8 (the table's rows are for this world size).
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) run: RunArgs,

    /// Element types, comma-separated: one set of rows each.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "f32,f16,bf16",
        value_name = "DTYPES"
    )]
    pub(crate) dtypes: Vec<DTypeArg>,

    /// Sizes measured (multiples of 16 bytes); the largest also sizes the staging buffers.
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) sweep: SweepArgs,

    /// The table file written (by rank 0).
    #[arg(long, default_value = "tpcomm-dispatch.txt", value_name = "FILE")]
    pub(crate) out: PathBuf,

    /// Let the table send staged sizes to the transport's all-reduce where it is faster:
    /// such a table needs `Reproducibility::AnyOrder` (results then depend on the size of a
    /// call in their last bits).
    #[arg(long)]
    pub(crate) allow_transport: bool,
}

const COLUMNS: [Column; 8] = [
    col::size(10),
    Column::fact("type", "", 5, "type"),
    col::variant("variant", 18),
    col::iters(),
    col::time::<2>("time", 10),
    col::min::<2>(10),
    col::busbw(7),
    col::vs_peer("vs transport", "t/transport", 12),
];

/// What a rank runs the candidates with.
struct Tuner<'r> {
    /// Forced one-stage and two-stage, each with a registered buffer of the largest size.
    instances: [(HostAllReduce, RegisteredInput<HostBackend>); 2],
    mpi: Option<&'r MpiWorld>,
}

impl Tuner<'_> {
    /// Writes this rank's input into both registered buffers (untimed: a registered input
    /// is written by the caller's own work).
    fn place<T: Element>(&self, data: &[T]) -> Result<(), BenchError> {
        for (ar, token) in &self.instances {
            ar.memory()?
                .write(token.buffer(), 0, bytemuck::cast_slice(data))?;
        }
        Ok(())
    }

    /// Runs variant `v` once on `input` into `output`; with `timed` (the MPI peer), its
    /// own time from just before its call.
    fn run<T, C>(
        &mut self,
        comm: &C,
        v: usize,
        (input, output): (&[T], &mut [T]),
        timed: bool,
    ) -> Result<u64, BenchError>
    where
        T: Element + tpcomm::transport::reduce::Element,
        C: Communicator,
    {
        match v {
            0 | 1 => {
                self.instances[v].0.all_reduce(input, output)?;
            }
            2 | 3 => {
                let (ar, token) = &mut self.instances[v - 2];
                ar.all_reduce_registered(token, output)?;
            }
            _ => match (self.mpi, <T as Element>::DTYPE) {
                (Some(mpi), DType::F32) => {
                    let (input, output) = (
                        bytemuck::cast_slice(input),
                        bytemuck::cast_slice_mut(output),
                    );
                    return mpi.all_reduce_sum(input, output, timed);
                }
                _ => {
                    let start = std::time::Instant::now();
                    comm.all_reduce(input, output, tpcomm::ReduceOp::Sum)?;
                    return Ok(elapsed_ns(start));
                }
            },
        }
        Ok(0)
    }
}

/// Whether variant `v` of `dtype` times itself after an `MPI_Barrier` (the MPI peer).
fn times_itself(mpi: bool, dtype: DType, v: usize) -> bool {
    mpi && dtype == DType::F32 && VARIANTS[v] == TRANSPORT
}

impl Bench for TuneArgs {
    const NAME: &'static str = "tune";

    fn run_args(&self) -> &RunArgs {
        &self.run
    }

    fn validate(&self) -> Result<(), BenchError> {
        self.sweep.validate()?;
        self.run.at_most(8)?;
        if !self.sweep.min_bytes.is_multiple_of(16) || self.dtypes.is_empty() {
            return Err(BenchError::Usage(
                "--min-bytes must be a multiple of 16 bytes and --dtypes name at least one \
                 type"
                    .into(),
            ));
        }
        crate::engine::report::check_writable(&self.out)
    }

    fn preamble(&self, mpi: bool) -> Vec<String> {
        vec![
            format!(
                "tune: the host custom all-reduce's algorithms on this machine, {}",
                self.sweep.describe()
            ),
            "staged 1stage / 2stage: eager all_reduce of a slice (copied into the staging \
             buffer), forced; registered 1stage / 2stage: all_reduce_registered (zero-copy)"
                .into(),
            if mpi {
                "transport (the peer): MPI_Allreduce (f32: the plain call on MPI_COMM_WORLD, \
                 timed after an MPI_Barrier as a C loop times it; f16/bf16: tpcomm's MPI \
                 transport, widened to f32)"
                    .into()
            } else {
                "transport (the peer): the threads transport's all-reduce".into()
            },
            format!(
                "each size picks the fastest of {} (the previous size's pick while within {:.0}% \
                 of it); the table goes to {}",
                if self.allow_transport {
                    "1stage, 2stage and, for staged inputs, the transport"
                } else {
                    "1stage and 2stage (bit-stable)"
                },
                TIE * 100.0,
                self.out.display()
            ),
        ]
    }

    fn measure<C: Communicator>(&self, comm: &C, s: &mut Session<'_>) -> Result<(), BenchError> {
        let mpi = MpiWorld::for_run(s.info);
        let sizes = self.sweep.sizes();
        let max_bytes = sizes.last().copied().unwrap_or(self.sweep.max_bytes);
        let instance = |algorithm| -> Result<_, BenchError> {
            let config = Config {
                max_bytes,
                algorithm: Some(algorithm),
                // What is measured must not depend on a table file in the environment.
                dispatch: Some(DispatchTable::host()),
                ..Config::default()
            };
            let mut ar = new_all_reduce(comm, config)?;
            let buffer = ar.memory()?.allocate(max_bytes)?;
            let token = ar
                .register_buffer(comm, buffer)
                .map_err(|refused| refused.into_error())?;
            Ok((ar, token))
        };
        let instances = [
            instance(Algorithm::OneStage)?,
            instance(Algorithm::TwoStage)?,
        ];
        let mut tuner = Tuner {
            instances,
            mpi: mpi.as_ref(),
        };
        let mut sync = new_sync(comm)?;
        s.progress.plan(self.dtypes.len() * sizes.len());
        let mut picks = Vec::new();
        for (di, &d) in self.dtypes.iter().enumerate() {
            let dtype = d.dtype();
            s.header(
                &format!(
                    "tune, {}, {} ranks: every candidate per size; vs transport = time / \
                     the transport's",
                    dtype.name(),
                    comm.size()
                ),
                &COLUMNS,
            );
            for (si, &bytes) in sizes.iter().enumerate() {
                let salt = ((di as u64) << 40) ^ ((si as u64) << 20) ^ 0x70e5;
                let tuning = (&mut tuner, &mut sync);
                let rows =
                    with_element!(dtype, T => measure_size::<T, C>(s, comm, tuning, bytes, salt))?;
                if s.prints() {
                    picks.push(Measured::of(comm.size(), dtype, bytes, &rows));
                }
                s.rows(&COLUMNS, rows, |_| true);
            }
        }
        if s.prints() {
            self.write_table(s, comm.size(), &picks)?;
        }
        for (ar, token) in tuner.instances {
            let mut ar = ar;
            drop(ar.unregister(comm, token).map_err(|r| r.into_error())?);
            ar.close_with(comm)?;
        }
        Ok(())
    }
}

/// Verifies every candidate at `bytes` of `T`, then times them interleaved; the rows.
fn measure_size<T, C>(
    s: &Session<'_>,
    comm: &C,
    (tuner, sync): (&mut Tuner<'_>, &mut HostAllReduce),
    bytes: usize,
    salt: u64,
) -> Result<Vec<Row>, BenchError>
where
    T: Element + tpcomm::transport::reduce::Element,
    C: Communicator,
{
    let (rank, ranks) = (comm.rank(), comm.size());
    let count = bytes / <T as Element>::DTYPE.size();
    let name = <T as Element>::DTYPE.name();
    let mpi = tuner.mpi.is_some();
    let spec = Spec {
        peer: Some(TRANSPORT),
        bus: Some(Bus::AllReduce),
        ..Spec::new(name, bytes.to_string(), bytes, &VARIANTS).with("type", name)
    };
    let mut data = (input::<T>(rank, count, salt), vec![T::from_f32(0.0); count]);
    s.verify(comm, &spec, &mut data, |(inp, out), v| {
        let salt = salt ^ ((v as u64) << 56);
        *inp = input(rank, count, salt);
        out.fill(T::from_f32(f32::NAN));
        tuner.place(inp)?;
        tuner.run(comm, v, (inp, out), false)?;
        Ok(check(out, &expected(ranks, count, salt)))
    })?;
    tuner.place(&data.0)?;
    s.measure(comm, &spec, &mut data, |(inp, out), v| {
        if times_itself(mpi, <T as Element>::DTYPE, v) {
            let mut ns = 0;
            time_synced(comm, sync, || {
                ns = tuner.run(comm, v, (inp, out), true)?;
                Ok(())
            })?;
            return Ok(ns);
        }
        time_synced(comm, sync, || {
            tuner.run(comm, v, (inp, out), false).map(drop)
        })
    })
}

/// One measured size of one element type: each candidate's median (us) per input.
#[derive(Debug, Clone)]
struct Measured {
    ranks: usize,
    dtype: DType,
    bytes: usize,
    /// Per input: (choice, median) of each candidate measured.
    candidates: [Vec<(Choice, f64)>; 2],
}

impl Measured {
    /// From the rows of one size.
    fn of(ranks: usize, dtype: DType, bytes: usize, rows: &[Row]) -> Self {
        let median = |variant: &str| {
            rows.iter()
                .find(|r| r.is(variant))
                .map(|r| r.stats.median_us)
        };
        let custom = |input: &str| -> Vec<(Choice, f64)> {
            Algorithm::ALL
                .iter()
                .filter_map(|&a| {
                    let m = median(&format!("{input} {}", a.name()))?;
                    Some((Choice::Custom(a), m))
                })
                .collect()
        };
        let mut staged = custom("staged");
        if let Some(t) = median(TRANSPORT) {
            staged.push((Choice::Transport, t));
        }
        Self {
            ranks,
            dtype,
            bytes,
            candidates: [staged, custom("registered")],
        }
    }
}

/// The bands of one key from its measured sizes (ascending): each size's pick serves the
/// sizes above the previous measured size up to it (the first from 0, the last to no
/// bound); `allowed` filters the candidates. A size keeps the previous pick while it is
/// within [`TIE`] of the fastest. Adjacent bands of one pick are merged.
fn bands(points: &[(usize, &[(Choice, f64)])], allowed: impl Fn(Choice) -> bool) -> Vec<Band> {
    let mut out: Vec<Band> = Vec::new();
    let mut previous: Option<Choice> = None;
    for (i, &(bytes, candidates)) in points.iter().enumerate() {
        let usable: Vec<(Choice, f64)> = candidates
            .iter()
            .copied()
            .filter(|&(c, m)| allowed(c) && m.is_finite())
            .collect();
        let Some(&(best, fastest)) = usable.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else {
            continue;
        };
        let kept = previous.filter(|p| {
            usable
                .iter()
                .any(|&(c, m)| c == *p && m <= fastest * (1.0 + TIE))
        });
        let pick = kept.unwrap_or(best);
        previous = Some(pick);
        let max = if i + 1 == points.len() {
            usize::MAX
        } else {
            bytes
        };
        match out.last_mut() {
            Some(last) if last.choice == pick => last.max = max,
            Some(last) => {
                let min = last.max + 1;
                out.push(Band::new(min, max, pick));
            }
            None => out.push(Band::new(0, max, pick)),
        }
    }
    out
}

impl TuneArgs {
    /// Rank 0: the table from every measured size, its comment lines (the machine, each
    /// size's medians and pick), written to `--out` and printed.
    fn write_table(
        &self,
        s: &mut Session<'_>,
        ranks: usize,
        measured: &[Measured],
    ) -> Result<(), BenchError> {
        let allow = self.allow_transport;
        let mut keys = Vec::new();
        let mut comments = vec![
            "# written by tpcomm-bench tune: the host custom all-reduce measured on".into(),
            format!("#   {}", Machine::current().describe()),
            format!(
                "#   {ranks} ranks ({}), {}; command: {}",
                s.info.transport,
                self.sweep.describe(),
                std::env::args().collect::<Vec<_>>().join(" ")
            ),
            format!(
                "# candidates: 1stage, 2stage{}; medians in us per size",
                if allow {
                    ", transport (staged inputs)"
                } else {
                    " (bit-stable: the transport's all-reduce is only measured)"
                }
            ),
        ];
        for &dtype in &self.dtypes.iter().map(|d| d.dtype()).collect::<Vec<_>>() {
            let of_type: Vec<&Measured> = measured.iter().filter(|m| m.dtype == dtype).collect();
            for (index, input) in Input::ALL.into_iter().enumerate() {
                let points: Vec<(usize, &[(Choice, f64)])> = of_type
                    .iter()
                    .map(|m| (m.bytes, m.candidates[index].as_slice()))
                    .collect();
                let allowed =
                    |c: Choice| c != Choice::Transport || (allow && input == Input::Staged);
                let key_bands = bands(&points, allowed);
                for m in &of_type {
                    let figures: Vec<String> = m.candidates[index]
                        .iter()
                        .map(|(c, t)| format!("{} {t:.2}", c.name()))
                        .collect();
                    let pick = key_bands
                        .iter()
                        .find(|b| b.min <= m.bytes && m.bytes <= b.max)
                        .map_or("-", |b| b.choice.name());
                    comments.push(format!(
                        "# {} {} {} {}: {} -> {pick}",
                        m.ranks,
                        dtype.name(),
                        input.name(),
                        format_bytes(m.bytes),
                        figures.join(", ")
                    ));
                }
                if !key_bands.is_empty() {
                    keys.push((
                        Key {
                            ranks,
                            dtype,
                            input,
                        },
                        key_bands,
                    ));
                }
            }
        }
        let origin = self.out.display().to_string();
        let table = DispatchTable::from_bands("host", &origin, keys)
            .map_err(|e| BenchError::Usage(format!("the tuned table does not check: {e}")))?;
        if table.transport_band().is_some() {
            comments.push(format!(
                "# uses the transport's all-reduce: needs Reproducibility::{:?}",
                Reproducibility::AnyOrder
            ));
        }
        let text = format!("{}\n{table}", comments.join("\n"));
        // What is written reads back as the same table.
        let back = DispatchTable::parse(&text, &origin)
            .map_err(|e| BenchError::Usage(format!("the tuned table does not read back: {e}")))?;
        debug_assert_eq!(back.digest(), table.digest());
        std::fs::write(&self.out, &text).map_err(|source| BenchError::Write {
            path: self.out.clone(),
            source,
        })?;
        s.note("");
        for line in table.to_string().lines().filter(|l| !l.starts_with('#')) {
            s.note(line);
        }
        s.summary(format!(
            "dispatch table for {ranks} ranks written to {} (digest {:016x}): use it with \
             TPCOMM_DISPATCH_TABLE={} or Config::dispatch",
            self.out.display(),
            back.digest(),
            self.out.display()
        ));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: Choice = Choice::Custom(Algorithm::OneStage);
    const TWO: Choice = Choice::Custom(Algorithm::TwoStage);

    fn picks(points: &[(usize, Vec<(Choice, f64)>)], allow: bool) -> Vec<(usize, usize, Choice)> {
        let points: Vec<(usize, &[(Choice, f64)])> =
            points.iter().map(|(b, c)| (*b, c.as_slice())).collect();
        bands(&points, |c| allow || c != Choice::Transport)
            .into_iter()
            .map(|b| (b.min, b.max, b.choice))
            .collect()
    }

    #[test]
    fn each_size_serves_up_to_itself_and_the_largest_to_no_bound() {
        let points = vec![
            (1024, vec![(ONE, 1.0), (TWO, 2.0)]),
            (8192, vec![(ONE, 5.0), (TWO, 4.0)]),
            (65536, vec![(ONE, 30.0), (TWO, 20.0)]),
        ];
        assert_eq!(
            picks(&points, false),
            vec![(0, 1024, ONE), (1025, usize::MAX, TWO)]
        );
    }

    #[test]
    fn a_pick_within_the_tie_of_the_fastest_is_kept_and_the_transport_only_when_allowed() {
        let points = vec![
            (1024, vec![(ONE, 1.0), (TWO, 2.0), (Choice::Transport, 0.5)]),
            // Two-stage 1% faster: noise, one-stage stays.
            (
                8192,
                vec![(ONE, 4.04), (TWO, 4.0), (Choice::Transport, 9.0)],
            ),
            (
                65536,
                vec![(ONE, 30.0), (TWO, 20.0), (Choice::Transport, 25.0)],
            ),
        ];
        assert_eq!(
            picks(&points, false),
            vec![(0, 8192, ONE), (8193, usize::MAX, TWO)]
        );
        assert_eq!(
            picks(&points, true),
            vec![(0, 1024, Choice::Transport), (1025, usize::MAX, TWO)]
        );
    }

    #[test]
    fn the_bands_it_writes_make_a_table_that_checks() {
        let points = [
            (1024, vec![(ONE, 1.0), (TWO, 2.0)]),
            (2048, vec![(ONE, 3.0), (TWO, 2.0)]),
            (4096, vec![(ONE, 3.0), (TWO, 4.0)]),
        ];
        let p: Vec<(usize, &[(Choice, f64)])> =
            points.iter().map(|(b, c)| (*b, c.as_slice())).collect();
        let key = Key {
            ranks: 2,
            dtype: DType::F32,
            input: Input::Staged,
        };
        let table = DispatchTable::from_bands("host", "t", [(key, bands(&p, |_| true))]).unwrap();
        assert_eq!(table.choice(2, DType::F32, Input::Staged, 1024), Some(ONE));
        assert_eq!(table.choice(2, DType::F32, Input::Staged, 2048), Some(TWO));
        assert_eq!(
            table.choice(2, DType::F32, Input::Staged, 1 << 30),
            Some(ONE)
        );
    }
}
