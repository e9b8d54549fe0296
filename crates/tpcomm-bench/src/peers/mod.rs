//! What the subcommands measure tpcomm against: the MPI peer ([`mpi_world`]) and the C loop
//! that checks it ([`c_loop`], with `peer_loop.c` and `staged_floor.c`), mpi4py
//! ([`mpi4py`], with `objects_peer.py`), and the floors that bound what any implementation
//! can reach on the machine ([`page_floor`], [`handoff_floor`], [`copy_floor`]).

use tpcomm::Communicator;
use tpcomm_ipc::{HostBuffer, HostMemory, MemoryRegion, PeerMappings, PeerMemory, Region};

use crate::engine::error::BenchError;

pub(crate) mod c_loop;
pub(crate) mod copy_floor;
pub(crate) mod handoff_floor;
pub(crate) mod mpi4py;
pub(crate) mod mpi_world;
pub(crate) mod page_floor;

/// An error naming `what` unless `input` and `output` have the same length.
pub(crate) fn same_length(what: &str, input: &[f32], output: &[f32]) -> Result<(), BenchError> {
    match input.len() == output.len() {
        true => Ok(()),
        false => Err(BenchError::Usage(format!(
            "{what}: {} elements in, {} out",
            input.len(),
            output.len()
        ))),
    }
}

/// `n` as an MPI count (a C `int`).
pub(crate) fn mpi_int(n: usize) -> Result<i32, BenchError> {
    i32::try_from(n).map_err(|_| BenchError::Usage("a count beyond MPI's 32 bits".into()))
}

/// A host buffer of rank 0's that every other rank maps (the floors' shared memory): the
/// buffer, the mappings, and where the buffer starts in this process.
#[derive(Debug)]
pub(crate) struct WriterBuffer {
    /// Rank 0's buffer (kept for the floor's life; elsewhere a placeholder of
    /// [`WriterBuffer::new`]'s `header` bytes).
    _buffer: HostBuffer,
    /// The other ranks' mappings of rank 0's buffer.
    peers: PeerMappings<HostMemory>,
    /// The first byte of rank 0's buffer in this process: the buffer itself, or the
    /// mapping of it (valid while `self` lives), page aligned.
    pub(crate) base: *mut u8,
}

impl WriterBuffer {
    /// Collective: rank 0 allocates `header + len` bytes and every other rank maps them
    /// (every rank passes the same `header` and `len`); `what` names the floor in errors.
    pub(crate) fn new<C: Communicator>(
        comm: &C,
        header: usize,
        len: usize,
        what: &str,
    ) -> Result<Self, BenchError> {
        let writer = comm.rank() == 0;
        let memory = HostMemory::new();
        let buffer = memory.allocate(if writer { header + len } else { header })?;
        let region = Region {
            addr: buffer.addr(),
            len: buffer.len(),
        };
        let mut peers = PeerMappings::new(memory, comm)?;
        let id = peers.exchange(comm, &[region])?;
        let base = if writer {
            buffer.as_ptr()
        } else {
            let mapping = peers.peer(id, 0, 0)?;
            if mapping.len() < header + len {
                return Err(BenchError::Usage(format!(
                    "{what}: rank 0 shares {} bytes, {} needed",
                    mapping.len(),
                    header + len
                )));
            }
            mapping.as_ptr()
        };
        Ok(Self {
            _buffer: buffer,
            peers,
            base,
        })
    }

    /// Unmaps this rank's mapping of rank 0's buffer (none on rank 0, whose buffer goes
    /// when `self` drops).
    pub(crate) fn close(mut self) -> Result<(), BenchError> {
        self.peers.close_all()?;
        Ok(())
    }
}
