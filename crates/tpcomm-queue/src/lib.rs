//! # tpcomm-queue
//!
//! A per-step broadcast queue for the control plane of a tensor-parallel engine: every step,
//! the scheduler's rank sends the step's metadata (requests, token ids, block tables,
//! sampling parameters: a few hundred bytes to a few MiB) to every other rank before the
//! model runs. A collective per step (an object broadcast over MPI) pays a rendezvous of
//! every rank and the transport's protocol on each message; [`BroadcastQueue`] pays neither:
//! after a collective creation, the writer's [`send`](BroadcastQueue::send) encodes the
//! value into a ring of chunks in shared memory and returns, and each reader's
//! [`recv`](BroadcastQueue::recv) copies it out, with no call of the transport.
//!
//! ## Design
//!
//! - **Ring.** The writer owns one shared-memory segment (a sealed memfd of `tpcomm-ipc`'s
//!   host backend): a header, one slot per reader on its host (that reader's progress), and
//!   `depth` chunks of `chunk_bytes`. A message takes `max(1, ceil(len / chunk_bytes))`
//!   consecutive chunks (the layout and its rules are in `docs/queue.md`). Each chunk
//!   carries a stamp (its sequence number plus one), the message number, the message length,
//!   the chunk's offset and length and FIRST/LAST flags.
//! - **Flags.** The writer writes chunk `c` once every reader's progress word shows chunk
//!   `c - depth` released, then stores the stamp (release). A reader waits for the stamp,
//!   checks every field, copies the bytes out, checks the stamp again and stores its progress
//!   (releasing the chunk at once: a large message streams through the ring, the writer
//!   filling chunks while the readers empty the ones before). The protocol is model-checked
//!   with loom (`cargo xtask loom`).
//! - **Streaming.** A value of few, large pieces (byte strings) is sized first (postcard's
//!   size pass, given up on values of many small pieces, where it would cost as much as the
//!   copy it saves) and, from 16 KiB or more than a chunk on, encoded straight into the
//!   chunks, each published as soon as it is full: the readers copy a chunk out while the
//!   writer encodes the next, and the bytes are copied once on the writer's side. Other values are encoded into the writer's
//!   buffer and copied into the ring chunk by chunk.
//! - **Messages larger than a chunk** (or than the whole ring) take the overflow path of
//!   consecutive chunks: the writer waits for free chunks as the readers copy, and a reader
//!   returns the value only once its last chunk is in. Never an error, never a partial read;
//!   the only limit is the agreed cap on a message (`Options::max_total_bytes`), checked
//!   by the writer before it sends anything.
//! - **Locality.** At creation every rank all-gathers its process identity (kernel boot id,
//!   PID namespace, PID, start time). The readers with the writer's boot id and PID namespace
//!   try to map the ring; the outcome is agreed, and every reader that does not map it
//!   (another host, a mapping refused here, or [`QueueConfig::via_transport`]) receives
//!   through the transport: the parent communicator is split into the writer and those
//!   readers, and each message is one broadcast of a 256-byte frame there (a header and the
//!   first 224 bytes), plus broadcasts of the rest in pieces that grow with what arrived;
//!   the split's waits are bounded by [`QueueConfig::timeout`] too.
//! - **Types.** Every message carries the shape of the writer's value (the data-model kinds
//!   of its first serde calls, `tpcomm_objects::Shape`); a reader whose type decodes with
//!   another shape gets [`QueueError::TypeMismatch`], not a value of the wrong type.
//! - **Memory.** A ring commits its first 8 MiB at creation (the default 4 MiB ring whole)
//!   and the pages of a larger one as the writer first reaches them (`docs/queue.md`, "What
//!   a ring costs").
//! - **Waits.** Spin, then park on a futex word in the segment, with the local transport's
//!   adaptive spin budget; every wait bounded by [`QueueConfig::timeout`], its error naming
//!   the peer waited for; a parked waiter wakes every tenth of the timeout (at most 100 ms),
//!   checks the parked count a peer could have overwritten, and a peer process's liveness,
//!   so that a peer killed with SIGKILL is reported as gone.
//!   A writer that fails tells its readers through the header, naming the culprit.
//! - **Lifecycle.** [`suspend`](BroadcastQueue::suspend) and
//!   [`resume`](BroadcastQueue::resume) are collective: readers unmap the ring and map it
//!   again (checked again); the ring is host memory owned by the writer, so undelivered
//!   messages survive a process checkpoint. [`close_with`](BroadcastQueue::close_with) closes
//!   every rank together; [`close`](BroadcastQueue::close) and `Drop` close one side.
//!
//! ## Threat model
//!
//! Peers are processes of the same user (mapping a peer's memfd needs ptrace access to it:
//! see `docs/peer-memory.md`), so the queue is no security boundary against a malicious
//! process. What it guarantees, whatever a peer writes into the ring or sends in a frame (a
//! bug, a torn write, a stale or foreign segment): **no undefined behaviour, no panic, no
//! out-of-bounds access, no hang, and no value framed from bytes other than one whole message
//! of the writer's**. Concretely:
//!
//! - every offset is computed from the agreed settings; the segment's own header is only
//!   compared with them (magic, layout version, every geometry field), at creation and at
//!   every resume;
//! - every chunk field is checked before use: the stamp must be the expected chunk's or its
//!   slot's previous one, the message number the expected one, the length the only one its
//!   offset allows (never past the chunk), the total constant over the message and within
//!   the cap, the flags exactly FIRST/LAST as the position implies;
//! - payload bytes are copied out of shared memory before they are decoded (a borrowed value
//!   never points into memory a peer can write), and the stamp is checked again after the
//!   copy: a writer rewriting a chunk under a reader is detected;
//! - decoding keeps the agreed depth limit (`Options::max_depth`), on stack segments sized
//!   for it, and so does the writer's encoding;
//! - every rank number read from the segment is a rank of the group, every parked count one
//!   its waiters can make, and a transport reader reserves the bytes of a message as they
//!   arrive, never ahead of them by more than a piece;
//! - the writer reads only numbers from its readers (progress and state words), compared,
//!   never used as offsets: a progress word past what was published is corruption;
//! - any such violation is [`QueueError::Corrupt`] with a [`Corruption`] naming the field,
//!   the peer and the message, and fails the queue.
//!
//! Not covered: the payload's *content*. The writer is the source of every message; a peer
//! that overwrites payload bytes inside a chunk between the writer's copy and the readers'
//! produces a well-framed message with other bytes (caught only if they do not decode).

#[cfg(test)]
mod attacks;
mod error;
mod layout;
mod queue;
mod ring;
mod shm;
mod wait;

pub use error::{Corruption, Departure, QueueError, Result};
pub use queue::{BroadcastQueue, Locality, QueueConfig, QueuePath};
