//! Stable addresses: the host twin of the CUDA virtual-memory backend.
//!
//! A [`HostMemory::stable`] backend does with memfds what `CudaVmmMemory` does with the
//! driver's virtual-memory API, so that the registry and the all-reduce exercise the same
//! lifecycle without a GPU:
//!
//! - **A detached mapping keeps its addresses.** [`PeerMemory::detach`] replaces a peer
//!   mapping with an inaccessible reservation of the same range (`mmap(PROT_NONE,
//!   MAP_FIXED)` over it: the kernel swaps the two in one step, so no other mapping can land
//!   in between); [`PeerMemory::reattach`] maps a fresh segment over the reservation the same
//!   way (`mmap(MAP_SHARED | MAP_FIXED)`), after every check `open` makes. The mapping's
//!   address is then what it was: tables holding it stay right.
//! - **A buffer can give its memory back.** [`PeerMemory::release_backing`] swaps the
//!   buffer's mapping for a reservation and closes its segment (the memory goes once no peer
//!   maps it); [`PeerMemory::restore_backing`] maps a new, zeroed, sealed segment at the same
//!   address. Its handles change (a new descriptor and inode), as a VMM allocation's do.
//!
//! Every mapping of such a backend maps the pages of its own handle's range only, never a
//! whole segment shared with other handles, so that one mapping can be detached and
//! reattached without the others. Buffers are never carved out of shared chunks, so that
//! each can be released on its own.
//!
//! A copy through a detached mapping or a released buffer is [`IpcError::Unbacked`]; the
//! all-reduce never launches while its mappings are detached (the lifecycle refuses it).
//!
//! [`PeerMemory::detach`]: crate::PeerMemory::detach
//! [`PeerMemory::reattach`]: crate::PeerMemory::reattach
//! [`PeerMemory::release_backing`]: crate::PeerMemory::release_backing
//! [`PeerMemory::restore_backing`]: crate::PeerMemory::restore_backing

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rustix::mm::{MapFlags, ProtFlags};

use super::fetch::Fetched;
use super::prefault::prefault;
use super::segment::{map_shared, page_size, segment_file};
use super::segment_checks::{check_fields, check_segment};
use super::segment_table::{segments, Exportable};
use super::{
    HostBuffer, HostHandle, HostMapping, HostMemory, OwnedSegment, PeerMap, PRIVATE_SEGMENT_NAME,
    SEGMENT_NAME,
};
use crate::backend::descriptor;
use crate::error::{os, IpcError, Result};
use crate::memory::MemoryRegion;

/// Where a handle's range lies in the pages of its segment: the first page's offset in the
/// segment, the range's offset in that page, and the pages' span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PageSpan {
    start: u64,
    inside: usize,
    span: usize,
}

/// The pages of `h`'s range (its fields checked by `check_fields`).
fn page_span(h: &HostHandle) -> Result<PageSpan> {
    let page = page_size() as u64;
    let start = h.offset - h.offset % page;
    let inside = (h.offset - start) as usize;
    let len = usize::try_from(h.len)
        .map_err(|_| IpcError::InvalidHandle("length out of range".into()))?;
    let span = inside
        .checked_add(len)
        .and_then(|end| end.checked_next_multiple_of(page as usize))
        .ok_or_else(|| IpcError::InvalidHandle("range overflows".into()))?;
    Ok(PageSpan {
        start,
        inside,
        span,
    })
}

/// Swaps the mapping at `ptr..ptr + len` for an inaccessible reservation.
///
/// # Safety
/// `ptr..ptr + len` is exactly a mapping this process made and owns (page aligned), no Rust
/// reference points into it, and nothing reads or writes it from now on but through the
/// owner, which treats it as unbacked.
unsafe fn reserve_in_place(ptr: NonNull<u8>, len: usize) -> Result<()> {
    // SAFETY: per the contract, the range is the caller's own mapping; MAP_FIXED replaces it
    // in one step with an anonymous PROT_NONE mapping of the same range.
    let p = unsafe {
        rustix::mm::mmap_anonymous(
            ptr.as_ptr().cast::<c_void>(),
            len,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
        )
    }
    .map_err(os("mmap(PROT_NONE, MAP_FIXED)"))?;
    debug_assert_eq!(p, ptr.as_ptr().cast::<c_void>());
    Ok(())
}

