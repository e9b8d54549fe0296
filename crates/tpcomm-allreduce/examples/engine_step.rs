//! A tensor-parallel MLP block of an engine, captured with its all-reduce into ONE CUDA graph.
//!
//! What an engine team copies: cudarc tensors (`CudaSlice<f32>`) on the engine's own
//! `CudaStream`, cuBLAS through cudarc's `cublas` feature, and the all-reduce issued on that
//! same stream (`CudaBackend::with_stream`). Rank `r` of `W` computes
//!
//! ```text
//! h_r = relu(x · W1[:, shard r])     column-parallel GEMM (cuBLAS), activation (a PTX kernel)
//! p_r = h_r · W2[shard r, :]         row-parallel GEMM (cuBLAS): this rank's partial sums
//! y   = p_0 + p_1 + ... + p_(W-1)    the all-reduce, on the engine's stream
//! ```
//!
//! The engine captures the whole step (both GEMMs, the activation, the all-reduce) on its
//! stream into one graph, hands it to the all-reduce (`adopt_graph`, so its replays are
//! checked), registers the captured buffers (`register_graph_buffers`), replays it, suspends
//! (`prepare_for_suspend`: every peer mapping closed) and resumes (`reinit_after_resume`:
//! reopened, the tables rewritten in place), and replays the same graph again. The eager step
//! and every replay are compared with a single-rank reference computed on the host.
//!
//! **Exact check.** Inputs are integers in -2..=2 and weights integers in -1..=1, so every
//! product and every partial sum is an integer of magnitude at most `2 * HIDDEN` (first GEMM)
//! or `2 * HIDDEN * INTERMEDIATE` < 2^24 (second GEMM and the all-reduce): exactly
//! representable in f32, and even in TF32 for the second GEMM's inputs (at most 2^11). Any
//! summation order (cuBLAS's split-K, the all-reduce's) therefore gives the same f32 values,
//! and the outputs are compared with `==`, with no tolerance.
//!
//! **Requirements.** libcublas (`libcublas.so.13` or `.so.12`; cudarc 0.19 tries both, and
//! `libcublasLt` of the same release next to it) on the loader path, e.g. the folder of the
//! `nvidia-cublas` python wheel on `LD_LIBRARY_PATH` (`cargo xtask gpu-check`'s `run.sh`
//! finds it). The activation kernel is PTX text that the driver compiles when it loads it;
//! libnvrtc is never loaded (cudarc's `nvrtc` feature only provides the `Ptx` type).
//!
//! **Ordering.** Everything of one step is issued on the engine's stream, in program order:
//! the GEMMs, the activation, the all-reduce's staging copy (when the input cannot be shared)
//! and kernel. Before any all-reduce runs, every rank runs the block once (cuBLAS chooses and
//! loads its kernels, the driver compiles the PTX): a rank that loads a kernel while a peer's
//! all-reduce kernel spins waiting for it could wait for ever on one GPU. See `docs/gpu.md`,
//! "Using tpcomm in an engine".
//!
//! Ranks are threads, one per visible GPU (several ranks share a GPU when there are fewer GPUs
//! than ranks). `--pool` keeps the partial sums in cudarc's pool memory (the all-reduce's
//! staging copy is then captured into the graph); by default they live in exportable memory
//! (`CudaMemory::allocate`, seen as a cudarc view), which the graph shares with the peers
//! without a copy.
//!
//! ```text
//! cargo run --release -p tpcomm-allreduce --features cuda --example engine_step -- [WORLD] [--pool]
//! ```
// The host-side tests (`cargo test`) use only the model and the GEMM layout.
#![cfg_attr(test, allow(dead_code, unused_imports))]

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use cudarc::cublas::{sys as cublas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use tpcomm_allreduce::{Algorithm, Config, CudaBackend, CudaOptions, CustomAllReduce};
use tpcomm_ipc::{CudaMemory, IpcError, PeerMemory};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

type Error = Box<dyn std::error::Error + Send + Sync>;
type AllReduce = CustomAllReduce<CudaBackend>;

/// Tokens of one decode step (the GEMMs' batch).
const TOKENS: usize = 8;
/// The model's hidden size: the all-reduce moves `TOKENS * HIDDEN` f32 (32 KiB).
const HIDDEN: usize = 1024;
/// The MLP's intermediate size, split across the ranks (divisible by 2, 4, 6 and 8).
const INTERMEDIATE: usize = 4608;
/// Rounds: 0 is the eager step, 1.. replays of the captured graph.
const ROUNDS: usize = 5;
/// The suspend / resume comes after this replay.
const RESUME_AFTER: usize = 2;
/// cuBLAS's workspace, set explicitly so that no GEMM allocates inside the capture (32 MiB:
/// what cuBLAS itself reserves per handle on Hopper).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Threads per block of the activation kernel.
const RELU_THREADS: u32 = 256;

// Every value the block computes is an integer below 2^24 in magnitude (see the module docs).
const _: () = assert!(2 * HIDDEN * INTERMEDIATE < 1 << 24);

/// The activation kernel's entry point in [`RELU_PTX`].
const RELU_ENTRY: &str = "relu_f32_inplace";

/// `relu_f32_inplace(float* x, unsigned n)`: `x[i] = max(x[i], 0)` for `i < n`, one element
/// per thread. PTX ISA 7.0 for sm_80 and later, like the all-reduce kernels' PTX (the driver
/// compiles it for the GPU it runs on); checked with CUDA 13.0's `ptxas -arch=sm_90` and
/// `-arch=sm_100`.
const RELU_PTX: &str = r#"
.version 7.0
.target sm_80
.address_size 64

.visible .entry relu_f32_inplace(
    .param .u64 relu_f32_inplace_x,
    .param .u32 relu_f32_inplace_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [relu_f32_inplace_x];
    ld.param.u32 %r1, [relu_f32_inplace_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.f32 %f1, [%rd4];
    max.f32 %f2, %f1, 0f00000000;
    st.global.f32 [%rd4], %f2;
DONE:
    ret;
}
"#;

/// The single-rank model: weights and every round's input (row-major), and the outputs the
/// block must produce.
struct Model {
    /// `HIDDEN x INTERMEDIATE`.
    w1: Vec<f32>,
    /// `INTERMEDIATE x HIDDEN`.
    w2: Vec<f32>,
    /// Per round, `TOKENS x HIDDEN`.
    inputs: Vec<Vec<f32>>,
    /// Per round, `relu(x · W1) · W2`, `TOKENS x HIDDEN`.
    outputs: Vec<Vec<f32>>,
}

/// A pseudo-random integer in `-span..=span` (a splitmix64 finalizer of `seed` and `i`).
fn small_int(seed: u64, i: usize, span: u64) -> f32 {
    let mut z = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % (2 * span + 1)) as f32 - span as f32
}

impl Model {
    fn new(rounds: usize) -> Self {
        let w1 = (0..HIDDEN * INTERMEDIATE)
            .map(|i| small_int(0x5731, i, 1))
            .collect::<Vec<_>>();
        let w2 = (0..INTERMEDIATE * HIDDEN)
            .map(|i| small_int(0x5732, i, 1))
            .collect::<Vec<_>>();
        let inputs: Vec<Vec<f32>> = (0..rounds)
            .map(|round| {
                (0..TOKENS * HIDDEN)
                    .map(|i| small_int(0x1000 + round as u64, i, 2))
                    .collect()
            })
            .collect();
        let outputs = inputs.iter().map(|x| mlp(x, &w1, &w2)).collect();
        Self {
            w1,
            w2,
            inputs,
            outputs,
        }
    }

    /// Rank `rank`'s column shard of W1: `HIDDEN x INTERMEDIATE / world`, row-major.
    fn w1_shard(&self, rank: usize, world: usize) -> Vec<f32> {
        let shard = INTERMEDIATE / world;
        (0..HIDDEN)
            .flat_map(|k| {
                let row = &self.w1[k * INTERMEDIATE..][..INTERMEDIATE];
                row[rank * shard..][..shard].iter().copied()
            })
            .collect()
    }

    /// Rank `rank`'s row shard of W2: `INTERMEDIATE / world x HIDDEN`, row-major (contiguous).
    fn w2_shard(&self, rank: usize, world: usize) -> &[f32] {
        let shard = INTERMEDIATE / world;
        &self.w2[rank * shard * HIDDEN..][..shard * HIDDEN]
    }
}

/// `relu(x · W1) · W2` of row-major matrices, in exact integer arithmetic.
fn mlp(x: &[f32], w1: &[f32], w2: &[f32]) -> Vec<f32> {
    let mut h = vec![0i64; TOKENS * INTERMEDIATE];
    for t in 0..TOKENS {
        let h_row = &mut h[t * INTERMEDIATE..][..INTERMEDIATE];
        for k in 0..HIDDEN {
            let xv = x[t * HIDDEN + k] as i64;
            for (acc, &w) in h_row
                .iter_mut()
                .zip(&w1[k * INTERMEDIATE..][..INTERMEDIATE])
            {
                *acc += xv * w as i64;
            }
        }
        for v in h_row.iter_mut() {
            *v = (*v).max(0);
        }
    }
    let mut y = vec![0i64; TOKENS * HIDDEN];
    for t in 0..TOKENS {
        let y_row = &mut y[t * HIDDEN..][..HIDDEN];
        for j in 0..INTERMEDIATE {
            let hv = h[t * INTERMEDIATE + j];
            for (acc, &w) in y_row.iter_mut().zip(&w2[j * HIDDEN..][..HIDDEN]) {
                *acc += hv * w as i64;
            }
        }
    }
    y.into_iter().map(|v| v as f32).collect()
}

/// One GEMM as column-major cuBLAS sees it: `C (m x n) = A (m x k) · B (k x n)`, no transposes,
/// leading dimensions `lda`, `ldb`, `ldc`.
///
/// A row-major `r x c` buffer is, read column-major, its own transpose (`c x r`, leading
/// dimension `c`). So the row-major product `C = A · B` is issued as the column-major product
/// `Cᵀ = Bᵀ · Aᵀ`, with the weight first and no transpose flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GemmShape {
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
}

