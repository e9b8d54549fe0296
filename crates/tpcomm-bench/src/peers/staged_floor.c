/* The floors of a staged all-reduce across cores, in C: the rows `floor 1stage` and
 * `floor 2stage` of `tpcomm-bench allreduce --transport mpi`. Built with the C loop
 * (`peer_loop.c`) into the same library, and called like it.
 *
 * A rank's input and output are private memory (an eager all-reduce), so its peers can
 * only read what it copies into shared memory. These loops do the least a staged
 * all-reduce must do, and nothing else: no shape checks, no lifecycle, no tables.
 *   op 1, one-stage: copy the input into this rank's staging buffer; one flag barrier;
 *         output = input + every peer's staging buffer.
 *   op 2, two-stage: copy the parts that peers reduce into the staging buffer; barrier;
 *         reduce this rank's part from its input and the peers' staging buffers into the
 *         output and into its temp buffer; barrier; copy every peer's part from the
 *         peer's temp buffer into the output.
 *   op 0: free the shared window (collective).
 * Below 1 MiB the buffers are double: call k uses set k % 2. A rank writes a set again
 * two calls later, after passing a barrier of the call between, which its peers reach only
 * once they have finished reading that set; so no barrier closes a call (tpcomm's host
 * backend ends every launch with one). From 1 MiB a call uses one set, and a third barrier
 * closes it: two sets would keep twice the memory in the caches. Two-stage reduces in
 * chunks of 1024 floats, into the temp buffer and then the output while the chunk is in
 * L1, as tpcomm does. The sums run backward with AVX where the CPU has it, as tpcomm's
 * copies into an output do (a forward loop is several times slower when the output sits
 * 16 bytes after a page boundary, as a large malloc'ed buffer does).
 *
 * staged_floor(op, send, count, recv, timed): `count` floats; with `timed`, an MPI_Barrier
 * first and the call timed with CLOCK_MONOTONIC. Returns the nanoseconds (0 untimed), or
 * -1 when MPI fails, the ranks are not all on one node (or more than 8), a peer does not
 * arrive within 10 s, or the op is unknown. The window is allocated on the first call and
 * again when a call needs more room; every rank must make the same calls.
 */
#define _POSIX_C_SOURCE 199309L
#include <immintrin.h>
#include <mpi.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#define PAGE 4096
#define MAX_RANKS 8
#define WAIT_NS 10000000000LL
/* From this many bytes a call uses one set of buffers and a closing barrier (below, two
 * sets and no closing barrier): measured on the development VM, two sets were faster up to
 * 32 KiB (one barrier less) and slower from 2 MiB (twice the memory in the caches). */
#define SINGLE_SET_FROM ((size_t)1 << 20)

static MPI_Comm node = MPI_COMM_NULL;
static MPI_Win win = MPI_WIN_NULL;
static int rank, world;
/* Floats per buffer; 0 while no window is allocated. */
static size_t capacity;
/* Every rank's segment: a page of flags (start, mid and closing barriers at 0, 64, 128),
 * then two staging buffers, then two temp buffers, each `capacity` floats rounded up to
 * pages. */
static char *base[MAX_RANKS];
static unsigned long long calls;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static size_t buffer_bytes(void) {
    return (capacity * sizeof(float) + PAGE - 1) / PAGE * PAGE;
}

static _Atomic unsigned long long *flag(int r, int which) {
    return (_Atomic unsigned long long *)(base[r] + 64 * which);
}

/* Whether the call being made uses one set of buffers (and a closing barrier). */
static int single_set;

static float *staging(int r, unsigned long long call) {
    return (float *)(base[r] + PAGE + (single_set ? 0 : (call & 1)) * buffer_bytes());
}

static float *temp(int r, unsigned long long call) {
    return (float *)(base[r] + PAGE + (2 + (single_set ? 0 : (call & 1))) * buffer_bytes());
}


static int release(void) {
    int rc = MPI_SUCCESS;
    if (win != MPI_WIN_NULL)
        rc |= MPI_Win_free(&win);
    if (node != MPI_COMM_NULL)
        rc |= MPI_Comm_free(&node);
    capacity = 0;
    return rc;
}

/* A window with room for `count` floats per buffer on every rank (collective). */
static int reserve(size_t count) {
    if (win != MPI_WIN_NULL && count <= capacity)
        return MPI_SUCCESS;
    if (release() != MPI_SUCCESS)
        return MPI_ERR_OTHER;
    int everyone;
    if (MPI_Comm_size(MPI_COMM_WORLD, &everyone) != MPI_SUCCESS ||
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) !=
            MPI_SUCCESS)
        return MPI_ERR_OTHER;
    if (MPI_Comm_size(node, &world) != MPI_SUCCESS || MPI_Comm_rank(node, &rank) != MPI_SUCCESS ||
        world != everyone || world > MAX_RANKS) {
        release();
        return MPI_ERR_OTHER;
    }
    capacity = count;
    MPI_Info info;
    char *mine;
    int rc = MPI_Info_create(&info);
    rc |= MPI_Info_set(info, "alloc_shared_noncontig", "true");
    rc |= MPI_Win_allocate_shared((MPI_Aint)(PAGE + 4 * buffer_bytes()), 1, info, node, &mine,
                                  &win);
    MPI_Info_free(&info);
    for (int r = 0; rc == MPI_SUCCESS && r < world; r++) {
        MPI_Aint size;
        int unit;
        rc |= MPI_Win_shared_query(win, r, &size, &unit, &base[r]);
    }
    if (rc != MPI_SUCCESS) {
        release();
        return rc;
    }
    memset(mine, 0, PAGE);
    calls = 0;
    /* Every rank's flags are zero before anybody waits on them. */
    return MPI_Barrier(node);
}

