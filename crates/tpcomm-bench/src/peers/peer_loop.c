/* The MPI peer as a C program writes it: one iteration of a C benchmark loop, which
 * `tpcomm-bench peer-check` compiles with mpicc into a shared library, loads into each MPI
 * rank and times interleaved with the bench's own MPI peer (rsmpi) on the same buffers.
 *
 * peer_iteration(op, send, send_count, recv, counts, displs, timed): with `timed`, an
 * MPI_Barrier on MPI_COMM_WORLD, then one call timed with CLOCK_MONOTONIC (the clock of
 * Rust's Instant); without, the call alone (the caller times it):
 *   op 0: MPI_Allgather of send_count bytes per rank;
 *   op 1: MPI_Allgatherv, send_count bytes from this rank, counts/displs for the receive;
 *   op 2: MPI_Allreduce of send_count floats, sum.
 * Returns the call's nanoseconds (0 untimed), or -1 when MPI fails or op is unknown.
 */
#define _POSIX_C_SOURCE 199309L
#include <mpi.h>
#include <time.h>

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

long long peer_iteration(int op, const void *send, int send_count, void *recv,
                         const int *counts, const int *displs, int timed) {
    int rc = timed ? MPI_Barrier(MPI_COMM_WORLD) : MPI_SUCCESS;
    long long t0 = timed ? now_ns() : 0;
    switch (op) {
    case 0:
        rc |= MPI_Allgather(send, send_count, MPI_BYTE, recv, send_count, MPI_BYTE,
                            MPI_COMM_WORLD);
        break;
    case 1:
        rc |= MPI_Allgatherv(send, send_count, MPI_BYTE, recv, counts, displs, MPI_BYTE,
                             MPI_COMM_WORLD);
        break;
    case 2:
        rc |= MPI_Allreduce(send, recv, send_count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    default:
        return -1;
    }
    long long t = timed ? now_ns() - t0 : 0;
    return rc == MPI_SUCCESS ? t : -1;
}