impl GemmShape {
    /// `h_r (TOKENS x shard) = x (TOKENS x HIDDEN) · W1_r (HIDDEN x shard)`.
    fn column_parallel(shard: usize) -> Self {
        Self {
            m: shard,
            n: TOKENS,
            k: HIDDEN,
            lda: shard,
            ldb: HIDDEN,
            ldc: shard,
        }
    }

    /// `p_r (TOKENS x HIDDEN) = h_r (TOKENS x shard) · W2_r (shard x HIDDEN)`.
    fn row_parallel(shard: usize) -> Self {
        Self {
            m: HIDDEN,
            n: TOKENS,
            k: shard,
            lda: HIDDEN,
            ldb: shard,
            ldc: HIDDEN,
        }
    }

    /// Elements cuBLAS reads from A, from B, and writes into C (the last element's index + 1).
    fn lens(self) -> [usize; 3] {
        [
            self.lda * (self.k - 1) + self.m,
            self.ldb * (self.n - 1) + self.k,
            self.ldc * (self.n - 1) + self.m,
        ]
    }

    /// cudarc's configuration: `alpha = 1`, `beta = 0`.
    fn config(self) -> Result<GemmConfig<f32>, Error> {
        let int = |v: usize| c_int::try_from(v).map_err(|_| format!("GEMM dimension {v}"));
        Ok(GemmConfig {
            transa: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            transb: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            m: int(self.m)?,
            n: int(self.n)?,
            k: int(self.k)?,
            alpha: 1.0,
            lda: int(self.lda)?,
            ldb: int(self.ldb)?,
            beta: 0.0,
            ldc: int(self.ldc)?,
        })
    }

