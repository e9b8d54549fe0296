//! What a rank runs the variants of `allreduce` with ([`Runner`]: the forced and automatic
//! instances, the replayed plans, the MPI peer and the C loop) and one element type's
//! table: every variant verified, then timed interleaved, each iteration lined up.

use tpcomm::allreduce::{Algorithm, CapturedPlan, DType, Element, HostBackend};
use tpcomm::ipc::{HostBuffer, HostMemory, PeerMemory};
use tpcomm::Communicator;

use super::floor::Floor;
use super::{columns, AllReduceArgs, InC, Variant, MEMCPY, MPI};
use crate::data::elements::{check, expected, input};
use crate::engine::error::BenchError;
use crate::engine::lineup::{time_synced, HostAllReduce};
use crate::engine::row::Bus;
use crate::engine::session::Session;
use crate::engine::timing::Spec;
use crate::peers::c_loop::CLoop;
use crate::peers::mpi_world::MpiWorld;

/// Stores every element of `values` again, unchanged (`black_box` keeps the stores).
pub(super) fn rewrite_in_place<T: Copy>(values: &mut [T]) {
    for v in values {
        *v = std::hint::black_box(*v);
    }
}

/// One captured plan per (element type, size), replayed by the `replay` rows, and the
/// peer-memory buffers they read and write.
pub(super) struct Replay<'b> {
    pub(super) memory: HostMemory,
    pub(super) input: &'b HostBuffer,
    pub(super) output: &'b HostBuffer,
    /// Per element type of `--dtypes`, per size: the plan and the algorithm it recorded.
    pub(super) plans: Vec<(CapturedPlan<'b, HostBackend>, Algorithm)>,
}

/// What a rank runs the variants with.
pub(super) struct Runner<'r, 'b> {
    /// The instances of one-stage, two-stage and auto (also replay's).
    pub(super) instances: [Option<HostAllReduce>; 3],
    pub(super) replay: Option<Replay<'b>>,
    pub(super) mpi: Option<&'r MpiWorld>,
    pub(super) c_loop: Option<&'r CLoop>,
}

/// The buffers of one size and element type on one rank (`MPI_Allreduce`, f32 only, uses
/// the same).
struct Case<T> {
    input: Vec<T>,
    output: Vec<T>,
    /// The memcpy variant's destination.
    copy: Vec<T>,
    /// The floors' buffers (f32 tables only).
    floor: Option<Floor>,
    /// The index of the replayed plan in [`Replay::plans`].
    plan: usize,
}

impl<T: Element> Case<T> {
    /// `what` from the C library, of the input into the output (f32 tables only), timed in
    /// C with `timed` (see [`CLoop::all_reduce_sum`], [`CLoop::staged_floor`]).
    fn in_c(&mut self, what: InC, c_loop: &CLoop, timed: bool) -> Result<u64, BenchError> {
        let input = bytemuck::cast_slice(&self.input);
        let output = bytemuck::cast_slice_mut(&mut self.output);
        match what {
            InC::Loop => c_loop.all_reduce_sum(input, output, timed),
            InC::Floor(floor) => c_loop.staged_floor(floor, input, output, timed),
        }
    }
}

