//! `cargo xtask valgrind`: the host backends' test suites under valgrind memcheck.
//!
//! Builds the test binaries that exercise the host shared-memory backends and the local
//! transport, and runs each under `valgrind --error-exitcode=99` (any invalid access, use
//! of uninitialised memory or definite leak fails the task). The 10,000-cycle leak tests are
//! left out: they count descriptors and mappings themselves and take too long under
//! valgrind.

use std::process::Command;

use crate::util;

/// (package, integration test) pairs run under memcheck.
const SUITES: [(&str, &str); 6] = [
    ("tpcomm-transport", "local_group"),
    ("tpcomm-objects", "failures"),
    ("tpcomm-ipc", "host"),
    ("tpcomm-ipc", "stable_addresses"),
    ("tpcomm-allreduce", "host"),
    ("tpcomm-allreduce", "stable"),
];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if let Some(a) = args.first() {
        return Err(format!("valgrind takes no arguments (got `{a}`)"));
    }
    if !util::on_path("valgrind") {
        return Err(
            "valgrind is not installed; install it with: apt-get install -y valgrind".into(),
        );
    }
    let mut failed = Vec::new();
    for (package, test) in SUITES {
        let exe = test_executable(package, test)?;
        let mut cmd = Command::new("valgrind");
        cmd.args([
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            "-q",
        ]);
        cmd.arg(&exe).arg("--test-threads=1");
        cmd.current_dir(util::root());
        if let Err(e) = util::run(cmd) {
            eprintln!("xtask valgrind: {package}/{test}: {e}");
            failed.push(format!("{package}/{test}"));
        }
    }
    if failed.is_empty() {
        println!("valgrind: {} suites clean", SUITES.len());
        Ok(())
    } else {
        Err(format!("memcheck failed for {}", failed.join(", ")))
    }
}

/// Builds one integration test and returns its executable (from cargo's JSON messages).
fn test_executable(package: &str, test: &str) -> Result<String, String> {
    let mut cmd = util::cargo();
    cmd.args([
        "test",
        "-p",
        package,
        "--test",
        test,
        "--no-run",
        "--message-format=json",
    ]);
    eprintln!("$ {}", util::show(&cmd));
    let out = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building {package}/{test} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .filter(|l| {
            l.contains("\"reason\":\"compiler-artifact\"")
                && l.contains(&format!("\"name\":\"{test}\""))
        })
        .find_map(|l| {
            let start = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = start + l[start..].find('"')?;
            Some(l[start..end].to_string())
        })
        .ok_or_else(|| format!("no executable reported for {package}/{test}"))
}
