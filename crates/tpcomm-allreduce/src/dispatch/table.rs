//! The dispatch table: for each world size, element type and [`Input`], bands of sizes
//! mapped to what serves them ([`Choice`]); the backends' built-in tables; the checks a
//! table passes against the backend it is used with; its digest, which every rank of a
//! communicator agrees on.

use std::collections::BTreeMap;
use std::fmt;

use super::parse::{TableError, TableProblem, FORMAT_LINE};
use super::{Algorithm, CUDA_ONE_STAGE_MAX_BYTES, MAX_RANKS};
use super::{ONE_STAGE_MAX_BYTES, STAGED_ONE_STAGE_MAX_BYTES};
use crate::dtype::DType;

/// What serves a band of sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    /// The custom all-reduce with this algorithm.
    Custom(Algorithm),
    /// The transport's own all-reduce (`MPI_Allreduce`, NCCL), whose reduction order is its
    /// own: allowed with [`Reproducibility::AnyOrder`] only.
    Transport,
}

impl Choice {
    /// Every choice, in the order a table file names them.
    pub const ALL: [Choice; 3] = [
        Choice::Custom(Algorithm::OneStage),
        Choice::Custom(Algorithm::TwoStage),
        Choice::Transport,
    ];

    /// Its name in a table file: `1stage`, `2stage` or `transport`.
    pub fn name(self) -> &'static str {
        match self {
            Choice::Custom(a) => a.name(),
            Choice::Transport => "transport",
        }
    }

    /// The choice named `name` in a table file.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Where a launch reads its inputs, which decides the rows it takes: the two cost
/// differently (an eager call copies its input into the staging buffer first, and a
/// two-stage one only the parts peers read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Input {
    /// Eager calls: the input copied into the staging buffer (RankData slot 0).
    Staged,
    /// Registered inputs and captured plans, read where they are.
    Registered,
}

impl Input {
    /// Both, in table order.
    pub const ALL: [Input; 2] = [Input::Staged, Input::Registered];

    /// Its name in a table file: `staged` or `registered`.
    pub fn name(self) -> &'static str {
        match self {
            Input::Staged => "staged",
            Input::Registered => "registered",
        }
    }

    /// The input named `name` in a table file.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|i| i.name() == name)
    }
}

/// What the choice of algorithm may change in a result.
///
/// One-stage and two-stage sum every element over the ranks in rank order with f32
/// accumulation, so they give bitwise-identical results, and an element's sum does not
/// depend on the other elements of the call: with [`BitStable`](Self::BitStable) a value's
/// all-reduce has the same bits whatever the size of the call it is part of (the batch),
/// the dispatch table and the timing of the machine. The transport's all-reduce
/// (`MPI_Allreduce`, NCCL) promises no order, and the order it takes can depend on the
/// message size; [`AnyOrder`](Self::AnyOrder) lets the table choose it, giving that
/// property up. Agreed across ranks at creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Reproducibility {
    /// The default: only the custom algorithms serve a call; a table naming `transport` is
    /// refused at creation, and `all_reduce_or_transport` reduces inputs the single launch
    /// cannot take (above `max_bytes`, not a multiple of 16 bytes) in several custom
    /// launches instead of the transport's all-reduce.
    #[default]
    BitStable,
    /// The table may send sizes to the transport's all-reduce, and inputs the custom path
    /// cannot take in one launch go there: results may differ in their last bits between
    /// sizes, batches and machines.
    AnyOrder,
}

impl Reproducibility {
    /// `"bit-stable"` or `"any-order"`.
    pub fn name(self) -> &'static str {
        match self {
            Reproducibility::BitStable => "bit-stable",
            Reproducibility::AnyOrder => "any-order",
        }
    }
}

/// The rows a table holds for one world size, element type and input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// World size, 1 to [`MAX_RANKS`].
    pub ranks: usize,
    /// Element type.
    pub dtype: DType,
    /// Where launches read their inputs.
    pub input: Input,
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ranks, {}, {} inputs",
            self.ranks,
            self.dtype.name(),
            self.input.name()
        )
    }
}

