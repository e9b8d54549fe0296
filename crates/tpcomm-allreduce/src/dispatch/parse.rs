//! The dispatch table's file format: line-based text, read by [`DispatchTable::parse`] and
//! [`DispatchTable::load`] (or through [`DISPATCH_TABLE_ENV`]), written by the table's
//! `Display`. Every error names the file and the line.
//!
//! ```text
//! # comments and blank lines anywhere
//! tpcomm-dispatch 1                 # the format line, first
//! backend host                      # the backend the rows were measured for
//! # ranks dtype input  min   max  algorithm
//! 2       f32   staged 0     4KiB 1stage
//! 2       f32   staged 4097  inf  2stage
//! *       *     *      0     inf  1stage   # `*`: every world size / type / input
//! ```
//!
//! A row gives the bands of sizes `min..=max` (bytes, with an optional `K`/`KiB`, `M`/`MiB`
//! or `G`/`GiB` suffix, powers of 1024; `max` may be `inf`) of one or more keys; each key's
//! bands, in file order, must start at 0, follow one another and end at `inf`. Algorithms:
//! `1stage`, `2stage`, `transport` (the transport's own all-reduce).

use std::collections::BTreeMap;
use std::path::Path;

use super::table::{check_bands, Band, Choice, DispatchTable, Input, Key, DTYPES};
use super::MAX_RANKS;

/// The first line of every table file (format version 1).
pub const FORMAT_LINE: &str = "tpcomm-dispatch 1";

/// The environment variable naming a table file that `CustomAllReduce::new` loads when its
/// `Config` names no table (as NCCL's tuner plugins read `NCCL_TUNER_CONFIG_FILE`).
pub const DISPATCH_TABLE_ENV: &str = "TPCOMM_DISPATCH_TABLE";

/// A table that cannot be read or used: where (the file, the line) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dispatch table {origin}{}: {problem}", line.map(|l| format!(", line {l}")).unwrap_or_default())]
pub struct TableError {
    /// The file's path, or what the table is.
    pub origin: String,
    /// The line (from 1), where one line is at fault.
    pub line: Option<usize>,
    /// What is wrong.
    pub problem: TableProblem,
}

/// What is wrong with a dispatch table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TableProblem {
    /// The file could not be read.
    #[error("cannot read it: {0}")]
    Read(String),
    /// The first line that is not a comment is not [`FORMAT_LINE`].
    #[error("the first line must be `{FORMAT_LINE}`, not {found:?}")]
    Format {
        /// What the line holds.
        found: String,
    },
    /// The `backend NAME` line is missing (before the first row) or repeated.
    #[error("the table names its backend once, in a `backend NAME` line before its rows")]
    Backend,
    /// A row without its six fields.
    #[error("a row has 6 fields (ranks dtype input min max algorithm), this one has {0}")]
    Fields(usize),
    /// A field that holds no value of its column.
    #[error("{column} {value:?} is not {expected}")]
    Field {
        /// The column.
        column: &'static str,
        /// What the row holds.
        value: String,
        /// What the column takes.
        expected: &'static str,
    },
    /// A band whose `min` is above its `max`.
    #[error("the band {min}..={max} ends before it starts")]
    Inverted {
        /// Its first size.
        min: usize,
        /// Its last size.
        max: usize,
    },
    /// A band that leaves a gap after the band before it, or overlaps it.
    #[error("{key}: this band starts at {min}, where it should start at {expected} (a key's bands go in order from 0, without gap or overlap)")]
    NotContiguous {
        /// The key.
        key: String,
        /// Where the band starts.
        min: usize,
        /// Where it must start.
        expected: usize,
    },
    /// A band after one that already reaches `inf`.
    #[error("{key}: every size already has an algorithm{}", unbounded_line.map(|l| format!(" (line {l} reaches inf)")).unwrap_or_default())]
    AfterUnbounded {
        /// The key.
        key: String,
        /// The line of the band that reaches `inf`.
        unbounded_line: Option<usize>,
    },
    /// The bands of a key stop before `inf`.
    #[error("{key}: the bands end at {}, so larger sizes have no algorithm (the last band's max must be `inf`)", max.map_or_else(|| "nothing".to_string(), |m| m.to_string()))]
    NotCovering {
        /// The key.
        key: String,
        /// Where its last band ends.
        max: Option<usize>,
    },
    /// The table is for another backend.
    #[error("it is for the {table} backend, not the {backend} backend")]
    OtherBackend {
        /// The table's.
        table: String,
        /// The communicator's.
        backend: String,
    },
    /// An algorithm the backend does not have.
    #[error("{key}: the {backend} backend has no {algorithm} algorithm")]
    NoSuchAlgorithm {
        /// The key.
        key: String,
        /// The backend.
        backend: String,
        /// The algorithm.
        algorithm: &'static str,
    },
    /// `transport` under [`Reproducibility::BitStable`](super::Reproducibility::BitStable).
    #[error("{key}: `transport` gives up bit-stable results (the transport's reduction order is its own); allow it with Reproducibility::AnyOrder")]
    TransportNotAllowed {
        /// The key.
        key: String,
    },
    /// Different bands for staged and registered inputs on a backend whose launches do not
    /// tell them apart.
    #[error("{key}: the {backend} backend's launches do not tell staged from registered inputs apart, so both must take the same bands")]
    InputsDiffer {
        /// The key.
        key: String,
        /// The backend.
        backend: String,
    },
}

