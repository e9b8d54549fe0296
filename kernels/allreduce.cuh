// tpcomm custom all-reduce: device code.
//
// Everything a kernel needs lives here: the shared-memory layout every rank agrees on
// (Signal, RankSignals, RankData), the flag barriers with their memory ordering, the
// 16-byte packed arithmetic with fp32 accumulation, and the one-stage and two-stage
// algorithms as templates over the element type and the world size. The entry points
// with their stable `extern "C"` names are instantiated in allreduce.cu.
//
// The Rust mirror of the layout is crates/tpcomm-kernels/src/layout.rs; a test there
// reads the `tpcomm_ar_layout` table that allreduce.cu compiles into every cubin and
// checks it field by field. docs/kernels.md explains the protocol.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tpcomm {

// ---------------------------------------------------------------------------------------
// Layout shared with the host (mirrored in Rust, checked by a test)
// ---------------------------------------------------------------------------------------

// Largest world size a kernel serves.
constexpr int kMaxRanks = 8;
// Capacity of a Signal block in thread blocks: a launch uses at most this many blocks.
constexpr int kMaxBlocks = 64;
// Block count a launch uses when the caller does not ask for fewer.
constexpr int kDefaultBlocks = 36;
// Threads per block of every entry point (also the launch bound).
constexpr int kThreads = 512;
// Every load and store of data moves one 16-byte pack.
constexpr int kPackBytes = 16;

// One per rank, in that rank's device memory, zeroed before first use. Peers write into
// it through their RankSignals table; the owner reads it locally.
//
// - start[b][p] / end[b][p]: the flag that rank p stored for thread block b in the start
//   barrier / in the second barrier of a launch (the end barrier of the one-stage kernel,
//   the barrier between the two halves of the two-stage kernel). One slot per writer, so
//   peers never write the same word. A start slot is 64 bits written in one access: the
//   flag in the low half, the writer's launch shape (launch_shape()) in the high half.
// - counter[b]: the value block b used in its last barrier; only the owner touches it.
// - error: 0, or the first barrier timeout or shape mismatch this rank saw (see
//   error_word()).
// - nonce: never touched by kernels; the host lifecycle writes a fresh value here after a
//   resume and reads it back through each peer's new mapping.
// - mismatch: with a shape-mismatch error, this rank's launch shape and the peer's,
//   written by the thread that recorded the error.
//
// Each group starts on its own 128-byte line so flag traffic from peers and the owner's
// counter updates do not share lines.
struct alignas(128) Signal {
  alignas(128) uint64_t start[kMaxBlocks][kMaxRanks];
  alignas(128) uint32_t end[kMaxBlocks][kMaxRanks];
  alignas(128) uint32_t counter[kMaxBlocks];
  alignas(128) uint32_t error;
  uint32_t reserved;
  uint64_t nonce;
  uint32_t mismatch[2];
};

// Stable table, one per rank, in device memory at an address fixed for the
// communicator's life: entry r is rank r's Signal block and rank r's two-stage temp
// buffer as mapped in this process (entry [rank] is this rank's own allocation). After a
// resume the host rewrites the entries in place; kernels captured earlier still hold the
// same table address.
struct RankSignals {
  Signal* signals[kMaxRanks];
  void* temps[kMaxRanks];
};

// Stable slot, one per registered or captured input: entry r is rank r's input buffer
// as mapped in this process.
struct RankData {
  const void* ptrs[kMaxRanks];
};

// Indices into the `tpcomm_ar_layout` table exported by allreduce.cu. Append only.
enum LayoutIndex : int {
  kLayoutVersion = 0,
  kLayoutMaxRanks,
  kLayoutMaxBlocks,
  kLayoutDefaultBlocks,
  kLayoutThreads,
  kLayoutPackBytes,
  kLayoutSignalSize,
  kLayoutSignalAlign,
  kLayoutSignalStart,
  kLayoutSignalEnd,
  kLayoutSignalCounter,
  kLayoutSignalError,
  kLayoutSignalNonce,
  kLayoutRankSignalsSize,
  kLayoutRankSignalsAlign,
  kLayoutRankSignalsSignals,
  kLayoutRankSignalsTemps,
  kLayoutRankDataSize,
  kLayoutRankDataAlign,
  kLayoutRankDataPtrs,
  kLayoutSignalMismatch,
  kLayoutLen,
};
constexpr unsigned long long kLayoutVersionValue = 2;

