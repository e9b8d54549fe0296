//! The child's side on the real driver: every operation of [`Op`] as CUDA driver calls
//! (cudarc's raw `driver::sys` bindings; the `cuCheckpointProcess*` entry points and
//! `cuGetErrorName`, which take and return plain `int`s, from tpcomm's declaration of them,
//! `tpcomm_transport::cuda_driver`) and system calls (`rustix`), each call recorded with its
//! result code and name.
//!
//! A call that fails ends its operation (what depends on it is not attempted); nothing here
//! panics on a driver failure. cudarc resolves each symbol on its first call and panics when
//! the library or a symbol is missing: the library is loaded here first (an `Init` without
//! it fails cleanly) and the child runs every operation under `catch_unwind`.

mod calls;
mod checkpoint;
mod context;
mod descriptors;
mod entry_points;
mod legacy;
mod slots;
mod vmm;

use std::os::fd::OwnedFd;

use cudarc::driver::sys;
use tpcomm_transport::cuda_driver::{error_strings, process_checkpoint};

use crate::facts::{bytes, check_pattern, pattern};
use crate::protocol::{Op, Reply};
use calls::Calls;
use checkpoint::Step;

/// Bytes written and checked in every allocation (its start).
pub(crate) const CHECK_BYTES: usize = 1 << 20;

/// One VMM mapping slot: a reservation kept for the process's life, and what is mapped in
/// it now.
#[derive(Default)]
struct Slot {
    reservation: Option<(sys::CUdeviceptr, usize)>,
    handle: Option<sys::CUmemGenericAllocationHandle>,
    mapped: bool,
    /// Descriptors this slot holds: the exported ones (own memory) or the fetched one
    /// (an import).
    fds: Vec<OwnedFd>,
}

/// The child's driver state.
pub(crate) struct Cuda {
    /// The driver library loaded (by an `Init`; it stays loaded).
    library_loaded: bool,
    error_name: Option<&'static error_strings::Available>,
    checkpoint: Option<process_checkpoint::Entries>,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    /// Retains of the primary context this process holds.
    retains: u32,
    legacy: Option<(sys::CUdeviceptr, usize)>,
    last_handle: Option<Vec<u8>>,
    peer_legacy: Option<sys::CUdeviceptr>,
    own: Slot,
    import: Slot,
    /// The second reservation of a same-process import.
    second: Slot,
    /// The socket to the peer process the parent gave (descriptor passing).
    peer_socket: Option<OwnedFd>,
}

impl Default for Cuda {
    fn default() -> Self {
        Self {
            library_loaded: false,
            error_name: None,
            checkpoint: None,
            dev: 0,
            ctx: std::ptr::null_mut(),
            retains: 0,
            legacy: None,
            last_handle: None,
            peer_legacy: None,
            own: Slot::default(),
            import: Slot::default(),
            second: Slot::default(),
            peer_socket: None,
        }
    }
}

impl Cuda {
    /// The driver state with the socket to the peer (from the parent, see
    /// [`crate::protocol::PEER_SOCKET_VAR`]).
    pub(crate) fn with_peer_socket(peer_socket: Option<OwnedFd>) -> Self {
        Self {
            peer_socket,
            ..Self::default()
        }
    }

