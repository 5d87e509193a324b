"""An experiment for docs/fsdp.md: does top-k under AdamW hold when every rank sends the *same*
positions, chosen from the sum of the ranks' gradients, instead of each rank its own top-k?

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/fsdp_shared_support.py -- \\
        simulate --workers 4 --steps 500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
        --seed 0 --fsdp topk:density=0.1,values=fp16,indices=rice[,ef=false] --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate --fsdp`` with a sparsifier); this
script only swaps the simulator's per-rank selection (``ShardedReduce._sparse``) for a shared one:

1. every worker compensates its gradient with its residual, as before;
2. per piece (one parameter's chunk for one owner), the sparsifier selects on the *sum* of the
   workers' compensated gradients: one support for all workers;
3. every worker sends its own values at those positions (rounded by the value codec); the owner
   sums them, so each selected position carries the exact mean (up to the value codec);
4. with error feedback each worker keeps what it did not send (everything off the support).

So the update is the top-k of the mean gradient, as a single worker's top-k would be, where the
per-rank rule adds partial sums over up to p times as many positions. The support needs an
agreement between the ranks (a threshold over the summed magnitudes, as the sparse AllReduce's
summaries give); this experiment computes it exactly and counts no bytes for it. The byte count
is the values alone (the indices are known to every rank): ``(p - 1)/p`` of the selected values
per worker, at the value codec's width. Not a library feature: the simulator only.
"""

from __future__ import annotations

import sys

import torch

from experiment_record import run_and_mark
from gradwire.fsdp import layout
from gradwire.harness.sharding import ShardedReduce

#: bytes per value of the value codecs this experiment takes
_WIDTH = {"fp32": 4, "fp16": 2, "bf16": 2}


def _shared_sparse(self: ShardedReduce, unit: int, flats: list[torch.Tensor], shapes: list[tuple[int, ...]],
                   members: list[int]) -> torch.Tensor:
    """``ShardedReduce._sparse`` with one support per piece, selected on the workers' summed
    compensated gradients (module docstring, steps 1-4)."""
    assert self.sparsifier is not None
    compensated = [self._compensated(w, unit, flat) for w, flat in enumerate(flats)]
    summed = torch.stack(compensated).sum(0)
    residuals = [x.clone() for x in compensated]
    total = torch.zeros_like(flats[0])
    width = _WIDTH[self.codec.value_codec.name]
    for piece in layout.pieces(shapes, self.workers):
        part = summed[piece.offset: piece.offset + piece.numel]
        indices = self.sparsifier.select(part, step=self.step,
                                         tensor_id=members[piece.parameter] * self.workers + piece.chunk)
        if indices.numel() == 0:
            continue
        positions = indices + piece.offset
        for w, x in enumerate(compensated):
            _, sent = self.codec.encode(indices=indices, values=x[positions], numel=piece.numel)
            total[positions] += sent
            residuals[w][positions] -= sent
            self.bytes_sent += width * indices.numel() * (piece.chunk != w)
    for w, residual in enumerate(residuals):
        self._keep(w, unit, residual)
    return total


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    if argv[:split]:
        raise SystemExit(f"fsdp_shared_support: no options of its own, got {argv[:split]}; usage: see the docstring")
    ShardedReduce._sparse = _shared_sparse  # type: ignore[method-assign]
    return run_and_mark(argv[split + 1:], "selection_variant",
                        {"script": "scripts/fsdp_shared_support.py", "support": "shared"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
