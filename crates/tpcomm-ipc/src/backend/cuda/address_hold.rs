//! `CudaAddressHold`: a reservation of device addresses at a fixed place, so that tests can
//! prove a reopened mapping lands elsewhere than a closed one.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;

use tpcomm_transport::cuda_driver::cudarc_probes::ADDRESS_RESERVATION;

use super::{CudaMemory, ALLOCATION_GRANULARITY};
use crate::backend::cuda_driver::context::PrimaryContext;
use crate::backend::cuda_driver::result;
use crate::error::{IpcError, Result};

/// A reservation of device virtual addresses (`cuMemAddressReserve` at a fixed address),
/// released on drop. While it lives nothing else (an IPC mapping included) can be placed in
/// the range: tests hold the addresses of closed peer mappings so that reopening them has to
/// choose new ones, as a process resumed elsewhere would.
#[derive(Debug)]
pub struct CudaAddressHold {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<PrimaryContext>,
}

impl CudaAddressHold {
    /// The first reserved address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for CudaAddressHold {
    fn drop(&mut self) {
        let freed = self.ctx.make_current().and_then(|()| {
            // SAFETY: reserved by `hold_address` with this size, freed once; nothing is
            // mapped in a range only this value knows.
            result::check("cuMemAddressFree", unsafe {
                cudarc::driver::sys::cuMemAddressFree(self.ptr, self.len)
            })
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "releasing a device address reservation failed");
        }
    }
}

impl CudaMemory {
    /// Reserves `len` bytes of device virtual addresses at exactly `addr` (rounded down to
    /// 2 MiB, the length up). Fails with [`IpcError::InvalidAllocation`] when the driver
    /// places the reservation elsewhere (the range is in use), releasing it.
    pub fn hold_address(&self, addr: u64, len: usize) -> Result<CudaAddressHold> {
        result::require(ADDRESS_RESERVATION)?;
        let granule = ALLOCATION_GRANULARITY as u64;
        let start = addr / granule * granule;
        let len = addr
            .checked_add(len as u64)
            .and_then(|end| (end - start).checked_next_multiple_of(granule))
            .and_then(|len| usize::try_from(len).ok())
            .ok_or_else(|| {
                IpcError::InvalidAllocation(format!(
                    "{len} bytes at {addr:#x} run past the address space"
                ))
            })?;
        self.ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; a reservation maps nothing, so it cannot touch
        // live memory.
        result::check("cuMemAddressReserve", unsafe {
            cudarc::driver::sys::cuMemAddressReserve(
                &mut ptr,
                len,
                ALLOCATION_GRANULARITY,
                start,
                0,
            )
        })?;
        let hold = CudaAddressHold {
            ptr,
            len,
            ctx: self.ctx.clone(),
        };
        if ptr != start {
            return Err(IpcError::InvalidAllocation(format!(
                "the driver reserved {len} bytes at {ptr:#x}, not at {start:#x}: the range is in use"
            )));
        }
        Ok(hold)
    }
}
