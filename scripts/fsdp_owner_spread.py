"""An experiment for docs/fsdp.md: does top-k with error feedback hold under AdamW when each owner
hands the optimizer what it received spread over the following steps, instead of in one burst?

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/fsdp_owner_spread.py --rate 0.1 -- \\
        simulate --workers 4 --steps 500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
        --seed 0 --fsdp topk:density=0.1,values=fp16,indices=rice --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate --fsdp`` with a sparsifier). The
senders are the simulator's own (per-rank top-k with plain error feedback); only the owner's side
changes. With error feedback a coordinate that is rarely selected arrives as the debt of the steps
it waited, in one step, and zero on the others: AdamW's second moment then sees the burst squared,
and the coordinate moves about ``1/sqrt(tau)`` of what dense AdamW moves it (docs/fsdp.md, "Top-k
with AdamW"). Here each owner keeps a bank ``b`` over its shard:

1. ``b <- b + (the sum of what the workers sent this step)``;
2. the reduce-scatter's result is ``r b`` (``--rate r``), and ``b <- (1 - r) b``.

So a burst reaches the optimizer as a geometric series over about ``1/r`` steps, and everything that
was sent still arrives, in full, in the end (the bank telescopes, as error feedback does). A
coordinate sent every step arrives with a lag of about ``1/r`` steps. Not a library feature: the
simulator only.
"""

from __future__ import annotations

import argparse
import sys

import torch

from experiment_record import run_and_mark
from gradwire.harness.sharding import ShardedReduce

_senders = ShardedReduce._sparse


def _spread(rate: float):
    def sparse(self: ShardedReduce, unit: int, flats: list[torch.Tensor], shapes: list[tuple[int, ...]],
               members: list[int]) -> torch.Tensor:
        """``ShardedReduce._sparse``, then the owners' banks (module docstring, steps 1-2)."""
        received = _senders(self, unit, flats, shapes, members)
        banks = self.__dict__.setdefault("owner_banks", {})
        bank = banks.setdefault(unit, torch.zeros_like(received))
        bank += received
        out = bank * rate
        bank -= out
        return out
    return sparse


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, required=True, help="the share of its bank an owner hands on per step")
    args = parser.parse_args(argv[:split])
    if not 0.0 < args.rate <= 1.0:
        raise SystemExit(f"fsdp_owner_spread: --rate must be in (0, 1], got {args.rate}")
    ShardedReduce._sparse = _spread(args.rate)  # type: ignore[method-assign]
    return run_and_mark(argv[split + 1:], "selection_variant",
                        {"script": "scripts/fsdp_owner_spread.py", "rule": "owner bank", "rate": args.rate})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