impl DispatchTable {
    /// Reads a table file (format in `docs/all-reduce.md`, "Dispatch"); errors name `path`
    /// and the line.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, TableError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TableError {
            origin: origin.clone(),
            line: None,
            problem: TableProblem::Read(e.to_string()),
        })?;
        Self::parse(&text, &origin)
    }

    /// The table file named by [`DISPATCH_TABLE_ENV`], if it is set (and not empty).
    pub fn from_env() -> Result<Option<Self>, TableError> {
        match std::env::var_os(DISPATCH_TABLE_ENV) {
            Some(path) if !path.is_empty() => Self::load(path).map(Some),
            _ => Ok(None),
        }
    }

    /// Parses a table's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, TableError> {
        let err = |line: usize, problem| TableError {
            origin: origin.into(),
            line: Some(line),
            problem,
        };
        let mut format_seen = false;
        let mut backend: Option<String> = None;
        let mut keys: BTreeMap<Key, Vec<Band>> = BTreeMap::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let content = raw.split('#').next().unwrap_or_default().trim();
            if content.is_empty() {
                continue;
            }
            if !format_seen {
                if content.split_whitespace().collect::<Vec<_>>().join(" ") != FORMAT_LINE {
                    let found = content.to_string();
                    return Err(err(line, TableProblem::Format { found }));
                }
                format_seen = true;
                continue;
            }
            let fields: Vec<&str> = content.split_whitespace().collect();
            if fields[0] == "backend" {
                if backend.is_some() || fields.len() != 2 {
                    return Err(err(line, TableProblem::Backend));
                }
                backend = Some(fields[1].to_string());
                continue;
            }
            if backend.is_none() {
                return Err(err(line, TableProblem::Backend));
            }
            let [ranks, dtype, input, min, max, algorithm] = fields[..] else {
                return Err(err(line, TableProblem::Fields(fields.len())));
            };
            let field = |column, value: &str, expected| {
                err(
                    line,
                    TableProblem::Field {
                        column,
                        value: value.into(),
                        expected,
                    },
                )
            };
            let ranks: Vec<usize> = match ranks {
                "*" => (1..=MAX_RANKS).collect(),
                n => match n.parse::<usize>() {
                    Ok(n) if (1..=MAX_RANKS).contains(&n) => vec![n],
                    _ => return Err(field("ranks", n, "a world size from 1 to 8, or *")),
                },
            };
            let dtypes: Vec<_> = match dtype {
                "*" => DTYPES.to_vec(),
                d => match DTYPES.into_iter().find(|t| t.name() == d) {
                    Some(t) => vec![t],
                    None => return Err(field("dtype", d, "f32, f16, bf16 or *")),
                },
            };
            let inputs: Vec<Input> = match input {
                "*" => Input::ALL.to_vec(),
                i => match Input::from_name(i) {
                    Some(i) => vec![i],
                    None => return Err(field("input", i, "staged, registered or *")),
                },
            };
            let min = parse_size(min)
                .filter(|&m| m != usize::MAX)
                .ok_or_else(|| field("min", min, "a size in bytes (4096, 4KiB, 1MiB)"))?;
            let max = parse_size(max)
                .ok_or_else(|| field("max", max, "a size in bytes (4096, 4KiB, 1MiB) or inf"))?;
            let choice = Choice::from_name(algorithm)
                .ok_or_else(|| field("algorithm", algorithm, "1stage, 2stage or transport"))?;
            let band = Band {
                min,
                max,
                choice,
                line: Some(line),
            };
            for &ranks in &ranks {
                for &dtype in &dtypes {
                    for &input in &inputs {
                        let key = Key {
                            ranks,
                            dtype,
                            input,
                        };
                        keys.entry(key).or_default().push(band);
                    }
                }
            }
        }
        let Some(backend) = backend else {
            return Err(TableError {
                origin: origin.into(),
                line: None,
                problem: if format_seen {
                    TableProblem::Backend
                } else {
                    TableProblem::Format {
                        found: String::new(),
                    }
                },
            });
        };
        for (key, bands) in &keys {
            check_bands(origin, key, bands)?;
        }
        Ok(DispatchTable::assemble(backend, origin.into(), keys))
    }
}

