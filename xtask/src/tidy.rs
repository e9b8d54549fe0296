//! The layout rules of the workspace, checked as tests (run by `cargo test --workspace`, so
//! by `cargo xtask test` and CI):
//!
//! - no Rust file under `crates/*/src` is longer than [`MAX_SOURCE_LINES`];
//! - every path the code map of `docs/architecture.md` names exists;
//! - no subcommand of the bench imports another subcommand;
//! - `unsafe` appears only in the modules `docs/architecture.md` lists ([`UNSAFE_HOMES`]).

use std::path::{Path, PathBuf};

use crate::util;

/// The longest a source file of a crate may grow; a file that needs more holds more than one
/// mechanism and becomes a folder.
const MAX_SOURCE_LINES: usize = 1_000;

/// Where `unsafe` may appear under `crates/*/src`: the backend modules, the transport's copies
/// and CUDA driver home, the queue's shared-memory module (and its loom model's cells), and
/// the bench's peers (foreign calls to MPI and C) and its engine-path GPU timing. The same
/// list is the "Invariants" section of `docs/architecture.md`.
const UNSAFE_HOMES: [&str; 10] = [
    "crates/tpcomm-transport/src/backend/",
    "crates/tpcomm-transport/src/copy.rs",
    "crates/tpcomm-transport/src/cuda_driver/",
    "crates/tpcomm-ipc/src/backend/",
    "crates/tpcomm-allreduce/src/backend/",
    "crates/tpcomm-checkpoint/src/backend/",
    "crates/tpcomm-queue/src/shm.rs",
    "crates/tpcomm-queue/src/ring.rs",
    "crates/tpcomm-bench/src/peers/",
    "crates/tpcomm-bench/src/commands/gpu/engine_path.rs",
];

/// Every `.rs` file below `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The `src` folders of the workspace's crates.
fn crate_sources() -> Vec<PathBuf> {
    let crates = util::root().join("crates");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .unwrap_or_else(|e| panic!("{}: {e}", crates.display()))
        .flatten()
        .map(|e| e.path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "found only {dirs:?} under crates/");
    dirs
}

fn relative(path: &Path) -> String {
    path.strip_prefix(util::root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// `a/{b,c}/d.rs` -> `a/b/d.rs`, `a/c/d.rs` (one level of braces, several groups).
fn expand_braces(pattern: &str) -> Vec<String> {
    let Some(open) = pattern.find('{') else {
        return vec![pattern.to_owned()];
    };
    let close = open
        + pattern[open..]
            .find('}')
            .unwrap_or_else(|| panic!("unclosed brace in `{pattern}`"));
    let (head, tail) = (&pattern[..open], &pattern[close + 1..]);
    pattern[open + 1..close]
        .split(',')
        .flat_map(|alt| expand_braces(&format!("{head}{alt}{tail}")))
        .collect()
}

/// The paths a code-map line names: the backticked words of its last table column that look
/// like files or folders.
fn named_paths(line: &str) -> Vec<String> {
    let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
    let Some(last) = cells.last() else {
        return Vec::new();
    };
    last.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| !w.contains(' ') && (w.contains('/') || w.ends_with(".rs")))
        .flat_map(expand_braces)
        .collect()
}

/// The folder a code-map section's paths are relative to, from its "Paths are under `x`" or
/// "Paths below `x`" line.
fn section_base(line: &str) -> Option<String> {
    let rest = line
        .split("Paths are under `")
        .nth(1)
        .or_else(|| line.split("Paths below `").nth(1))
        .or_else(|| line.split("Paths below are relative to `").nth(1))?;
    Some(rest.split('`').next()?.trim_end_matches('/').to_owned())
}

#[test]
fn no_crate_source_file_is_longer_than_the_limit() {
    let mut long = Vec::new();
    for dir in crate_sources() {
        for file in rust_files(&dir) {
            let text = std::fs::read_to_string(&file).expect("a readable source file");
            let lines = text.lines().count();
            if lines > MAX_SOURCE_LINES {
                long.push(format!("{} ({lines} lines)", relative(&file)));
            }
        }
    }
    assert!(
        long.is_empty(),
        "files over {MAX_SOURCE_LINES} lines hold more than one mechanism; cut them into a \
         folder: {long:?}"
    );
}

#[test]
fn every_path_the_code_map_names_exists() {
    let root = util::root();
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).expect("the doc");
    let map = doc
        .split("\n## Code map\n")
        .nth(1)
        .expect("docs/architecture.md has a `## Code map` section");
    let map = map.split("\n## ").next().unwrap_or(map);
    let mut base = String::new();
    let mut checked = 0;
    let mut missing = Vec::new();
    for line in map.lines() {
        if line.starts_with("### ") {
            base.clear();
        }
        if let Some(b) = section_base(line) {
            base = b;
        }
        if !line.trim_start().starts_with('|') {
            continue;
        }
        for path in named_paths(line) {
            // A section's paths are relative to its crate; paths from the root (`tests/`,
            // `xtask/`, ...) are tried second. A `*` names a folder's files: the folder counts.
            let path = path.split('*').next().unwrap_or(&path).to_owned();
            let candidates = [root.join(&base).join(&path), root.join(&path)];
            checked += 1;
            if !candidates.iter().any(|c| c.exists()) {
                missing.push(format!("{base}: {path}"));
            }
        }
    }
    assert!(checked > 200, "the code map names only {checked} paths");
    assert!(
        missing.is_empty(),
        "the code map names paths that do not exist: {missing:?}"
    );
}

#[test]
fn no_bench_subcommand_imports_another() {
    let commands = util::root().join("crates/tpcomm-bench/src/commands");
    let files = rust_files(&commands);
    assert!(files.len() >= 10, "found only {files:?}");
    let mut crossings = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        for (n, line) in text.lines().enumerate() {
            if line.contains("crate::commands") {
                crossings.push(format!("{}:{}: {}", relative(&file), n + 1, line.trim()));
            }
        }
    }
    assert!(
        crossings.is_empty(),
        "a subcommand imports only the engine, the data and the peers: {crossings:?}"
    );
}

#[test]
fn unsafe_appears_only_in_the_modules_that_may_hold_it() {
    let root = util::root();
    let mut strays = Vec::new();
    for dir in crate_sources() {
        for file in rust_files(&dir) {
            let rel = relative(&file);
            if UNSAFE_HOMES.iter().any(|home| rel.starts_with(home)) {
                continue;
            }
            let text = std::fs::read_to_string(root.join(&rel)).expect("a readable file");
            let code = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .any(|l| {
                    ["unsafe {", "unsafe fn", "unsafe impl", "unsafe extern"]
                        .iter()
                        .any(|k| l.contains(k))
                });
            if code {
                strays.push(rel);
            }
        }
    }
    assert!(
        strays.is_empty(),
        "`unsafe` outside the modules docs/architecture.md lists: {strays:?}"
    );
}

#[test]
fn braces_expand_into_every_alternative() {
    assert_eq!(
        expand_braces("src/{a,b}/c.rs"),
        ["src/a/c.rs", "src/b/c.rs"]
    );
    assert_eq!(
        named_paths("| x `a b` | `src/x.rs`, `tests/{y,z}.rs` |"),
        ["src/x.rs", "tests/y.rs", "tests/z.rs"]
    );
}
