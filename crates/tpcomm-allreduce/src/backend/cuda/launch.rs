//! Kernel launches: the kernel and grid of a request (`route`, `block_bound`), and the launch
//! on the stream, whose arguments name the tables, never a peer address.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cudarc::driver::sys;
use tpcomm_ipc::DevicePeerMemory;
use tpcomm_kernels as kernels;

use super::driver_api::check;
use super::CudaBackend;
use crate::backend::{Launch, RANK_DATA_BYTES};
use crate::dispatch::{Algorithm, FallbackReason};
use crate::dtype::DType;
use crate::error::{AllReduceError, Result};

/// Blocks one launch may use: `max_blocks`, and at most an equal share of the
/// `multiprocessors` among `ranks_per_device` ranks (at least 1).
pub fn block_bound(max_blocks: u32, multiprocessors: u32, ranks_per_device: usize) -> u32 {
    let ranks = u32::try_from(ranks_per_device.max(1)).unwrap_or(u32::MAX);
    max_blocks.min((multiprocessors / ranks).max(1))
}

/// Whether the kernels serve a request: the agreed peer access first, then a kernel for
/// the element type, world size and size. Pure: the same on every rank given the same
/// arguments, so every rank takes the same path.
pub fn route(
    peer_access: &std::result::Result<(), FallbackReason>,
    world: usize,
    dtype: DType,
    bytes: usize,
    algorithm: Algorithm,
    max_blocks: u32,
) -> std::result::Result<(), FallbackReason> {
    peer_access.clone()?;
    kernels::launch_config(
        kernel_dtype(dtype),
        world,
        bytes as u64,
        kernel_algorithm(algorithm),
        max_blocks,
    )
    .map(drop)
    .map_err(|e| FallbackReason::NoKernel {
        reason: e.to_string(),
    })
}

fn kernel_dtype(dtype: DType) -> kernels::Dtype {
    match dtype {
        DType::F32 => kernels::Dtype::F32,
        DType::F16 => kernels::Dtype::F16,
        DType::Bf16 => kernels::Dtype::Bf16,
    }
}

fn kernel_algorithm(algorithm: Algorithm) -> kernels::Algorithm {
    match algorithm {
        Algorithm::OneStage => kernels::Algorithm::OneStage,
        Algorithm::TwoStage => kernels::Algorithm::TwoStage,
    }
}

pub(super) fn timeout_ns(timeout: Duration) -> u64 {
    // 0 would mean "wait forever" to the kernels: a zero timeout waits 1 ns instead.
    u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).max(1)
}

impl<M: DevicePeerMemory> CudaBackend<M> {
    /// Enqueues the launch `l` on the stream: the kernel and grid from
    /// `tpcomm_kernels::launch_config` (at most [`max_blocks`](Self::max_blocks) blocks).
    pub(super) fn launch_kernel(&self, l: &Launch<'_, Self>) -> Result<()> {
        let bytes = l.count * l.dtype.size();
        let config = kernels::launch_config(
            kernel_dtype(l.dtype),
            l.world,
            bytes as u64,
            kernel_algorithm(l.algorithm),
            self.max_blocks(),
        )
        .map_err(|e| AllReduceError::InvalidArgument(e.to_string()))?;
        kernels::check_alignment(l.out)
            .map_err(|e| AllReduceError::InvalidArgument(e.to_string()))?;
        let function = self.module.function(config.kernel)?;
        let mut data = l.rank_data.device_ptr() + (l.slot * RANK_DATA_BYTES) as u64;
        let mut peers = l.rank_signals.device_ptr();
        let mut own = l.own_signal.device_ptr();
        let mut out = l.out;
        let mut rank = l.rank as i32;
        let mut elements = config.elements as i64;
        let mut timeout = timeout_ns(l.timeout);
        self.timeout_ns.store(timeout, Ordering::Relaxed);
        let mut params: [*mut c_void; 7] = [
            (&mut data as *mut u64).cast(),
            (&mut peers as *mut u64).cast(),
            (&mut own as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
            (&mut rank as *mut i32).cast(),
            (&mut elements as *mut i64).cast(),
            (&mut timeout as *mut u64).cast(),
        ];
        self.bind()?;
        // SAFETY: `function` belongs to the loaded module and takes exactly these seven
        // arguments (kernels/allreduce.cu: RankData*, RankSignals*, Signal*, void*, int,
        // long long, unsigned long long), each pointed to by `params` for the call; the
        // pointers name this rank's stable tables, own Signal block and an output of
        // `bytes` bytes that `CustomAllReduce` checked; grid and block come from launch_config.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                config.blocks,
                1,
                1,
                config.threads,
                1,
                1,
                config.shared_mem_bytes,
                self.stream.cu_stream(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