/// Maps `len` bytes of `fd` from `offset` shared, read-write, over the reservation at `ptr`.
///
/// # Safety
/// `ptr..ptr + len` is a reservation this process made and owns (page aligned, no Rust
/// reference into it); `fd` is a sealed segment of at least `offset + len` bytes.
unsafe fn map_over(
    ptr: NonNull<u8>,
    len: usize,
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
) -> Result<()> {
    // SAFETY: per the contract, the range is the caller's own reservation; MAP_FIXED
    // replaces it in one step; the file cannot shrink (sealed), so no access faults.
    let p = unsafe {
        rustix::mm::mmap(
            ptr.as_ptr().cast::<c_void>(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::FIXED,
            fd,
            offset,
        )
    }
    .map_err(os("mmap(MAP_SHARED, MAP_FIXED)"))?;
    if p != ptr.as_ptr().cast::<c_void>() {
        // MAP_FIXED maps at the address or fails: a kernel that placed it elsewhere broke
        // that contract; the mapping is left to the process.
        return Err(IpcError::Os {
            call: "mmap(MAP_FIXED)",
            source: rustix::io::Errno::INVAL,
        });
    }
    Ok(())
}

/// Unmaps the reservation of a released buffer (its `Drop`).
pub(super) fn free_reservation(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the reservation `release_buffer` made over the buffer's own range, unmapped
    // once, by the buffer's drop.
    if let Err(e) = unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), len) } {
        tracing::warn!(error = %e, "releasing a buffer's address reservation failed");
    }
}

impl HostMemory {
    /// A backend with stable addresses, the CPU twin of the CUDA virtual-memory backend
    /// (see the module documentation of `tpcomm_ipc::backend::host`):
    /// [`keeps_addresses`](crate::PeerMemory::keeps_addresses) and
    /// [`releases_backing`](crate::PeerMemory::releases_backing) are true. Every buffer is a
    /// segment of its own (nothing is carved out of chunks) and every peer mapping maps its
    /// own handle's pages, so a registry of this backend costs a descriptor fetch and an
    /// `mmap` per region where [`HostMemory::new`] shares one per chunk.
    ///
    /// ```
    /// use tpcomm_ipc::{HostMemory, MemoryRegion, PeerMemory};
    ///
    /// let memory = HostMemory::stable();
    /// let mut buffer = memory.allocate(4096)?;
    /// let addr = buffer.addr();
    /// memory.release_backing(&mut buffer)?; // the memory is gone, the address kept
    /// assert!(memory.write(&buffer, 0, &[1]).is_err());
    /// memory.restore_backing(&mut buffer)?; // fresh zeroed memory at the same address
    /// assert_eq!(buffer.addr(), addr);
    /// memory.write(&buffer, 0, &[1])?;
    /// # Ok::<_, tpcomm_ipc::IpcError>(())
    /// ```
    pub fn stable() -> Self {
        Self {
            stable: true,
            ..Self::default()
        }
    }

    /// True for a [`stable`](Self::stable) backend.
    pub fn is_stable(&self) -> bool {
        self.stable
    }

    fn require_stable(&self, what: &str) -> Result<()> {
        if self.stable {
            Ok(())
        } else {
            Err(IpcError::Unsupported {
                backend: "host",
                what: format!("{what} (HostMemory::new; HostMemory::stable does)"),
            })
        }
    }

    /// Fetches and checks the segment `h` names (the checks of `open`).
    fn fetch_checked(&self, h: &HostHandle) -> Result<Fetched> {
        check_fields(h)?;
        let Fetched { fd, pidfd } = self.fetch_fd(h)?;
        let fd = descriptor::checked(fd, |fd| check_segment(fd, h))?;
        Ok(Fetched { fd, pidfd })
    }

    /// `open_all` of a stable backend: each handle's own pages, mapped at an address the
    /// kernel chooses.
    pub(super) fn open_unshared(&self, handles: &[&HostHandle]) -> Result<Vec<HostMapping>> {
        let mut mappings = Vec::with_capacity(handles.len());
        for &h in handles {
            check_fields(h)?;
            let pages = page_span(h)?;
            let Fetched { fd, pidfd } = self.fetch_checked(h)?;
            let ptr = map_shared(&fd, pages.start, pages.span)?;
            if let Some(pidfd) = &pidfd {
                self.cache().keep(h.pid, pidfd.clone());
            }
            mappings.push(HostMapping {
                map: Arc::new(PeerMap {
                    ptr,
                    len: pages.span,
                    owner: h.pid,
                    pidfd,
                    dev: h.dev,
                    inode: h.inode,
                }),
                offset: pages.inside,
                len: h.len as usize,
                detached: false,
            });
        }
        prefault(&mappings);
        Ok(mappings)
    }

