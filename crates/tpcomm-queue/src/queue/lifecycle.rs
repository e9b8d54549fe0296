//! The lifecycle: the collective suspend, resume and close (each one tagged step of the
//! group), closing one side alone, and failing the queue for good, told to the peers.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tpcomm_ipc::{tagged_all_gather, IpcError, Step, StepTag};
use tpcomm_transport::Communicator;

use super::transport::{write_frame, END};
use super::{BroadcastQueue, Life, Role};
use crate::error::{Departure, QueueError, Result};
use crate::layout::{Layout, ReaderState, WriterState};
use crate::shm::{JoinError, SharedRing};

impl<C: Communicator> BroadcastQueue<C> {
    /// Collective: suspends the queue with the rest of the group. Every rank agrees in one
    /// tagged step; then each reader on the writer's host unmaps the ring, so that this
    /// process holds no peer mapping. The ring is host memory owned by the writer: messages
    /// sent and not received yet stay in it. Until [`resume`](Self::resume), `send` and
    /// `recv` fail with [`Suspended`](QueueError::Suspended). Suspending a suspended queue
    /// does nothing.
    pub fn suspend(&mut self, comm: &C) -> Result<()> {
        self.same_group(comm)?;
        match &self.life {
            Life::Suspended => return Ok(()),
            Life::Failed { .. } => return Err(self.refused("suspend")),
            Life::Active | Life::Ended => {}
        }
        let _span = tracing::info_span!("queue_suspend", rank = self.rank).entered();
        let sequence = self.next_step();
        if let Err(e) = step(comm, Step::QueueSuspend, self.id, sequence, &self.messages) {
            return Err(self.fail(e));
        }
        if let Role::Reader { ring, .. } = &mut self.role {
            if let Some(ring) = ring.take() {
                let unmapped = ring
                    .unmap(&self.memory)
                    .map_err(|source| QueueError::Memory {
                        rank: self.rank,
                        what: "unmapping the ring",
                        source,
                    });
                if let Err(e) = unmapped {
                    return Err(self.fail(e));
                }
            }
        }
        self.life = Life::Suspended;
        tracing::info!(
            rank = self.rank,
            messages = self.messages,
            "queue suspended"
        );
        Ok(())
    }

    /// Collective: resumes a suspended queue. Each reader on the writer's host maps the ring
    /// again and checks it (the layout version and every header field against the agreed
    /// settings, its slot's claim, its progress word against its own count); the outcomes
    /// are agreed, so that a failure on one rank fails the queue on every rank
    /// ([`PeerFailed`](QueueError::PeerFailed) naming it). Resuming an active queue does
    /// nothing.
    pub fn resume(&mut self, comm: &C) -> Result<()> {
        self.same_group(comm)?;
        match &self.life {
            Life::Suspended => {}
            Life::Failed { .. } => return Err(self.refused("resume")),
            Life::Active | Life::Ended => return Ok(()),
        }
        let _span = tracing::info_span!("queue_resume", rank = self.rank).entered();
        let mut own_error = None;
        if let Role::Reader {
            ring,
            handle,
            slot,
            next_chunk,
        } = &mut self.role
        {
            // The ring's slots, as created: one per reader on the writer's host, including
            // those that could not map it.
            let layout = Layout::new(self.settings.depth, self.settings.chunk_bytes, self.slots)
                .expect("the layout existed at creation");
            match SharedRing::rejoin(
                &self.memory,
                handle,
                layout,
                (self.id, self.writer),
                (*slot, self.rank),
                *next_chunk,
            ) {
                Ok(mapped) => *ring = Some(mapped),
                Err(e) => {
                    own_error = Some(match e {
                        JoinError::Unreachable(source) => QueueError::Memory {
                            rank: self.rank,
                            what: "mapping the ring again",
                            source,
                        },
                        JoinError::Corrupt(problem) => QueueError::Corrupt {
                            rank: self.rank,
                            peer: self.writer,
                            message: self.messages,
                            problem,
                        },
                        JoinError::Late { messages } => QueueError::JoinedLate {
                            rank: self.rank,
                            writer: self.writer,
                            messages,
                        },
                    })
                }
            }
        }
        let sequence = self.next_step();
        let verdict = own_error.as_ref().map(|e| e.to_string());
        let verdicts: Vec<Option<String>> =
            match step(comm, Step::QueueResume, self.id, sequence, &verdict) {
                Ok(v) => v,
                Err(e) => return Err(self.fail(e)),
            };
        let failed: Vec<usize> = (0..self.size).filter(|&r| verdicts[r].is_some()).collect();
        if !failed.is_empty() {
            let e = own_error.unwrap_or(QueueError::PeerFailed {
                rank: self.rank,
                step: "resume",
                ranks: failed,
            });
            return Err(self.fail(e));
        }
        self.life = Life::Active;
        tracing::info!(rank = self.rank, messages = self.messages, "queue resumed");
        Ok(())
    }

    /// Collective: closes the queue on every rank. The ranks agree in one tagged step (each
    /// saying how many messages it sent or received: messages a reader never received are
    /// reported in the trace), then the writer frees the ring and the readers unmap it.
    /// Works on a suspended queue too; on a failed one, [`close`](Self::close) is the way.
    pub fn close_with(mut self, comm: &C) -> Result<()> {
        self.same_group(comm)?;
        let _span = tracing::info_span!("queue_close", rank = self.rank).entered();
        let sequence = self.next_step();
        let counts: Vec<u64> = step(comm, Step::QueueClose, self.id, sequence, &self.messages)?;
        let sent = counts[self.writer];
        let unread: Vec<(usize, u64)> = (0..self.size)
            .filter(|&r| r != self.writer && counts[r] < sent)
            .map(|r| (r, sent - counts[r]))
            .collect();
        if !unread.is_empty() {
            tracing::info!(
                rank = self.rank,
                ?unread,
                "queue closed with messages not received"
            );
        }
        self.depart(Departure::Closed, false);
        self.release()
    }