    /// Refuses operands shorter than what the GEMM touches (what makes `gemm` sound).
    fn check(self, a: usize, b: usize, c: usize) -> Result<(), Error> {
        let need = self.lens();
        if a < need[0] || b < need[1] || c < need[2] {
            return Err(format!(
                "GEMM {self:?} needs {need:?} elements, the operands hold {:?}",
                [a, b, c]
            )
            .into());
        }
        Ok(())
    }
}

/// What one rank holds on its GPU: cuBLAS on the engine's stream with its workspace, the
/// activation kernel, the weight shards and the activations.
///
/// Fields drop in order: the cuBLAS handle before its workspace.
struct Block {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    relu: CudaFunction,
    /// `HIDDEN x shard`.
    w1: CudaSlice<f32>,
    /// `shard x HIDDEN`.
    w2: CudaSlice<f32>,
    /// The step's input, `TOKENS x HIDDEN` (written before each replay).
    x: CudaSlice<f32>,
    /// The activation, `TOKENS x shard`.
    h: CudaSlice<f32>,
    shard: usize,
    cublas_version: c_int,
}

impl Block {
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        model: &Model,
        rank: usize,
        world: usize,
    ) -> Result<Self, Error> {
        let shard = INTERMEDIATE / world;
        let blas = CudaBlas::new(stream.clone())?;
        // After `CudaBlas::new`: cublasSetStream resets the workspace to cuBLAS's own.
        let workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _record) = workspace.device_ptr(stream);
            // SAFETY: the handle is alive; `workspace` is CUBLAS_WORKSPACE_BYTES of device
            // memory of this context (pool allocations are aligned beyond cuBLAS's 256 bytes),
            // owned by this Block next to the handle and dropped after it, and the graphs
            // using it are dropped before the Block.
            unsafe {
                cublas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut c_void,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        let mut cublas_version: c_int = 0;
        // SAFETY: live handle; out-pointer to a local.
        unsafe { cublas_sys::cublasGetVersion_v2(*blas.handle(), &mut cublas_version) }.result()?;
        let relu = ctx
            .load_module(Ptx::from_src(RELU_PTX))?
            .load_function(RELU_ENTRY)?;
        Ok(Self {
            stream: stream.clone(),
            blas,
            _workspace: workspace,
            relu,
            w1: stream.clone_htod(&model.w1_shard(rank, world))?,
            w2: stream.clone_htod(model.w2_shard(rank, world))?,
            x: stream.alloc_zeros(TOKENS * HIDDEN)?,
            h: stream.alloc_zeros(TOKENS * shard)?,
            shard,
            cublas_version,
        })
    }

    /// Issues the column-parallel GEMM, the activation and the row-parallel GEMM into
    /// `partial` on the engine's stream (captured when the stream is being captured).
    fn forward<P: DevicePtrMut<f32>>(&mut self, partial: &mut P) -> Result<(), Error> {
        let up = GemmShape::column_parallel(self.shard);
        up.check(self.w1.len(), self.x.len(), self.h.len())?;
        // SAFETY: `check` proved that A, B and C hold every element the GEMM touches; all
        // three are device memory of the handle's context, used on its stream only.
        unsafe { self.blas.gemm(up.config()?, &self.w1, &self.x, &mut self.h) }?;

        let n = u32::try_from(self.h.len())?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(RELU_THREADS), 1, 1),
            block_dim: (RELU_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.relu);
        launch.arg(&mut self.h).arg(&n);
        // SAFETY: relu_f32_inplace(float* x, unsigned n) takes exactly these two arguments and
        // touches x[0..n), which `h` holds (n is its length).
        unsafe { launch.launch(cfg) }?;

        let down = GemmShape::row_parallel(self.shard);
        down.check(self.w2.len(), self.h.len(), partial.len())?;
        // SAFETY: as for the first GEMM; `partial` is device memory of this context.
        unsafe { self.blas.gemm(down.config()?, &self.w2, &self.h, partial) }?;
        Ok(())
    }
}