impl Runner<'_, '_> {
    /// Runs `variant` once; returns the algorithm it used.
    fn run<T: Element>(
        &mut self,
        variant: Variant,
        case: &mut Case<T>,
    ) -> Result<Option<Algorithm>, BenchError> {
        let missing = || BenchError::Usage(format!("nothing runs {}", variant.name()));
        if let Some(what) = variant.in_c() {
            case.in_c(what, self.c_loop.ok_or_else(missing)?, false)?;
            return Ok(None);
        }
        let slot = match variant {
            Variant::OneStage => 0,
            Variant::TwoStage => 1,
            _ => 2,
        };
        match variant {
            Variant::Replay => {
                let (plan, algorithm) = &self.replay.as_ref().ok_or_else(missing)?.plans[case.plan];
                plan.replay(self.instances[2].as_mut().ok_or_else(missing)?)?;
                Ok(Some(*algorithm))
            }
            Variant::Memcpy => {
                case.copy.copy_from_slice(&case.input);
                Ok(None)
            }
            Variant::FloorEager | Variant::FloorSum => {
                let floor = case.floor.as_mut().ok_or_else(missing)?;
                floor.run(
                    variant == Variant::FloorEager,
                    bytemuck::cast_slice(&case.input),
                    bytemuck::cast_slice_mut(&mut case.output),
                );
                Ok(None)
            }
            Variant::Mpi => {
                let (input, output) = (&case.input, &mut case.output);
                let mpi = self.mpi.ok_or_else(missing)?;
                mpi.all_reduce_sum(
                    bytemuck::cast_slice(input),
                    bytemuck::cast_slice_mut(output),
                    false,
                )?;
                Ok(None)
            }
            _ => {
                let ar = self.instances[slot].as_mut().ok_or_else(missing)?;
                Ok(Some(ar.all_reduce(&case.input, &mut case.output)?))
            }
        }
    }

    /// Runs `variant` (one that [`Variant::times_itself`]) as a C benchmark loop runs its
    /// call: an `MPI_Barrier`, then the call between two clock reads; its nanoseconds.
    fn run_timed_by_itself<T: Element>(
        &self,
        variant: Variant,
        case: &mut Case<T>,
    ) -> Result<u64, BenchError> {
        let missing = || BenchError::Usage(format!("nothing runs {}", variant.name()));
        match variant.in_c() {
            Some(what) => case.in_c(what, self.c_loop.ok_or_else(missing)?, true),
            None => self.mpi.ok_or_else(missing)?.all_reduce_sum(
                bytemuck::cast_slice(&case.input),
                bytemuck::cast_slice_mut(&mut case.output),
                true,
            ),
        }
    }

    /// `--rewrite`: writes this rank's input for `variant` again, with the values it holds,
    /// so that its lines are freshly written by this core.
    fn rewrite<T: Element>(&self, variant: Variant, case: &mut Case<T>) -> Result<(), BenchError> {
        match (variant, &self.replay) {
            (Variant::Replay, Some(r)) => {
                let mut raw = vec![0u8; std::mem::size_of_val(case.input.as_slice())];
                r.memory.read(r.input, 0, &mut raw)?;
                r.memory.write(r.input, 0, &raw)?;
            }
            _ => rewrite_in_place(&mut case.input),
        }
        Ok(())
    }

    /// Runs `variant` on fresh data; the algorithm it used and what is wrong, if anything.
    fn verify<T: Element>(
        &mut self,
        (rank, ranks): (usize, usize),
        variant: Variant,
        case: &mut Case<T>,
        salt: u64,
    ) -> Result<(Option<Algorithm>, Option<String>), BenchError> {
        let count = case.input.len();
        case.input = input(rank, count, salt);
        case.output.fill(T::from_f32(f32::NAN));
        case.copy.fill(T::from_f32(f32::NAN));
        if let (Variant::FloorEager | Variant::FloorSum, Some(floor)) = (variant, &mut case.floor) {
            floor.fill(rank, salt);
        }
        let replayed = variant == Variant::Replay;
        if let (true, Some(r)) = (replayed, &self.replay) {
            r.memory
                .write(r.input, 0, bytemuck::cast_slice(&case.input))?;
            r.memory
                .write(r.output, 0, bytemuck::cast_slice(&case.output))?;
        }
        let algorithm = self.run(variant, case)?;
        if let (true, Some(r)) = (replayed, &self.replay) {
            r.memory
                .read(r.output, 0, bytemuck::cast_slice_mut(&mut case.output))?;
        }
        let problem = match variant {
            Variant::Memcpy => (bytemuck::cast_slice::<T, u8>(&case.copy)
                != bytemuck::cast_slice::<T, u8>(&case.input))
            .then(|| "the copy differs from its source".to_string()),
            _ => check(&case.output, &expected(ranks, count, salt)),
        };
        Ok((algorithm, problem))
    }