    /// Closes this rank's side alone (not collective): the writer marks the ring closed,
    /// so that its readers receive every message it sent and then
    /// [`Closed`](QueueError::Closed), and sends the transport readers an end frame; a
    /// reader marks its slot closed, so that a writer that laps it gets
    /// [`ReaderGone`](QueueError::ReaderGone). Then the ring is freed or unmapped. Dropping
    /// the queue does the same without the end frame, and says it was dropped.
    pub fn close(mut self) -> Result<()> {
        let _span =
            tracing::info_span!("queue_close", rank = self.rank, collective = false).entered();
        self.depart(Departure::Closed, true);
        self.release()
    }

    /// Ok while active; the refusal otherwise.
    pub(super) fn usable(&self, op: &'static str) -> Result<()> {
        match self.life {
            Life::Active => Ok(()),
            _ => Err(self.refused(op)),
        }
    }

    /// The error refusing `op` in the current state.
    pub(super) fn refused(&self, op: &'static str) -> QueueError {
        match &self.life {
            Life::Suspended => QueueError::Suspended {
                rank: self.rank,
                op,
            },
            Life::Failed { culprit, reason } => QueueError::Failed {
                rank: self.rank,
                op,
                culprit: *culprit,
                reason: reason.clone(),
            },
            Life::Ended => QueueError::Closed {
                rank: self.rank,
                writer: self.writer,
                messages: self.messages,
            },
            Life::Active => QueueError::Failed {
                rank: self.rank,
                op,
                culprit: None,
                reason: "the ring is not mapped".into(),
            },
        }
    }

    /// Fails the queue for good with `e` (the first failure is kept), telling the peers on
    /// this host: the writer marks the ring failed naming the culprit, a reader marks its
    /// slot as left. Returns `e`.
    pub(super) fn fail(&mut self, e: QueueError) -> QueueError {
        if !matches!(self.life, Life::Failed { .. }) {
            let culprit = e.culprit();
            tracing::warn!(rank = self.rank, error = %e, "queue failed");
            match &self.role {
                Role::Writer {
                    ring: Some(ring), ..
                } => {
                    ring.set_writer_state(WriterState::Failed, culprit.or(Some(self.rank)));
                }
                Role::Reader {
                    ring: Some(ring),
                    slot,
                    ..
                } => ring.set_reader_state(*slot, ReaderState::Dropped),
                _ => {}
            }
            self.life = Life::Failed {
                culprit,
                reason: e.to_string(),
            };
        }
        e
    }

    /// Tells the peers on this host that this rank leaves (`how`), and with `end_frame` the
    /// transport readers too (the writer's end frame).
    fn depart(&mut self, how: Departure, end_frame: bool) {
        if self.departed {
            return;
        }
        self.departed = true;
        let failed = matches!(self.life, Life::Failed { .. });
        match &self.role {
            Role::Writer {
                ring: Some(ring), ..
            } if !failed => {
                let state = match how {
                    Departure::Closed => WriterState::Closed,
                    Departure::Dropped | Departure::Exited => WriterState::Dropped,
                };
                ring.set_writer_state(state, None);
            }
            Role::Reader {
                ring: Some(ring),
                slot,
                ..
            } => {
                let state = match how {
                    Departure::Closed => ReaderState::Closed,
                    Departure::Dropped | Departure::Exited => ReaderState::Dropped,
                };
                ring.set_reader_state(*slot, state);
            }
            _ => {}
        }
        if end_frame && self.is_writer() && !failed {
            if let Some(remote) = &self.remote {
                write_frame(&mut self.frame, END, self.messages, (0, 0));
                if let Err(e) = remote.broadcast(0, &mut self.frame) {
                    tracing::warn!(rank = self.rank, error = %e, "the end frame was not sent");
                }
            }
        }
        tracing::info!(rank = self.rank, messages = self.messages, how = %how, "queue closed");
    }

    /// Frees the writer's ring or unmaps a reader's, reporting a failure.
    fn release(mut self) -> Result<()> {
        let ring = match &mut self.role {
            Role::Writer { ring, .. } | Role::Reader { ring, .. } => ring.take(),
            Role::Remote => None,
        };
        match ring {
            Some(ring) => ring
                .unmap(&self.memory)
                .map_err(|source| QueueError::Memory {
                    rank: self.rank,
                    what: "unmapping the ring",
                    source,
                }),
            None => Ok(()),
        }
    }

    fn same_group(&self, comm: &C) -> Result<()> {
        if comm.rank() == self.rank && comm.size() == self.size {
            return Ok(());
        }
        Err(QueueError::WrongCommunicator {
            rank: self.rank,
            size: self.size,
            comm_rank: comm.rank(),
            comm_size: comm.size(),
        })
    }

    fn next_step(&mut self) -> u64 {
        let s = self.steps;
        self.steps += 1;
        s
    }
}

impl<C: Communicator> Drop for BroadcastQueue<C> {
    fn drop(&mut self) {
        self.depart(Departure::Dropped, false);
    }
}

/// One tagged all-gather of the queue's life.
pub(super) fn step<C, T>(
    comm: &C,
    step: Step,
    group: u64,
    sequence: u64,
    value: &T,
) -> Result<Vec<T>>
where
    C: Communicator + ?Sized,
    T: Serialize + DeserializeOwned,
{
    let tag = StepTag {
        step,
        group,
        sequence,
    };
    tagged_all_gather(comm, tag, value).map_err(|source: IpcError| QueueError::Step {
        rank: comm.rank(),
        step: step.name(),
        source,
    })
}