    /// Runs one operation; its calls and values.
    pub(crate) fn run(&mut self, op: &Op) -> Reply {
        let mut reply = Reply::default();
        let mut values = std::collections::BTreeMap::new();
        let mut calls = Calls {
            calls: &mut reply.calls,
            error_name: self.error_name,
        };
        if !self.library_loaded && !matches!(op, Op::Init) {
            calls.note(
                "init",
                false,
                "NOT_INITIALIZED",
                "the driver library is not loaded (no successful init)",
            );
        } else {
            match op {
                Op::Init => self.init(&mut calls, &mut values),
                Op::MemInfo => self.mem_info(&mut calls, &mut values),
                Op::LegacyAlloc { bytes, seed } => self.legacy_alloc(&mut calls, *bytes, *seed),
                Op::LegacyExport => self.legacy_export(&mut calls, &mut values),
                Op::LegacyOpen { handle, seed } => self.legacy_open(&mut calls, handle, *seed),
                Op::LegacyReadPeer { seed } => {
                    match self.peer_legacy {
                        Some(p) => {
                            self.read_check(&mut calls, "peer mapping", p, *seed);
                        }
                        None => {
                            calls.note("read", false, "NOT_OPEN", "no peer mapping is open");
                        }
                    };
                }
                Op::LegacyClose => self.legacy_close(&mut calls),
                Op::ReInit => self.re_init(&mut calls, &mut values),
                Op::CtxReset => self.ctx_reset(&mut calls, &mut values),
                Op::CtxReleaseRetain => self.ctx_release_retain(&mut calls, &mut values),
                Op::VmmCreate { bytes, seed } => {
                    self.vmm_create(&mut calls, &mut values, *bytes, *seed)
                }
                Op::VmmFresh { seed } => self.vmm_fresh(&mut calls, &mut values, *seed),
                Op::VmmExport => self.vmm_export(&mut calls, &mut values),
                Op::VmmOffer { fd } => self.vmm_offer(&mut calls, *fd),
                Op::VmmImport {
                    pid,
                    fd,
                    size,
                    seed,
                } => self.vmm_import(&mut calls, &mut values, *pid, *fd, *size, *seed),
                Op::VmmReadPeer { seed } => self.slot_read(&mut calls, Which::Import, *seed),
                Op::VmmWritePeer { seed } => self.slot_write(&mut calls, Which::Import, *seed),
                Op::VmmReadOwn { seed } => self.slot_read(&mut calls, Which::Own, *seed),
                Op::VmmUnmapImport => self.slot_release(&mut calls, Which::Import),
                Op::VmmReleaseOwn => self.slot_release(&mut calls, Which::Own),
                Op::VmmSelfImport { seed, write_seed } => {
                    self.vmm_self_import(&mut calls, &mut values, *seed, *write_seed)
                }
                Op::CkptLock { timeout_ms } => {
                    self.ckpt(&mut calls, &mut values, Step::Lock(*timeout_ms))
                }
                Op::CkptCheckpoint => self.ckpt(&mut calls, &mut values, Step::Checkpoint),
                Op::CkptRestore => self.ckpt(&mut calls, &mut values, Step::Restore),
                Op::CkptUnlock => self.ckpt(&mut calls, &mut values, Step::Unlock),
                Op::State => {
                    self.state(&mut calls, &mut values);
                }
                Op::Exit => {}
            }
        }
        reply.values = values;
        reply
    }

    fn write_pattern(
        &self,
        c: &mut Calls<'_>,
        what: &str,
        ptr: sys::CUdeviceptr,
        seed: u8,
    ) -> bool {
        let data = pattern(seed, CHECK_BYTES);
        // SAFETY: `data` is CHECK_BYTES of host memory; `ptr` names at least CHECK_BYTES of
        // device memory mapped in this context (every allocation of the probe is larger).
        let r = unsafe { sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len()) };
        c.cu(
            "cuMemcpyHtoD",
            r,
            format!(
                "{} of the pattern of seed {seed:#04x} into {what} at {ptr:#x}",
                bytes(CHECK_BYTES as u64)
            ),
        )
    }

    fn read_check(&self, c: &mut Calls<'_>, what: &str, ptr: sys::CUdeviceptr, seed: u8) -> bool {
        let mut got = vec![0u8; CHECK_BYTES];
        // SAFETY: `got` is CHECK_BYTES of host memory; `ptr` names at least CHECK_BYTES of
        // device memory mapped in this context.
        let r = unsafe { sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), ptr, got.len()) };
        if !c.cu(
            "cuMemcpyDtoH",
            r,
            format!("{} from {what} at {ptr:#x}", bytes(CHECK_BYTES as u64)),
        ) {
            return false;
        }
        c.check("verify", check_pattern(seed, &got))
    }
}

#[derive(Debug, Clone, Copy)]
enum Which {
    Own,
    Import,
    Second,
}

impl Which {
    fn describe(self) -> &'static str {
        match self {
            Which::Own => "the own allocation",
            Which::Import => "the import",
            Which::Second => "the second mapping",
        }
    }
}

#[cfg(test)]
mod tests;