    pub(super) fn detach_mapping(&self, mapping: &mut HostMapping) -> Result<()> {
        self.require_stable("detaching a mapping")?;
        if mapping.detached {
            return Ok(());
        }
        let addr = mapping.addr();
        let Some(map) = Arc::get_mut(&mut mapping.map) else {
            return Err(IpcError::AddressNotKept {
                addr,
                reason: "the mapping shares its segment's mapping with other handles \
                         (opened by a HostMemory::new backend)"
                    .into(),
            });
        };
        // SAFETY: `map` is this mapping's own (unshared: `get_mut`) mapping of exactly
        // `ptr..ptr + len`; nothing reaches it while detached (copies check `detached`).
        unsafe { reserve_in_place(map.ptr, map.len) }?;
        map.pidfd = None;
        mapping.detached = true;
        tracing::trace!(addr, len = mapping.len, "host mapping detached");
        Ok(())
    }

    pub(super) fn reattach_mapping(&self, mapping: &mut HostMapping, h: &HostHandle) -> Result<()> {
        self.require_stable("reattaching a mapping")?;
        let addr = mapping.addr();
        let not_kept = |reason: String| IpcError::AddressNotKept { addr, reason };
        if !mapping.detached {
            return Err(not_kept("the mapping is not detached".into()));
        }
        check_fields(h)?;
        let pages = page_span(h)?;
        let span = mapping.map.len;
        if pages.span != span || pages.inside != mapping.offset || h.len as usize != mapping.len {
            return Err(not_kept(format!(
                "the handle's {} bytes at offset {} of their page need {} bytes of pages; \
                 the kept range is {} bytes at offset {} ({} bytes of pages)",
                h.len, pages.inside, pages.span, mapping.len, mapping.offset, span
            )));
        }
        let Some(map) = Arc::get_mut(&mut mapping.map) else {
            return Err(not_kept("the mapping's range is shared".into()));
        };
        let Fetched { fd, pidfd } = self.fetch_checked(h)?;
        // SAFETY: `map.ptr..+span` is this detached mapping's own reservation (unshared:
        // `get_mut`); `fd` is a sealed segment of `segment_len >= start + span` bytes
        // (`check_fields`, `check_segment`).
        unsafe { map_over(map.ptr, span, fd.as_fd(), pages.start) }?;
        map.owner = h.pid;
        map.dev = h.dev;
        map.inode = h.inode;
        map.pidfd = pidfd.clone();
        if let Some(pidfd) = pidfd {
            self.cache().keep(h.pid, pidfd);
        }
        mapping.detached = false;
        prefault(std::slice::from_ref(mapping));
        tracing::trace!(
            addr,
            len = mapping.len,
            pid = h.pid,
            "host mapping reattached"
        );
        Ok(())
    }

    pub(super) fn release_buffer(&self, buffer: &mut HostBuffer) -> Result<usize> {
        self.require_stable("releasing a buffer's memory")?;
        let Some(segment) = buffer.segment.as_ref() else {
            return Ok(0);
        };
        if buffer.carved.is_some() || Arc::strong_count(segment) != 1 {
            return Err(IpcError::Unsupported {
                backend: "host",
                what: "releasing a buffer carved out of a shared chunk".into(),
            });
        }
        // Not exportable from now on: its handles are stale.
        segments().remove(buffer.ptr.as_ptr() as usize);
        // SAFETY: the buffer's own segment is mapped exactly at `ptr..ptr + len` (a buffer
        // of its own segment starts at the mapping and spans it); copies through the buffer
        // check `segment` from now on.
        unsafe { reserve_in_place(buffer.ptr, buffer.len) }?;
        let segment = buffer
            .segment
            .take()
            .and_then(Arc::into_inner)
            .expect("the segment is unshared (checked above)");
        segment.forget_mapping();
        tracing::trace!(addr = ?buffer.ptr, len = buffer.len, "host buffer released");
        Ok(buffer.len)
    }

