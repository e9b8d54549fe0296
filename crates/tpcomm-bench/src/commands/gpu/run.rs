//! The run of `gpu` on a GPU: the preamble (device, driver, environment), the custom rows
//! per kind of peer memory and world size, the engine path, the NCCL reference, the
//! ratios between them, the closing lines and the report (written before NCCL too).

use std::time::Instant;

use cudarc::driver::{sys, CudaContext};
use serde::Serialize;
#[cfg(feature = "nccl")]
use tpcomm::allreduce::DType;
use tpcomm::ipc::{CudaMemory, CudaVmmMemory, IpcError};
use tpcomm::transport::LocalGroup;

use super::custom::{run_world, COLUMNS};
#[cfg(feature = "nccl")]
use super::nccl;
use super::{engine_path, GpuArgs};
use crate::engine::error::BenchError;
use crate::engine::launch::{self, RunInfo};
use crate::engine::options::MemoryArg;
use crate::engine::row::Row;
use crate::engine::session::Session;
use crate::engine::summary::{distinct, per_size};
use crate::engine::sweep::format_bytes;

/// Hardware work queues asked for when the environment does not say: every rank's
/// stream gets its own queue, so that no rank's kernel waits in a queue behind a peer's
/// kernel that spins waiting for it.
const DEVICE_MAX_CONNECTIONS: &str = "32";

/// What the JSON report records besides the options.
#[derive(Debug, Serialize)]
struct Settings<'a> {
    #[serde(flatten)]
    args: &'a GpuArgs,
    sizes: Vec<usize>,
    device: String,
    driver: String,
    nccl_library: Option<String>,
    /// False for the report written before the NCCL reference.
    complete: bool,
    cuda_device_max_connections: Option<String>,
    cuda_module_loading: Option<String>,
    elapsed_s: f64,
}

