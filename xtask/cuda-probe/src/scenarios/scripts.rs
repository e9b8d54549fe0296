//! The scenarios' scripts: the requests each scenario sends its processes, in order, and
//! where it stops.

use super::session::{Replies, Session};
use super::End;
use crate::protocol::{Op, Role};

/// Bytes of each legacy (`cuMemAlloc`) allocation.
const LEGACY_BYTES: u64 = 4 << 20;
/// Bytes of each VMM allocation (rounded up to the granularity).
const VMM_BYTES: u64 = 32 << 20;

fn value_of(replies: &Replies, role: Role, key: &str) -> Result<String, String> {
    replies[role.index()]
        .as_ref()
        .and_then(|r| r.value(key))
        .map(str::to_string)
        .ok_or_else(|| format!("process {} reported no {key}", role.name()))
}

pub(super) fn device_check(s: &mut Session<'_>) -> Result<(), End> {
    let r = s.all("device.init", Op::Init)?;
    s.require(&r, "the device check")?;
    Ok(())
}

fn init(s: &mut Session<'_>) -> Result<(), End> {
    let r = s.all("setup.init", Op::Init)?;
    s.require(&r, "init")?;
    s.all("setup.mem_info", Op::MemInfo)?;
    Ok(())
}

/// Init, a legacy allocation each, exported, opened by the peer (its contents checked),
/// closed. The handles.
fn legacy_setup(s: &mut Session<'_>, close: bool) -> Result<Replies, End> {
    init(s)?;
    let r = s.each("setup.legacy_alloc", |r| {
        Ok(Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: r.seed(0),
        })
    })?;
    s.require(&r, "the legacy allocation")?;
    let handles = s.all("setup.legacy_export", Op::LegacyExport)?;
    let opened = s.each("setup.legacy_open", |r| {
        Ok(Op::LegacyOpen {
            handle: value_of(&handles, r.peer(), "handle")?,
            seed: r.peer().seed(0),
        })
    })?;
    if close {
        s.all("setup.legacy_close", Op::LegacyClose)?;
    }
    s.require(&opened, "opening the peer's handle before the checkpoint")?;
    s.all("setup.mem_info_before", Op::MemInfo)?;
    Ok(handles)
}

/// Fresh handles exported after the restore, opened by the peer (contents `round`), closed.
fn fresh_legacy(s: &mut Session<'_>, round: u8) -> Result<(), End> {
    let fresh = s.all("after.fresh_export", Op::LegacyExport)?;
    s.each("after.fresh_open", |r| {
        Ok(Op::LegacyOpen {
            handle: value_of(&fresh, r.peer(), "handle")?,
            seed: r.peer().seed(round),
        })
    })?;
    s.all("after.fresh_close", Op::LegacyClose)?;
    Ok(())
}

pub(super) fn legacy_as_is(s: &mut Session<'_>) -> Result<(), End> {
    let old = legacy_setup(s, true)?;
    s.cycle(true)?;
    s.all("after.mem_info", Op::MemInfo)?;
    fresh_legacy(s, 0)?;
    old_legacy(s, &old)
}

pub(super) fn legacy_reinit(s: &mut Session<'_>) -> Result<(), End> {
    let old = legacy_setup(s, true)?;
    s.cycle(false)?;
    s.all("after.reinit", Op::ReInit)?;
    fresh_legacy(s, 0)?;
    old_legacy(s, &old)
}

/// The handles exported before the checkpoint, opened by the peer, closed.
fn old_legacy(s: &mut Session<'_>, old: &Replies) -> Result<(), End> {
    s.each("after.old_open", |r| {
        Ok(Op::LegacyOpen {
            handle: value_of(old, r.peer(), "handle")?,
            seed: r.peer().seed(0),
        })
    })?;
    s.all("after.old_close", Op::LegacyClose)?;
    Ok(())
}