/* Stores `epoch` into this rank's flag `which`, then waits for every peer's. */
static int barrier(int which, unsigned long long epoch) {
    atomic_store_explicit(flag(rank, which), epoch, memory_order_release);
    long long deadline = now_ns() + WAIT_NS;
    for (int r = 0; r < world; r++) {
        unsigned long spins = 0;
        while (r != rank && atomic_load_explicit(flag(r, which), memory_order_acquire) < epoch) {
            _mm_pause();
            if (++spins % 65536 == 0 && now_ns() > deadline)
                return -1;
        }
    }
    return 0;
}

/* Floats per chunk of a two-stage reduction: its sums land in the temp buffer and are
 * copied to the output while they are in L1, as tpcomm's host backend does. */
#define CHUNK 1024

/* dst[i] = own[i] + every peers[q][i], for i < n, backward, with 32-byte aligned stores
 * (an unaligned one splits a cache line every other store). */
__attribute__((target("avx"))) static void sum_avx(float *dst, const float *own,
                                                    const float *const *peers, int npeers,
                                                    size_t n) {
    size_t i = n;
    while (i > 0 && ((size_t)(dst + i) % 32 != 0 || i < 8)) {
        i--;
        float s = own[i];
        for (int q = 0; q < npeers; q++)
            s += peers[q][i];
        dst[i] = s;
    }
    while (i >= 8) {
        i -= 8;
        __m256 s = _mm256_loadu_ps(own + i);
        for (int q = 0; q < npeers; q++)
            s = _mm256_add_ps(s, _mm256_loadu_ps(peers[q] + i));
        _mm256_store_ps(dst + i, s);
    }
    while (i > 0) {
        i--;
        float s = own[i];
        for (int q = 0; q < npeers; q++)
            s += peers[q][i];
        dst[i] = s;
    }
}

static void sum_plain(float *dst, const float *own, const float *const *peers, int npeers,
                      size_t n) {
    for (size_t i = n; i-- > 0;) {
        float s = own[i];
        for (int q = 0; q < npeers; q++)
            s += peers[q][i];
        dst[i] = s;
    }
}

/* A copy is a sum with no peers. */
static void sum(float *dst, const float *own, const float *const *peers, int npeers, size_t n) {
    if (__builtin_cpu_supports("avx"))
        sum_avx(dst, own, peers, npeers, n);
    else
        sum_plain(dst, own, peers, npeers, n);
}

/* Rank r's part of `count` floats in two-stage: equal parts in whole 16-float packs. */
static void part(size_t count, int r, size_t *lo, size_t *hi) {
    size_t each = ((count + world - 1) / world + 15) / 16 * 16;
    *lo = (size_t)r * each < count ? (size_t)r * each : count;
    *hi = *lo + each < count ? *lo + each : count;
}

/* Every peer's staging buffer of `call`, from element `at`, in rank order; how many. */
static int peer_staging(unsigned long long call, size_t at, const float **peers) {
    int n = 0;
    for (int r = 0; r < world; r++)
        if (r != rank)
            peers[n++] = staging(r, call) + at;
    return n;
}

static int one_stage(const float *send, size_t count, float *recv) {
    unsigned long long call = ++calls;
    memcpy(staging(rank, call), send, count * sizeof(float));
    if (barrier(0, call))
        return -1;
    const float *peers[MAX_RANKS];
    int n = peer_staging(call, 0, peers);
    sum(recv, send, peers, n, count);
    if (single_set && barrier(2, call))
        return -1;
    return 0;
}

static int two_stage(const float *send, size_t count, float *recv) {
    unsigned long long call = ++calls;
    size_t lo, hi;
    part(count, rank, &lo, &hi);
    float *mine = staging(rank, call);
    memcpy(mine, send, lo * sizeof(float));
    memcpy(mine + hi, send + hi, (count - hi) * sizeof(float));
    if (barrier(0, call))
        return -1;
    const float *peers[MAX_RANKS];
    int n = peer_staging(call, lo, peers);
    float *mine_temp = temp(rank, call);
    for (size_t c = lo; c < hi; c += CHUNK) {
        size_t len = hi - c < CHUNK ? hi - c : CHUNK;
        sum(mine_temp + c, send + c, peers, n, len);
        sum(recv + c, mine_temp + c, peers, 0, len);
        for (int q = 0; q < n; q++)
            peers[q] += len;
    }
    if (barrier(1, call))
        return -1;
    for (int r = 0; r < world; r++) {
        if (r == rank)
            continue;
        size_t plo, phi;
        part(count, r, &plo, &phi);
        sum(recv + plo, temp(r, call) + plo, peers, 0, phi - plo);
    }
    if (single_set && barrier(2, call))
        return -1;
    return 0;
}

long long staged_floor(int op, const void *send, int count, void *recv, int timed) {
    if (op == 0)
        return release() == MPI_SUCCESS ? 0 : -1;
    if ((op != 1 && op != 2) || count < 0 || reserve((size_t)count) != MPI_SUCCESS)
        return -1;
    if (timed && MPI_Barrier(MPI_COMM_WORLD) != MPI_SUCCESS)
        return -1;
    int single = (size_t)count * sizeof(float) >= SINGLE_SET_FROM;
    /* A rank may still read the set the last call used: everybody finishes it first. */
    if (single != single_set && MPI_Barrier(node) != MPI_SUCCESS)
        return -1;
    single_set = single;
    long long t0 = timed ? now_ns() : 0;
    int rc = op == 1 ? one_stage(send, (size_t)count, recv) : two_stage(send, (size_t)count, recv);
    long long t = timed ? now_ns() - t0 : 0;
    return rc == 0 ? t : -1;
}
