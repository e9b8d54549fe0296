//! The C loop: the MPI calls of a C benchmark loop (`peer_loop.c`, one iteration: an
//! `MPI_Barrier`, then the call timed in C) and the staged all-reduce floors
//! (`staged_floor.c`), compiled with `mpicc` by each rank and loaded. It is the reference
//! the in-run MPI peer is checked against (`peer-check`, the `C loop` row of `allreduce`).

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::data::collective::{Case, TransportOp};
use crate::engine::error::BenchError;
use crate::peers::{mpi_int, same_length};

/// The C source of the C loop, compiled by each rank into its own temporary directory.
const C_SOURCE: &str = include_str!("peer_loop.c");
/// The C source of the staged floors, built into the same library.
const FLOOR_SOURCE: &str = include_str!("staged_floor.c");

/// One iteration of the C loop: `peer_iteration` of `peer_loop.c`.
type Iteration =
    unsafe extern "C" fn(i32, *const c_void, i32, *mut c_void, *const i32, *const i32, i32) -> i64;
/// One call of a staged floor: `staged_floor` of `staged_floor.c`.
type FloorCall = unsafe extern "C" fn(i32, *const c_void, i32, *mut c_void, i32) -> i64;

/// The staged all-reduce floors of `staged_floor.c` (op codes there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StagedFloor {
    /// Copy in, one barrier, sum every rank's buffer.
    OneStage = 1,
    /// Copy in the parts peers reduce, barrier, reduce a part, barrier, gather the parts.
    TwoStage = 2,
}

/// The MPI calls of a C benchmark loop (`src/peers/peer_loop.c`), compiled with `mpicc -O2`
/// into a shared library by this rank and loaded: the reference the in-run peer is checked
/// against (`peer-check`, and the `C loop` row of `allreduce`).
pub(crate) struct CLoop {
    /// The library, kept loaded while `iteration` may be called.
    _library: libloading::Library,
    iteration: Iteration,
    floor: FloorCall,
}

impl std::fmt::Debug for CLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CLoop")
    }
}

impl CLoop {
    /// The op code of `MPI_Allreduce` (sum of floats) in `peer_loop.c`.
    pub(crate) const ALL_REDUCE: i32 = 2;

    /// Compiles the C loop in a temporary directory of this process and loads it.
    pub(crate) fn load() -> Result<Self, BenchError> {
        let dir = std::env::temp_dir().join(format!("tpcomm-bench-peer-{}", std::process::id()));
        let built = build(&dir);
        let loaded = built.and_then(|path| {
            let load = |e: libloading::Error| BenchError::Usage(format!("{}: {e}", path.display()));
            // SAFETY: the library is ours, just compiled from `peer_loop.c`, with no
            // initializers.
            let library = unsafe { libloading::Library::new(&path) }.map_err(load)?;
            // SAFETY: `peer_iteration` in `peer_loop.c` has the signature of `Iteration`.
            let symbol = unsafe { library.get::<Iteration>(b"peer_iteration\0") };
            let iteration = *symbol.map_err(load)?;
            // SAFETY: `staged_floor` in `staged_floor.c` has the signature of `FloorCall`.
            let symbol = unsafe { library.get::<FloorCall>(b"staged_floor\0") };
            let floor = *symbol.map_err(load)?;
            Ok(Self {
                _library: library,
                iteration,
                floor,
            })
        });
        let _ = std::fs::remove_dir_all(&dir);
        loaded
    }

    /// One iteration of the C loop: call `op` on the buffers; with `timed`, an
    /// `MPI_Barrier` first and the call timed in C (its nanoseconds on this rank), otherwise
    /// the call alone (0).
    ///
    /// # Safety
    /// `send` must hold `send_count` elements of the op's type and `recv`, `counts` and
    /// `displs` what the op needs for the communicator's ranks (see `peer_loop.c`); every
    /// rank makes the same call.
    unsafe fn call(
        &self,
        op: i32,
        (send, send_count): (*const c_void, usize),
        recv: *mut c_void,
        [counts, displs]: [&[i32]; 2],
        timed: bool,
    ) -> Result<u64, BenchError> {
        let send_count = mpi_int(send_count)?;
        // SAFETY: per this function's contract; MPI is initialized (the ranks are MPI ranks).
        let ns = unsafe {
            (self.iteration)(
                op,
                send,
                send_count,
                recv,
                counts.as_ptr(),
                displs.as_ptr(),
                i32::from(timed),
            )
        };
        u64::try_from(ns).map_err(|_| BenchError::Usage(format!("C loop: MPI call {op} failed")))
    }

