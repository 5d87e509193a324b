"""Top-k's exact pick among its candidates, native against torch/numpy, in one process.

    python scripts/topk_finish_ab.py [--steps 60]

ResNet-18's gradients, top-k 1% with error feedback, fp16/Rice, AllGather, through `gradwire bench
hook`'s steps (one process, one thread), alternating step by step in ABBA order between
`_finish`'s native path (numpy's partition for the k-th, then `kernels.keep_largest_candidates`)
and the torch/numpy path it replaced (`topk_indices` of the magnitudes, two gathers). Prints the
select phase and the hook per step, medians and quartiles over each path's steps. Within one
process the machine's drift hits both paths alike, which separate launches on a shared 2-core
machine do not resolve (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gradwire.bench import hook as bench
from gradwire.core.config import ExchangeConfig
from gradwire.sparsify import topk

METHOD = "topk:density=0.01,values=fp16,indices=rice,collective=allgather"


def torch_numpy_finish(flat: torch.Tensor, candidates: topk.Candidates, k: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """``topk._finish`` without the native path: the same answer (tests/test_kernels.py)."""
    positions, values = candidates
    if values is None:
        values = torch.index_select(flat, 0, positions)
    return topk.largest_among(positions, values, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps, half for each path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = {"native": topk._finish, "torch/numpy": torch_numpy_finish}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    with bench._one_rank_group():
        run = bench._Run(ExchangeConfig(**bench._options(METHOD)), bench._gradients("resnet18"))
        for _ in range(3):
            run.step()
        for i in range(args.steps):
            name = ("native", "torch/numpy")[(i // 2) % 2 ^ (i % 2)]  # A B B A A B B A ...
            topk._finish = paths[name]
            phases = run.step()
            times[name].append((phases["select"] * 1e3, phases["hook"] * 1e3))
    for name, rows in times.items():
        select, hook = [row[0] for row in rows], [row[1] for row in rows]
        low, _, high = statistics.quantiles(select, n=4)
        print(f"{name:12s} steps {len(rows)}  select median {statistics.median(select):.2f} ms "
              f"(quartiles {low:.2f}-{high:.2f})  hook median {statistics.median(hook):.2f} ms")


if __name__ == "__main__":
    main()