    /// Verifies and times every variant at every size for `T`, the element type of table
    /// `dtype_index`, each iteration lined up by `sync`; rank 0 prints.
    pub(super) fn bench<T: Element, C: Communicator>(
        &mut self,
        s: &mut Session<'_>,
        comm: &C,
        args: &AllReduceArgs,
        dtype_index: usize,
        sync: &mut HostAllReduce,
    ) -> Result<(), BenchError> {
        let (rank, ranks) = (comm.rank(), comm.size());
        let name = T::DTYPE.name();
        let with_mpi = self.mpi.is_some() && T::DTYPE == DType::F32;
        let columns = columns(with_mpi);
        s.header(
            &format!(
                "all_reduce sum, {name}, {ranks} ranks: size = bytes per rank; busbw = algbw * \
                 2(n-1)/n"
            ),
            &columns,
        );
        let mut variants = args.paths.clone();
        variants.push(Variant::Memcpy);
        let floors = T::DTYPE == DType::F32;
        if floors {
            variants.extend([Variant::FloorEager, Variant::FloorSum]);
        }
        if with_mpi {
            variants.push(Variant::Mpi);
            if self.c_loop.is_some() {
                variants.extend([Variant::FloorStaged1, Variant::FloorStaged2, Variant::CLoop]);
            }
        }
        let names: Vec<&str> = variants.iter().map(|v| v.name()).collect();
        let sizes = args.sweep.sizes();
        for (size_index, &bytes) in sizes.iter().enumerate() {
            let count = bytes / T::DTYPE.size();
            let zeros = || vec![T::from_f32(0.0); count];
            let mut case = Case {
                input: zeros(),
                output: zeros(),
                copy: zeros(),
                floor: floors.then(|| Floor::new(count, ranks)),
                plan: dtype_index * sizes.len() + size_index,
            };
            let spec = Spec {
                peer: with_mpi.then_some(MPI),
                bus: Some(Bus::AllReduce),
                ..Spec::new(name, bytes.to_string(), bytes, &names)
                    .with("count", count)
                    .with("type", name)
            };
            let salt = ((dtype_index as u64) << 40) ^ ((size_index as u64) << 20) ^ 0x5eed;
            let mut algorithms = Vec::with_capacity(variants.len());
            s.verify(comm, &spec, &mut case, |case, k| {
                let salt = salt ^ ((k as u64) << 56);
                let (algorithm, problem) = self.verify((rank, ranks), variants[k], case, salt)?;
                algorithms.push(algorithm);
                Ok(problem)
            })?;
            let rows = s.measure(comm, &spec, &mut case, |case, k| {
                if args.rewrite {
                    self.rewrite(variants[k], case)?;
                }
                let variant = variants[k];
                if !variant.times_itself() {
                    return time_synced(comm, sync, || self.run(variant, case).map(drop));
                }
                let mut ns = 0;
                time_synced(comm, sync, || {
                    ns = self.run_timed_by_itself(variant, case)?;
                    Ok(())
                })?;
                Ok(ns)
            })?;
            let copy = rows
                .iter()
                .find(|r| r.is(MEMCPY))
                .map(|r| r.stats.median_us);
            let rows = rows
                .into_iter()
                .zip(&algorithms)
                .map(|(row, a)| {
                    let vs_copy = copy.filter(|&c| c > 0.0 && !row.is(MEMCPY));
                    let vs_copy = vs_copy.map(|c| row.stats.median_us / c);
                    row.with("algorithm", a.map(Algorithm::name))
                        .with("vs_memcpy", vs_copy)
                })
                .collect();
            s.rows(&columns, rows, |_| true);
        }
        match (with_mpi, self.c_loop) {
            // Every rank ran the staged floors of this table: their window goes together.
            (true, Some(c_loop)) => c_loop.release_staged_floors(),
            _ => Ok(()),
        }
    }
}