/// Sizes `min..=max` bytes (`max` = `usize::MAX`: no bound, `inf` in a file) and what serves
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Band {
    /// The smallest size of the band.
    pub min: usize,
    /// The largest size of the band (included).
    pub max: usize,
    /// What serves it.
    pub choice: Choice,
    /// The line of the file that gave it (`None` for built-in and built bands).
    pub line: Option<usize>,
}

impl Band {
    /// A band built in code.
    pub fn new(min: usize, max: usize, choice: Choice) -> Self {
        Self {
            min,
            max,
            choice,
            line: None,
        }
    }
}

/// Which algorithm serves each size, per world size, element type and [`Input`]: bands of
/// sizes that start at 0 and follow one another up to no bound.
///
/// Each backend has a built-in table ([`host`](Self::host), [`cuda`](Self::cuda));
/// `tpcomm-bench tune` measures a machine and writes a file ([`load`](Self::load),
/// [`parse`](Self::parse); the format is in `docs/all-reduce.md`, "Dispatch"). A file need
/// not name every key: the backend's built-in rows serve the keys it leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchTable {
    backend: String,
    origin: String,
    keys: BTreeMap<Key, Vec<Band>>,
}

/// Every element type, in table order.
pub(crate) const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

impl DispatchTable {
    /// The host backend's built-in table: [`STAGED_ONE_STAGE_MAX_BYTES`] for eager
    /// (staged) inputs and [`ONE_STAGE_MAX_BYTES`] for registered ones, every element type.
    pub fn host() -> Self {
        Self::from_thresholds(
            "host",
            "the host backend's built-in table",
            &STAGED_ONE_STAGE_MAX_BYTES,
            &ONE_STAGE_MAX_BYTES,
        )
    }

    /// The host thresholds of registered inputs ([`ONE_STAGE_MAX_BYTES`]) for both inputs:
    /// the default of a backend whose launch shapes do not tell staged from registered
    /// inputs apart ([`Backend::shape_includes_slot`](crate::Backend::shape_includes_slot)).
    pub fn host_same_inputs() -> Self {
        Self::from_thresholds(
            "host",
            "the host thresholds for registered inputs, for both inputs",
            &ONE_STAGE_MAX_BYTES,
            &ONE_STAGE_MAX_BYTES,
        )
    }

    /// The CUDA backend's built-in table: [`CUDA_ONE_STAGE_MAX_BYTES`] for both inputs
    /// (its launch shapes leave the RankData slot out, so both must take the same rows).
    pub fn cuda() -> Self {
        Self::from_thresholds(
            "cuda",
            "the CUDA backend's built-in table",
            &CUDA_ONE_STAGE_MAX_BYTES,
            &CUDA_ONE_STAGE_MAX_BYTES,
        )
    }

    /// One-stage up to `staged[ranks]` (`registered[ranks]`) bytes, two-stage above, for
    /// every world size and element type.
    fn from_thresholds(
        backend: &str,
        origin: &str,
        staged: &[usize; MAX_RANKS + 1],
        registered: &[usize; MAX_RANKS + 1],
    ) -> Self {
        let mut keys = BTreeMap::new();
        for ranks in 1..=MAX_RANKS {
            for dtype in DTYPES {
                for input in Input::ALL {
                    let t = match input {
                        Input::Staged => staged[ranks],
                        Input::Registered => registered[ranks],
                    };
                    let one = Choice::Custom(Algorithm::OneStage);
                    let bands = if t == usize::MAX {
                        vec![Band::new(0, usize::MAX, one)]
                    } else {
                        let two = Choice::Custom(Algorithm::TwoStage);
                        vec![Band::new(0, t, one), Band::new(t + 1, usize::MAX, two)]
                    };
                    keys.insert(
                        Key {
                            ranks,
                            dtype,
                            input,
                        },
                        bands,
                    );
                }
            }
        }
        Self {
            backend: backend.into(),
            origin: origin.into(),
            keys,
        }
    }

