//! Steady state: once warm, the writer's `send` allocates nothing and a reader's `recv`
//! allocates only the value it returns (counted per thread by a counting allocator); and a
//! reader whose buffer cannot grow in the middle of a message (the allocator refusing, per
//! thread, blocks past a size) skips it and reads the next.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use serde_bytes::ByteBuf;
use tpcomm_queue::{BroadcastQueue, QueueConfig};
use tpcomm_transport::{Communicator, LocalCommunicator, LocalGroup};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    /// Blocks of at least this many bytes are refused on this thread.
    static REFUSE_FROM: Cell<usize> = const { Cell::new(usize::MAX) };
}

// SAFETY: every call is forwarded to the system allocator unchanged, or refused with a null
// pointer (which `GlobalAlloc` allows); the counter and the limit are thread-local cells that
// allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= REFUSE_FROM.with(Cell::get) {
            return std::ptr::null_mut();
        }
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= REFUSE_FROM.with(Cell::get) {
            return std::ptr::null_mut();
        }
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

#[test]
fn a_reader_that_cannot_allocate_in_the_middle_of_a_message_skips_it_and_reads_the_next() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let config = QueueConfig {
            depth: 4,
            chunk_bytes: 1024,
            ..QueueConfig::default()
        };
        let mut q = BroadcastQueue::create(&comm, config).unwrap();
        // 64 chunks each: the reader's buffer grows chunk by chunk, and is refused past 16 KiB,
        // in the middle of the first.
        let big = |b: u8| ByteBuf::from(vec![b; 64 << 10]);
        if q.is_writer() {
            let sent = [big(1), ByteBuf::from(vec![2; 10]), big(3)]
                .iter()
                .try_for_each(|v| q.send(v));
            comm.barrier().unwrap();
            q.close_with(&comm).unwrap();
            return (sent, Vec::new());
        }
        REFUSE_FROM.with(|r| r.set(16 << 10));
        let first = q.recv::<ByteBuf>().map(ByteBuf::into_vec);
        REFUSE_FROM.with(|r| r.set(usize::MAX));
        let mut got = vec![first];
        for _ in 0..2 {
            got.push(q.recv::<ByteBuf>().map(ByteBuf::into_vec));
        }
        comm.barrier().unwrap();
        q.close_with(&comm).unwrap();
        (Ok(()), got)
    });
    let mut results = results.into_iter().map(|r| r.unwrap());
    let (sent, _) = results.next().unwrap();
    assert!(
        sent.is_ok(),
        "the writer blamed for the reader's allocation: {sent:?}"
    );
    let (_, got) = results.next().unwrap();
    assert!(
        matches!(
            got[0],
            Err(tpcomm_queue::QueueError::Allocation { message: 0, .. })
        ),
        "{:?}",
        got[0].as_ref().map(Vec::len)
    );
    assert_eq!(got[1].as_deref().ok(), Some(&[2u8; 10][..]));
    assert_eq!(got[2].as_deref().ok(), Some(&[3u8; 64 << 10][..]));
}