// ---------------------------------------------------------------------------------------
// Error word
// ---------------------------------------------------------------------------------------

// Which barrier of a launch timed out (bits 16..23 of the error word), or kShape: the
// start barrier saw a peer that launched another shape (element count or type).
enum class BarrierKind : uint32_t {
  kStart = 1,  // entry barrier of both algorithms
  kEnd = 2,    // exit barrier of the one-stage kernel
  kMid = 3,    // barrier between reduce-scatter and all-gather of the two-stage kernel
  kShape = 4,  // not a timeout: a peer's start flag carried another launch shape
};

// bit 31: set; bits 16..23: BarrierKind; bits 8..15: thread block; bits 0..7: the peer
// rank whose flag never arrived (or whose shape differed).
__host__ __device__ constexpr uint32_t error_word(BarrierKind kind, uint32_t block,
                                                  uint32_t peer) {
  return 0x80000000u | (static_cast<uint32_t>(kind) << 16) | ((block & 0xffu) << 8) |
         (peer & 0xffu);
}

// ---------------------------------------------------------------------------------------
// Flag access with explicit memory ordering
// ---------------------------------------------------------------------------------------
//
// All flag accesses are at system scope (.sys): the peer is another GPU, reached over
// NVLink/PCIe, or another process on the same GPU. Relaxed and acquire loads at .sys scope
// are "strong" operations, so a polling loop never spins on a stale L1 copy.

enum class Order {
  // Only the flag value matters: st.relaxed.sys / ld.relaxed.sys.
  kRelaxed,
  // The flag publishes data written before it: st.release.sys / ld.acquire.sys.
  kAcqRel,
};

template <Order kOrder>
__device__ __forceinline__ void store_flag(uint32_t* slot, uint32_t value) {
  if constexpr (kOrder == Order::kAcqRel) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(slot), "r"(value) : "memory");
  } else {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(slot), "r"(value) : "memory");
  }
}

template <Order kOrder>
__device__ __forceinline__ uint32_t load_flag(const uint32_t* slot) {
  uint32_t value;
  if constexpr (kOrder == Order::kAcqRel) {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(slot) : "memory");
  } else {
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(slot) : "memory");
  }
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Spins until *slot == value. Gives up after timeout_ns nanoseconds (0: never) and
// returns false.
template <Order kOrder>
__device__ __forceinline__ bool wait_flag(const uint32_t* slot, uint32_t value,
                                          uint64_t timeout_ns) {
  if (load_flag<kOrder>(slot) == value) return true;
  const uint64_t begin = global_timer_ns();
  while (load_flag<kOrder>(slot) != value) {
    if (timeout_ns != 0 && global_timer_ns() - begin > timeout_ns) return false;
  }
  return true;
}

template <BarrierKind kKind>
__device__ __forceinline__ uint32_t* flag_row(Signal* signal) {
  // The start barrier has its own 64-bit slots (start_barrier()). The end barrier
  // (one-stage) and the mid barrier (two-stage) are each the second and last barrier of
  // their launch, so they share the `end` slots.
  static_assert(kKind == BarrierKind::kEnd || kKind == BarrierKind::kMid, "second barrier");
  return signal->end[blockIdx.x];
}

// Barrier of thread block b with block b of every peer, at flag `value`.
//
// Thread p < N stores `value` into peer p's slot for this rank, then waits until this
// rank's slot for peer p holds `value`. Values only grow by one per barrier, and the two
// barriers of a launch use separate slot arrays: a peer can store its next value into one
// of my slots only after it passed a barrier that needs my flag from after this one, so
// no waiter can miss the value it waits for.
//
// With kAcqRel, the leading __syncthreads() orders every thread's earlier stores before
// the release store (release is cumulative), and the acquire load plus the trailing
// block-wide barrier order every thread's later loads after it.
//
// Returns true on every thread when all peers arrived; false on every thread when one
// did not within timeout_ns (the first such peer is recorded in self->error).
template <int N, BarrierKind kKind, Order kOrder, bool kSyncBefore>
__device__ __forceinline__ bool block_barrier(const RankSignals* peers, Signal* self, int rank,
                                              uint32_t value, uint64_t timeout_ns) {
  if constexpr (kSyncBefore) __syncthreads();
  int late = 0;
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    store_flag<kOrder>(flag_row<kKind>(peers->signals[peer]) + rank, value);
    if (!wait_flag<kOrder>(flag_row<kKind>(self) + peer, value, timeout_ns)) {
      late = 1;
      atomicCAS(&self->error, 0u, error_word(kKind, blockIdx.x, peer));
    }
  }
  return __syncthreads_or(late) == 0;
}

