//! The one error type of the bench.

use std::path::PathBuf;

use tpcomm::{ObjectError, TransportError};
use tpcomm_ipc::IpcError;

/// Everything that stops a benchmark run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    /// A collective failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// An object collective failed.
    #[error(transparent)]
    Object(#[from] ObjectError),
    /// A peer-memory operation failed.
    #[error(transparent)]
    Ipc(#[from] IpcError),
    /// The custom all-reduce failed (or refused the input).
    #[error(transparent)]
    AllReduce(#[from] tpcomm::allreduce::AllReduceError),
    /// A broadcast queue failed.
    #[error(transparent)]
    Queue(#[from] tpcomm::QueueError),
    /// The hand-written floor of `objects` failed to encode or decode.
    #[error("floor: postcard")]
    Postcard(#[from] postcard::Error),
    /// The options make no sense together (clap checks each option alone).
    #[error("{0}")]
    Usage(String),
    /// A collective returned without error but moved the wrong bytes.
    #[error(
        "{what} delivered wrong data on rank {rank}: {detail} (ranks that saw wrong data: \
         {bad_ranks:?})"
    )]
    WrongData {
        /// The variant and case (`"rsmpi all_gather of 1024 B"`).
        what: String,
        /// The first rank that saw wrong data.
        rank: usize,
        /// What was wrong, as seen on this rank (or "see rank N").
        detail: String,
        /// Every rank that saw wrong data.
        bad_ranks: Vec<usize>,
    },
    /// Reading a JSON report failed.
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON report does not parse.
    #[error("{path} is not a tpcomm-bench JSON report")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Drawing a chart failed.
    #[error("cannot draw {path}: {detail}")]
    Plot { path: PathBuf, detail: String },
    /// `compare` found rows slower than the threshold allows.
    #[error("{0} rows regressed beyond the threshold")]
    Regressions(usize),
    /// Writing the JSON report failed.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A CUDA driver call of the bench itself (events, graphs) failed.
    #[cfg(feature = "cuda")]
    #[error("CUDA {call}: {detail}")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// A GPU subcommand in a bench built without the `cuda` feature.
    #[cfg(not(feature = "cuda"))]
    #[error(
        "this tpcomm-bench was built without `cuda`: rebuild with `cargo build --release -p \
         tpcomm-bench --features cuda,nccl` (nvcc from `cargo xtask setup-cuda`), or run \
         `cargo xtask gpu-check`"
    )]
    WithoutCuda,
    /// Serializing the JSON report failed.
    #[error("cannot serialize the JSON report")]
    Json(#[from] serde_json::Error),
}

/// `e` followed by its sources, `": "`-separated.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
