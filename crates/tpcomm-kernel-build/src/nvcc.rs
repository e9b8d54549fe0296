//! Finding the CUDA compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::BuildError;

/// Where `cargo xtask setup-cuda` unpacks the CUDA compiler wheels, relative to the
/// workspace root.
pub const WHEELS_DIR: &str = "target/cuda";

/// nvcc inside [`WHEELS_DIR`] once the wheels are unpacked, relative to the workspace root.
pub const WHEELS_NVCC: &str = "target/cuda/nvidia/cu13/bin/nvcc";

/// Which rule found nvcc (in the order they are tried).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvccOrigin {
    /// The `NVCC` environment variable (a path to the program).
    EnvNvcc,
    /// `$CUDA_HOME/bin/nvcc`.
    CudaHome,
    /// `nvcc` on `PATH`.
    Path,
    /// The wheels unpacked by `cargo xtask setup-cuda` (see [`WHEELS_NVCC`]).
    Wheels,
}

impl std::fmt::Display for NvccOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NvccOrigin::EnvNvcc => "$NVCC",
            NvccOrigin::CudaHome => "$CUDA_HOME",
            NvccOrigin::Path => "PATH",
            NvccOrigin::Wheels => "cargo xtask setup-cuda wheels",
        })
    }
}

/// A CUDA compiler that exists and is executable.
#[derive(Debug, Clone)]
pub struct Nvcc {
    path: PathBuf,
    origin: NvccOrigin,
}

impl Nvcc {
    /// Finds nvcc: `$NVCC`, then `$CUDA_HOME/bin/nvcc`, then `nvcc` on `PATH`, then
    /// `<workspace_root>/target/cuda/nvidia/cu13/bin/nvcc`. A variable that is set but
    /// points at nothing executable is skipped (and listed in the error).
    ///
    /// # Errors
    /// [`BuildError::NvccNotFound`] listing every place tried; its message names
    /// `cargo xtask setup-cuda`.
    pub fn locate(workspace_root: &Path) -> Result<Nvcc, BuildError> {
        Self::locate_with(
            workspace_root,
            std::env::var_os("NVCC").map(PathBuf::from),
            std::env::var_os("CUDA_HOME").map(PathBuf::from),
            std::env::var_os("PATH"),
        )
    }

    /// [`Nvcc::locate`] with the environment passed in (for tests).
    pub fn locate_with(
        workspace_root: &Path,
        nvcc_env: Option<PathBuf>,
        cuda_home: Option<PathBuf>,
        path_env: Option<std::ffi::OsString>,
    ) -> Result<Nvcc, BuildError> {
        let mut candidates: Vec<(NvccOrigin, PathBuf)> = Vec::new();
        let mut tried = Vec::new();
        match nvcc_env {
            Some(p) => candidates.push((NvccOrigin::EnvNvcc, p)),
            None => tried.push("$NVCC: not set".to_owned()),
        }
        match cuda_home {
            Some(home) => candidates.push((NvccOrigin::CudaHome, home.join("bin").join("nvcc"))),
            None => tried.push("$CUDA_HOME: not set".to_owned()),
        }
        let mut on_path = false;
        if let Some(paths) = path_env {
            for dir in std::env::split_paths(&paths) {
                if dir.as_os_str().is_empty() {
                    continue;
                }
                let p = dir.join("nvcc");
                if is_executable(&p) {
                    candidates.push((NvccOrigin::Path, p));
                    on_path = true;
                    break;
                }
            }
        }
        if !on_path {
            tried.push("nvcc on PATH: none".to_owned());
        }
        candidates.push((NvccOrigin::Wheels, workspace_root.join(WHEELS_NVCC)));

        for (origin, path) in candidates {
            if is_executable(&path) {
                return Ok(Nvcc { path, origin });
            }
            let why = if path.exists() {
                "is not an executable file"
            } else {
                "does not exist"
            };
            tried.push(format!("{origin}: {} {why}", path.display()));
        }
        Err(BuildError::NvccNotFound { tried })
    }