    pub(super) fn restore_buffer(&self, buffer: &mut HostBuffer) -> Result<()> {
        self.require_stable("restoring a buffer's memory")?;
        if buffer.segment.is_some() {
            return Ok(());
        }
        let name = if buffer.private {
            PRIVATE_SEGMENT_NAME
        } else {
            SEGMENT_NAME
        };
        let (fd, dev, inode) = segment_file(buffer.len, name)?;
        // SAFETY: `ptr..ptr + len` is the reservation `release_buffer` left, owned by the
        // buffer; `fd` was just sized to `len` bytes and sealed.
        unsafe { map_over(buffer.ptr, buffer.len, fd.as_fd(), 0) }?;
        let segment = OwnedSegment {
            ptr: buffer.ptr,
            len: buffer.len,
            fd,
            dev,
            inode,
        };
        if !buffer.private {
            segments().insert(
                buffer.ptr.as_ptr() as usize,
                Exportable {
                    len: buffer.len,
                    fd: segment.fd.as_raw_fd(),
                    dev,
                    inode,
                    segment_len: buffer.len,
                    offset: 0,
                },
            );
        }
        buffer.segment = Some(Arc::new(segment));
        tracing::trace!(addr = ?buffer.ptr, len = buffer.len, "host buffer restored");
        Ok(())
    }
}

impl OwnedSegment {
    /// Closes the descriptor without unmapping: the caller replaced the mapping with a
    /// reservation it owns.
    fn forget_mapping(self) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `fd` is read out once from a value that is never dropped (ManuallyDrop),
        // so it is closed once, here, and the mapping it described is left alone.
        drop(unsafe { std::ptr::read(&this.fd) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PeerMemory;

    fn handle(offset: u64, len: u64) -> HostHandle {
        HostHandle {
            pid: 1,
            fd: 3,
            dev: 1,
            inode: 1,
            segment_len: 1 << 20,
            offset,
            len,
        }
    }

    #[test]
    fn a_range_inside_one_page_spans_that_page() {
        let page = page_size();
        let p = page_span(&handle(page as u64 + 16, 32)).unwrap();
        assert_eq!(
            p,
            PageSpan {
                start: page as u64,
                inside: 16,
                span: page
            }
        );
    }

    #[test]
    fn a_range_across_a_page_boundary_spans_both_pages() {
        let page = page_size();
        let p = page_span(&handle(page as u64 - 8, 16)).unwrap();
        assert_eq!(p.start, 0);
        assert_eq!(p.inside, page - 8);
        assert_eq!(p.span, 2 * page);
    }

    #[test]
    fn a_plain_backend_refuses_to_detach_and_to_release() {
        let memory = HostMemory::new();
        let mut buffer = memory.allocate(1 << 21).unwrap();
        match memory.release_backing(&mut buffer) {
            Err(IpcError::Unsupported {
                backend: "host",
                what,
            }) => {
                assert!(what.contains("HostMemory::stable"), "{what}")
            }
            other => panic!("{other:?}"),
        }
        memory.write(&buffer, 0, &[1]).unwrap();
    }

    #[test]
    fn a_released_buffer_is_not_exportable_and_a_restored_one_exports_a_new_segment() {
        let memory = HostMemory::stable();
        let mut buffer = memory.allocate(8192).unwrap();
        assert!(!buffer.is_carved());
        let before = memory.export(buffer.addr(), 8192).unwrap();
        memory.write(&buffer, 0, &[7; 16]).unwrap();
        assert_eq!(memory.release_backing(&mut buffer).unwrap(), 8192);
        assert_eq!(memory.release_backing(&mut buffer).unwrap(), 0);
        assert!(matches!(
            memory.export(buffer.addr(), 8192),
            Err(IpcError::NotExportable { .. })
        ));
        let mut out = [0u8; 16];
        assert!(matches!(
            memory.read(&buffer, 0, &mut out),
            Err(IpcError::Unbacked {
                what: "a released buffer",
                ..
            })
        ));
        let addr = buffer.addr();
        memory.restore_backing(&mut buffer).unwrap();
        assert_eq!(buffer.addr(), addr);
        memory.read(&buffer, 0, &mut out).unwrap();
        assert_eq!(out, [0; 16], "fresh memory reads as zeros");
        let after = memory.export(buffer.addr(), 8192).unwrap();
        assert_ne!(after.inode, before.inode, "a new segment");
    }
}
