#!/bin/bash
# How the local-ring rounds of docs/benchmarks.md ("Rounds without a lock shared by every rank",
# 2026-12-02) were taken: latency_old / bench_old built at 89de853, latency_new / bench_new at
# 4d41a9c (cargo build --release -p tpcomm-bench --features mpi; cargo build --release
# -p tpcomm-transport --features mpi --examples), copied beside this script.
# Alternated rounds on one machine: the local transport before (89de853) and after (4d41a9c), and Open MPI.
M="mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2"
echo "# latency example (crates/tpcomm-transport/examples/latency.rs), 2 ranks, 8 B, 3000 iterations; columns: round, build, barrier / all_gather / broadcast median us (slowest rank)"
for r in $(seq 1 12); do for b in before after mpi; do
  case $b in before) ./latency_old --iters 3000;; after) ./latency_new --iters 3000;; mpi) $M ./latency_new --mpi --iters 3000 2>/dev/null;; esac | tail -n 3 | awk -v b=$b -v r=$r '{v=v" "$2} END{print r, b, v}'
done; done
echo "# tpcomm-bench transport --ops all_gather,broadcast --max-bytes 8 (local: before, after; mpi: under mpirun -np 2 --transport mpi); columns: round, build, all_gather median us [direct MPI], broadcast median us [direct MPI]"
for r in $(seq 1 10); do for b in before after mpi; do
  case $b in before) out=$(./bench_old transport --ops all_gather,broadcast --max-bytes 8 2>/dev/null);; after) out=$(./bench_new transport --ops all_gather,broadcast --max-bytes 8 2>/dev/null);; mpi) out=$($M ./bench_new transport --transport mpi --ops all_gather,broadcast --max-bytes 8 2>/dev/null);; esac
  echo "$r $b $(echo "$out" | awk '$1==8 {printf "%s %s ", $7, ($11==""?"-":$11)}')"
done; done
