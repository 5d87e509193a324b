"""An experiment for docs/local-steps.md: sparse outer steps with no positions on the wire, the
support chosen from what every rank already holds (the outer momentum), the values quantized.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/diloco_momentum_support.py --density 0.12 --explore 0.25 -- \\
        simulate --workers 4 --steps 1500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
        --seed 0 --method 'diloco:sync_every=32,warmup_steps=300,unsent=residual+quantize:bits=4,block=1024' \\
        --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate --method diloco:...+quantize:...``
with ``unsent=residual``, one fragment, no overlap); this script swaps the simulator's quantized
AllReduce (``SimulatedExchange._quantized``) for one over a shared support. Per sync:

1. every worker compensates Δ with its residual (``c = Δ + e``), as the quantized exchange does;
2. every rank picks the same support ``S``, per parameter ``density`` of its entries: the
   ``(1 - explore)`` share with the largest ``|m|``, ``m`` the outer optimizer's momentum buffer
   (identical on every rank: every rank steps the same outer optimizer on the same average), and
   the ``explore`` share drawn at random from the rest with a generator every rank seeds alike
   (the run's seed and the sync's number). The momentum is zero off every support so far and at
   the first sync, so without the random share the support could never move;
3. ``c[S]`` goes through the library's quantized AllReduce, replayed as the simulator replays it
   (``blockquant.roundtrip``: each worker's chunks quantized, the owner's float32 sum in rank
   order, re-quantized);
4. each worker keeps ``c - sent`` as its residual: its quantization error on ``S``, all of ``c``
   off it; the outer optimizer steps on the average, zero off ``S``.

Bytes: the quantized AllReduce of ``|S|`` values (``2 (p - 1)`` chunks of ``|S| / p`` values at
the codec's bits, one float32 scale per block) and nothing else: no positions, no counts. Why it
might hold where per-worker top-k lost: the AllReduce sends each value about ``2 (p - 1) / p``
times where the AllGather sends each worker's payload ``p - 1`` times, and int4 values cost 4
bits where a Rice position and a 3-bit value cost about 9, so the same bytes carry about 4× the
entries. Not a library feature: the simulator only.
"""

from __future__ import annotations

import argparse
import sys

import torch

from experiment_record import run_and_mark, split_command
from gradwire.core.config import QUANTIZE_BITS
from gradwire.harness.diloco_sim import SimulatedDiLoCo, SimulatedExchange, replay_quantized_allreduce

_ORIGINAL_START = SimulatedDiLoCo._start


def _support(momentum: list[torch.Tensor], numels: list[int], offsets: list[int], density: float,
             explore: float, generator: torch.Generator) -> torch.Tensor:
    """Step 2: ascending int64 positions in the fragment's flat space, the same on every rank."""
    chosen = []
    for moment, numel, offset in zip(momentum, numels, offsets):
        k = min(numel, max(1, round(density * numel)))
        random_share = min(k, round(explore * k))
        scores = moment.reshape(-1).abs()
        exploit = torch.topk(scores, k - random_share, sorted=False).indices if k > random_share else \
            torch.zeros(0, dtype=torch.int64)
        draw = torch.rand(numel, generator=generator)
        draw[exploit] = 2.0  # never drawn again: the two shares are disjoint
        explored = torch.topk(draw, random_share, largest=False, sorted=False).indices
        chosen.append(torch.cat([exploit, explored]) + offset)
    return torch.sort(torch.cat(chosen)).values


def _start_with_support(self: SimulatedDiLoCo, fragments: list[int], finish_at: int) -> None:
    """``SimulatedDiLoCo._start``, with step 2's support handed to the patched exchange."""
    if self.local.unsent != "residual" or self.local.fragments != 1 or self.local.overlap_steps:
        raise SystemExit("diloco_momentum_support: needs unsent=residual, one fragment and no overlap")
    if self.exchange.config.quantize is None:
        raise SystemExit("diloco_momentum_support: needs a quantize:bits=... exchange")
    state = self.outer[0]  # every worker's outer optimizer holds the same momentum
    views = state.global_views[0]
    momentum = []
    for view in views:
        buffer = state.optimizer.state.get(view, {}).get("momentum_buffer")
        momentum.append(torch.zeros_like(view) if buffer is None else buffer)
    options = self.__dict__["momentum_support_options"]
    generator = torch.Generator().manual_seed(options["seed"] * 1_000_003 + self.rounds)
    self.exchange.support = _support(momentum, [v.numel() for v in views], state.offsets[0], options["density"],
                                     options["explore"], generator)
    _ORIGINAL_START(self, fragments, finish_at)


def _quantized_on_support(self: SimulatedExchange, groups: list) -> tuple[torch.Tensor, float]:
    """Steps 1, 3 and 4 (``SimulatedExchange._quantized`` over ``self.support`` only)."""
    bits, block = QUANTIZE_BITS[self.config.quantize], self.config.quantize_block
    support = self.support
    compensated = self.compensated(groups)  # step 1
    applied, errors, nbytes = replay_quantized_allreduce([flat[support] for flat in compensated], bits, block)
    for flat, error in zip(compensated, errors):  # step 4: off the support everything is still owed
        flat[support] = error
    self.keep_residuals(groups, compensated)
    out = torch.zeros(groups[0].numel)
    out[support] = applied / self.workers
    return out, nbytes


def main(argv: list[str]) -> int:
    own, command, seed = split_command(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, required=True, help="share of each parameter's entries sent")
    parser.add_argument("--explore", type=float, default=0.25, help="share of the support drawn at random")
    options = parser.parse_args(own)
    if not (0 < options.density <= 1 and 0 <= options.explore <= 1):
        raise SystemExit("diloco_momentum_support: --density in (0, 1], --explore in [0, 1]")
    settings = {"density": options.density, "explore": options.explore, "seed": seed}

    def start(self: SimulatedDiLoCo, fragments: list[int], finish_at: int) -> None:
        self.__dict__["momentum_support_options"] = settings
        _start_with_support(self, fragments, finish_at)

    SimulatedDiLoCo._start = start  # type: ignore[method-assign]
    SimulatedExchange._quantized = _quantized_on_support  # type: ignore[method-assign]
    return run_and_mark(command, "sync_variant", {"script": "scripts/diloco_momentum_support.py",
                                                  "rule": "momentum support", "density": options.density,
                                                  "explore": options.explore})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