// The start barrier of block b, which also compares launch shapes: thread p < N stores
// (shape << 32 | value) into peer p's start slot for this rank in one 64-bit access, then
// waits until this rank's start slot for peer p holds `value` in its low half, and
// compares the high half, stored by the same access, with its own shape. Only arrival
// matters otherwise (relaxed, as before: see docs/kernels.md).
//
// kLate on every thread when a peer did not arrive within timeout_ns (recorded in
// self->error); kMismatch on every thread when a peer launched another shape (recorded in
// self->error with both shapes in self->mismatch, unless an error was recorded before);
// kAllSame otherwise. If any two ranks' shapes differ, every rank sees a peer differing
// from itself, so every rank's block b gets kMismatch.
enum class StartOutcome { kAllSame, kMismatch, kLate };

__device__ __forceinline__ void store_start(uint64_t* slot, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(slot), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_start(const uint64_t* slot) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(slot) : "memory");
  return value;
}

template <int N>
__device__ __forceinline__ StartOutcome start_barrier(const RankSignals* peers, Signal* self,
                                                      int rank, uint32_t value, uint32_t shape,
                                                      uint64_t timeout_ns) {
  int late = 0;
  int differs = 0;
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    store_start(&peers->signals[peer]->start[blockIdx.x][rank],
                (static_cast<uint64_t>(shape) << 32) | value);
    const uint64_t* slot = &self->start[blockIdx.x][peer];
    uint64_t seen = load_start(slot);
    if (static_cast<uint32_t>(seen) != value) {
      const uint64_t begin = global_timer_ns();
      while (static_cast<uint32_t>(seen = load_start(slot)) != value) {
        if (timeout_ns != 0 && global_timer_ns() - begin > timeout_ns) {
          late = 1;
          break;
        }
      }
    }
    if (late) {
      atomicCAS(&self->error, 0u, error_word(BarrierKind::kStart, blockIdx.x, peer));
    } else if (static_cast<uint32_t>(seen >> 32) != shape) {
      differs = 1;
      if (atomicCAS(&self->error, 0u, error_word(BarrierKind::kShape, blockIdx.x, peer)) ==
          0u) {
        self->mismatch[0] = shape;
        self->mismatch[1] = static_cast<uint32_t>(seen >> 32);
      }
    }
  }
  if (__syncthreads_or(late)) return StartOutcome::kLate;
  return __syncthreads_or(differs) ? StartOutcome::kMismatch : StartOutcome::kAllSame;
}

// ---------------------------------------------------------------------------------------
// 16-byte packs with fp32 accumulation
// ---------------------------------------------------------------------------------------

using Pack = uint4;
static_assert(sizeof(Pack) == kPackBytes, "a pack is 16 bytes");

template <typename To, typename From>
__device__ __forceinline__ To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

__device__ __forceinline__ uint32_t word(const Pack& p, int i) {
  return i == 0 ? p.x : i == 1 ? p.y : i == 2 ? p.z : p.w;
}

// Per element type: how many elements a pack holds and how to move them to and from
// fp32. `add` accumulates in fp32; `store` rounds to nearest even.
template <typename T>
struct PackMath;

template <>
struct PackMath<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void load(const Pack& p, float (&acc)[kElems]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = __uint_as_float(word(p, i));
  }
  __device__ __forceinline__ static void add(const Pack& p, float (&acc)[kElems]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += __uint_as_float(word(p, i));
  }
  __device__ __forceinline__ static Pack store(const float (&acc)[kElems]) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]),
                      __float_as_uint(acc[2]), __float_as_uint(acc[3]));
  }
};