/// One step: the block into `partial`, then the all-reduce of `partial` into `y`.
fn step<P>(
    block: &mut Block,
    ar: &mut AllReduce,
    partial: &mut P,
    y: &mut CudaSlice<f32>,
) -> Result<Algorithm, Error>
where
    P: DevicePtr<f32> + DevicePtrMut<f32>,
{
    block.forward(partial)?;
    Ok(ar.all_reduce_device(&*partial, y)?)
}

/// `y` against the reference, exactly.
fn check(
    stream: &Arc<CudaStream>,
    y: &CudaSlice<f32>,
    want: &[f32],
    what: &str,
) -> Result<(), Error> {
    let got = stream.clone_dtoh(y)?;
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None if got.len() == want.len() => Ok(()),
        None => Err(format!("{what}: {} outputs, expected {}", got.len(), want.len()).into()),
        Some(i) => Err(format!(
            "{what}: output {i} (token {}, feature {}) is {}, the single-rank reference {}",
            i / HIDDEN,
            i % HIDDEN,
            got[i],
            want[i]
        )
        .into()),
    }
}

/// Where every peer's Signal block, staging and temp buffers are mapped now.
fn peer_addresses(ar: &AllReduce, world: usize) -> Result<Vec<u64>, Error> {
    let mut out = Vec::new();
    for peer in (0..world).filter(|&p| p != ar.rank()) {
        for region in 0..3 {
            out.push(ar.base_address(peer, region)?);
        }
    }
    Ok(out)
}

