"""The mpi4py peer of `tpcomm-bench objects` and `tpcomm-bench queue`: comm.allgather, or
comm.bcast from rank 0, of the same values in Python.

usage: mpirun -np N python3 objects_peer.py COLLECTIVE ITERS WARMUP PAYLOAD...
  COLLECTIVE: allgather (objects) or bcast (queue: rank 0's value to every rank).
  ITERS 0: adaptive, as the bench (about 40 ms per payload, 20 to 1000 iterations).
  PAYLOAD: blob:BYTES (one bytes object per rank), records:N (N dicts per rank) or step:N
  (a scheduler step of N requests: a dict holding a list of N dicts).

The values are built exactly as the bench builds its own (same generator), checked once
after a first call, then timed: each iteration is a barrier and one comm.allgather (or
comm.bcast), counted as its slowest rank's time. Rank 0 prints one JSON line per payload:
the payload, a fingerprint of the values moved (every rank's for allgather, rank 0's for
bcast: FNV-1a 64 of a canonical encoding, which the bench compares with its own), the
warm-up count and every iteration's time in nanoseconds.
"""
import json
import struct
import sys
import time

from mpi4py import MPI

M = (1 << 64) - 1
BLOB_SALT = 0x0B1E_C705
VOCABULARY = 128_256


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def blob(rank, n):
    words = (n + 7) // 8
    base = BLOB_SALT ^ (rank << 48)
    return b"".join(splitmix64(base ^ k).to_bytes(8, "little") for k in range(words))[:n]


def record(rank, i):
    seed = ((rank << 40) ^ i) & M
    return {
        "id": (rank << 32) | i,
        "name": f"r{rank}-rec-{i:09}",
        "tokens": [splitmix64((seed * 31 + t) & M) % VOCABULARY for t in range(8)],
        "score": (splitmix64(~seed & M) >> 11) / float(1 << 53),
    }


def scheduled_request(rank, i):
    seed = ((rank << 40) ^ i) & M

    def r(k):
        return splitmix64((seed * 37 + k) & M)

    return {
        "id": f"q{rank}-req-{i:09}",
        "prompt_len": r(0) % 8192,
        "tokens": [r(1 + t) % VOCABULARY for t in range(4)],
        "block_table": [r(100 + b) % 16384 for b in range(16)],
        "temperature": (r(200) >> 11) / float(1 << 53),
        "top_p": (r(201) >> 11) / float(1 << 53),
        "max_tokens": r(202) % 4096,
    }


def value(payload, rank):
    kind, size = payload.split(":")
    if kind == "step":
        return {
            "step": rank * 1000 + 7,
            "requests": [scheduled_request(rank, i) for i in range(int(size))],
        }
    if kind == "blob":
        units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
        units.update({"g": 1 << 30, "gib": 1 << 30})
        digits = size.rstrip("BbKkMmGgIi")
        return blob(rank, int(digits) * units[size[len(digits):].lower()])
    return [record(rank, i) for i in range(int(size))]


def canonical(v):
    if isinstance(v, bytes):
        return v
    out = bytearray()
    if isinstance(v, dict):
        out += struct.pack("<Q", v["step"])
        for r in v["requests"]:
            out += r["id"].encode() + b"\0" + struct.pack("<I", r["prompt_len"])
            out += struct.pack("<4I", *r["tokens"]) + struct.pack("<16I", *r["block_table"])
            out += struct.pack("<dd", r["temperature"], r["top_p"])
            out += struct.pack("<I", r["max_tokens"])
        return bytes(out)
    for r in v:
        out += struct.pack("<Q", r["id"]) + r["name"].encode() + b"\0"
        out += struct.pack("<8I", *r["tokens"]) + struct.pack("<d", r["score"])
    return bytes(out)


def fnv1a64(chunks):
    h = 0xCBF29CE484222325
    for data in chunks:
        for b in data:
            h = ((h ^ b) * 0x100000001B3) & M
    return f"{h:016x}"


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    collective, iters, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if collective == "bcast":

        def call(v):
            return comm.bcast(v if rank == 0 else None, root=0)

        movers = [0]
    else:
        call = comm.allgather
        movers = list(range(size))
    for payload in sys.argv[4:]:
        mine = value(payload, rank)
        everyone = [value(payload, r) for r in movers]
        expected = everyone if collective != "bcast" else everyone[0]
        got = call(mine)
        bad = comm.allreduce(int(got != expected), op=MPI.SUM)
        if bad:
            if rank == 0:
                print(f"mpi4py peer: {payload}: wrong values on {bad} ranks", file=sys.stderr)
            comm.Abort(3)
        fingerprint = fnv1a64(canonical(v) for v in everyone) if rank == 0 else ""
        del expected, everyone, got

        def once():
            comm.Barrier()
            t0 = time.perf_counter_ns()
            out = call(mine)
            t = time.perf_counter_ns() - t0
            del out
            return t

        warm = [once() for _ in range(warmup)]
        n = iters
        if n == 0:
            est = sorted(comm.allreduce(t, op=MPI.MAX) for t in warm)[len(warm) // 2] if warm else 1
            n = comm.bcast(min(1000, max(20, 40_000_000 // max(est, 1))), root=0)
        local = [once() for _ in range(n)]
        every = comm.gather(local, root=0)
        if rank == 0:
            slowest = [max(ts) for ts in zip(*every)]
            line = {"payload": payload, "fingerprint": fingerprint, "warmup": warmup}
            line["samples_ns"] = slowest
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
