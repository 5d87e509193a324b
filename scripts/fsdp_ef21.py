"""An experiment for docs/fsdp.md: does top-k under AdamW hold with EF21's error feedback, where
what is compressed is the *change* of each rank's gradient and the owner hands the optimizer a
dense estimate, instead of plain error feedback's sparse sum?

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/fsdp_ef21.py -- \\
        simulate --workers 4 --steps 500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
        --seed 0 --fsdp topk:density=0.1,values=fp16,indices=rice --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate --fsdp`` with a sparsifier); this
script only swaps the simulator's per-rank rule (``ShardedReduce._sparse``) for EF21's (Richtárik,
Sokolov and Fatkhullin, 2021). Every worker w keeps ``s_w``, the estimate of its gradient that the
owners hold, over the unit's flat gradient (zeros at first; the memory of plain error feedback's
residual); each owner keeps the sum of those estimates over its shard, ``S = Σ_w s_w``. Per step:

1. every worker computes ``d_w = g_w - s_w``, what its gradient moved away from the owners' estimate;
2. per piece (one parameter's chunk for one owner) it selects from ``d_w`` with the sparsifier, as the
   per-rank rule selects from ``g_w + e_w``, and sends those values (rounded by the value codec);
3. both sides add what was sent: the worker to ``s_w``, the owner to ``S``;
4. the reduce-scatter's result is ``S`` over the owner's shard: *dense*, every coordinate an
   estimate of the sum, not zero where nothing was sent this step.

The bytes are those of the per-rank rule (the same pieces, counts and codecs). What differs for the
optimizer: under plain error feedback a coordinate's gradient is zero on most steps and a burst
on the others, which AdamW's second moment punishes (docs/fsdp.md, "Top-k with AdamW"); here
every coordinate carries its last estimate each step. ``ef=false`` in the spec is ignored: the
estimates are the rule. Not a library feature: the simulator only.
"""

from __future__ import annotations

import sys

import torch

from experiment_record import run_and_mark
from gradwire.fsdp import layout
from gradwire.harness.sharding import ShardedReduce


def _ef21_sparse(self: ShardedReduce, unit: int, flats: list[torch.Tensor], shapes: list[tuple[int, ...]],
                 members: list[int]) -> torch.Tensor:
    """``ShardedReduce._sparse`` with EF21's estimates (module docstring, steps 1-4)."""
    assert self.sparsifier is not None
    estimates = self.__dict__.setdefault("ef21_estimates", [{} for _ in range(self.workers)])
    sums = self.__dict__.setdefault("ef21_sums", {})
    total = sums.setdefault(unit, torch.zeros_like(flats[0]))
    pieces = layout.pieces(shapes, self.workers)
    for w, flat in enumerate(flats):
        estimate = estimates[w].setdefault(unit, torch.zeros_like(flat))
        change = flat - estimate
        for piece in pieces:
            part = change[piece.offset: piece.offset + piece.numel]
            indices = self.sparsifier.select(part, step=self.step,
                                             tensor_id=members[piece.parameter] * self.workers + piece.chunk)
            if indices.numel() == 0:
                continue
            data, sent = self.codec.encode(indices=indices, values=part[indices], numel=piece.numel)
            self.bytes_sent += len(data) * (piece.chunk != w)
            positions = indices + piece.offset
            estimate[positions] += sent
            total[positions] += sent
    return total.clone()  # the caller divides its result in place


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    if argv[:split]:
        raise SystemExit(f"fsdp_ef21: no options of its own, got {argv[:split]}; usage: see the docstring")
    ShardedReduce._sparse = _ef21_sparse  # type: ignore[method-assign]
    return run_and_mark(argv[split + 1:], "selection_variant", {"script": "scripts/fsdp_ef21.py", "rule": "ef21"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
