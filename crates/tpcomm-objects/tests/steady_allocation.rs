//! Steady-state object collectives allocate only the values they return: the send buffer,
//! the receive buffer and the transport's post are kept from one call to the next (a fresh
//! buffer past glibc's mmap threshold costs a page fault per 4 KiB page, more than the
//! transfer itself).
//!
//! A dedicated test binary, so that its global allocator counts nothing but these tests (per
//! thread: each rank is a thread of its own).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use serde_bytes::ByteBuf;
use tpcomm_objects::{
    all_gather, all_gather_borrowed, all_gather_into, broadcast_into, gather_into,
};
use tpcomm_transport::{Communicator, LocalGroup};

/// Counts the bytes each thread allocates (realloc growth included).
struct PerThread;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // `try_with`: the allocator also runs while thread-locals are torn down.
    let _ = ALLOCATED.try_with(|a| a.set(a.get() + bytes));
}

fn allocated() -> usize {
    ALLOCATED.with(Cell::get)
}

// SAFETY: delegates every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size.saturating_sub(layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: PerThread = PerThread;

const BLOB: usize = 64 << 10;

/// Calls of each kind; the first two warm the kept buffers up.
const CALLS: usize = 8;

/// Steady calls (of `CALLS - 2`) that must allocate nothing beyond their values. Not all:
/// the threads transport reuses a post only once every peer has let go of it, and a peer
/// the scheduler holds up (a loaded machine) can make one call take a fresh post. A buffer
/// made on every call still fails every one of them.
const STEADY_WITHIN: usize = 4;

#[test]
fn steady_state_all_gathers_allocate_only_the_values_they_return() {
    let results = LocalGroup::new(2).run(|comm| {
        let mine = ByteBuf::from(vec![comm.rank() as u8 + 1; BLOB]);
        let mut owned = Vec::new();
        let mut borrowed = Vec::new();
        for _ in 0..CALLS {
            let before = allocated();
            let all: Vec<ByteBuf> = all_gather(&comm, &mine).unwrap();
            owned.push(allocated() - before);
            assert_eq!(all[1 - comm.rank()][0], 2 - comm.rank() as u8);
            drop(all);

            let before = allocated();
            let gathered = all_gather_borrowed(&comm, &mine).unwrap();
            borrowed.push(allocated() - before);
            let views: Vec<&serde_bytes::Bytes> = gathered.decode().unwrap();
            assert_eq!(views[1 - comm.rank()].len(), BLOB);
            drop(views);
            drop(gathered);
            comm.barrier().unwrap();
        }
        (owned, borrowed)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (owned, borrowed) = r.unwrap();
        // The returned values: two 64 KiB blobs and the vector holding them. Slack for the
        // bookkeeping (header entries, counts, a post's reference count): well under one
        // blob, so that any per-call send, receive or post buffer shows.
        let values = 2 * BLOB + 2 * std::mem::size_of::<ByteBuf>();
        let slack = 8 << 10;
        let within = |calls: &[usize], bound: usize| {
            calls
                .iter()
                .skip(2)
                .filter(|&&bytes| bytes <= bound)
                .count()
        };
        assert!(
            within(&owned, values + slack) >= STEADY_WITHIN,
            "rank {rank}: fewer than {STEADY_WITHIN} steady all_gather calls allocated only \
             their values ({values} bytes + {slack} slack); calls: {owned:?}"
        );
        assert!(
            within(&borrowed, slack) >= STEADY_WITHIN,
            "rank {rank}: fewer than {STEADY_WITHIN} steady all_gather_borrowed calls \
             allocated at most {slack} bytes; calls: {borrowed:?}"
        );
    }
}

/// The `_into` forms decode over the values of the last call: once `out` has room for every
/// rank's strings, a steady call allocates nothing for them (only the bookkeeping slack).
#[test]
fn steady_state_into_forms_allocate_nothing_for_strings_they_can_reuse() {
    let results = LocalGroup::new(2).run(|comm| {
        let mine: Vec<String> = (0..64).map(|i| format!("{i:01000}")).collect();
        let mut all: Vec<Vec<String>> = Vec::new();
        let mut one: Vec<String> = Vec::new();
        let mut at_root: Vec<Vec<String>> = Vec::new();
        let mut calls = Vec::new();
        for _ in 0..CALLS {
            let before = allocated();
            all_gather_into(&comm, &mine, &mut all).unwrap();
            let root_has = (comm.rank() == 1).then_some(&mine);
            broadcast_into(&comm, 1, root_has, &mut one).unwrap();
            let filled = gather_into(&comm, 0, &mine, &mut at_root).unwrap();
            calls.push(allocated() - before);
            assert_eq!(all[1 - comm.rank()], mine);
            assert_eq!(one, mine);
            assert_eq!(filled, comm.rank() == 0);
            if filled {
                assert_eq!(at_root[1], mine);
            }
            comm.barrier().unwrap();
        }
        calls
    });
    for (rank, r) in results.into_iter().enumerate() {
        let calls = r.unwrap();
        // Three times 64 strings of 1000 bytes arrive per call (and twice more at the gather's
        // root): 192 KB a fresh decode would allocate. The slack is that of the test above.
        let slack = 8 << 10;
        let steady = calls.iter().skip(2).filter(|&&b| b <= slack).count();
        assert!(
            steady >= STEADY_WITHIN,
            "rank {rank}: fewer than {STEADY_WITHIN} steady all_gather_into + broadcast_into + \
             gather_into calls allocated at most {slack} bytes; calls: {calls:?}"
        );
        assert!(
            calls[0] >= 3 * 64 * 1000,
            "the first call fills `out`: {calls:?}"
        );
    }
}
