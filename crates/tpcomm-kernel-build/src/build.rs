//! Compiling a translation unit into the fatbin tpcomm embeds.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::report::{check_resources, parse_ptxas_report, KernelResources};
use crate::{BuildError, Nvcc};

/// One GPU architecture the fatbin carries code for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuTarget {
    /// Compute capability as a number: 80 for sm_80.
    pub arch: u32,
    /// Whether the fatbin holds SASS (a cubin) for it.
    pub sass: bool,
    /// Whether the fatbin holds PTX for it (JIT-compiled by newer drivers for newer GPUs).
    pub ptx: bool,
}

/// What the fatbin carries: SASS for A100 (sm_80), H100/H200 (sm_90) and B200 (sm_100),
/// and compute_80 PTX so any later GPU can JIT it. nvcc 13.0 emits PTX ISA 9.0, which a
/// 580-series driver still accepts.
pub const TARGETS: &[GpuTarget] = &[
    GpuTarget {
        arch: 80,
        sass: true,
        ptx: true,
    },
    GpuTarget {
        arch: 90,
        sass: true,
        ptx: false,
    },
    GpuTarget {
        arch: 100,
        sass: true,
        ptx: false,
    },
];

/// The nvcc arguments that build `source` into the fatbin `output`.
///
/// `--compress-mode=none` keeps every entry uncompressed, so that [`crate::fatbin`] can
/// read the cubins and PTX back (nvcc compresses fatbin entries by default).
pub fn fatbin_args(source: &Path, output: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-fatbin",
        "--compress-mode=none",
        "-O3",
        "-std=c++17",
        "-Xptxas",
        "-v",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    for t in TARGETS {
        let mut codes = Vec::new();
        if t.sass {
            codes.push(format!("sm_{}", t.arch));
        }
        if t.ptx {
            codes.push(format!("compute_{}", t.arch));
        }
        args.push("-gencode".into());
        args.push(format!("arch=compute_{},code=[{}]", t.arch, codes.join(",")).into());
    }
    args.push("-o".into());
    args.push(output.into());
    args.push(source.into());
    args
}

/// A fatbin that compiled and passed the resource check.
#[derive(Debug, Clone)]
pub struct FatbinBuild {
    /// Where the fatbin was written.
    pub output: PathBuf,
    /// One record per entry function and SASS target.
    pub resources: Vec<KernelResources>,
    /// Everything nvcc printed.
    pub log: String,
    /// How long nvcc ran.
    pub elapsed: Duration,
}

/// Compiles `source` (a `.cu` file) into the uncompressed fatbin `output` with
/// [`fatbin_args`], creating `output`'s folder if needed.
///
/// # Errors
/// - [`BuildError::CompileFailed`] with nvcc's output when it fails;
/// - [`BuildError::EmptyReport`] when the ptxas report names no kernel;
/// - [`BuildError::ResourceViolation`] when any kernel spills registers or uses a stack
///   frame or local memory (the fatbin is then deleted, so nothing embeds it);
/// - [`BuildError::Spawn`] / [`BuildError::Io`] for failures around the process.
pub fn build_fatbin(nvcc: &Nvcc, source: &Path, output: &Path) -> Result<FatbinBuild, BuildError> {
    if let Some(dir) = output.parent() {
        std::fs::create_dir_all(dir).map_err(|source| BuildError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let mut cmd = nvcc.command();
    cmd.args(fatbin_args(source, output));
    let shown = std::iter::once(nvcc.path().as_os_str().to_owned())
        .chain(cmd.get_args().map(|a| a.to_owned()))
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let started = Instant::now();
    let out = cmd.output().map_err(|source| BuildError::Spawn {
        program: nvcc.path().to_path_buf(),
        source,
    })?;
    let elapsed = started.elapsed();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(BuildError::CompileFailed {
            command: shown,
            status: out.status.to_string(),
            log,
        });
    }
    let resources = parse_ptxas_report(&log);
    if resources.is_empty() {
        return Err(BuildError::EmptyReport { log });
    }
    if let Err(e) = check_resources(&resources) {
        let _ = std::fs::remove_file(output);
        return Err(e);
    }
    Ok(FatbinBuild {
        output: output.to_path_buf(),
        resources,
        log,
        elapsed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_ask_for_an_uncompressed_fatbin_with_every_target_and_ptx() {
        let args: Vec<String> = fatbin_args(Path::new("k.cu"), Path::new("out/k.fatbin"))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        let joined = args.join(" ");
        assert!(joined.starts_with("-fatbin --compress-mode=none -O3 -std=c++17 -Xptxas -v"));
        assert!(joined.contains("-gencode arch=compute_80,code=[sm_80,compute_80]"));
        assert!(joined.contains("-gencode arch=compute_90,code=[sm_90]"));
        assert!(joined.contains("-gencode arch=compute_100,code=[sm_100]"));
        assert!(joined.ends_with("-o out/k.fatbin k.cu"));
    }

    #[test]
    fn targets_are_sm80_sm90_sm100_with_ptx_for_the_oldest_only() {
        let sass: Vec<u32> = TARGETS.iter().filter(|t| t.sass).map(|t| t.arch).collect();
        let ptx: Vec<u32> = TARGETS.iter().filter(|t| t.ptx).map(|t| t.arch).collect();
        assert_eq!(sass, [80, 90, 100]);
        assert_eq!(ptx, [80]);
    }
}
