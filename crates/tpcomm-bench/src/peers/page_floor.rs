//! The kernel's floor under a suspend + resume of host peer memory: unmapping and mapping
//! again the same number of shared pages, with nothing else (no descriptor fetch, no check,
//! no agreement between ranks), for `tpcomm-bench lifecycle` to time in the same run.
//!
//! A suspend must unmap every peer mapping and a resume must map them again and fault in the
//! pages the first replay reads (or that replay pays for them), so the page-table work of
//! the pages a rank has mapped from its peers bounds the transition from below. The pages
//! are counted from `/proc/self/smaps` (the resident size of every mapping that holds a
//! given peer address), and the floor redoes that work on a memfd of its own with as many
//! pages, written once as a peer's buffers are: `munmap`, then `mmap` and a read of one byte
//! per page (the kernel's fault-around maps its neighbours, as it does for the real pages).

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};

use crate::engine::error::BenchError;

/// The size of a page of `/proc/self/smaps` (`kB` figures) and of this floor's pages.
fn page_size() -> usize {
    rustix::param::page_size()
}

/// Pages mapped now by the mappings of this process that hold any of `addresses`, from
/// `/proc/self/smaps` (each mapping counted once).
pub(crate) fn resident_pages(addresses: &[u64]) -> Result<usize, BenchError> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")
        .map_err(|e| BenchError::Usage(format!("/proc/self/smaps: {e}")))?;
    Ok(resident_pages_in(&smaps, addresses, page_size()))
}

/// [`resident_pages`] over the text of an `smaps` file.
fn resident_pages_in(smaps: &str, addresses: &[u64], page: usize) -> usize {
    let mut holds = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((start, end)) = first.split_once('-').and_then(|(s, e)| {
            Some((
                u64::from_str_radix(s, 16).ok()?,
                u64::from_str_radix(e, 16).ok()?,
            ))
        }) {
            holds = addresses.iter().any(|a| (start..end).contains(a));
        } else if holds && first == "Rss:" {
            kib += words
                .next()
                .and_then(|w| w.parse::<usize>().ok())
                .unwrap_or(0);
        }
    }
    (kib << 10) / page
}

/// A memfd of `pages` pages, written once through a mapping kept for its lifetime, and a
/// second mapping of it that [`PageFloor::unmap`] and [`PageFloor::map`] take down and make
/// again.
#[derive(Debug)]
pub(crate) struct PageFloor {
    fd: OwnedFd,
    len: usize,
    owner: NonNull<c_void>,
    view: Option<NonNull<c_void>>,
}

/// Maps the whole of `fd` shared, read-write.
fn map_shared(fd: &OwnedFd, len: usize) -> Result<NonNull<c_void>, BenchError> {
    // SAFETY: a new mapping at an address the kernel picks, of a memfd of `len` bytes this
    // value owns; nothing else is at that address.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(|e| BenchError::Usage(format!("mmap of the page floor: {e}")))?;
    NonNull::new(ptr).ok_or_else(|| BenchError::Usage("mmap returned null".into()))
}

/// Reads one byte of each page of the `len` bytes at `ptr`.
fn touch(ptr: NonNull<c_void>, len: usize) {
    for offset in (0..len).step_by(page_size()) {
        // SAFETY: `ptr` is a live mapping of `len` bytes of a memfd that this floor sized to
        // `len` and never shrinks; an atomic load is defined whatever else maps the page.
        let byte = unsafe { AtomicU8::from_ptr(ptr.as_ptr().cast::<u8>().add(offset)) };
        std::hint::black_box(byte.load(Ordering::Relaxed));
    }
}

