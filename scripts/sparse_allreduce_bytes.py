"""Per-worker bytes of the sparse AllReduce vs an AllGather of the same top-k entries vs dense.

Runs p = 2, 4, 8 gloo ranks on loopback (one process each). Every rank draws a synthetic gradient
(normal, seeded by rank), selects its exact top-k (1% by default), derives balanced regions
(``balanced_boundaries``) and runs ``sparse_allreduce`` with raw entries (int32 relative index +
float32 value = 8 bytes).

How bytes are counted: sparse AllReduce -- what this rank's code handed to the collectives for its
peers (``SparseAllreduceResult.sent_by_collective``: counts, data, histograms, lengths; its own share
excluded), max and mean over ranks. AllGather -- ring formula, ``(p-1) * k * 8`` (the same 8-byte
entries, no header). Dense -- ring AllReduce formula, ``2 (p-1)/p * 4 numel``. ``model`` is the
α–β model's byte prediction (``alphabeta.sparse_allreduce_cost``) for comparison.

    PYTHONPATH=src python scripts/sparse_allreduce_bytes.py [--numel 4194304] [--density 0.01]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, numel: int, density: float, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from gradwire.exchange.regions import balanced_boundaries
    from gradwire.exchange.sparse_allreduce import sparse_allreduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        k = max(1, int(numel * density))
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
        indices = torch.topk(gradient.abs(), k).indices.sort().values
        boundaries = balanced_boundaries(indices, numel)
        result = sparse_allreduce(indices=indices, values=gradient[indices], numel=numel, k=k, boundaries=boundaries)
        results.put((rank, result.sent_by_collective, result.indices.numel()))
    finally:
        dist.destroy_process_group()


def measure(world_size: int, numel: int, density: float, timeout: float = 600.0) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(r, world_size, port, numel, density, results), daemon=True)
                 for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        got = [results.get(timeout=timeout) for _ in range(world_size)]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    sent = [sum(s.values()) for _, s, _ in got]
    return {"p": world_size, "kept": got[0][2], "sparse_max": max(sent), "sparse_mean": sum(sent) / len(sent),
            "by_collective_rank0": next(s for r, s, _ in got if r == 0)}


def main() -> int:
    from gradwire.exchange.alphabeta import allgather_payloads, dense_allreduce, sparse_allreduce_cost

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    k = max(1, int(args.numel * args.density))
    rows = []
    print(f"numel={args.numel} density={args.density} k={k}; bytes sent per worker (8-byte entries)")
    print(f"{'p':>3} {'kept':>7} {'sparse max':>11} {'sparse mean':>11} {'model':>11} {'allgather':>11} "
          f"{'dense':>11} {'sparse/allg':>11} {'entries':>8}")
    for p in args.workers:
        start = time.monotonic()
        row = measure(p, args.numel, args.density)
        row["allgather"] = allgather_payloads(k, p, 8.0, header_bytes=0, length_round=False).bytes_sent
        row["dense"] = dense_allreduce(args.numel, p).bytes_sent
        row["model"] = sparse_allreduce_cost(k, p, 8.0).bytes_sent
        row["ratio"] = row["sparse_max"] / row["allgather"] if row["allgather"] else float("nan")
        row["entries_per_k"] = row["sparse_max"] / 8 / k
        row["seconds_under_load"] = round(time.monotonic() - start, 1)
        rows.append(row)
        print(f"{p:>3} {row['kept']:>7} {row['sparse_max']:>11.0f} {row['sparse_mean']:>11.0f} {row['model']:>11.0f} "
              f"{row['allgather']:>11.0f} {row['dense']:>11.0f} {row['ratio']:>11.3f} {row['entries_per_k']:>7.2f}k")
    by_p = {r["p"]: r for r in rows}
    if 8 in by_p:
        print(f"p=8: sparse-allreduce / allgather = {by_p[8]['ratio']:.3f} (target <= 0.35)")
    if 4 in by_p and 8 in by_p:
        growth = by_p[8]["sparse_max"] / by_p[4]["sparse_max"]
        print(f"p=4 -> 8: sparse-allreduce bytes x{growth:.3f} (target within 0.8..1.2); "
              f"allgather x{by_p[8]['allgather'] / by_p[4]['allgather']:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