    /// A table for `backend` from bands built in code (the tuner's), checked as a file's
    /// rows are: each key's bands start at 0, follow one another and end with no bound.
    /// `origin` names it in messages.
    pub fn from_bands(
        backend: &str,
        origin: &str,
        bands: impl IntoIterator<Item = (Key, Vec<Band>)>,
    ) -> Result<Self, TableError> {
        let keys: BTreeMap<Key, Vec<Band>> = bands.into_iter().collect();
        for (key, bands) in &keys {
            check_bands(origin, key, bands)?;
        }
        Ok(Self {
            backend: backend.into(),
            origin: origin.into(),
            keys,
        })
    }

    /// Assembles a parsed table (its bands checked by the parser).
    pub(super) fn assemble(
        backend: String,
        origin: String,
        keys: BTreeMap<Key, Vec<Band>>,
    ) -> Self {
        Self {
            backend,
            origin,
            keys,
        }
    }

    /// The backend the table is for (`"host"`, `"cuda"`).
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Where the table comes from: a file's path, or which built-in table it is.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The keys the table has rows for, in order.
    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.keys.keys()
    }

    /// The bands of `key`, if the table has rows for it.
    pub fn bands(&self, key: &Key) -> Option<&[Band]> {
        self.keys.get(key).map(Vec::as_slice)
    }

    /// What serves `bytes` of `dtype` on `ranks` ranks from `input`, if the table has rows
    /// for that key.
    pub fn choice(&self, ranks: usize, dtype: DType, input: Input, bytes: usize) -> Option<Choice> {
        let key = Key {
            ranks,
            dtype,
            input,
        };
        self.keys
            .get(&key)?
            .iter()
            .find(|b| b.min <= bytes && bytes <= b.max)
            .map(|b| b.choice)
    }

    /// This table's rows, and `base`'s for every key this table leaves out (a file over
    /// its backend's built-in table); the origin stays this table's.
    pub fn over(&self, base: &DispatchTable) -> DispatchTable {
        let mut keys = base.keys.clone();
        keys.extend(self.keys.iter().map(|(k, b)| (*k, b.clone())));
        Self {
            backend: self.backend.clone(),
            origin: self.origin.clone(),
            keys,
        }
    }

    /// The rows for `ranks` ranks only.
    pub fn for_ranks(&self, ranks: usize) -> DispatchTable {
        Self {
            backend: self.backend.clone(),
            origin: self.origin.clone(),
            keys: self
                .keys
                .iter()
                .filter(|(k, _)| k.ranks == ranks)
                .map(|(k, b)| (*k, b.clone()))
                .collect(),
        }
    }

    /// A 64-bit digest of the rows (FNV-1a of [`Display`](fmt::Display)'s text): equal for
    /// equal rows whatever the origin, comments and spacing of their files. Every rank of a
    /// communicator agrees on it at creation.
    pub fn digest(&self) -> u64 {
        self.to_string()
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
    }

    /// The first band that names the transport's all-reduce, with its key.
    pub fn transport_band(&self) -> Option<(&Key, &Band)> {
        self.keys
            .iter()
            .flat_map(|(k, bands)| bands.iter().map(move |b| (k, b)))
            .find(|(_, b)| b.choice == Choice::Transport)
    }

    /// Fails unless the table is for the backend named `backend` (a file names the backend
    /// it was measured for).
    pub fn check_backend(&self, backend: &str) -> Result<(), TableError> {
        if self.backend == backend {
            return Ok(());
        }
        Err(TableError {
            origin: self.origin.clone(),
            line: None,
            problem: TableProblem::OtherBackend {
                table: self.backend.clone(),
                backend: backend.into(),
            },
        })
    }

    /// Checks the table against the backend `backend` it is used with: the algorithms it
    /// has, whether its launch shapes tell staged from registered inputs apart (if not,
    /// both inputs must take the same rows: ranks whose inputs differ would otherwise run
    /// different algorithms unnoticed), and whether the transport's all-reduce is allowed.
    pub fn check_for(
        &self,
        backend: &str,
        algorithms: &[Algorithm],
        inputs_apart: bool,
        reproducibility: Reproducibility,
    ) -> Result<(), TableError> {
        let err = |line: Option<usize>, problem| TableError {
            origin: self.origin.clone(),
            line,
            problem,
        };
        for (key, bands) in &self.keys {
            for band in bands {
                match band.choice {
                    Choice::Custom(a) if !algorithms.contains(&a) => {
                        return Err(err(
                            band.line,
                            TableProblem::NoSuchAlgorithm {
                                key: key.to_string(),
                                backend: backend.into(),
                                algorithm: a.name(),
                            },
                        ));
                    }
                    Choice::Transport if reproducibility == Reproducibility::BitStable => {
                        return Err(err(
                            band.line,
                            TableProblem::TransportNotAllowed {
                                key: key.to_string(),
                            },
                        ));
                    }
                    _ => {}
                }
            }
            if !inputs_apart && key.input == Input::Registered {
                let staged = Key {
                    input: Input::Staged,
                    ..*key
                };
                let other = self.keys.get(&staged);
                if other.map(|o| same_bands(o, bands)) == Some(false) {
                    let line = bands.iter().find_map(|b| b.line);
                    return Err(err(
                        line,
                        TableProblem::InputsDiffer {
                            key: key.to_string(),
                            backend: backend.into(),
                        },
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Whether two lists of bands cover the same sizes with the same choices (lines aside).
fn same_bands(a: &[Band], b: &[Band]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x.min, x.max, x.choice) == (y.min, y.max, y.choice))
}

/// Checks that `bands` start at 0, follow one another without gap or overlap and end with no
/// bound; the error names the band's line.
pub(super) fn check_bands(origin: &str, key: &Key, bands: &[Band]) -> Result<(), TableError> {
    let err = |line, problem| TableError {
        origin: origin.into(),
        line,
        problem,
    };
    let mut expected = Some(0usize);
    let mut unbounded_at = None;
    for band in bands {
        if band.min > band.max {
            return Err(err(
                band.line,
                TableProblem::Inverted {
                    min: band.min,
                    max: band.max,
                },
            ));
        }
        let Some(start) = expected else {
            return Err(err(
                band.line,
                TableProblem::AfterUnbounded {
                    key: key.to_string(),
                    unbounded_line: unbounded_at,
                },
            ));
        };
        if band.min != start {
            return Err(err(
                band.line,
                TableProblem::NotContiguous {
                    key: key.to_string(),
                    min: band.min,
                    expected: start,
                },
            ));
        }
        expected = band.max.checked_add(1);
        if expected.is_none() {
            unbounded_at = band.line;
        }
    }
    match (expected, bands.last()) {
        (None, _) => Ok(()),
        (Some(_), last) => Err(err(
            last.and_then(|b| b.line),
            TableProblem::NotCovering {
                key: key.to_string(),
                max: last.map(|b| b.max),
            },
        )),
    }
}

/// A size as a table file writes it: bytes, or `inf` for no bound.
pub(super) fn size_text(bytes: usize) -> String {
    if bytes == usize::MAX {
        "inf".into()
    } else {
        bytes.to_string()
    }
}

/// The table as a file holds it: the format line, the backend, then one row per band
/// (sizes in bytes), keys in order.
impl fmt::Display for DispatchTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{FORMAT_LINE}")?;
        writeln!(f, "backend {}", self.backend)?;
        writeln!(f, "# ranks dtype input min_bytes max_bytes algorithm")?;
        for (key, bands) in &self.keys {
            for band in bands {
                writeln!(
                    f,
                    "{} {} {} {} {} {}",
                    key.ranks,
                    key.dtype.name(),
                    key.input.name(),
                    band.min,
                    size_text(band.max),
                    band.choice.name()
                )?;
            }
        }
        Ok(())
    }
}
