"""CPU time of the core's top-k selection over an FSDP module's (parameter, destination) pieces.

    PYTHONPATH=src python scripts/piece_selection_timing.py [--density 0.1] [--world-size 4] [--rounds 300]

One process, one thread. For each module of the gpt workload's model (``gradwire train --fsdp --model
gpt``: the embeddings and heads as the root, each block its own FSDP module), the flat chunk-by-rank
gradient of ``--world-size`` shards is split into FSDP's pieces, and :class:`gradwire.core.selection.
Selection` compensates and selects them (top-k per piece with error feedback, the check before it,
and the residuals' update with nothing received), as ``gradwire.fsdp`` does once per module and
step. Prints the median over ``--rounds`` rounds of one step's selection over every module, in ms,
its number of pieces, and the one-pass floor (``torch.add(out=)`` over the same elements) measured
in the same rounds. Run it with another checkout's ``src`` on ``PYTHONPATH`` to compare trees.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from gradwire.core.feedback import ErrorFeedback
    from gradwire.core.group import Entry, Group, ShardTarget, check_entries
    from gradwire.core.selection import Selection
    from gradwire.core.stats import ExchangeStats
    from gradwire.fsdp import layout
    from gradwire.harness.workloads import build_workload
    from gradwire.sparsify import get_sparsifier

    model = build_workload("gpt", "pystdlib", seed=0).model
    modules = [[p for name, p in model.named_parameters() if not name.startswith("blocks.")]]
    modules += [list(block.parameters()) for block in model.blocks]
    generator = torch.Generator().manual_seed(0)
    flats = [layout.flatten([torch.randn(p.shape, generator=generator) for p in params], args.world_size)
             for params in modules]
    shapes = [[tuple(p.shape) for p in params] for params in modules]
    selection = Selection(get_sparsifier("topk", density=args.density), ErrorFeedback(), "layer", ExchangeStats())
    pieces = [layout.pieces(s, args.world_size) for s in shapes]
    total = sum(flat.numel() for flat in flats)
    a, b, c = (torch.randn(total, generator=generator) for _ in range(3))

    def one_step(step: int) -> None:
        for m, (flat, module_pieces) in enumerate(zip(flats, pieces)):
            entries = [Entry((m, piece.parameter, piece.chunk), piece.parameter, flat[piece.offset: piece.offset +
                                                                                      piece.numel], piece.offset)
                       for piece in module_pieces]
            # one shard's view of the layout (no process group needed): the pieces are what is timed
            group = Group(ShardTarget(flat, torch.zeros(flat.numel()), group=None), entries, divisor=1)
            check_entries(group)
            selection.run(group, step, deferred=selection.deferrable(group))
            for entry in group.entries:
                if entry.indices is not None and not entry.unused:
                    selection.feedback.update(entry.key, entry.compensated, entry.indices,
                                              entry.compensated[entry.indices])

    for step in range(5):
        one_step(step)
    hook, floor = [], []
    for step in range(args.rounds):
        started = time.perf_counter()
        one_step(step)
        hook.append(time.perf_counter() - started)
        started = time.perf_counter()
        torch.add(a, b, out=c)
        floor.append(time.perf_counter() - started)
    count = sum(len(p) for p in pieces)
    print(f"{len(flats)} modules, {count} pieces, {total:,} elements, top-k {args.density:g}, p = {args.world_size}: "
          f"selection {statistics.median(hook) * 1e3:.2f} ms per step (min {min(hook) * 1e3:.2f}), "
          f"floor {statistics.median(floor) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
