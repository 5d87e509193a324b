"""Per-worker bytes of the int8/int4 quantized reduce-scatter and AllReduce vs float32, and their error.

Runs p gloo ranks on loopback (one process each, p = 4 by default). Every rank draws a synthetic
gradient (normal, seeded by rank, every 97th value x50 so that blocks differ in scale) of
``--numel`` float32 values and runs ``quantized_reduce_scatter`` (on the input padded to p equal
chunks) and ``quantized_allreduce`` for each bit width and block size.

How bytes are counted: quantized -- what this rank's code handed to the collectives for its peers
(``sent_by_collective``, its own share excluded), the max over ranks. float32 reduce-scatter --
``(p-1) * 4 * ceil(n/p)`` (the same all_to_all_single of float32 chunks); float32 ring AllReduce --
``2 (p-1)/p * 4n`` (``alphabeta.dense_allreduce``). ``model`` is ``alphabeta.quantized_allreduce_cost``.
Error: ``|result - exact sum| / |exact sum|`` (L2, exact sum in float64), for the reduce-scatter
over this rank's shard (max over ranks) and for the AllReduce over the whole result.

    PYTHONPATH=src python scripts/quantized_bytes.py [--numel 4194304] [--workers 4] [--block-sizes 64 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gradient(rank: int, numel: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
    x[::97] *= 50
    return x


def _rank(rank: int, world_size: int, port: int, numel: int, block_sizes: list[int], results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from gradwire.exchange.quantized import quantized_allreduce, quantized_reduce_scatter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        x = _gradient(rank, numel)
        chunk = math.ceil(numel / world_size)
        padded = torch.nn.functional.pad(x, (0, world_size * chunk - numel))
        exact = sum(_gradient(r, numel).double() for r in range(world_size))  # every rank can compute it
        exact_shard = torch.nn.functional.pad(exact, (0, world_size * chunk - numel))[rank * chunk:(rank + 1) * chunk]
        rows = {}
        for bits in (8, 4):
            for block_size in block_sizes:
                reduced = quantized_reduce_scatter(padded, bits=bits, block_size=block_size)
                result = quantized_allreduce(x, bits=bits, block_size=block_size)
                rows[(bits, block_size)] = {
                    "rs": reduced.bytes_sent, "ar": result.bytes_sent,
                    "rs_error": float((reduced.shard.double() - exact_shard).norm() / exact_shard.norm()),
                    "ar_error": float((result.values.double() - exact).norm() / exact.norm())}
        results.put((rank, rows))
    finally:
        dist.destroy_process_group()


def measure(world_size: int, numel: int, block_sizes: list[int], timeout: float = 600.0) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(r, world_size, port, numel, block_sizes, results), daemon=True)
                 for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        got = [results.get(timeout=timeout)[1] for _ in range(world_size)]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return {key: {"rs": max(g[key]["rs"] for g in got), "ar": max(g[key]["ar"] for g in got),
                  "rs_error": max(g[key]["rs_error"] for g in got), "ar_error": got[0][key]["ar_error"]}
            for key in got[0]}


def main() -> int:
    from gradwire.exchange.alphabeta import dense_allreduce, quantized_allreduce_cost

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    p, n = args.workers, args.numel
    measured = measure(p, n, args.block_sizes)
    fp32_rs = (p - 1) * 4 * math.ceil(n / p)
    fp32_ar = dense_allreduce(n, p).bytes_sent
    print(f"p={p} numel={n}; bytes sent per worker (max over ranks); float32 reduce-scatter {fp32_rs}, "
          f"float32 ring AllReduce {fp32_ar:.0f}")
    print(f"{'bits':>4} {'block':>5} {'RS bytes':>10} {'RS/fp32':>8} {'AR bytes':>10} {'model':>10} {'AR/fp32':>8} "
          f"{'formula':>8} {'RS err':>9} {'AR err':>9}")
    rows = []
    for (bits, block_size), row in measured.items():
        model = quantized_allreduce_cost(n, p, bits=bits, block_size=block_size).bytes_sent
        row = {"bits": bits, "block_size": block_size, **row, "model": model, "rs_ratio": row["rs"] / fp32_rs,
               "ar_ratio": row["ar"] / fp32_ar, "formula_ratio": (bits / 8 + 4 / block_size) / 4}
        rows.append(row)
        print(f"{bits:>4} {block_size:>5} {row['rs']:>10} {row['rs_ratio']:>8.4f} {row['ar']:>10} {model:>10.0f} "
              f"{row['ar_ratio']:>8.4f} {row['formula_ratio']:>8.4f} {row['rs_error']:>9.2e} {row['ar_error']:>9.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
