//! One mapping per peer segment: the segments a backend (and its clones) has mapped now,
//! shared by every handle opened in them, and the open path that maps a segment once its
//! descriptor is fetched and checked.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::fetch::Fetched;
use super::proc_fallback::process_exited;
use super::segment::map_shared;
use super::segment_checks::{check_fields, check_len, check_segment};
use super::segment_table::segments;
use super::{lock, HostHandle, HostMemory, PeerMap};
use crate::backend::descriptor::{self, has_exited};
use crate::error::{IpcError, Result};

/// The mappings of peer segments open now, by segment identity (device, inode). An entry
/// whose mapping is gone fails to upgrade and is replaced.
///
/// Keying by identity alone is sound: a live mapping holds its file, so no other file can
/// have the same device and inode while the entry upgrades.
#[derive(Debug, Default)]
pub(super) struct ViewCache {
    by_segment: HashMap<(u64, u64), Weak<PeerMap>>,
}

impl ViewCache {
    /// Entries past which dead ones are swept on insertion.
    const SWEEP_AT: usize = 64;

    pub(super) fn get(&self, dev: u64, inode: u64) -> Option<Arc<PeerMap>> {
        self.by_segment.get(&(dev, inode)).and_then(Weak::upgrade)
    }

    pub(super) fn insert(&mut self, dev: u64, inode: u64, map: &Arc<PeerMap>) {
        if self.by_segment.len() >= Self::SWEEP_AT {
            self.by_segment.retain(|_, m| m.strong_count() > 0);
        }
        self.by_segment.insert((dev, inode), Arc::downgrade(map));
    }
}

impl HostMemory {
    /// The mapping of the segment `h` names, after checking `h`: the one open already (its
    /// owner still alive), or a new one made after fetching and checking the descriptor.
    /// `views` is held while fetching and mapping, so that two threads opening handles of
    /// one segment map it once.
    pub(super) fn segment_map(
        &self,
        views: &mut ViewCache,
        h: &HostHandle,
        own_pid: u32,
    ) -> Result<Arc<PeerMap>> {
        let segment_len = check_fields(h)?;
        if let Some(map) = views.get(h.dev, h.inode).filter(|m| m.owner == h.pid) {
            check_len(&map, h)?;
            check_alive(&map, h, own_pid)?;
            return Ok(map);
        }
        let Fetched { fd, pidfd } = self.fetch_fd(h)?;
        let fd = descriptor::checked(fd, |fd| check_segment(fd, h))?;
        let ptr = map_shared(&fd, 0, segment_len)?;
        let map = Arc::new(PeerMap {
            ptr,
            len: segment_len,
            owner: h.pid,
            pidfd: pidfd.clone(),
            dev: h.dev,
            inode: h.inode,
        });
        views.insert(h.dev, h.inode, &map);
        if let Some(pidfd) = pidfd {
            self.cache().keep(h.pid, pidfd);
        }
        Ok(map)
    }

    /// Peer segments this backend (and its clones) has mapped now: one per segment, however
    /// many handles of it are open.
    pub fn peer_segments_mapped(&self) -> usize {
        lock(&self.views)
            .by_segment
            .values()
            .filter(|m| m.strong_count() > 0)
            .count()
    }
}

/// A handle of a segment mapped already opens from that mapping only as long as it would
/// open afresh: the segment still has a live buffer (same process), or its owner still
/// runs. Its descriptor is not fetched again: the mapping holds the segment, so its device
/// and inode name it and no other file.
pub(super) fn check_alive(map: &PeerMap, h: &HostHandle, own_pid: u32) -> Result<()> {
    if h.pid == own_pid {
        return segments().check_live(h.fd, h.inode);
    }
    let exited = match &map.pidfd {
        Some(pidfd) => has_exited(pidfd),
        None => process_exited(h.pid),
    };
    if exited {
        return Err(IpcError::OwnerGone { pid: h.pid });
    }
    Ok(())
}