/// The device's name, compute capability and multiprocessors; the driver's versions.
fn describe_device(ordinal: i32) -> (String, String) {
    let device = CudaContext::new(ordinal as usize)
        .and_then(|ctx| {
            let name = ctx.name()?;
            let (major, minor) = ctx.compute_capability()?;
            let sms =
                ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let mem = ctx.total_mem()?;
            Ok(format!(
                "{name} (device {ordinal}, sm_{major}{minor}, {sms} SMs, {:.0} GiB)",
                mem as f64 / (1u64 << 30) as f64
            ))
        })
        .unwrap_or_else(|e| format!("device {ordinal} (not described: {e})"));
    let api = tpcomm::ipc::backend::cuda::result::driver_version()
        .map(|v| format!("CUDA {}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let kernel = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|s| s.lines().next().map(str::to_string))
        .and_then(|l| {
            l.split_whitespace()
                .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
                .map(str::to_string)
        });
    let driver = match kernel {
        Some(k) => format!("{api} driver API, kernel module {k}"),
        None => format!("{api} driver API"),
    };
    (device, driver)
}

pub(super) fn run(args: &GpuArgs) -> Result<(), BenchError> {
    let started = Instant::now();
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // Before the driver is initialised and while this process has one thread.
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", DEVICE_MAX_CONNECTIONS);
    }
    launch::warn_if_under_mpirun();
    let info = RunInfo::local("local (ranks as threads of this process, all on one GPU)");
    // Probe the device first: a machine without one fails here with a typed error.
    drop(CudaMemory::new(args.device)?);
    let (device, driver) = describe_device(args.device);
    let sizes = args.sizes();
    let k = args.graph_launches;
    let worlds: Vec<String> = args.worlds.iter().map(u32::to_string).collect();
    let lines = [
        format!("world sizes {}", worlds.join(", ")),
        format!("GPU: {device}; {driver}"),
        format!(
            "env: CUDA_DEVICE_MAX_CONNECTIONS={}, CUDA_MODULE_LOADING={}",
            std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_default(),
            std::env::var("CUDA_MODULE_LOADING").unwrap_or_else(|_| "(unset)".into())
        ),
        format!(
            "sizes {}; K = {k} all-reduces per graph; {} timed replays after {} warm-up, \
             before and after the resume",
            sizes
                .iter()
                .map(|&b| format_bytes(b))
                .collect::<Vec<_>>()
                .join(", "),
            args.iters,
            args.warmup
        ),
        "each row: CustomAllReduce<CudaBackend<memory>> forced to one algorithm; every rank captures \
         a CUDA graph of K all-reduces (one input buffer -> one output buffer, \
         capture_graph), registers it (register_graph_buffers) and replays it concurrently \
         with its peers"
            .into(),
        "time: per all-reduce, median over replays of the slowest rank's replay time (CUDA \
         events on its backend stream) / K; blk: blocks per launch (SMs / ranks, bounded)"
            .into(),
        "after: the same graphs after prepare_for_suspend + reinit_after_resume (s+r: its \
         time, slowest rank; freed: device memory the suspend gave back, all ranks); \
         same-process aliases do not move, so this proves the tables and flags survive, \
         not that a remap works"
            .into(),
        "mem: the peer memory of the buffers, legacy CUDA IPC or virtual memory (vmm: the \
         suspend releases the Signal, staging and temp buffers; the resume maps fresh \
         memory at the same addresses)"
            .into(),
        "busbw = algbw * 2(n-1)/n as in nccl-tests, but every rank shares one GPU's memory: \
         not a link bandwidth"
            .into(),
        "every graph verified before timing, before and after the resume (small-integer \
         inputs, output poisoned, compared bit for bit on every rank)"
            .into(),
    ];
    let json = args.json.as_deref();
    let ranks = args.worlds.iter().copied().max().unwrap_or(0) as usize;
    let mut s = Session::start(&info, "gpu", 0, ranks, json, &lines)?;
    s.note("");
    s.header(
        "custom all-reduce (CUDA graphs, ranks as threads on one GPU)",
        &COLUMNS,
    );
    let mut rows: Vec<Row> = Vec::new();
    for &memory in &args.memory {
        if memory == MemoryArg::Vmm {
            if let Err(IpcError::Unsupported { what, .. }) = CudaVmmMemory::new(args.device) {
                s.note(&format!("vmm: skipped (the GPU does not support {what})"));
                continue;
            }
        }
        for &world in &args.worlds {
            let results = LocalGroup::new(world as usize).run(|comm| match memory {
                MemoryArg::Legacy => run_world(&comm, args, CudaMemory::same_process(args.device)?),
                MemoryArg::Vmm => run_world(&comm, args, CudaVmmMemory::same_process(args.device)?),
            });
            rows.extend(launch::first_rank_output(results)?);
        }
    }
    let settings = |nccl_library: Option<String>, complete: bool| Settings {
        args,
        sizes: sizes.clone(),
        device: device.clone(),
        driver: driver.clone(),
        nccl_library,
        complete,
        cuda_device_max_connections: std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok(),
        cuda_module_loading: std::env::var("CUDA_MODULE_LOADING").ok(),
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    // Written now and again after NCCL: an NCCL failure or hang cannot cost these rows.
    s.keep(rows.clone());
    s.write_json("gpu", json, &settings(None, false), &[])?;

    // The engine path; a failure is reported at the end, after NCCL and the report.
    s.note("");
    let (engine_rows, engine_failure) = match engine_path::run(&mut s, args) {
        Ok(found) => (found, None),
        Err(e) => {
            let text = crate::engine::error::chain(&e);
            s.note(&format!("engine path: FAILED: {text}"));
            eprintln!("tpcomm-bench gpu: engine path failed: {text}");
            (Vec::new(), Some(e))
        }
    };
    s.keep(engine_rows.clone());
    s.write_json("gpu", json, &settings(None, false), &[])?;

    s.note("");
    let (nccl_rows, nccl_library): (Vec<Row>, _) = if args.no_nccl {
        s.note("nccl: skipped (--no-nccl)");
        (Vec::new(), None)
    } else {
        #[cfg(not(feature = "nccl"))]
        let reference = {
            s.note("nccl: reference skipped (built without the `nccl` feature)");
            Ok::<_, BenchError>((Vec::new(), None))
        };
        #[cfg(feature = "nccl")]
        let reference = {
            let dtypes = distinct(rows.iter().filter_map(|r| {
                [DType::F32, DType::F16, DType::Bf16]
                    .into_iter()
                    .find(|d| d.name() == r.text("type"))
            }));
            nccl::reference(&s, args, &dtypes, &sizes)
        };
        match reference {
            Ok(found) => found,
            Err(e) => {
                let e = crate::engine::error::chain(&e);
                s.note(&format!("nccl: reference FAILED: {e}"));
                eprintln!("tpcomm-bench gpu: nccl reference failed: {e}");
                (Vec::new(), None)
            }
        }
    };
    for r in &mut rows {
        let nccl = nccl_rows
            .iter()
            .find(|n| n.text("type") == r.text("type") && n.bytes == r.bytes);
        if let Some(n) = nccl.filter(|n| n.stats.median_us > 0.0) {
            r.peer = Some(n.variant.clone());
            r.vs_peer = Some(r.stats.median_us / n.stats.median_us);
        }
    }
    // Virtual memory against legacy IPC, row for row (same world, type, algorithm, size).
    let legacy: Vec<(String, String, String, usize, f64)> = rows
        .iter()
        .filter(|r| r.text("memory") == MemoryArg::Legacy.name())
        .map(|r| {
            let key = (r.text("ranks"), r.text("type"), r.variant.clone(), r.bytes);
            (key.0, key.1, key.2, key.3, r.stats.median_us)
        })
        .collect();
    for r in rows
        .iter_mut()
        .filter(|r| r.text("memory") == MemoryArg::Vmm.name())
    {
        let peer = legacy.iter().find(|l| {
            (&l.0, &l.1, &l.2, l.3) == (&r.text("ranks"), &r.text("type"), &r.variant, r.bytes)
        });
        if let Some(l) = peer.filter(|l| l.4 > 0.0) {
            let ratio = r.stats.median_us / l.4;
            r.info.insert("vmm_over_legacy".into(), ratio.into());
        }
    }
    summarize(&mut s, &rows);
    s.note(&format!("total {:.1} s", started.elapsed().as_secs_f64()));
    s.keep_only(
        nccl_rows
            .into_iter()
            .chain(rows)
            .chain(engine_rows)
            .collect(),
    );
    let stated = "the engine path's worlds (--engine-worlds)";
    let targets = engine_path::targets();
    s.finish(
        "gpu",
        json,
        &settings(nccl_library, true),
        &targets,
        (true, stated),
    )?;
    engine_failure.map_or(Ok(()), Err)
}

/// Closing lines: per world, type and algorithm, the after/before spread and the
/// custom / NCCL ratio per size with its geometric mean.
fn summarize(s: &mut Session<'_>, rows: &[Row]) {
    s.note("");
    for (table, algorithm) in distinct(rows.iter().map(|r| (&r.table, &r.variant))) {
        let group = rows
            .iter()
            .filter(|r| &r.table == table && &r.variant == algorithm);
        let spread: Vec<f64> = group
            .clone()
            .filter_map(|r| r.number("after_over_before"))
            .collect();
        let worst = spread.iter().copied().fold(0.0f64, f64::max);
        let best = spread.iter().copied().fold(f64::INFINITY, f64::min);
        s.summary(format!(
            "{table} {algorithm}: after/before resume {best:.3}..{worst:.3}"
        ));
        if let (per, Some(g)) = per_size(group.clone(), |r| r.vs_peer, 2) {
            s.summary(format!(
                "{table} {algorithm}: time / nccl(1 rank) per size: {per}; geomean {g:.2}x"
            ));
        }
        if let (per, Some(g)) = per_size(group.clone(), |r| r.number("vmm_over_legacy"), 2) {
            s.summary(format!(
                "{table} {algorithm}: vmm / legacy per size: {per}; geomean {g:.2}x (the \
                 kernels read the same tables: expected 1.00x)"
            ));
        }
        if let Some(r) = group.clone().next() {
            let us = |k: &str| {
                r.number(k)
                    .map_or_else(|| "-".into(), |x| format!("{x:.0}"))
            };
            let mib = |k: &str| {
                r.number(k).map_or_else(
                    || "-".into(),
                    |x| format!("{:.1}", x / f64::from(1u32 << 20)),
                )
            };
            s.summary(format!(
                "{table} {algorithm}: suspend {} us, resume {} us; released {} MiB per \
                 rank, device memory freed {} MiB",
                us("suspend_us"),
                us("resume_us"),
                mib("released_bytes"),
                mib("device_freed_bytes")
            ));
        }
    }
}
