//! The values of options several subcommands share: element types (`--dtypes` of
//! `allreduce` and `gpu`) and kinds of CUDA peer memory (`--memory` of `gpu` and
//! `checkpoint`).

use clap::ValueEnum;
use serde::Serialize;
use tpcomm::allreduce::DType;

/// An element type on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    pub(crate) fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::Bf16,
        }
    }
}

/// A kind of CUDA peer memory on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum MemoryArg {
    /// Legacy CUDA IPC (`cuMemAlloc`, `cuIpcOpenMemHandle`).
    Legacy,
    /// Virtual memory (`cuMemCreate`, POSIX descriptors, kept addresses).
    Vmm,
}

impl MemoryArg {
    /// The name in tables and JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Legacy => "legacy",
            Self::Vmm => "vmm",
        }
    }
}