    /// The program's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which rule found it.
    pub fn origin(&self) -> NvccOrigin {
        self.origin
    }

    /// A command running this nvcc.
    pub fn command(&self) -> Command {
        Command::new(&self.path)
    }

    /// The release line of `nvcc --version`, e.g.
    /// `Cuda compilation tools, release 13.0, V13.0.88`.
    ///
    /// # Errors
    /// [`BuildError::Spawn`] when nvcc cannot start, [`BuildError::CompileFailed`] when it
    /// exits with a failure.
    pub fn version(&self) -> Result<String, BuildError> {
        let mut cmd = self.command();
        cmd.arg("--version");
        let out = cmd.output().map_err(|source| BuildError::Spawn {
            program: self.path.clone(),
            source,
        })?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(BuildError::CompileFailed {
                command: format!("{} --version", self.path.display()),
                status: out.status.to_string(),
                log: text + &String::from_utf8_lossy(&out.stderr),
            });
        }
        Ok(text
            .lines()
            .find(|l| l.contains("release"))
            .unwrap_or_else(|| text.trim())
            .trim()
            .to_owned())
    }
}

fn is_executable(path: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(path) else {
        return false;
    };
    if !meta.is_file() {
        return false;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        meta.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_nvcc(dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join("nvcc");
        std::fs::write(
            &p,
            "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n",
        )
        .unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        p
    }

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("tpcomm-kernel-build-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn missing_compiler_error_names_setup_cuda_and_every_place_tried() {
        let root = scratch("missing");
        let err = Nvcc::locate_with(&root, None, None, Some("".into())).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("cargo xtask setup-cuda"), "{msg}");
        assert!(msg.contains("$NVCC: not set"), "{msg}");
        assert!(msg.contains("$CUDA_HOME: not set"), "{msg}");
        assert!(msg.contains(WHEELS_NVCC), "{msg}");
    }

    #[test]
    fn nvcc_variable_wins_over_cuda_home_and_wheels() {
        let root = scratch("order");
        let env = fake_nvcc(&root.join("env"));
        fake_nvcc(&root.join("home/bin"));
        fake_nvcc(&root.join("target/cuda/nvidia/cu13/bin"));
        let found =
            Nvcc::locate_with(&root, Some(env.clone()), Some(root.join("home")), None).unwrap();
        assert_eq!(found.origin(), NvccOrigin::EnvNvcc);
        assert_eq!(found.path(), env);
        let found = Nvcc::locate_with(&root, None, Some(root.join("home")), None).unwrap();
        assert_eq!(found.origin(), NvccOrigin::CudaHome);
    }

    #[test]
    fn path_is_searched_before_the_wheels() {
        let root = scratch("path");
        fake_nvcc(&root.join("bin"));
        fake_nvcc(&root.join("target/cuda/nvidia/cu13/bin"));
        let found =
            Nvcc::locate_with(&root, None, None, Some(root.join("bin").into_os_string())).unwrap();
        assert_eq!(found.origin(), NvccOrigin::Path);
    }

    #[test]
    fn unpacked_wheels_are_the_last_resort() {
        let root = scratch("wheels");
        fake_nvcc(&root.join("target/cuda/nvidia/cu13/bin"));
        let found =
            Nvcc::locate_with(&root, Some(root.join("nothing")), None, Some("".into())).unwrap();
        assert_eq!(found.origin(), NvccOrigin::Wheels);
        assert_eq!(
            found.version().unwrap(),
            "Cuda compilation tools, release 13.0, V13.0.88"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_file_without_execute_permission_is_not_a_compiler() {
        let root = scratch("noexec");
        let p = fake_nvcc(&root.join("env"));
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Nvcc::locate_with(&root, Some(p), None, None).unwrap_err();
        assert!(err.to_string().contains("is not an executable file"));
    }
}
