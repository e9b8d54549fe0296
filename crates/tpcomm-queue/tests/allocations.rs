//! Steady state: once warm, the writer's `send` allocates nothing and a reader's `recv`
//! allocates only the value it returns (counted per thread by a counting allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use serde_bytes::ByteBuf;
use tpcomm_queue::{BroadcastQueue, QueueConfig};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is a
// thread-local cell that allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn a_warm_queue_allocates_nothing_but_the_values_it_returns() {
    const MESSAGES: u64 = 200;
    let results = LocalGroup::new(3).run(|comm: LocalCommunicator| {
        let config = QueueConfig {
            depth: 4,
            chunk_bytes: 4096,
            ..QueueConfig::default()
        };
        let mut q = BroadcastQueue::create(&comm, config).unwrap();
        // Sizes within a chunk and across several.
        let values: Vec<ByteBuf> = [64, 4096, 20_000]
            .iter()
            .map(|&n| ByteBuf::from(vec![3u8; n]))
            .collect();
        let mut round = |count: u64| {
            for i in 0..count {
                let v = &values[i as usize % values.len()];
                if q.is_writer() {
                    q.send(v).unwrap();
                } else {
                    let got: ByteBuf = q.recv().unwrap();
                    assert_eq!(&got, v);
                }
            }
        };
        round(10);
        let before = allocations();
        round(MESSAGES);
        let during = allocations() - before;
        comm.barrier().unwrap();
        q.close_with(&comm).unwrap();
        during
    });
    let counts: Vec<u64> = results.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(counts[0], 0, "the writer's sends allocated");
    for &c in &counts[1..] {
        assert_eq!(
            c, MESSAGES,
            "a reader allocated more than one buffer per value"
        );
    }
}
