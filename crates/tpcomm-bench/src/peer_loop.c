/* The MPI peer as a C program writes it, to check the peer tpcomm-bench measures in its own
 * runs (`tpcomm-bench peer-check` compiles this file with mpicc and runs it under mpirun).
 *
 * usage: peer_loop OP ITERS WARMUP BYTES...
 *   OP: allgather (BYTES gathered in total, equal blocks), allgatherv (BYTES gathered in
 *   total, near-equal counts, larger first), allreduce (BYTES per rank of f32, sum).
 *
 * Per size, on buffers allocated once: WARMUP untimed calls, then ITERS iterations of
 * MPI_Barrier + one timed call (MPI_Wtime); each iteration counts as its slowest rank's time
 * and rank 0 prints "OP BYTES MEDIAN_US", the median over iterations, as tpcomm-bench does.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 5) {
        if (rank == 0) fprintf(stderr, "usage: %s OP ITERS WARMUP BYTES...\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *op = argv[1];
    int iters = atoi(argv[2]), warmup = atoi(argv[3]);
    double *local = malloc(sizeof(double) * iters), *slowest = malloc(sizeof(double) * iters);
    for (int a = 4; a < argc; a++) {
        long bytes = atol(argv[a]);
        int *counts = malloc(sizeof(int) * n), *displs = malloc(sizeof(int) * n);
        for (int r = 0, d = 0; r < n; r++) {
            counts[r] = (int)(bytes / n + (r < bytes % n));
            displs[r] = d;
            d += counts[r];
        }
        char *send = calloc(bytes + 1, 1), *recv = calloc(bytes + 1, 1);
        int block = (int)(bytes / n);
        for (int i = -warmup; i < iters; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (strcmp(op, "allgather") == 0) {
                MPI_Allgather(send, block, MPI_BYTE, recv, block, MPI_BYTE, MPI_COMM_WORLD);
            } else if (strcmp(op, "allgatherv") == 0) {
                MPI_Allgatherv(send, counts[rank], MPI_BYTE, recv, counts, displs, MPI_BYTE,
                               MPI_COMM_WORLD);
            } else if (strcmp(op, "allreduce") == 0) {
                MPI_Allreduce(send, recv, (int)(bytes / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            } else {
                if (rank == 0) fprintf(stderr, "unknown op %s\n", op);
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
            double t = MPI_Wtime() - t0;
            if (i >= 0) local[i] = t;
        }
        MPI_Reduce(local, slowest, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            qsort(slowest, iters, sizeof(double), cmp);
            double median = iters % 2 ? slowest[iters / 2]
                                      : (slowest[iters / 2 - 1] + slowest[iters / 2]) / 2;
            printf("%s %ld %.3f\n", op, bytes, median * 1e6);
            fflush(stdout);
        }
        free(send);
        free(recv);
        free(counts);
        free(displs);
    }
    free(local);
    free(slowest);
    MPI_Finalize();
    return 0;
}