/// What one rank's [`run`] works with besides its tensors.
#[derive(Clone, Copy)]
struct Engine<'a> {
    comm: &'a LocalCommunicator,
    devices: usize,
    memory: &'a CudaMemory,
    stream: &'a Arc<CudaStream>,
    model: &'a Model,
}

/// One rank's run, from the warm-up to the close; returns its report line.
fn run<P>(
    engine: Engine<'_>,
    block: &mut Block,
    partial: &mut P,
    y: &mut CudaSlice<f32>,
) -> Result<String, Error>
where
    P: DevicePtr<f32> + DevicePtrMut<f32>,
{
    let Engine {
        comm,
        devices,
        memory,
        stream,
        model,
    } = engine;
    let world = comm.size();
    // Warm-up before any all-reduce exists: cuBLAS picks and loads its kernels for these
    // shapes and this workspace, the driver compiles the PTX.
    stream.memcpy_htod(&model.inputs[0], &mut block.x)?;
    block.forward(partial)?;
    stream.synchronize()?;
    comm.barrier()?;

    // The all-reduce on the engine's stream.
    let options = CudaOptions {
        ranks_per_device: world.div_ceil(devices.min(world)),
        ..CudaOptions::default()
    };
    let backend = CudaBackend::with_stream(comm, memory, options, stream.clone())?;
    let topology = backend.topology().reason.clone();
    let mut ar = CustomAllReduce::new(backend, memory.clone(), comm, Config::default())?;

    // Round 0, eagerly: the input is staged, the output written straight into `y`.
    let algorithm = step(block, &mut ar, partial, y)?;
    ar.synchronize()?;
    check(stream, y, &model.outputs[0], "eager step")?;
    comm.barrier()?;

    // The engine captures the whole step on its stream: GEMMs, activation, all-reduce.
    let mark = ar.capture_mark();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = step(block, &mut ar, partial, y);
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    captured?;
    let graph = ended?.ok_or("the capture recorded nothing")?;
    let graph = ar.adopt_graph(graph, mark)?;
    if graph.launches() != 1 {
        return Err(format!("the graph holds {} all-reduces, not 1", graph.launches()).into());
    }
    // Collective, after the capture: fills the graph's RankData slot on every rank.
    ar.register_graph_buffers(comm)?;

    let mut moved = None;
    for round in 1..model.inputs.len() {
        stream.memcpy_htod(&model.inputs[round], &mut block.x)?;
        ar.replay_graph(&graph)?;
        ar.synchronize()?;
        check(stream, y, &model.outputs[round], &format!("replay {round}"))?;
        if round == RESUME_AFTER {
            // The engine suspends (every peer mapping closed) and resumes (reopened, the
            // tables rewritten in place); the graph captured before stays valid.
            let before = peer_addresses(&ar, world)?;
            ar.prepare_for_suspend(comm)?;
            ar.reinit_after_resume(comm)?;
            moved = Some(before != peer_addresses(&ar, world)?);
        }
    }
    drop(graph);
    ar.close_with(comm)?;
    let moved = match moved {
        Some(true) => "moved",
        Some(false) => "at the same addresses (ranks as threads share their allocations)",
        None => "no resume ran",
    };
    Ok(format!(
        "topology: {topology}; the eager step ({}) and {} graph replays equal the single-rank \
         reference; peer mappings after the resume: {moved}",
        algorithm.name(),
        model.inputs.len() - 1,
    ))
}