pub(super) fn legacy_reset(s: &mut Session<'_>) -> Result<(), End> {
    legacy_new_context(s, "after.reset", Op::CtxReset)
}

pub(super) fn legacy_release(s: &mut Session<'_>) -> Result<(), End> {
    legacy_new_context(s, "after.release", Op::CtxReleaseRetain)
}

/// As 1a, then the primary context renewed by `renew` (step `step`), a new allocation
/// exported and opened by the peer.
fn legacy_new_context(s: &mut Session<'_>, step: &str, renew: Op) -> Result<(), End> {
    legacy_setup(s, true)?;
    s.cycle(false)?;
    s.all(step, renew)?;
    s.each("after.legacy_alloc", |r| {
        Ok(Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: r.seed(2),
        })
    })?;
    fresh_legacy(s, 2)
}

pub(super) fn legacy_left_open(s: &mut Session<'_>) -> Result<(), End> {
    legacy_setup(s, false)?;
    s.cycle(false)?;
    s.each("after.read_peer", |r| {
        Ok(Op::LegacyReadPeer {
            seed: r.peer().seed(0),
        })
    })?;
    Ok(())
}

/// `pidfd_getfd` + import of the peer's descriptor `fd_from[peer]` (the pattern `seed(peer)`
/// expected).
fn import_peer(
    s: &mut Session<'_>,
    step: &str,
    fds: &Replies,
    sizes: &Replies,
    seed: impl Fn(Role) -> u8,
) -> Result<Replies, End> {
    let pids = [s.pid(Role::A), s.pid(Role::B)];
    // Each exporter first offers its descriptor over the socket pair (the importer takes that
    // copy where pidfd_getfd is not allowed).
    s.each(&format!("{step}.offer"), |r| {
        let fd = value_of(fds, r, "fd")?
            .parse()
            .map_err(|_| "a descriptor that is not a number".to_string())?;
        Ok(Op::VmmOffer { fd })
    })?;
    s.each(step, |r| {
        let peer = r.peer();
        let fd = value_of(fds, peer, "fd")?
            .parse()
            .map_err(|_| "a descriptor that is not a number".to_string())?;
        let size = value_of(sizes, peer, "size")?
            .parse()
            .map_err(|_| "a size that is not a number".to_string())?;
        Ok(Op::VmmImport {
            pid: pids[peer.index()],
            fd,
            size,
            seed: seed(r),
        })
    })
}

/// Init, a VMM allocation each, exported, imported by the peer and checked, written by the
/// peer through its mapping and checked by the owner, the import unmapped and released;
/// with `release_own` the owner's memory too. The create replies (sizes) and the export
/// replies (descriptors).
fn vmm_setup(
    s: &mut Session<'_>,
    unmap: bool,
    release_own: bool,
) -> Result<(Replies, Replies), End> {
    init(s)?;
    let created = s.each("setup.vmm_create", |r| {
        Ok(Op::VmmCreate {
            bytes: VMM_BYTES,
            seed: r.seed(0),
        })
    })?;
    s.require(&created, "the VMM allocation")?;
    let exported = s.all("setup.vmm_export", Op::VmmExport)?;
    let imported = import_peer(s, "setup.vmm_import", &exported, &created, |r| {
        r.peer().seed(0)
    })?;
    s.require(
        &imported,
        "importing the peer's allocation before the checkpoint",
    )?;
    s.each("setup.vmm_write_peer", |r| {
        Ok(Op::VmmWritePeer { seed: r.seed(1) })
    })?;
    s.each("setup.vmm_read_own", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(1),
        })
    })?;
    if unmap {
        s.all("setup.vmm_unmap_import", Op::VmmUnmapImport)?;
    }
    if release_own {
        s.all("setup.vmm_release_own", Op::VmmReleaseOwn)?;
    }
    s.all("setup.mem_info_before", Op::MemInfo)?;
    Ok((created, exported))
}

