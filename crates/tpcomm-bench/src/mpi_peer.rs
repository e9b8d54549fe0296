//! The MPI peer: the same collective called on `MPI_COMM_WORLD` through MPI's C API (rsmpi's
//! `ffi` module), the way a C program calls MPI: one plain call on buffers allocated (and
//! counts converted to 32-bit MPI counts) once per case, before timing, so that each timed
//! iteration is an `MPI_Barrier` and the MPI call, and nothing else. [`CLoop`] is the
//! reference it is checked against: the same calls made from a C loop (`src/peer_loop.c`),
//! in `tpcomm-bench peer-check` and in `allreduce`.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::engine::error::BenchError;
use crate::engine::launch::RunInfo;
use crate::transport::Case;

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

/// The MPI calls of a C benchmark loop (`src/peer_loop.c`), compiled with `mpicc -O2` into a
/// shared library by this rank and loaded: the reference the in-run peer is checked against
/// (`peer-check`, and the `C loop` row of `allreduce`).
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
    pub(crate) unsafe fn call(
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

/// An error naming `what` unless `input` and `output` have the same length.
fn same_length(what: &str, input: &[f32], output: &[f32]) -> Result<(), BenchError> {
    match input.len() == output.len() {
        true => Ok(()),
        false => Err(BenchError::Usage(format!(
            "{what}: {} elements in, {} out",
            input.len(),
            output.len()
        ))),
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

/// `MPI_COMM_WORLD` through rsmpi, in MPI mode.
#[cfg(feature = "mpi")]
pub(crate) struct MpiWorld(mpi::topology::SimpleCommunicator);

#[cfg(feature = "mpi")]
impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MpiWorld")
    }
}

#[cfg(feature = "mpi")]
impl MpiWorld {
    /// The world communicator when this run's ranks are MPI ranks.
    pub(crate) fn for_run(info: &RunInfo) -> Option<Self> {
        (info.transport == "mpi").then(|| Self(mpi::topology::SimpleCommunicator::world()))
    }

    /// Runs `case`'s operation once as the plain MPI call on its buffers and 32-bit counts,
    /// through MPI's C API (`mpi::ffi`), as a C benchmark loop calls it: with `timed`, an
    /// `MPI_Barrier` first and the call between two clock reads (its nanoseconds on this
    /// rank); otherwise the call alone (0).
    ///
    /// rsmpi's safe calls are not used here: each one asks MPI for the communicator's size
    /// and converts its buffer lengths on every call, about 10 ns that a C loop does not
    /// spend, 2-3% of a 64-byte all-gather (`tpcomm-bench peer-check` compares this peer with
    /// a C loop).
    pub(crate) fn run(&self, case: &mut Case, timed: bool) -> Result<u64, BenchError> {
        use crate::transport::{TransportOp as Op, ROOT};
        use mpi::ffi;
        use mpi::raw::AsRaw as _;
        let comm = self.0.as_raw();
        let [counts, displs] = &case.mpi_counts;
        let (counts, displs) = (counts.as_ptr(), displs.as_ptr());
        let (send_len, recv_len) = (mpi_int(case.send.len())?, mpi_int(case.recv.len())?);
        let floats = mpi_int(case.send_f32.len())?;
        let (send, recv) = (case.send.as_ptr().cast(), case.recv.as_mut_ptr().cast());
        let (send_f32, recv_f32) = (case.send_f32.as_ptr(), case.recv_f32.as_mut_ptr());
        let (root, is_root) = (ROOT as i32, case.rank == ROOT);
        // SAFETY: reading an immutable handle constant exported by rsmpi's C shim.
        let byte = unsafe { ffi::RSMPI_UINT8_T };
        self.iteration(timed, case.op.name(), || {
            // SAFETY: the buffers and count tables are the case's, as large as `Case::new`
            // made them for this operation on this communicator's ranks (the receive buffer
            // is `send_len * size` bytes for all-gather; the tables have one entry per rank
            // and describe the receive buffer; all-to-all's equal blocks make them the send
            // layout too; all-reduce's vectors hold `floats` each); every rank makes the same
            // call.
            unsafe {
                match case.op {
                    Op::AllGather => {
                        ffi::MPI_Allgather(send, send_len, byte, recv, send_len, byte, comm)
                    }
                    Op::AllGatherVarcount => {
                        ffi::MPI_Allgatherv(send, send_len, byte, recv, counts, displs, byte, comm)
                    }
                    Op::GatherVarcount => ffi::MPI_Gatherv(
                        send,
                        send_len,
                        byte,
                        if is_root { recv } else { std::ptr::null_mut() },
                        counts,
                        displs,
                        byte,
                        root,
                        comm,
                    ),
                    Op::Broadcast => ffi::MPI_Bcast(recv, recv_len, byte, root, comm),
                    Op::AllToAllVarcount => ffi::MPI_Alltoallv(
                        send, counts, displs, byte, recv, counts, displs, byte, comm,
                    ),
                    Op::AllReduce => all_reduce_floats(send_f32, recv_f32, floats, comm),
                }
            }
        })
    }

    /// `MPI_Barrier` on the world, called as a C loop calls it.
    pub(crate) fn barrier(&self) -> Result<(), BenchError> {
        use mpi::raw::AsRaw as _;
        // SAFETY: MPI is initialized (the ranks are MPI ranks) and the communicator is the
        // world.
        match unsafe { mpi::ffi::MPI_Barrier(self.0.as_raw()) } {
            0 => Ok(()),
            rc => Err(BenchError::Usage(format!("MPI_Barrier failed ({rc})"))),
        }
    }

    /// `MPI_Allreduce` (sum) of `input` into `output` through MPI's C API, as
    /// [`MpiWorld::run`] runs it: with `timed`, after an `MPI_Barrier` and between two clock
    /// reads (its nanoseconds), otherwise the call alone (0).
    pub(crate) fn all_reduce_sum(
        &self,
        input: &[f32],
        output: &mut [f32],
        timed: bool,
    ) -> Result<u64, BenchError> {
        use mpi::raw::AsRaw as _;
        same_length("MPI_Allreduce", input, output)?;
        let count = mpi_int(input.len())?;
        let comm = self.0.as_raw();
        let (input, output) = (input.as_ptr(), output.as_mut_ptr());
        // SAFETY: `input` and `output` hold `count` floats each (checked above); MPI is
        // initialized and every rank makes the call.
        self.iteration(timed, "all_reduce", || unsafe {
            all_reduce_floats(input, output, count, comm)
        })
    }

    /// One iteration of a C benchmark loop around `call` (an MPI call returning its code):
    /// with `timed`, an `MPI_Barrier` first and `call` between two clock reads (its
    /// nanoseconds on this rank), otherwise `call` alone (0); an error naming `what` unless
    /// MPI returns success.
    fn iteration(
        &self,
        timed: bool,
        what: &str,
        call: impl FnOnce() -> i32,
    ) -> Result<u64, BenchError> {
        if timed {
            self.barrier()?;
        }
        let start = std::time::Instant::now();
        let rc = call();
        let ns = if timed {
            crate::engine::timing::elapsed_ns(start)
        } else {
            0
        };
        match rc {
            0 => Ok(ns),
            rc => Err(BenchError::Usage(format!("MPI {what} failed ({rc})"))),
        }
    }
}

/// `MPI_Allreduce` (sum) of `count` floats from `input` into `output` on `comm`; MPI's code.
///
/// # Safety
/// `input` and `output` hold `count` floats each; MPI is initialized and every rank of `comm`
/// makes the same call.
#[cfg(feature = "mpi")]
unsafe fn all_reduce_floats(
    input: *const f32,
    output: *mut f32,
    count: i32,
    comm: mpi::ffi::MPI_Comm,
) -> i32 {
    use mpi::ffi;
    // SAFETY: per this function's contract; the datatype and op are rsmpi's immutable handle
    // constants.
    unsafe {
        ffi::MPI_Allreduce(
            input.cast(),
            output.cast(),
            count,
            ffi::RSMPI_FLOAT,
            ffi::RSMPI_SUM,
            comm,
        )
    }
}

/// `n` as an MPI count (a C `int`).
fn mpi_int(n: usize) -> Result<i32, BenchError> {
    i32::try_from(n).map_err(|_| BenchError::Usage("a count beyond MPI's 32 bits".into()))
}

/// Without the `mpi` feature there is no MPI peer.
#[cfg(not(feature = "mpi"))]
#[derive(Debug)]
pub(crate) enum MpiWorld {}

#[cfg(not(feature = "mpi"))]
impl MpiWorld {
    pub(crate) fn for_run(_: &RunInfo) -> Option<Self> {
        None
    }

    pub(crate) fn run(&self, _: &mut Case, _: bool) -> Result<u64, BenchError> {
        match *self {}
    }

    pub(crate) fn barrier(&self) -> Result<(), BenchError> {
        match *self {}
    }

    pub(crate) fn all_reduce_sum(
        &self,
        _: &[f32],
        _: &mut [f32],
        _: bool,
    ) -> Result<u64, BenchError> {
        match *self {}
    }
}