/// One rank: the engine's context, stream, tensors and cuBLAS, then [`run`].
fn rank(
    comm: &LocalCommunicator,
    devices: usize,
    model: &Model,
    pool: bool,
) -> Result<String, Error> {
    let (rank, world) = (comm.rank(), comm.size());
    let ordinal = rank % devices;
    // The engine's context and stream. This context handle does no cudarc event tracking:
    // the stream orders every use of the tensors, and a capture cannot wait on events
    // recorded outside it.
    let ctx = CudaContext::new(ordinal)?;
    // SAFETY: every slice of this context handle is used on `stream` only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let memory = CudaMemory::same_process(ordinal as i32)?;
    let mut block = Block::new(&ctx, &stream, model, rank, world)?;
    let mut y = stream.alloc_zeros::<f32>(TOKENS * HIDDEN)?;
    let engine = Engine {
        comm,
        devices,
        memory: &memory,
        stream: &stream,
        model,
    };
    let (where_, line) = if pool {
        // cudarc's pool memory: the all-reduce captures its staging copy into the graph.
        let mut partial = stream.alloc_zeros::<f32>(TOKENS * HIDDEN)?;
        let line = run(engine, &mut block, &mut partial, &mut y);
        ("cudarc pool memory (staging copy in the graph)", line?)
    } else {
        // Exportable memory seen as a cudarc view: the graph shares it with the peers.
        let buffer = memory.allocate(TOKENS * HIDDEN * std::mem::size_of::<f32>())?;
        let mut partial = buffer.view::<f32>(TOKENS * HIDDEN, &stream)?;
        let line = run(engine, &mut block, &mut partial, &mut y);
        ("exportable memory (zero-copy in the graph)", line?)
    };
    Ok(format!(
        "rank {rank}: GPU {ordinal}, cuBLAS {}, partial sums in {where_}; {line}",
        block.cublas_version
    ))
}

/// The largest world size the kernels serve (2, 4, 6, 8) with at most one rank per GPU, and
/// at least 2.
fn default_world(devices: usize) -> usize {
    let n = devices.clamp(2, 8);
    n - n % 2
}

