//! What the subcommands measure tpcomm against: the MPI peer ([`mpi_world`]) and the C loop
//! that checks it ([`c_loop`], with `peer_loop.c` and `staged_floor.c`), mpi4py
//! ([`mpi4py`], with `objects_peer.py`), and the floors that bound what any implementation
//! can reach on the machine ([`page_floor`], [`handoff_floor`], [`copy_floor`]).

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