    /// `MPI_Allreduce` (sum) of `input` into `output` from C: with `timed`, as the C loop
    /// times it (a barrier, then the call, its nanoseconds); otherwise the call alone.
    pub(crate) fn all_reduce_sum(
        &self,
        input: &[f32],
        output: &mut [f32],
        timed: bool,
    ) -> Result<u64, BenchError> {
        same_length("C loop", input, output)?;
        let send = (input.as_ptr().cast(), input.len());
        // SAFETY: `input` holds `input.len()` floats and `output` as many (checked above),
        // all that MPI_Allreduce reads and writes; it takes no counts or displacements.
        unsafe {
            self.call(
                Self::ALL_REDUCE,
                send,
                output.as_mut_ptr().cast(),
                [&[]; 2],
                timed,
            )
        }
    }

    /// One iteration of the C loop on a transport `case`'s buffers, the call `op`: with
    /// `timed`, barrier and clock in C (its nanoseconds on this rank), otherwise the call
    /// alone (0).
    pub(crate) fn run_case(
        &self,
        op: i32,
        case: &mut Case,
        timed: bool,
    ) -> Result<u64, BenchError> {
        let [counts, displs] = &case.mpi_counts;
        let (send, recv) = match case.op {
            TransportOp::AllReduce => (
                (case.send_f32.as_ptr().cast(), case.send_f32.len()),
                case.recv_f32.as_mut_ptr().cast(),
            ),
            _ => (
                (case.send.as_ptr().cast(), case.send.len()),
                case.recv.as_mut_ptr().cast(),
            ),
        };
        // SAFETY: the buffers are the case's, as large as the counts say (`Case::new`), and
        // every rank makes the same call.
        unsafe { self.call(op, send, recv, [counts, displs], timed) }
    }

    /// The staged floor `floor` of `input` into `output` (`staged_floor.c`): with `timed`,
    /// an `MPI_Barrier`, then the call timed in C (its nanoseconds); otherwise the call
    /// alone. Every rank makes the same calls; the first (and any larger than before)
    /// allocates a shared window on every rank.
    pub(crate) fn staged_floor(
        &self,
        floor: StagedFloor,
        input: &[f32],
        output: &mut [f32],
        timed: bool,
    ) -> Result<u64, BenchError> {
        same_length("staged floor", input, output)?;
        let count = i32::try_from(input.len())
            .map_err(|_| BenchError::Usage("staged floor: a count beyond 32 bits".into()))?;
        // SAFETY: `input` holds `count` floats and `output` as many (checked above), all
        // that the floor reads and writes of them; MPI is initialized, and every rank makes
        // the same call (this function's contract).
        let ns = unsafe {
            (self.floor)(
                floor as i32,
                input.as_ptr().cast(),
                count,
                output.as_mut_ptr().cast(),
                i32::from(timed),
            )
        };
        u64::try_from(ns).map_err(|_| {
            BenchError::Usage(format!(
                "staged floor {floor:?} failed (MPI, a peer absent for 10 s, or ranks not all \
                 on one node)"
            ))
        })
    }

    /// Frees the staged floors' shared window on every rank (collective; a no-op when none
    /// is allocated).
    pub(crate) fn release_staged_floors(&self) -> Result<(), BenchError> {
        // SAFETY: op 0 reads and writes no buffer; every rank makes the same call.
        let rc = unsafe { (self.floor)(0, std::ptr::null(), 0, std::ptr::null_mut(), 0) };
        match rc {
            0 => Ok(()),
            _ => Err(BenchError::Usage(
                "staged floors: MPI_Win_free failed".into(),
            )),
        }
    }
}

/// Compiles the C loop and the staged floors into a shared library in `dir`; its path.
fn build(dir: &Path) -> Result<PathBuf, BenchError> {
    let write = |path: &Path, source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| write(dir, e))?;
    let (src, lib) = (dir.join("peer_loop.c"), dir.join("libpeer_loop.so"));
    let floor = dir.join("staged_floor.c");
    std::fs::write(&src, C_SOURCE).map_err(|e| write(&src, e))?;
    std::fs::write(&floor, FLOOR_SOURCE).map_err(|e| write(&floor, e))?;
    let status = Command::new("mpicc")
        .args(["-O2", "-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg(&floor)
        .status()
        .map_err(|e| BenchError::Usage(format!("mpicc not found ({e}): install Open MPI")))?;
    if !status.success() {
        return Err(BenchError::Usage(format!("mpicc failed ({status})")));
    }
    Ok(lib)
}
