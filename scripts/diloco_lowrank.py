"""An experiment for docs/local-steps.md: low-rank outer steps (PowerSGD's exchange, Vogels et al.
2019, applied to DiLoCo's pseudo-gradient) with error feedback, as a way below 1/2000 of DDP's bytes.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/diloco_lowrank.py --rank 2 -- \\
        simulate --workers 4 --steps 1500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
        --seed 0 --method 'diloco:sync_every=64,warmup_steps=300,unsent=residual+quantize:bits=8' --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate --method diloco:...+quantize:...``
with one fragment and no overlap: the quantized exchange is only the carrier, its compensation and
residuals are what this script reuses); this script swaps the simulator's
quantized AllReduce (``SimulatedExchange._quantized``) for a low-rank one. Per sync, per parameter:

1. every worker compensates Δ with its residual (``c = Δ + e``), as the core's exchanges do;
2. a matrix (the parameter viewed as ``(shape[0], rest)``, both sides longer than ``rank``) is
   ``M_w = c``. Every rank holds the same ``Q`` (n × rank; seeded alike at the first sync, the last
   sync's ``Q`` after it: PowerSGD's warm start). ``P = mean_w(M_w Q)`` (an AllReduce of fp16
   values), ``P̂`` its orthonormal basis (QR, the same on every rank), ``Q_w = M_w^T P̂``,
   ``Q = mean_w(Q_w)`` (a second fp16 AllReduce); every rank applies ``P̂ Q^T``;
3. worker w keeps ``e = c - P̂ Q_w^T`` (its fp16-rounded ``Q_w``): what it did not send, so
   ``Σ_w (c_w - e_w) = W P̂ Q^T`` and the feedback telescopes;
4. a vector or a thin matrix goes as fp16 values in a plain AllReduce, its rounding kept as ``e``.

``--iterations I`` repeats step 2's two products I times per sync (each repetition costs both
AllReduces again). ``unsent=residual`` or ``unsent=model`` (where the unsent part waits, as for a
sparsifier).

``--report-first-sync`` trains to the first sync, prints how well each exchange approximates the
workers' mean compensated Δ there (``|mean - applied| / |mean|``: the top ``rank`` singular
triplets of the mean, this script's exchange with 1, 2 and 4 iterations from a fresh random ``Q``,
and per-worker top-k averaged as the AllGather applies it) with each one's bytes, and how alike
the workers' Δ are (cosines), and exits.

Bytes: the ring AllReduce's ``2 (p - 1) / p`` of every fp16 vector sent (the library's
``ring_allreduce_bytes``), nothing else: no positions, no counts, no scales. Not a library
feature: the simulator only.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

from experiment_record import run_and_mark, split_command
from gradwire.exchange import ring_allreduce_bytes
from gradwire.harness.diloco_sim import SimulatedDiLoCo, SimulatedExchange

_ORIGINAL_START = SimulatedDiLoCo._start


def _fp16(tensor: torch.Tensor) -> torch.Tensor:
    """What a float32 tensor is after a trip through fp16 (the AllReduce's values)."""
    return tensor.to(torch.float16).to(torch.float32)


def _start_with_shapes(self: SimulatedDiLoCo, fragments: list[int], finish_at: int) -> None:
    """``SimulatedDiLoCo._start``, with the fragment's parameter shapes handed to the patched exchange."""
    if self.local.fragments != 1 or self.local.overlap_steps:
        raise SystemExit("diloco_lowrank: needs one fragment and no overlap")
    if self.exchange.config.quantize is None:
        raise SystemExit("diloco_lowrank: needs a quantize:bits=... exchange as its carrier")
    state = self.outer[0]
    self.exchange.lowrank_shapes = [tuple(state.parameters[i].shape) for i in state.fragments[0]]
    _ORIGINAL_START(self, fragments, finish_at)


def _matrix_shape(shape: tuple, rank: int) -> tuple[int, int] | None:
    """(rows, columns) a parameter is compressed as, or None when it goes as plain values (step 4)."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    columns = 1
    for size in shape[1:]:
        columns *= size
    return (rows, columns) if min(rows, columns) > rank else None


def _power_iterations(ms: list[torch.Tensor], q: torch.Tensor, iterations: int,
                      sent: Callable[[torch.Tensor], torch.Tensor]
                      ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Step 2, ``iterations`` times from ``q``: the shared basis ``P̂``, each worker's ``Q_w`` as sent
    (``sent``: what a value is after the wire, e.g. :func:`_fp16`) and their mean ``Q``."""
    for _ in range(iterations):
        basis = torch.linalg.qr(torch.stack([sent(m @ q) for m in ms]).sum(0) / len(ms)).Q
        q_own = [sent(m.t() @ basis) for m in ms]
        q = torch.stack(q_own).sum(0) / len(ms)
    return basis, q_own, q


def _lowrank(self: SimulatedExchange, groups: list) -> tuple[torch.Tensor, float]:
    """Steps 1-4 (``SimulatedExchange._quantized``'s place)."""
    options = self.lowrank_options
    rank, iterations, p = options["rank"], options["iterations"], self.workers
    bases = self.__dict__.setdefault("lowrank_q", {})
    compensated = self.compensated(groups)  # step 1
    out = torch.zeros(groups[0].numel)
    nbytes = 0.0
    for position, (entry, shape) in enumerate(zip(groups[0].entries, self.lowrank_shapes)):
        piece = slice(entry.offset, entry.offset + entry.numel)
        matrix = _matrix_shape(shape, rank)
        if matrix is None:  # step 4
            sent = [_fp16(flat[piece]) for flat in compensated]
            for flat, values in zip(compensated, sent):
                flat[piece] -= values
            out[piece] = torch.stack(sent).sum(0) / p
            nbytes += ring_allreduce_bytes(entry.numel, 2, p)
            continue
        rows, columns = matrix
        ms = [flat[piece].view(rows, columns) for flat in compensated]
        q = bases.get(position)
        if q is None:
            generator = torch.Generator().manual_seed(options["seed"] * 1_000_003 + position)
            q = torch.randn(columns, rank, generator=generator)
        basis, q_own, q = _power_iterations(ms, q, iterations, _fp16)  # step 2
        nbytes += iterations * (ring_allreduce_bytes(rows * rank, 2, p) + ring_allreduce_bytes(columns * rank, 2, p))
        bases[position] = q
        out[piece] = (basis @ q.t()).reshape(-1)
        for m, own in zip(ms, q_own):  # step 3 (in place: ``ms`` are views of ``compensated``)
            m -= basis @ own.t()
    self.keep_residuals(groups, compensated)
    return out, nbytes


def _first_sync_report(self: SimulatedExchange, groups: list) -> tuple[torch.Tensor, float]:
    """``--report-first-sync`` (module docstring): print the table, then leave the process."""
    flats = self.compensated(groups)
    mean = torch.stack(flats).mean(0)
    pieces = [(slice(e.offset, e.offset + e.numel), shape) for e, shape in zip(groups[0].entries, self.lowrank_shapes)]

    def relative(applied: torch.Tensor) -> float:
        return float((mean - applied).norm() / mean.norm())

    def lowrank(rank: int, iterations: int, exact: bool) -> tuple[torch.Tensor, float]:
        applied, nbytes = mean.clone(), 0.0
        for piece, shape in pieces:
            matrix = _matrix_shape(shape, rank)
            if matrix is None:
                nbytes += ring_allreduce_bytes(piece.stop - piece.start, 2, self.workers)
                continue
            rows, columns = matrix
            if exact:
                u, s, v = torch.linalg.svd(mean[piece].view(rows, columns), full_matrices=False)
                applied[piece] = ((u[:, :rank] * s[:rank]) @ v[:rank]).reshape(-1)
                continue
            ms = [flat[piece].view(rows, columns) for flat in flats]
            q = torch.randn(columns, rank, generator=torch.Generator().manual_seed(len(pieces)))
            basis, _, q = _power_iterations(ms, q, iterations, lambda values: values)
            applied[piece] = (basis @ q.t()).reshape(-1)
            nbytes += iterations * (ring_allreduce_bytes(rows * rank, 2, self.workers)
                                    + ring_allreduce_bytes(columns * rank, 2, self.workers))
        return applied, nbytes

    cosines = [float(torch.nn.functional.cosine_similarity(flats[0], flat, dim=0)) for flat in flats[1:]]
    print("first sync: cosine of worker 0's compensated Δ with the others' "
          + ", ".join(f"{c:.3f}" for c in cosines), flush=True)
    print("first sync: |mean - applied| / |mean| of the workers' compensated Δ (fp16 bytes per worker)", flush=True)
    for rank in (2, 3, 4, 8):
        best, _ = lowrank(rank, 0, exact=True)
        row = [f"rank {rank}: top singular triplets {relative(best):.3f}"]
        for iterations in (1, 2, 4):
            applied, nbytes = lowrank(rank, iterations, exact=False)
            row.append(f"{iterations} iteration(s) {relative(applied):.3f} ({nbytes / 1e3:.1f} kB)")
        print("  " + "; ".join(row), flush=True)
    for density in (0.04, 0.1):
        applied = torch.zeros_like(mean)
        for flat in flats:
            for piece, _ in pieces:
                values = flat[piece]
                kept = torch.topk(values.abs(), max(1, int(density * values.numel()))).indices
                applied[piece.start + kept] += values[kept] / self.workers
        print(f"  top-k {density:.0%} per worker, averaged: {relative(applied):.3f}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    own, command, seed = split_command(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True, help="the rank of each matrix's approximation")
    parser.add_argument("--iterations", type=int, default=1, help="power iterations per sync (each costs bytes)")
    parser.add_argument("--report-first-sync", action="store_true",
                        help="print how well each exchange approximates the first sync's mean Δ, then exit")
    options = parser.parse_args(own)
    if options.rank < 1 or options.iterations < 1:
        raise SystemExit("diloco_lowrank: --rank and --iterations are at least 1")
    settings = {"rank": options.rank, "iterations": options.iterations, "seed": seed}

    def start(self: SimulatedDiLoCo, fragments: list[int], finish_at: int) -> None:
        self.exchange.lowrank_options = settings
        _start_with_shapes(self, fragments, finish_at)

    SimulatedDiLoCo._start = start  # type: ignore[method-assign]
    SimulatedExchange._quantized = _first_sync_report if options.report_first_sync else _lowrank  # type: ignore

    return run_and_mark(command, "sync_variant", {"script": "scripts/diloco_lowrank.py", "rule": "powersgd",
                                                  "rank": options.rank, "iterations": options.iterations})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