// Two 16-bit floats per 32-bit word, converted pairwise.
template <typename Pair, float2 (*kToFloat2)(Pair), Pair (*kFromFloat2)(float2)>
struct PairPackMath {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void load(const Pack& p, float (&acc)[kElems]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = kToFloat2(bit_cast<Pair>(word(p, i)));
      acc[2 * i] = f.x;
      acc[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static void add(const Pack& p, float (&acc)[kElems]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = kToFloat2(bit_cast<Pair>(word(p, i)));
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ __forceinline__ static Pack store(const float (&acc)[kElems]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = bit_cast<uint32_t>(kFromFloat2(make_float2(acc[2 * i], acc[2 * i + 1])));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

__device__ __forceinline__ float2 half2_to_float2(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ __half2 float2_to_half2(float2 f) { return __float22half2_rn(f); }
__device__ __forceinline__ float2 bf162_to_float2(__nv_bfloat162 h) {
  return __bfloat1622float2(h);
}
__device__ __forceinline__ __nv_bfloat162 float2_to_bf162(float2 f) {
  return __float22bfloat162_rn(f);
}

template <>
struct PackMath<__half> : PairPackMath<__half2, half2_to_float2, float2_to_half2> {};
template <>
struct PackMath<__nv_bfloat16>
    : PairPackMath<__nv_bfloat162, bf162_to_float2, float2_to_bf162> {};

// Element type codes of a launch shape.
template <typename T>
struct DtypeCode;
template <>
struct DtypeCode<float> {
  static constexpr uint32_t kValue = 1;
};
template <>
struct DtypeCode<__half> {
  static constexpr uint32_t kValue = 2;
};
template <>
struct DtypeCode<__nv_bfloat16> {
  static constexpr uint32_t kValue = 3;
};

// What a launch reduces, as carried in the high half of its start flags: bits 0..27 the
// pack count (16 bytes each) modulo 2^28, bits 28..31 the element type code (never 0).
template <typename T>
__device__ __forceinline__ uint32_t launch_shape(long long n_elems) {
  return (static_cast<uint32_t>(n_elems / PackMath<T>::kElems) & 0x0fffffffu) |
         (DtypeCode<T>::kValue << 28);
}

// Sum of pack i over the N inputs, in rank order 0, 1, ..., N-1 with fp32 accumulation:
// the same operations in the same order on every rank, so every rank gets the same bits.
// All N loads are issued before the first add.
//
// Data loads and stores use the .cg cache operator (L2 only): pointers read from the
// tables are generic, and __ldcg/__stcg both select the global state space and skip an L1
// that would never be hit (every pack is read once, and peers' data lives in their L2).
template <typename T, int N>
__device__ __forceinline__ Pack reduce_pack(const Pack* const (&inputs)[N], int i) {
  Pack loaded[N];
#pragma unroll
  for (int r = 0; r < N; ++r) loaded[r] = __ldcg(inputs[r] + i);
  float acc[PackMath<T>::kElems];
  PackMath<T>::load(loaded[0], acc);
#pragma unroll
  for (int r = 1; r < N; ++r) PackMath<T>::add(loaded[r], acc);
  return PackMath<T>::store(acc);
}

// ---------------------------------------------------------------------------------------
// Algorithms
// ---------------------------------------------------------------------------------------
//
// Arguments common to both (see allreduce.cu for the entry points):
//   data       stable RankData slot: every rank's input, n_elems elements, 16-byte aligned
//   peers      stable RankSignals table of this rank
//   self       this rank's Signal block (its own allocation, never remapped)
//   out        this rank's output, n_elems elements, 16-byte aligned; may alias its input
//              for the two-stage kernel only
//   rank       this rank, 0 <= rank < N
//   n_elems    element count, a multiple of the pack size, n_elems / pack < 2^31
//   timeout_ns bound on each barrier wait, 0 waits forever
// Every rank must launch the same kernel with the same grid and n_elems: block b of one
// rank only ever synchronizes with block b of the others.

// One stage: every rank reads every input and writes the full sum.
template <typename T, int N>
__device__ __forceinline__ void one_stage(const RankData* data, const RankSignals* peers,
                                          Signal* self, void* out, int rank,
                                          long long n_elems, uint64_t timeout_ns) {
  static_assert(N >= 2 && N <= kMaxRanks, "world size");
  const uint32_t base = self->counter[blockIdx.x];
  const Pack* inputs[N];
#pragma unroll
  for (int r = 0; r < N; ++r) inputs[r] = static_cast<const Pack*>(data->ptrs[r]);
  Pack* dst = static_cast<Pack*>(out);
  const int packs = static_cast<int>(n_elems / PackMath<T>::kElems);

  // Inputs were written by earlier work on each peer's stream, complete when its kernel
  // started: only the peers' arrival (and their launch shapes) matters.
  const StartOutcome start =
      start_barrier<N>(peers, self, rank, base + 1, launch_shape<T>(n_elems), timeout_ns);
  if (start == StartOutcome::kLate) return;

  // A peer that launched another shape: every rank's block skips the reduction (nothing
  // of a peer is read) but still crosses the end barrier, so no peer waits out its
  // timeout and the counters stay in step.
  if (start == StartOutcome::kAllSame) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < packs;
         i += gridDim.x * blockDim.x)
      dst[i] = reduce_pack<T, N>(inputs, i);
  }

  // Nobody leaves while a peer may still read its input (the caller may overwrite it
  // right after). Every load of a peer's input has returned, its value consumed by a
  // store before the leading __syncthreads(): no data is published, relaxed suffices.
  if (!block_barrier<N, BarrierKind::kEnd, Order::kRelaxed, true>(peers, self, rank,
                                                                   base + 2, timeout_ns))
    return;
  if (threadIdx.x == 0) self->counter[blockIdx.x] = base + 2;
}

// Two stages: reduce-scatter into each rank's temp buffer, then all-gather from the temp
// buffers. Rank r reduces packs [r*part, r*part + len(r)) where part = packs / N and the
// last rank also takes the remainder; pack i of that range goes to its temp at index i.
// Block b handles the same indices i in both halves on every rank, so the per-block mid
// barrier covers exactly the temp entries the block reads afterwards.
template <typename T, int N>
__device__ __forceinline__ void two_stage(const RankData* data, const RankSignals* peers,
                                          Signal* self, void* out, int rank,
                                          long long n_elems, uint64_t timeout_ns) {
  static_assert(N >= 2 && N <= kMaxRanks, "world size");
  const uint32_t base = self->counter[blockIdx.x];
  const int packs = static_cast<int>(n_elems / PackMath<T>::kElems);
  const int part = packs / N;
  const int last_len = packs - (N - 1) * part;
  const int stride = gridDim.x * blockDim.x;
  const int first = blockIdx.x * blockDim.x + threadIdx.x;

  const StartOutcome start =
      start_barrier<N>(peers, self, rank, base + 1, launch_shape<T>(n_elems), timeout_ns);
  if (start == StartOutcome::kLate) return;
  // A peer that launched another shape: skip both halves (nothing of a peer is read) but
  // still cross the mid barrier, as every rank's block does (see one_stage).
  const bool same = start == StartOutcome::kAllSame;

  if (same) {
    const Pack* inputs[N];
#pragma unroll
    for (int r = 0; r < N; ++r) inputs[r] = static_cast<const Pack*>(data->ptrs[r]);
    Pack* mine = static_cast<Pack*>(peers->temps[rank]);
    const int begin = rank * part;
    const int len = rank == N - 1 ? last_len : part;
    for (int i = first; i < len; i += stride) {
      __stcg(mine + i, reduce_pack<T, N>(inputs, begin + i));
    }
  }

  // Peers are about to read what this block just wrote into its temp buffer: release
  // those stores, acquire theirs. This barrier also proves every peer finished reading
  // this rank's input, so no end barrier is needed (the next launch's start barrier
  // keeps a peer's late temp reads safe from this rank's next reduce-scatter).
  if (!block_barrier<N, BarrierKind::kMid, Order::kAcqRel, true>(peers, self, rank, base + 2,
                                                                  timeout_ns))
    return;
  if (!same) {
    if (threadIdx.x == 0) self->counter[blockIdx.x] = base + 2;
    return;
  }

  // Each rank starts gathering from its own part, then the next ranks in ring order, so
  // the ranks do not all read the same peer at once.
  const Pack* temps[N];
  int offsets[N];
  int lens[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const int r = (rank + k) % N;
    temps[k] = static_cast<const Pack*>(peers->temps[r]);
    offsets[k] = r * part;
    lens[k] = r == N - 1 ? last_len : part;
  }
  Pack* dst = static_cast<Pack*>(out);
  for (int i = first; i < last_len; i += stride) {
    Pack gathered[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (i < lens[k]) gathered[k] = __ldcg(temps[k] + i);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (i < lens[k]) dst[offsets[k] + i] = gathered[k];
    }
  }
  if (threadIdx.x == 0) self->counter[blockIdx.x] = base + 2;
}

}  // namespace tpcomm
