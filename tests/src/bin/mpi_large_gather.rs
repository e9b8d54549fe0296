//! One real all-gather of more than 2 GiB over MPI (`cargo xtask test --large`).
//!
//! Each rank contributes `TPCOMM_LARGE_MIB` MiB (default 1100, so 2 ranks gather 2200 MiB,
//! past the 2 GiB that one MPI-3 call can move), all-gathers it as a serde value, checks
//! every byte, and reports its peak resident memory against the gathered bytes (a figure
//! for docs/benchmarks.md, not an assertion). Rank 0 prints a `case ... ok` line that
//! xtask counts.

use std::process::ExitCode;
use std::time::Instant;

use tpcomm::objects;
use tpcomm::transport::{Communicator, MpiCommunicator};

/// Byte `i` of rank `rank`'s contribution.
fn byte(rank: usize, i: usize) -> u8 {
    ((i % 251) as u8) ^ (rank as u8).wrapping_mul(97)
}

/// Peak resident set size of this process (VmHWM), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn main() -> ExitCode {
    tpcomm_conformance::mpi_program("mpi-large-gather", run_program)
}

/// One rank's part; true when every rank succeeded.
fn run_program(comm: &MpiCommunicator) -> bool {
    let mib: usize = std::env::var("TPCOMM_LARGE_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1100);
    let (me, n) = (comm.rank(), comm.size());
    let per_rank = mib << 20;
    let gathered_bytes = per_rank * n;
    let mine: Vec<u8> = (0..per_rank).map(|i| byte(me, i)).collect();

    let started = Instant::now();
    let result = objects::all_gather_borrowed(comm, serde_bytes::Bytes::new(&mine));
    let elapsed = started.elapsed();
    let verdict = match result {
        Err(e) => Err(format!("all_gather failed: {e}")),
        Ok(gathered) => match gathered.decode::<&serde_bytes::Bytes>() {
            Err(e) => Err(format!("decode failed: {e}")),
            Ok(values) => (0..n)
                .find_map(|r| {
                    let v: &[u8] = values[r];
                    if v.len() != per_rank {
                        return Some(format!("rank {r}: {} bytes, expected {per_rank}", v.len()));
                    }
                    v.iter()
                        .enumerate()
                        .find(|&(i, &b)| b != byte(r, i))
                        .map(|(i, _)| format!("rank {r}: byte {i} differs"))
                })
                .map_or(Ok(()), Err),
        },
    };
    drop(mine);
    let peak = peak_rss().unwrap_or(0);
    let ratio = peak as f64 / gathered_bytes as f64;
    let ok = verdict.is_ok();
    let all_ok = tpcomm_conformance::all_ranks_ok(comm, ok);
    let mut peaks = vec![0u8; 8 * n];
    let _ = comm.all_gather(&peak.to_le_bytes(), &mut peaks);
    if me == 0 {
        let worst = peaks
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .max()
            .unwrap_or(peak);
        let worst_ratio = worst as f64 / gathered_bytes as f64;
        println!(
            "all_gather of {:.2} GiB over {n} ranks: {:.2} s, peak RSS {:.2} GiB per rank = {worst_ratio:.2}x the gathered bytes (target <= 2.5x)",
            gathered_bytes as f64 / (1u64 << 30) as f64,
            elapsed.as_secs_f64(),
            worst as f64 / (1u64 << 30) as f64,
        );
        match (&verdict, all_ok) {
            (Ok(()), true) => println!("case large_all_gather_past_2_gib_is_intact ... ok"),
            (Err(e), _) => println!("case large_all_gather_past_2_gib_is_intact ... FAILED: {e}"),
            (Ok(()), false) => {
                println!("case large_all_gather_past_2_gib_is_intact ... FAILED: on another rank")
            }
        }
    } else if let Err(e) = &verdict {
        eprintln!("rank {me}: {e} (ratio {ratio:.2})");
    }
    all_ok
}
