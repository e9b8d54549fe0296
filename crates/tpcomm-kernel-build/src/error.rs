//! The crate's error type (hand-written: the crate has no dependencies).

use std::fmt;
use std::path::PathBuf;

use crate::report::{format_table, KernelResources};

/// Why finding the compiler or building a fatbin failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// No nvcc anywhere this crate looks. The message names `cargo xtask setup-cuda`.
    NvccNotFound {
        /// Every place that was tried, in order, with why it did not qualify.
        tried: Vec<String>,
    },
    /// nvcc could not be started at all.
    Spawn {
        /// The program that failed to start.
        program: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// nvcc ran and exited with a failure.
    CompileFailed {
        /// The command line, for reproducing.
        command: String,
        /// Exit status as printed by the OS (`exit status: 1`).
        status: String,
        /// Everything nvcc printed (stdout, then stderr).
        log: String,
    },
    /// nvcc succeeded but its ptxas report named no kernel (was `-Xptxas -v` lost?).
    EmptyReport {
        /// Everything nvcc printed.
        log: String,
    },
    /// At least one kernel spills registers or uses a stack frame or local memory.
    ResourceViolation {
        /// The offending kernels (one entry per kernel and architecture).
        violations: Vec<KernelResources>,
        /// The whole report, for context.
        all: Vec<KernelResources>,
    },
    /// Reading or writing a file around the build failed.
    Io {
        /// The file or folder concerned.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::NvccNotFound { tried } => {
                writeln!(
                    f,
                    "nvcc (CUDA 13.0) not found; run `cargo xtask setup-cuda` to download and \
                     unpack it into target/cuda, or set NVCC / CUDA_HOME. Tried:"
                )?;
                for t in tried {
                    writeln!(f, "  - {t}")?;
                }
                Ok(())
            }
            BuildError::Spawn { program, source } => {
                write!(f, "cannot start `{}`: {source}", program.display())
            }
            BuildError::CompileFailed {
                command,
                status,
                log,
            } => write!(f, "`{command}` failed ({status}):\n{log}"),
            BuildError::EmptyReport { log } => write!(
                f,
                "nvcc succeeded but its ptxas report lists no kernel; output was:\n{log}"
            ),
            BuildError::ResourceViolation { violations, all } => {
                writeln!(
                    f,
                    "{} kernel build(s) spill registers or use a stack frame / local memory:",
                    violations.len()
                )?;
                for v in violations {
                    writeln!(
                        f,
                        "  {} {}: {} registers, stack {} B, spill stores {} B, spill loads {} B, \
                         lmem {} B",
                        v.kernel,
                        v.arch,
                        v.registers,
                        v.stack_frame_bytes,
                        v.spill_store_bytes,
                        v.spill_load_bytes,
                        v.local_memory_bytes
                    )?;
                }
                write!(f, "full report:\n{}", format_table(all))
            }
            BuildError::Io { path, source } => write!(f, "{}: {source}", path.display()),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Spawn { source, .. } | BuildError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
