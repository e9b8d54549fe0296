#!/bin/bash
# How the rounds of docs/benchmarks.md "Small posts in the slot's own words" (2026-12-02,
# fourteenth session) were taken: latency_old / bench_old built at 0f2a082, latency_new /
# bench_new at eba90ad (cargo build --release -p tpcomm-bench --features mpi; cargo build
# --release -p tpcomm-transport --features mpi --examples), copied beside this script.
# Alternated rounds on one machine: the threads transport before and after, and Open MPI.
M="mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2"
echo "# latency example, 2 ranks, 8 B, 3000 iterations; columns: round, build, barrier / all_gather / broadcast median us (slowest rank), calls with both ranks on one CPU, voluntary switches"
for r in $(seq 1 ${ROUNDS:-10}); do for b in before after mpi; do
  case $b in before) ./latency_old --iters 3000;; after) ./latency_new --iters 3000;; mpi) $M ./latency_new --mpi --iters 3000 2>/dev/null;; esac 2>/dev/null \
    | awk -v b=$b -v r=$r '$1=="barrier"||$1=="all_gather"||$1=="broadcast" {v=v" "$2} /one CPU after/ {w=$8" of "$10" on one CPU; switches "$(NF-1)" "$NF} END{print r, b, v, "|", w}'
done; done
echo "# tpcomm-bench transport --ops all_gather,broadcast --max-bytes 8 (threads: before, after; mpi: --transport mpi); columns: round, build, all_gather median us [direct MPI], broadcast median us [direct MPI]"
for r in $(seq 1 ${ROUNDS:-10}); do for b in before after mpi; do
  case $b in before) out=$(./bench_old transport --ops all_gather,broadcast --max-bytes 8 2>/dev/null);; after) out=$(./bench_new transport --ops all_gather,broadcast --max-bytes 8 2>/dev/null);; mpi) out=$($M ./bench_new transport --transport mpi --ops all_gather,broadcast --max-bytes 8 2>/dev/null);; esac
  echo "$r $b $(echo "$out" | awk '$1==8 {printf "%s %s ", $7, ($11==""?"-":$11)}')"
done; done