/// A size of a table file: bytes with an optional binary suffix, or `inf` (`usize::MAX`).
fn parse_size(text: &str) -> Option<usize> {
    if text == "inf" {
        return Some(usize::MAX);
    }
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, suffix) = text.split_at(digits);
    let shift = match suffix {
        "" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        _ => return None,
    };
    number
        .parse::<usize>()
        .ok()?
        .checked_mul(1 << shift)
        .filter(|&n| n != usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::{Algorithm, Reproducibility};
    use crate::dtype::DType;

    const ONE: Choice = Choice::Custom(Algorithm::OneStage);
    const TWO: Choice = Choice::Custom(Algorithm::TwoStage);

    fn problem_at(text: &str) -> (Option<usize>, TableProblem) {
        let e = DispatchTable::parse(text, "t.txt").expect_err("refused");
        assert_eq!(e.origin, "t.txt");
        (e.line, e.problem)
    }

    #[test]
    fn a_table_reads_its_rows_with_wildcards_suffixes_and_comments() {
        let table = DispatchTable::parse(
            "# measured here\n\ntpcomm-dispatch 1\nbackend host\n\
             2 f32 staged 0 4KiB 1stage   # small\n\
             2 f32 staged 4097 inf 2stage\n\
             * bf16 * 0 inf transport\n",
            "t.txt",
        )
        .expect("valid");
        assert_eq!(table.backend(), "host");
        assert_eq!(table.origin(), "t.txt");
        assert_eq!(table.choice(2, DType::F32, Input::Staged, 4096), Some(ONE));
        assert_eq!(table.choice(2, DType::F32, Input::Staged, 4112), Some(TWO));
        assert_eq!(table.choice(2, DType::F32, Input::Registered, 64), None);
        for ranks in 1..=8 {
            for input in Input::ALL {
                let c = table.choice(ranks, DType::Bf16, input, 1 << 30);
                assert_eq!(c, Some(Choice::Transport));
            }
        }
        let band = table.bands(&Key {
            ranks: 2,
            dtype: DType::F32,
            input: Input::Staged,
        });
        assert_eq!(band.map(|b| b[1].line), Some(Some(6)));
    }

    #[test]
    fn a_table_written_out_reads_back_equal_with_the_same_digest() {
        for table in [DispatchTable::host(), DispatchTable::cuda()] {
            let text = table.to_string();
            let back = DispatchTable::parse(&text, table.origin()).expect("round trip");
            assert_eq!(back.to_string(), text);
            assert_eq!(back.digest(), table.digest());
        }
        assert_ne!(
            DispatchTable::host().digest(),
            DispatchTable::cuda().digest()
        );
    }

    #[test]
    fn the_digest_ignores_comments_spacing_and_origin_but_not_a_band() {
        let a = "tpcomm-dispatch 1\nbackend host\n2 f32 staged 0 inf 1stage\n";
        let b = "# x\ntpcomm-dispatch   1\n backend host \n2  f32 staged 0 inf 1stage # y\n";
        let c = "tpcomm-dispatch 1\nbackend host\n2 f32 staged 0 inf 2stage\n";
        let parse = |t, o| DispatchTable::parse(t, o).unwrap().digest();
        assert_eq!(parse(a, "a"), parse(b, "b"));
        assert_ne!(parse(a, "a"), parse(c, "a"));
    }

    #[test]
    fn bands_out_of_order_with_a_gap_or_an_overlap_are_refused_naming_the_line() {
        let head = "tpcomm-dispatch 1\nbackend host\n";
        let gap = format!("{head}2 f32 staged 0 4096 1stage\n2 f32 staged 8192 inf 2stage\n");
        let (line, p) = problem_at(&gap);
        assert_eq!(line, Some(4));
        assert!(
            matches!(
                p,
                TableProblem::NotContiguous {
                    min: 8192,
                    expected: 4097,
                    ..
                }
            ),
            "{p:?}"
        );
        let overlap = format!("{head}2 f32 staged 0 4096 1stage\n2 f32 staged 16 inf 2stage\n");
        assert_eq!(problem_at(&overlap).0, Some(4));
        let unordered = format!("{head}2 f32 staged 4097 inf 2stage\n2 f32 staged 0 4096 1stage\n");
        let (line, p) = problem_at(&unordered);
        assert_eq!(line, Some(3));
        assert!(
            matches!(p, TableProblem::NotContiguous { expected: 0, .. }),
            "{p:?}"
        );
        let after = format!("{head}* f32 staged 0 inf 1stage\n2 f32 staged 0 4096 1stage\n");
        let (line, p) = problem_at(&after);
        assert_eq!(line, Some(4));
        assert!(
            matches!(
                p,
                TableProblem::AfterUnbounded {
                    unbounded_line: Some(3),
                    ..
                }
            ),
            "{p:?}"
        );
        let inverted = format!("{head}2 f32 staged 0 4096 1stage\n2 f32 staged 4097 16 2stage\n");
        assert_eq!(
            problem_at(&inverted),
            (Some(4), TableProblem::Inverted { min: 4097, max: 16 })
        );
    }

    #[test]
    fn bands_that_stop_before_inf_are_refused_naming_the_last_line() {
        let text = "tpcomm-dispatch 1\nbackend host\n2 f32 staged 0 4096 1stage\n";
        let (line, p) = problem_at(text);
        assert_eq!(line, Some(3));
        assert!(
            matches!(
                p,
                TableProblem::NotCovering {
                    max: Some(4096),
                    ..
                }
            ),
            "{p:?}"
        );
        let message = DispatchTable::parse(text, "t.txt").unwrap_err().to_string();
        assert!(
            message.starts_with("dispatch table t.txt, line 3: 2 ranks, f32, staged inputs"),
            "{message}"
        );
    }

    #[test]
    fn fields_that_hold_no_value_of_their_column_are_refused_naming_the_line() {
        let row = |r: &str| format!("tpcomm-dispatch 1\nbackend host\n{r}\n");
        for (bad, column) in [
            ("9 f32 staged 0 inf 1stage", "ranks"),
            ("0 f32 staged 0 inf 1stage", "ranks"),
            ("2 f64 staged 0 inf 1stage", "dtype"),
            ("2 f32 eager 0 inf 1stage", "input"),
            ("2 f32 staged x inf 1stage", "min"),
            ("2 f32 staged inf inf 1stage", "min"),
            ("2 f32 staged 0 4TiB 1stage", "max"),
            ("2 f32 staged 0 inf 3stage", "algorithm"),
        ] {
            match problem_at(&row(bad)) {
                (Some(3), TableProblem::Field { column: c, .. }) => assert_eq!(c, column, "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(
            problem_at(&row("2 f32 staged 0 inf")),
            (Some(3), TableProblem::Fields(5))
        );
    }

    #[test]
    fn the_format_line_and_one_backend_line_come_first() {
        assert!(matches!(
            problem_at("backend host\n2 f32 staged 0 inf 1stage\n"),
            (Some(1), TableProblem::Format { .. })
        ));
        assert_eq!(
            problem_at("tpcomm-dispatch 1\n2 f32 staged 0 inf 1stage\n"),
            (Some(2), TableProblem::Backend)
        );
        assert_eq!(
            problem_at("tpcomm-dispatch 1\nbackend host\nbackend cuda\n"),
            (Some(3), TableProblem::Backend)
        );
        assert_eq!(
            problem_at("").1,
            TableProblem::Format {
                found: String::new()
            }
        );
        assert_eq!(
            problem_at("tpcomm-dispatch 1\n"),
            (None, TableProblem::Backend)
        );
    }

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_overflow() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("4KiB"), Some(4096));
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("8MiB"), Some(8 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("inf"), Some(usize::MAX));
        assert_eq!(parse_size("99999999999999999999G"), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_size("4 KiB"), None);
    }

    #[test]
    fn the_backend_check_names_the_line_of_what_it_refuses() {
        let text = "tpcomm-dispatch 1\nbackend host\n\
                    * * * 0 64KiB 1stage\n* * * 65537 inf transport\n";
        let table = DispatchTable::parse(text, "t.txt").unwrap();
        let both = &Algorithm::ALL;
        let e = table
            .check_for("host", both, true, Reproducibility::BitStable)
            .unwrap_err();
        assert_eq!(e.line, Some(4));
        assert!(
            matches!(e.problem, TableProblem::TransportNotAllowed { .. }),
            "{e}"
        );
        table
            .check_for("host", both, true, Reproducibility::AnyOrder)
            .expect("allowed when asked for");
        let e = table.check_backend("cuda").unwrap_err();
        assert!(
            matches!(e.problem, TableProblem::OtherBackend { .. }),
            "{e}"
        );
        table.check_backend("host").expect("its own backend");
        let e = table
            .check_for(
                "host",
                &[Algorithm::TwoStage],
                true,
                Reproducibility::AnyOrder,
            )
            .unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(
            matches!(
                e.problem,
                TableProblem::NoSuchAlgorithm {
                    algorithm: "1stage",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_backend_that_cannot_tell_inputs_apart_refuses_different_bands_for_them() {
        let text = "tpcomm-dispatch 1\nbackend cuda\n\
                    2 f32 staged 0 inf 1stage\n2 f32 registered 0 inf 2stage\n";
        let table = DispatchTable::parse(text, "t.txt").unwrap();
        let e = table
            .check_for("cuda", &Algorithm::ALL, false, Reproducibility::BitStable)
            .unwrap_err();
        assert_eq!(e.line, Some(4));
        assert!(
            matches!(e.problem, TableProblem::InputsDiffer { .. }),
            "{e}"
        );
        table
            .check_for("cuda", &Algorithm::ALL, true, Reproducibility::BitStable)
            .expect("a backend whose shapes carry the slot takes them");
        DispatchTable::cuda()
            .check_for("cuda", &Algorithm::ALL, false, Reproducibility::BitStable)
            .expect("the built-in CUDA table");
        DispatchTable::host()
            .check_for("host", &Algorithm::ALL, true, Reproducibility::BitStable)
            .expect("the built-in host table");
    }

    #[test]
    fn a_file_over_the_built_in_table_keeps_the_built_in_rows_it_leaves_out() {
        let text = "tpcomm-dispatch 1\nbackend host\n2 f32 staged 0 inf 1stage\n";
        let file = DispatchTable::parse(text, "t.txt").unwrap();
        let merged = file.over(&DispatchTable::host());
        assert_eq!(merged.origin(), "t.txt");
        assert_eq!(
            merged.choice(2, DType::F32, Input::Staged, 8 << 20),
            Some(ONE)
        );
        assert_eq!(
            merged.choice(2, DType::F16, Input::Staged, 8 << 20),
            Some(TWO)
        );
        assert_eq!(
            merged.choice(4, DType::F32, Input::Staged, 8 << 20),
            Some(TWO)
        );
        let two = merged.for_ranks(2);
        assert!(two.keys().all(|k| k.ranks == 2));
        assert_eq!(two.keys().count(), 6);
    }

    #[test]
    fn a_missing_file_is_a_read_error_naming_it() {
        let e = DispatchTable::load("/nonexistent/table.txt").unwrap_err();
        assert_eq!(e.origin, "/nonexistent/table.txt");
        assert!(matches!(e.problem, TableProblem::Read(_)), "{e}");
    }
}
