//! Same-process aliases (`CudaMemory::same_process`): a handle this process exported opens
//! as the local allocation itself, after checking that it is still the one exported, with
//! peer access where it lies on another device.

use super::{CudaHandle, CudaMapping, CudaMemory};
use crate::backend::cuda_driver::result;
use crate::backend::cuda_region::legacy::export_table;
use crate::error::{IpcError, Result};

impl CudaMemory {
    /// Opens a handle this process exported as an alias of the local allocation, after
    /// checking that the allocation still exists with the size the handle names and is the
    /// one exported (the driver gives the same handle for it: a new allocation at a freed
    /// one's address has another).
    pub(super) fn open_alias(&self, h: &CudaHandle, len: usize) -> Result<CudaMapping> {
        let base = export_table().get(&h.ipc).copied().ok_or_else(|| {
            IpcError::InvalidHandle(
                "the handle names this process but no allocation it exported".into(),
            )
        })?;
        self.ctx.make_current()?;
        match result::mem_get_address_range(base) {
            Ok((b, size)) if b == base && size as u64 == h.base_len => {}
            Ok((_, size)) => {
                return Err(IpcError::InvalidHandle(format!(
                    "the allocation is {size} bytes, the handle says {}",
                    h.base_len
                )))
            }
            Err(e) => {
                return Err(IpcError::InvalidHandle(format!(
                    "the exported allocation at {base:#x} is gone: {e}"
                )))
            }
        }
        if result::ipc_get_mem_handle(base)? != h.ipc {
            return Err(IpcError::StaleHandle(format!(
                "the allocation exported at {base:#x} was freed; another one lies there now"
            )));
        }
        let owner = result::pointer_device_ordinal(base)?;
        match alias_access(self.ctx.ordinal, h.device, owner)? {
            AliasAccess::SameDevice => {}
            AliasAccess::Peer(device) => self.enable_peer_access(device)?,
        }
        Ok(CudaMapping {
            key: (h.ipc, self.ctx.ordinal),
            base,
            offset: h.offset,
            len,
            ctx: self.ctx.clone(),
            released: false,
            alias: true,
            vmm: None,
        })
    }

    /// Lets this backend's context read and write device `peer`'s memory (ranks that are
    /// threads of one process on several GPUs: kernels of this device read a peer's
    /// aliases). Enabling twice is fine; a refusal (no P2P between the devices, too many
    /// peers) is [`IpcError::PeerAccess`] with the driver's error.
    pub fn enable_peer_access(&self, peer: i32) -> Result<()> {
        let fail = |cause: IpcError| IpcError::PeerAccess {
            device: self.ctx.ordinal,
            peer_device: peer,
            cause: Box::new(cause),
        };
        let device = result::device_get(peer).map_err(fail)?;
        let peer_ctx = result::primary_ctx_retain(device).map_err(fail)?;
        let enabled = self.ctx.make_current().and_then(|()| {
            // SAFETY: `peer_ctx` is retained until the release below.
            unsafe { result::ctx_enable_peer_access(peer_ctx) }
        });
        // SAFETY: balances the retain above; the peer access, once enabled, belongs to the
        // contexts, and the peer's own CudaMemory keeps its context alive.
        if let Err(e) = unsafe { result::primary_ctx_release(device) } {
            tracing::warn!(error = %e, device = peer, "releasing a peer's primary context failed");
        }
        let now = enabled.map_err(fail)?;
        tracing::debug!(
            device = self.ctx.ordinal,
            peer,
            newly = now,
            "peer access enabled"
        );
        Ok(())
    }
}

/// How a same-process alias reaches its allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AliasAccess {
    /// The allocation is on the importer's own device.
    SameDevice,
    /// The allocation is on this other device: the importer's context needs peer access.
    Peer(i32),
}

/// Checks a same-process alias against its device: `handle_device` is the device the
/// handle says (the exporter's), `owner_device` the one the allocation at its address is
/// on now (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`), `own_device` the importer's. An
/// allocation on another device than the handle says (freed and replaced) is
/// [`IpcError::InvalidHandle`]; on another device than the importer's, it needs peer access.
pub fn alias_access(own_device: i32, handle_device: i32, owner_device: i32) -> Result<AliasAccess> {
    if owner_device != handle_device {
        return Err(IpcError::InvalidHandle(format!(
            "the handle names an allocation of device {handle_device}, but the memory at its \
             address is on device {owner_device}"
        )));
    }
    Ok(if owner_device == own_device {
        AliasAccess::SameDevice
    } else {
        AliasAccess::Peer(owner_device)
    })
}
