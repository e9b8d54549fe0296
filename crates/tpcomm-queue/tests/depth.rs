//! Nesting: the writer refuses a value deeper than the agreed `max_depth` (nothing sent,
//! never a stack overflow), and a reader decodes the deepest value the agreed depth allows
//! on a rank thread's 2 MiB stack, in debug and release builds (alone in their test binary:
//! before the fix each of these aborted the process).

use serde::{Deserialize, Serialize};
use tpcomm_objects::Options;
use tpcomm_queue::{BroadcastQueue, QueueConfig, QueueError};
use tpcomm_transport::{LocalCommunicator, LocalGroup};

/// A chain of `Nest`s: a newtype struct and an option per link (two levels of nesting).
#[derive(Debug, Serialize, Deserialize)]
struct Nest(Option<Box<Nest>>);

impl Nest {
    fn chain(links: usize) -> Self {
        let mut n = Nest(None);
        for _ in 0..links {
            n = Nest(Some(Box::new(n)));
        }
        n
    }
}

impl Drop for Nest {
    // Unlinked one by one: dropping a long chain recursively would overflow the stack.
    fn drop(&mut self) {
        let mut next = self.0.take();
        while let Some(mut n) = next {
            next = n.0.take();
        }
    }
}

#[test]
fn a_value_nested_past_the_agreed_depth_is_refused_by_the_writer_with_nothing_sent() {
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut q = BroadcastQueue::create(&comm, QueueConfig::default())?;
        if q.is_writer() {
            match q.send(&Nest::chain(100_000)) {
                Err(QueueError::TooDeep {
                    message: 0,
                    limit: Options::DEFAULT_MAX_DEPTH,
                    ..
                }) => {}
                other => panic!("expected the writer to refuse the depth, got {other:?}"),
            }
            q.send(&Nest::chain(3))?;
        } else {
            let got: Nest = q.recv()?;
            assert!(got.0.is_some(), "the next message arrives, and only it");
        }
        q.close_with(&comm)
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(matches!(r, Ok(Ok(()))), "rank {rank}: {r:?}");
    }
}

/// About 2 KiB of fields per level, 257 bytes of postcard: the deepest chain the maximum
/// depth allows is 66 KB.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Wide {
    a: [u64; 32],
    b: [u64; 32],
    c: [u64; 32],
    d: [u64; 32],
    e: [u64; 32],
    f: [u64; 32],
    g: [u64; 32],
    h: [u64; 32],
    next: Option<Box<Wide>>,
}

impl Wide {
    /// `links` levels; each is a struct and an option: two levels of nesting.
    fn chain(links: usize) -> Self {
        let mut w = None;
        for i in 0..links {
            let fill = [i as u64 % 3; 32];
            w = Some(Box::new(Wide {
                a: fill,
                b: fill,
                c: fill,
                d: fill,
                e: fill,
                f: fill,
                g: fill,
                h: fill,
                next: w,
            }));
        }
        *w.expect("at least one link")
    }
}

#[test]
fn the_deepest_value_the_agreed_depth_allows_decodes_on_a_rank_thread_stack() {
    // Each link takes two levels (its struct; its option, at the depth of its arrays): 256
    // links reach the 512 allowed, the innermost `None` the 512th.
    const LINKS: usize = Options::MAX_DEPTH / 2;
    let results = LocalGroup::new(2).run(|comm: LocalCommunicator| {
        let mut config = QueueConfig::default();
        config.options.max_depth = Options::MAX_DEPTH;
        let mut q = BroadcastQueue::create(&comm, config)?;
        if q.is_writer() {
            q.send(&Wide::chain(LINKS))?;
        } else {
            let got: Wide = q.recv()?;
            assert!(got == Wide::chain(LINKS), "the value arrives whole");
        }
        q.close_with(&comm)
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(matches!(r, Ok(Ok(()))), "rank {rank}: {r:?}");
    }
}
