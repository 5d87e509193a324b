"""Why quantization blocks restart at every parameter in gradwire.fsdp: per-tensor error of one
reduce-scatter of real gradients, blocks from each destination chunk's start (straddling
parameters) against blocks restarting at every parameter's chunk.

The ``gpt`` workload (509,248 parameters, pystdlib, seed 0) on W simulated workers (the shards a
W-rank run gives), one batch of 16 x 128 bytes each; the reduction is
``gradwire.harness.sharding.ShardedReduce`` (what ``gradwire.fsdp.compress`` does per FSDP unit),
without error feedback so that every number is one step's; the error of a tensor is
``|reduced - exact mean| / |exact mean|`` (L2). Also the quantized bytes per rank of one step both
ways (``exchange.blockquant.quantized_bytes``).

    PYTHONPATH=src python scripts/fsdp_block_alignment.py [--workers 4]
"""

from __future__ import annotations

import argparse

import torch

from gradwire.exchange.blockquant import quantized_bytes
from gradwire.fsdp import layout
from gradwire.harness.sharding import ShardedReduce, unit_parameters
from gradwire.harness.simulate import _shard_batches, exact_mean
from gradwire.harness.workloads import build_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = build_workload("gpt", None, seed=0)
    model, w = workload.model, args.workers
    names = [n for n, _ in model.named_parameters()]
    grads = []
    for rank in range(w):
        inputs, targets = next(_shard_batches(workload, w, rank, 16, 0))
        model.zero_grad()
        workload.loss(model(inputs), targets).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    exact = exact_mean(grads)
    print(f"gpt, {w} workers, one step, no error feedback: the 4 tensors with the largest error")
    for bits in (8, 4):
        for aligned in (False, True):
            reduced = ShardedReduce(model, w, quantize=f"int{bits}", error_feedback=False, aligned=aligned)(grads)
            errors = sorted(((float((r - e).norm() / e.norm()), n) for r, e, n in zip(reduced, exact, names)),
                            reverse=True)
            worst = ", ".join(f"{n} {err:.3f}" for err, n in errors[:4])
            print(f"int{bits} {'restarting at every parameter' if aligned else 'from each chunk start    '}: {worst}")
    shapes = dict(model.named_parameters())
    for bits in (8, 4):
        straddling = aligned_bytes = 0
        for _, unit in unit_parameters(model):
            chunks = [layout.chunk_numel(tuple(shapes[n].shape), w) for n in unit]
            straddling += (w - 1) * quantized_bytes(sum(chunks), bits, 128)
            aligned_bytes += (w - 1) * quantized_bytes(sum(chunks), bits, 128, chunks)
        print(f"int{bits} bytes per rank and step: {straddling} from chunk starts, {aligned_bytes} restarting "
              f"(+{aligned_bytes - straddling}, {100 * (aligned_bytes / straddling - 1):.2f}%)")


if __name__ == "__main__":
    main()
