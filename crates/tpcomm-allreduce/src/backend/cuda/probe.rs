//! The topology probe: how this rank's GPU reaches every rank's, asked of NVML where it loads
//! (`super::super::nvml`), else of the driver (`cuDeviceCanAccessPeer`) for the GPUs visible
//! in this process. The rows are all-gathered and decided in `crate::topology`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::driver_api::{check, driver_error};
use crate::backend::nvml::Nvml;
use crate::error::Result;
use crate::topology::Link;

/// How this rank's GPU reaches every rank's (by UUID, `uuids[rank]` its own): the same GPU,
/// NVML's answer (NVLink, PCIe, none) where NVML loads, else the driver's
/// `cuDeviceCanAccessPeer` for GPUs visible in this process, else unprobed (one GPU visible
/// per process and no NVML: CUDA IPC and the creation-time P2P data test decide). Never
/// fails: a probe error is traced and the link counts as unprobed.
pub(super) fn probe_links(ctx: &Arc<CudaContext>, uuids: &[[u8; 16]], rank: usize) -> Vec<Link> {
    // Ranks that all share one GPU need no probe (and no NVML initialization, which takes
    // a while, at every creation).
    if uuids.iter().all(|u| *u == uuids[rank]) {
        return vec![Link::SameDevice; uuids.len()];
    }
    let nvml = match Nvml::shared() {
        Ok(nvml) => Some(nvml),
        Err(why) => {
            tracing::debug!(%why, "NVML not available: the topology probe uses the driver");
            None
        }
    };
    let visible = visible_devices().unwrap_or_else(|e| {
        tracing::debug!(error = %e, "listing the visible devices failed");
        Vec::new()
    });
    let own = ctx.cu_device();
    let mut row = Vec::with_capacity(uuids.len());
    for (peer, uuid) in uuids.iter().enumerate() {
        if peer == rank || *uuid == uuids[rank] {
            row.push(Link::SameDevice);
            continue;
        }
        if let Some(nvml) = &nvml {
            match nvml.link(&uuids[rank], uuid) {
                Ok(link) => {
                    row.push(link);
                    continue;
                }
                Err(why) => tracing::debug!(peer, %why, "NVML could not tell the link"),
            }
        }
        let link = match visible.iter().find(|(u, _)| u == uuid) {
            None => Link::Unknown,
            Some(&(_, dev)) => {
                let mut can = 0;
                // SAFETY: out-pointer to a local; both devices exist.
                let code = unsafe { sys::cuDeviceCanAccessPeer(&mut can, own, dev) };
                match check("cuDeviceCanAccessPeer", code) {
                    Ok(()) if can != 0 => Link::P2p,
                    Ok(()) => Link::NoP2p,
                    Err(e) => {
                        tracing::debug!(peer, error = %e, "cuDeviceCanAccessPeer failed");
                        Link::Unknown
                    }
                }
            }
        };
        row.push(link);
    }
    row
}

/// The devices visible in this process, by UUID.
fn visible_devices() -> Result<Vec<([u8; 16], sys::CUdevice)>> {
    let count = CudaContext::device_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
    let mut visible = Vec::new();
    for ordinal in 0..count {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointer to a local; the ordinal is in range.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, dev)
        })?;
        visible.push((uuid.bytes.map(|b| b as u8), dev));
    }
    Ok(visible)
}