/// Fresh memory at the kept reservation, exported, imported at the importer's kept
/// reservation, then data both ways. `round` seeds the owner's pattern, `round + 1` the
/// peer's write.
fn vmm_fresh(s: &mut Session<'_>, round: u8) -> Result<(), End> {
    let fresh = s.each("after.vmm_fresh", |r| {
        Ok(Op::VmmFresh {
            seed: r.seed(round),
        })
    })?;
    let exported = s.all("after.fresh_export", Op::VmmExport)?;
    import_peer(s, "after.fresh_import", &exported, &fresh, |r| {
        r.peer().seed(round)
    })?;
    s.each("after.fresh_write_peer", |r| {
        Ok(Op::VmmWritePeer {
            seed: r.seed(round + 1),
        })
    })?;
    s.each("after.fresh_read_own", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(round + 1),
        })
    })?;
    Ok(())
}

pub(super) fn vmm_released(s: &mut Session<'_>) -> Result<(), End> {
    vmm_setup(s, true, true)?;
    s.cycle(true)?;
    s.all("after.mem_info", Op::MemInfo)?;
    vmm_fresh(s, 2)
}

pub(super) fn vmm_live(s: &mut Session<'_>) -> Result<(), End> {
    let (created, exported) = vmm_setup(s, true, false)?;
    s.cycle(true)?;
    s.all("after.mem_info", Op::MemInfo)?;
    // The owner's memory holds what the peer wrote before the checkpoint.
    s.each("after.restored_contents", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(1),
        })
    })?;
    // The descriptors exported before the checkpoint, still open in the exporters; the
    // peer's memory holds this process's write.
    import_peer(s, "after.old_fd_import", &exported, &created, |r| r.seed(1))?;
    s.all("after.old_fd_unmap", Op::VmmUnmapImport)?;
    let again = s.all("after.reexport", Op::VmmExport)?;
    import_peer(s, "after.reexport_import", &again, &created, |r| r.seed(1))?;
    s.each("after.reexport_write_peer", |r| {
        Ok(Op::VmmWritePeer { seed: r.seed(5) })
    })?;
    s.each("after.reexport_read_own", |r| {
        Ok(Op::VmmReadOwn {
            seed: r.peer().seed(5),
        })
    })?;
    s.all("after.reexport_unmap", Op::VmmUnmapImport)?;
    s.all("after.release_restored", Op::VmmReleaseOwn)?;
    vmm_fresh(s, 2)
}

pub(super) fn vmm_left_mapped(s: &mut Session<'_>) -> Result<(), End> {
    vmm_setup(s, false, false)?;
    s.cycle(false)?;
    s.each("after.read_peer", |r| {
        Ok(Op::VmmReadPeer { seed: r.seed(1) })
    })?;
    Ok(())
}

pub(super) fn vmm_self(s: &mut Session<'_>) -> Result<(), End> {
    init(s)?;
    let r = s.each("self.vmm_create", |r| {
        Ok(Op::VmmCreate {
            bytes: VMM_BYTES,
            seed: r.seed(0),
        })
    })?;
    s.require(&r, "the VMM allocation")?;
    let r = s.all("self.vmm_export", Op::VmmExport)?;
    s.require(&r, "the export")?;
    s.each("self.vmm_self_import", |r| {
        Ok(Op::VmmSelfImport {
            seed: r.seed(0),
            write_seed: r.seed(4),
        })
    })?;
    Ok(())
}

pub(super) fn state_query(s: &mut Session<'_>) -> Result<(), End> {
    init(s)?;
    s.all(
        "setup.legacy_alloc",
        Op::LegacyAlloc {
            bytes: LEGACY_BYTES,
            seed: Role::A.seed(0),
        },
    )?;
    s.all("setup.state", Op::State)?;
    s.cycle_with(false, true)
}

pub(super) fn job_file(s: &mut Session<'_>) -> Result<(), End> {
    legacy_setup(s, true)?;
    s.cycle(false)?;
    fresh_legacy(s, 0)
}
