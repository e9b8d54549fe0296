// tpcomm custom all-reduce: the entry points and the exported layout table.
//
// Entry point names are stable (the Rust crate tpcomm-kernels lists them and a test
// checks that every one is in the fatbin for every architecture):
//
//   tpcomm_ar_<algorithm>_<dtype>_w<world size>
//     algorithm  1stage | 2stage
//     dtype      f32 | f16 | bf16
//     world size 2 | 4 | 6 | 8
//
// Every entry point has the same parameters, in this order (C types):
//
//   const tpcomm::RankData*    data        stable RankData slot with every rank's input
//   const tpcomm::RankSignals* peers       this rank's stable RankSignals table
//   tpcomm::Signal*            self        this rank's own Signal block
//   void*                      out         this rank's output
//   int                        rank
//   long long                  n_elems     elements (not bytes)
//   unsigned long long         timeout_ns  per barrier wait; 0 waits forever
//
// Launch with tpcomm::kThreads threads per block and at most tpcomm::kMaxBlocks blocks,
// no dynamic shared memory. See allreduce.cuh for the contract of each argument.

#include "allreduce.cuh"

using tpcomm::RankData;
using tpcomm::RankSignals;
using tpcomm::Signal;

#define TPCOMM_AR_ENTRY(ALGO_NAME, ALGO_FN, DTYPE_NAME, T, N)                                 \
  extern "C" __global__ void __launch_bounds__(tpcomm::kThreads, 1)                           \
      tpcomm_ar_##ALGO_NAME##_##DTYPE_NAME##_w##N(                                            \
          const RankData* data, const RankSignals* peers, Signal* self, void* out, int rank, \
          long long n_elems, unsigned long long timeout_ns) {                                 \
    tpcomm::ALGO_FN<T, N>(data, peers, self, out, rank, n_elems, timeout_ns);                 \
  }

#define TPCOMM_AR_WORLD_SIZES(ALGO_NAME, ALGO_FN, DTYPE_NAME, T) \
  TPCOMM_AR_ENTRY(ALGO_NAME, ALGO_FN, DTYPE_NAME, T, 2)          \
  TPCOMM_AR_ENTRY(ALGO_NAME, ALGO_FN, DTYPE_NAME, T, 4)          \
  TPCOMM_AR_ENTRY(ALGO_NAME, ALGO_FN, DTYPE_NAME, T, 6)          \
  TPCOMM_AR_ENTRY(ALGO_NAME, ALGO_FN, DTYPE_NAME, T, 8)

#define TPCOMM_AR_DTYPES(ALGO_NAME, ALGO_FN)                         \
  TPCOMM_AR_WORLD_SIZES(ALGO_NAME, ALGO_FN, f32, float)              \
  TPCOMM_AR_WORLD_SIZES(ALGO_NAME, ALGO_FN, f16, __half)             \
  TPCOMM_AR_WORLD_SIZES(ALGO_NAME, ALGO_FN, bf16, __nv_bfloat16)

TPCOMM_AR_DTYPES(1stage, one_stage)
TPCOMM_AR_DTYPES(2stage, two_stage)

// The CUDA compiler's view of the layout, compiled into every cubin (and the PTX) as an
// initialized device global, indexed by tpcomm::LayoutIndex. The Rust crate reads it
// out of the fatbin at test time and compares it with its #[repr(C)] mirror.
extern "C" __device__ const unsigned long long tpcomm_ar_layout[tpcomm::kLayoutLen] = {
    tpcomm::kLayoutVersionValue,
    tpcomm::kMaxRanks,
    tpcomm::kMaxBlocks,
    tpcomm::kDefaultBlocks,
    tpcomm::kThreads,
    tpcomm::kPackBytes,
    sizeof(Signal),
    alignof(Signal),
    offsetof(Signal, start),
    offsetof(Signal, end),
    offsetof(Signal, counter),
    offsetof(Signal, error),
    offsetof(Signal, nonce),
    sizeof(RankSignals),
    alignof(RankSignals),
    offsetof(RankSignals, signals),
    offsetof(RankSignals, temps),
    sizeof(RankData),
    alignof(RankData),
    offsetof(RankData, ptrs),
    offsetof(Signal, mismatch),
};
