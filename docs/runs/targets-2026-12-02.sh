#!/bin/bash
# How the rounds of docs/benchmarks.md "Every target of the speed work on the Zen 3 VM again"
# (2026-12-02, fifteenth session) were run: one round runs every target of the speed work
# once, in this order; ROUNDS rounds back to back. Binaries from main's release build:
#   cargo build --release -p tpcomm-bench --features mpi
#   cargo build --release -p tpcomm-transport --features mpi --examples
cd "$(dirname "$0")/../.."
B=target/release/tpcomm-bench
L=target/release/examples/latency
M="mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2"
for r in $(seq 1 "${ROUNDS:-3}"); do
  echo "######## round $r $(date -u +%H:%M:%S)"
  echo "#### allreduce, MPI"; $M $B allreduce --transport mpi
  echo "#### transport 8 B, threads"; $B transport --ops all_gather,broadcast --max-bytes 8
  echo "#### transport 8 B, MPI"; $M $B transport --transport mpi --ops all_gather,broadcast --max-bytes 8
  echo "#### latency, threads"; $L --iters 3000
  echo "#### latency, MPI"; $M $L --mpi --iters 3000
  echo "#### latency, idle CPU"; $L --idle 1 --ranks 2
  echo "#### lifecycle, MPI"; $M $B lifecycle --transport mpi
  echo "#### lifecycle, threads"; $B lifecycle
  echo "#### objects, threads, with mpi4py"; $B objects
done