fn main() -> Result<(), Error> {
    // Before the driver initializes. EAGER: every kernel of a module is loaded with it, so
    // none is loaded while a peer's all-reduce kernel spins waiting for this rank. 32
    // connections: every rank's stream its own hardware queue.
    for (name, value) in [
        ("CUDA_MODULE_LOADING", "EAGER"),
        ("CUDA_DEVICE_MAX_CONNECTIONS", "32"),
    ] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let mut world = None;
    let mut pool = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--pool" => pool = true,
            n => {
                let parsed = n
                    .parse::<usize>()
                    .map_err(|e| format!("`{n}`: expected a world size or --pool ({e})"))?;
                world = Some(parsed);
            }
        }
    }
    let devices = match CudaMemory::same_process(0) {
        Ok(_) => CudaContext::device_count()?.max(1) as usize,
        Err(IpcError::NoDevice(why)) => {
            if std::env::var("TPCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
                return Err(format!("TPCOMM_REQUIRE_GPU=1 but no CUDA device: {why}").into());
            }
            println!("skipped: no CUDA device: {why}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    // SAFETY: dlopen of the cuBLAS library the ranks load next (its initializers run; it is
    // closed again), so that a missing library is this error and not cudarc's panic.
    if !unsafe { cublas_sys::is_culib_present() } {
        return Err(
            "libcublas (libcublas.so.13 or libcublas.so.12) is not on the loader path: \
                    put the folder holding it (e.g. the nvidia-cublas python wheel's lib folder) \
                    on LD_LIBRARY_PATH"
                .into(),
        );
    }
    let world = world.unwrap_or_else(|| default_world(devices));
    if !matches!(world, 2 | 4 | 6 | 8) || !INTERMEDIATE.is_multiple_of(world) {
        return Err(format!(
            "world size {world}: the kernels serve 2, 4, 6 or 8 ranks, and the block splits \
             {INTERMEDIATE} intermediate features evenly over them"
        )
        .into());
    }
    let model = Model::new(ROUNDS);
    println!(
        "engine_step: {world} ranks as threads on {} GPU(s); MLP {TOKENS} tokens x {HIDDEN} -> \
         {INTERMEDIATE} -> {HIDDEN} (f32), all-reduce of {} KiB",
        devices.min(world),
        (TOKENS * HIDDEN * 4) >> 10
    );
    let results = LocalGroup::new(world)
        .timeout(Duration::from_secs(120))
        .run(|comm| rank(&comm, devices, &model, pool));
    let mut first_error = None;
    for (r, result) in results.into_iter().enumerate() {
        let outcome = result
            .map_err(|e| format!("rank {r}: {e}"))
            .and_then(|line| line.map_err(|e| format!("rank {r}: {e}")));
        match outcome {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("{e}");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        None => Ok(()),
        Some(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column-major `C = A · B` as cuBLAS computes it for `shape` (no transposes).
    fn host_gemm(shape: GemmShape, a: &[f32], b: &[f32], c: &mut [f32]) {
        for j in 0..shape.n {
            for i in 0..shape.m {
                let mut acc = 0.0f64;
                for l in 0..shape.k {
                    acc += f64::from(a[i + l * shape.lda]) * f64::from(b[l + j * shape.ldb]);
                }
                c[i + j * shape.ldc] = acc as f32;
            }
        }
    }

    #[test]
    fn every_ranks_gemms_on_its_shards_sum_to_the_single_rank_block() {
        let model = Model::new(1);
        let (x, want) = (&model.inputs[0], &model.outputs[0]);
        for world in [2, 4, 6, 8] {
            let shard = INTERMEDIATE / world;
            let mut y = vec![0.0f32; TOKENS * HIDDEN];
            for rank in 0..world {
                let (w1, w2) = (model.w1_shard(rank, world), model.w2_shard(rank, world));
                let (up, down) = (
                    GemmShape::column_parallel(shard),
                    GemmShape::row_parallel(shard),
                );
                // The buffers the block allocates are exactly what the GEMMs touch.
                assert_eq!(up.lens(), [w1.len(), x.len(), TOKENS * shard]);
                assert_eq!(down.lens(), [w2.len(), TOKENS * shard, TOKENS * HIDDEN]);
                let mut h = vec![0.0f32; TOKENS * shard];
                host_gemm(up, &w1, x, &mut h);
                h.iter_mut().for_each(|v| *v = v.max(0.0));
                let mut partial = vec![0.0f32; TOKENS * HIDDEN];
                host_gemm(down, w2, &h, &mut partial);
                y.iter_mut().zip(&partial).for_each(|(y, p)| *y += p);
            }
            assert_eq!(&y, want, "world {world}");
        }
    }

    #[test]
    fn the_reference_is_exact_in_f32_and_not_trivial() {
        let model = Model::new(2);
        for out in &model.outputs {
            assert!(out.iter().all(|v| v.abs() < (1 << 24) as f32));
            // The activation cuts (some outputs differ from the linear block's) and the
            // outputs are spread out, so a wrong shard or layout cannot pass.
            assert!(out.iter().filter(|v| **v == 0.0).count() < out.len() / 4);
        }
        assert_ne!(model.outputs[0], model.outputs[1]);
        let linear: Vec<f32> = {
            let x = &model.inputs[0];
            let mut h = vec![0.0f64; TOKENS * INTERMEDIATE];
            for t in 0..TOKENS {
                for k in 0..HIDDEN {
                    for j in 0..INTERMEDIATE {
                        h[t * INTERMEDIATE + j] += f64::from(x[t * HIDDEN + k])
                            * f64::from(model.w1[k * INTERMEDIATE + j]);
                    }
                }
            }
            (0..TOKENS * HIDDEN)
                .map(|i| {
                    let (t, c) = (i / HIDDEN, i % HIDDEN);
                    (0..INTERMEDIATE)
                        .map(|j| h[t * INTERMEDIATE + j] * f64::from(model.w2[j * HIDDEN + c]))
                        .sum::<f64>() as f32
                })
                .collect()
        };
        assert_ne!(linear, model.outputs[0]);
    }

    #[test]
    fn the_activation_ptx_declares_the_entry_the_block_launches() {
        let entry = format!(".visible .entry {RELU_ENTRY}(");
        assert_eq!(RELU_PTX.matches(&entry).count(), 1);
        // Two parameters, as `forward` pushes them: the pointer, then the count.
        assert!(RELU_PTX.contains(&format!(".param .u64 {RELU_ENTRY}_x,")));
        assert!(RELU_PTX.contains(&format!(".param .u32 {RELU_ENTRY}_n\n")));
        assert!(!RELU_PTX.contains('\0'));
    }

    #[test]
    fn the_default_world_is_one_rank_per_gpu_on_even_counts() {
        assert_eq!(default_world(1), 2);
        assert_eq!(default_world(2), 2);
        assert_eq!(default_world(3), 2);
        assert_eq!(default_world(7), 6);
        assert_eq!(default_world(8), 8);
        assert_eq!(default_world(16), 8);
    }

    #[test]
    fn small_ints_cover_their_span() {
        let seen: std::collections::BTreeSet<i32> =
            (0..1000).map(|i| small_int(7, i, 2) as i32).collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![-2, -1, 0, 1, 2]);
    }
}
