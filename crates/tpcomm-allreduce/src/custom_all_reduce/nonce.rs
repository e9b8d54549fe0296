//! The nonce proof of fresh peer mappings, at creation (where the backend asks) and after
//! every resume: each rank writes a nonce into its Signal block and reads every peer's
//! through its new mapping.

use tpcomm_ipc::PeerMemory;
use tpcomm_transport::Communicator;

use super::{open_mut, CustomAllReduce, SIGNAL};
use crate::backend::Backend;
use crate::error::{AllReduceError, Result};

impl<B: Backend> CustomAllReduce<B> {
    /// The one-time P2P data test of creation ([`Backend::prove_at_creation`]): after
    /// `prior` (this rank's table writes), each rank writes a fresh nonce into its Signal
    /// block, the nonces are all-gathered (tagged [`Step::CreateNonces`](tpcomm_ipc::Step)),
    /// and each rank reads every peer's through its mapping. Returns this rank's outcome (for
    /// the `Ready` step, which fails every rank together); `Err` only when the exchange
    /// itself failed.
    pub(super) fn prove_at_creation<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        prior: Result<()>,
    ) -> Result<Result<()>> {
        let (prepared, proof) =
            self.nonce_test(comm, "new", tpcomm_ipc::Step::CreateNonces, prior)?;
        tracing::debug!(
            rank = self.rank,
            passed = proof.is_ok(),
            "peer-to-peer data test of the new mappings"
        );
        Ok(prepared.and(proof))
    }

    /// The nonce test of fresh mappings, shared by creation and resume: when `prior` (this
    /// rank's own preparation) succeeded, writes a fresh nonce into this rank's Signal block;
    /// every rank all-gathers its nonce, or none after a local failure, under `step`; a rank
    /// that wrote one then reads every announced peer nonce through that peer's mapping.
    /// Returns (this rank's preparation, the proof); `Err` only when the exchange itself
    /// failed. A rank whose preparation failed still joins the exchange, so nobody waits.
    pub(super) fn nonce_test<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        call: &'static str,
        step: tpcomm_ipc::Step,
        prior: Result<()>,
    ) -> Result<(Result<()>, Result<()>)> {
        let nonce = prior.and_then(|()| {
            let res = self.resources(call)?;
            let nonce = fresh_nonce(self.rank);
            self.backend.write_table(
                res.peers.backend(),
                &res.signal,
                self.backend.nonce_offset(),
                &nonce.to_le_bytes(),
            )?;
            Ok(nonce)
        });
        let res = open_mut(&mut self.res, call)?;
        let nonces: Vec<Option<u64>> =
            res.peers.agree(comm, step, &nonce.as_ref().ok().copied())?;
        let proof = match &nonce {
            Ok(_) => self.prove(call, &nonces),
            Err(_) => Ok(()),
        };
        Ok((nonce.map(drop), proof))
    }

    /// Reads every peer's announced nonce through the new mapping of its Signal block.
    fn prove(&self, call: &'static str, nonces: &[Option<u64>]) -> Result<()> {
        let res = self.resources(call)?;
        let memory = res.peers.backend();
        for (peer, expected) in nonces.iter().enumerate() {
            let Some(expected) = *expected else { continue };
            if peer == self.rank {
                continue;
            }
            let mapping = res.peers.peer(res.base, peer, SIGNAL)?;
            let mut raw = [0u8; 8];
            memory.read(mapping, self.backend.nonce_offset(), &mut raw)?;
            let found = u64::from_le_bytes(raw);
            if found != expected {
                return Err(AllReduceError::NonceMismatch {
                    peer,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }
}

/// A nonce unlikely to repeat: time, rank and a per-process counter mixed.
fn fresh_nonce(rank: usize) -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let z = t
        ^ ((rank as u64) << 56)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    crate::backend::mix64(z) | 1
}