impl PageFloor {
    /// A floor of `pages` pages (at least one), mapped and touched.
    pub(crate) fn new(pages: usize) -> Result<Self, BenchError> {
        let len = pages.max(1) * page_size();
        let fail = |what: &str, e: rustix::io::Errno| {
            BenchError::Usage(format!("{what} of the page floor: {e}"))
        };
        let fd = rustix::fs::memfd_create("tpcomm-bench-floor", MemfdFlags::CLOEXEC)
            .map_err(|e| fail("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| fail("ftruncate", e))?;
        let owner = map_shared(&fd, len)?;
        for offset in (0..len).step_by(page_size()) {
            // SAFETY: `owner` maps `len` bytes of the memfd, sized above; only this value
            // writes them.
            let byte = unsafe { AtomicU8::from_ptr(owner.as_ptr().cast::<u8>().add(offset)) };
            byte.store(1, Ordering::Relaxed);
        }
        let mut floor = Self {
            fd,
            len,
            owner,
            view: None,
        };
        floor.map()?;
        Ok(floor)
    }

    /// Pages of the floor.
    pub(crate) fn pages(&self) -> usize {
        self.len / page_size()
    }

    /// Unmaps the second mapping (a suspend's work); nothing when it is not mapped.
    pub(crate) fn unmap(&mut self) -> Result<(), BenchError> {
        if let Some(view) = self.view.take() {
            // SAFETY: `view` is this floor's mapping of `len` bytes, made by `map` and
            // referenced nowhere else once taken out of `self.view`.
            unsafe { rustix::mm::munmap(view.as_ptr(), self.len) }
                .map_err(|e| BenchError::Usage(format!("munmap of the page floor: {e}")))?;
        }
        Ok(())
    }

    /// Maps the memfd again and reads a byte of each page (a resume's work, pre-faulted).
    pub(crate) fn map(&mut self) -> Result<(), BenchError> {
        self.unmap()?;
        let view = map_shared(&self.fd, self.len)?;
        touch(view, self.len);
        self.view = Some(view);
        Ok(())
    }
}

impl Drop for PageFloor {
    fn drop(&mut self) {
        let _ = self.unmap();
        // SAFETY: `owner` is this floor's first mapping of `len` bytes, made in `new` and
        // used by nothing past this point.
        let _ = unsafe { rustix::mm::munmap(self.owner.as_ptr(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-s 00000000 00:01 12 /memfd:tpcomm-peer (deleted)
Size:               4096 kB
Rss:                 136 kB
Pss:                  68 kB
7f0000400000-7f0000800000 rw-s 00000000 00:01 13 /memfd:tpcomm-peer (deleted)
Size:               4096 kB
Rss:                  40 kB
7f0000800000-7f0000801000 rw-p 00000000 00:00 0
Rss:                   4 kB
";

    #[test]
    fn resident_pages_sum_the_mappings_that_hold_an_address_once_each() {
        let page = 4096;
        let two_in_first = [0x7f00_0000_1000, 0x7f00_0000_2000];
        assert_eq!(resident_pages_in(SMAPS, &two_in_first, page), 34);
        let both = [0x7f00_0000_1000, 0x7f00_0040_0000];
        assert_eq!(resident_pages_in(SMAPS, &both, page), 44);
        assert_eq!(resident_pages_in(SMAPS, &[0x7f00_0080_0000], page), 1);
        assert_eq!(
            resident_pages_in(SMAPS, &[0x1000], page),
            0,
            "no mapping holds it"
        );
    }

    #[test]
    fn the_floor_maps_its_pages_again_after_each_unmap() {
        let mut floor = PageFloor::new(8).unwrap();
        assert_eq!(floor.pages(), 8);
        let view = floor.view.unwrap().as_ptr() as u64;
        let resident = resident_pages(&[view]).unwrap();
        assert_eq!(resident, 8, "every page faulted in by the touch");
        floor.unmap().unwrap();
        assert!(floor.view.is_none());
        floor.unmap().unwrap();
        floor.map().unwrap();
        let view = floor.view.unwrap().as_ptr() as u64;
        assert_eq!(resident_pages(&[view]).unwrap(), 8, "faulted in again");
    }
}
