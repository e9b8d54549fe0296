/* Prototype (not part of the build): an eager all-reduce of unregistered buffers on 2 ranks
 * that reads the peer's caller buffer in place with process_vm_readv (cross memory attach),
 * timed against MPI_Allreduce in the same run. Written to decide whether the eager path
 * should read peers' inputs this way instead of staging them; see docs/benchmarks.md,
 * "Tried and dropped: reading the peer's input with process_vm_readv".
 *
 *   mpicc -O2 -march=native -o cma cma-prototype.c -lm
 *   mpirun -np 2 ./cma [CHUNK_BYTES]      (default 65536)
 *
 * cma1: one-stage. Start flag; the peer's whole input read chunk by chunk into a private
 *       buffer and summed with this rank's input into the output; end flag.
 * cma2: two-stage. Start flag; the peer's half of the elements this rank reduces read
 *       chunk by chunk and summed into the output and into this rank's shared temp
 *       buffer; mid flag; the peer's reduced half copied from its temp buffer; end flag.
 * Flags: one 32-bit word per rank and kind in an MPI shared window, release/acquire.
 * Time: median over iterations of the slowest rank, variants interleaved per iteration.
 */
#define _GNU_SOURCE
#include <math.h>
#include <mpi.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static _Atomic uint32_t *flags; /* [rank][kind], 16 words apart */
static int rank;
static uint32_t epoch;

static _Atomic uint32_t *flag(int r, int kind) { return flags + r * 64 + kind * 16; }

static void flag_barrier(int kind) {
    epoch++;
    atomic_store_explicit(flag(1 - rank, kind), epoch, memory_order_release);
    while (atomic_load_explicit(flag(rank, kind), memory_order_acquire) != epoch)
        __builtin_ia32_pause();
}

static size_t chunk = 65536 / 4; /* elements per process_vm_readv */
static float private_buf[(1 << 20) / 4];
static pid_t peer_pid;
static uint64_t peer_input;
static float *temp[2];

static void read_peer(float *dst, uint64_t remote, size_t bytes) {
    struct iovec local = {dst, bytes}, peer = {(void *)remote, bytes};
    ssize_t n = process_vm_readv(peer_pid, &local, 1, &peer, 1, 0);
    if (n != (ssize_t)bytes) {
        perror("process_vm_readv");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

static void one_stage(const float *in, float *out, size_t count) {
    flag_barrier(0);
    for (size_t s = 0; s < count; s += chunk) {
        size_t n = count - s < chunk ? count - s : chunk;
        read_peer(private_buf, peer_input + 4 * s, n * 4);
        for (size_t i = 0; i < n; i++) out[s + i] = in[s + i] + private_buf[i];
    }
    flag_barrier(2);
}

static void two_stage(const float *in, float *out, size_t count) {
    size_t half = (count / 2 + 3) / 4 * 4;
    size_t a = rank ? half : 0, b = rank ? count : half;   /* this rank's part */
    size_t pa = rank ? 0 : half, pb = rank ? half : count; /* the peer's part */
    flag_barrier(0);
    for (size_t s = a; s < b; s += chunk) {
        size_t n = b - s < chunk ? b - s : chunk;
        read_peer(private_buf, peer_input + 4 * s, n * 4);
        for (size_t i = 0; i < n; i++) {
            float v = in[s + i] + private_buf[i];
            out[s + i] = v;
            temp[rank][s + i] = v;
        }
    }
    flag_barrier(1);
    memcpy(out + pa, temp[1 - rank] + pa, (pb - pa) * 4);
    flag_barrier(2);
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc > 1) chunk = (size_t)atol(argv[1]) / 4;
    if (chunk < 1024 || chunk > sizeof private_buf / 4) {
        fprintf(stderr, "CHUNK_BYTES: 4 KiB to 1 MiB\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const size_t max_count = (8 << 20) / 4;
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Win win;
    void *base;
    MPI_Win_allocate_shared(4096 + max_count * 4, 64, MPI_INFO_NULL, node, &base, &win);
    for (int r = 0; r < 2; r++) {
        MPI_Aint size;
        int unit;
        void *p;
        MPI_Win_shared_query(win, r, &size, &unit, &p);
        if (r == 0) flags = p;
        temp[r] = (float *)((char *)p + 4096);
    }
    if (rank == 0) memset((void *)flags, 0, 1024);
    MPI_Barrier(MPI_COMM_WORLD);

    /* Caller buffers as a Rust Vec holds them (malloc: 16 bytes into a page). */
    float *in = malloc(max_count * 4), *out = malloc(max_count * 4), *ref = malloc(max_count * 4);
    for (size_t i = 0; i < max_count; i++) in[i] = (float)((i * 7 + rank * 3) % 101);
    uint64_t mine[2] = {(uint64_t)getpid(), (uint64_t)in}, both[4];
    MPI_Allgather(mine, 2, MPI_UINT64_T, both, 2, MPI_UINT64_T, MPI_COMM_WORLD);
    peer_pid = (pid_t)both[2 * (1 - rank)];
    peer_input = both[2 * (1 - rank) + 1];
    if (rank == 0) printf("# chunk %zu bytes; input %% 4096 = %lu\n", chunk * 4, (unsigned long)((uint64_t)in % 4096));

    double *t[3];
    for (int v = 0; v < 3; v++) t[v] = malloc(sizeof(double) * 400);
    double log_sum[3] = {0, 0, 0};
    int sizes = 0;
    for (size_t bytes = 1024; bytes <= (8u << 20); bytes *= 2) {
        size_t count = bytes / 4;
        int iters = bytes >= (1 << 20) ? 60 : 400;
        for (int w = 0; w < 5; w++) {
            MPI_Allreduce(in, ref, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            one_stage(in, out, count);
            two_stage(in, out, count);
        }
        one_stage(in, out, count);
        if (memcmp(out, ref, bytes)) printf("one-stage result differs at %zu bytes\n", bytes);
        two_stage(in, out, count);
        if (memcmp(out, ref, bytes)) printf("two-stage result differs at %zu bytes\n", bytes);
        for (int i = 0; i < iters; i++)
            for (int v = 0; v < 3; v++) {
                flag_barrier(3);
                double t0 = now_us();
                if (v == 0) MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                else if (v == 1) one_stage(in, out, count);
                else two_stage(in, out, count);
                double dt = now_us() - t0, slowest;
                MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                t[v][i] = slowest;
            }
        double m[3];
        for (int v = 0; v < 3; v++) {
            qsort(t[v], iters, sizeof(double), by_value);
            m[v] = t[v][iters / 2];
        }
        if (rank == 0)
            printf("%8zu B  MPI_Allreduce %9.2f us  cma1 %9.2f us (%.2fx)  cma2 %9.2f us (%.2fx)\n",
                   bytes, m[0], m[1], m[0] / m[1], m[2], m[0] / m[2]);
        if (bytes >= 8192) {
            for (int v = 1; v < 3; v++) log_sum[v] += log(m[0] / m[v]);
            sizes++;
        }
    }
    if (rank == 0)
        printf("speedup over MPI_Allreduce, geomean 8 KiB..8 MiB: cma1 %.2fx, cma2 %.2fx\n",
               exp(log_sum[1] / sizes), exp(log_sum[2] / sizes));
    MPI_Win_free(&win);
    MPI_Finalize();
    return 0;
}
