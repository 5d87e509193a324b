"""An experiment for docs/local-steps.md: sparse outer steps with EF21's error feedback, where each
worker compresses the *change* of its pseudo-gradient and the outer optimizer steps on a dense
estimate of the mean pseudo-gradient, instead of on the sparse mean.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/diloco_ef21.py -- \\
        simulate --workers 4 --steps 1500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
        --seed 0 --method 'diloco:sync_every=32,warmup_steps=300,unsent=residual+topk:density=0.02,...' --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate --method diloco:...+SPARSIFIER`` with
``unsent=residual``, one fragment, no overlap, and a period that divides the local steps, so that
no forced sync ends the run); this script only swaps one sync of the simulator
(``SimulatedDiLoCo._start``) for EF21's (Richtárik, Sokolov and Fatkhullin, 2021). Worker w keeps
``s_w``, the estimate of its pseudo-gradient that every rank holds for it (zeros at first: the
memory error feedback's residual took), and every rank keeps ``S``, the mean of the estimates. Per sync:

1. every worker computes ``d_w = Δ_w - s_w``, what its pseudo-gradient moved away from its estimate;
2. the exchange runs on ``d_w`` as it ran on ``Δ_w`` (selection, codecs, the AllGather's bytes), with
   no residual added;
3. ``s_w <- s_w + (what w sent)``, ``S <- S + (the exchange's mean)``: the same on every rank, as
   every rank decoded every payload;
4. the outer optimizer steps on ``S``: dense, every coordinate its estimate, where the sparse
   rules step on the mean of the sent entries and zero elsewhere; every worker restarts from θ.

The bytes are the exchange's own. Not a library feature: the simulator only.
"""

from __future__ import annotations

import sys

import torch

from experiment_record import run_and_mark
from gradwire.exchange import ring_allreduce_bytes
from gradwire.harness.diloco_sim import SimulatedDiLoCo
from gradwire.local_steps.outer import fragment_group


def _start_ef21(self: SimulatedDiLoCo, fragments: list[int], finish_at: int) -> None:
    """``SimulatedDiLoCo._start`` with EF21's estimates (module docstring, steps 1-4)."""
    if self.local.unsent != "residual" or self.local.fragments != 1 or self.local.overlap_steps:
        raise SystemExit("diloco_ef21: needs unsent=residual, one fragment and no overlap")
    estimates = self.__dict__.setdefault("ef21_estimates", {})
    means = self.__dict__.setdefault("ef21_means", {})
    averaged = []
    sent = 0.0
    for fragment in fragments:
        groups, changes = [], []
        for worker, state in enumerate(self.outer):
            members, offsets = state.fragments[fragment], state.offsets[fragment]
            delta = state.pseudo_gradient(fragment, self.deltas[worker][fragment], keep_start=self.local.carries)
            estimate = estimates.setdefault((worker, fragment), torch.zeros_like(delta))
            delta.sub_(estimate)  # step 1, in the buffer the exchange reads
            changes.append(delta.clone())
            for index in members:  # step 2: nothing owed is added to the change
                self.exchange.feedback[worker].clear(self.keys[worker][index])
            groups.append(fragment_group(delta, state.parameters, members, offsets, self.keys[worker],
                                         self.tensor_ids, float(self.workers)))
        result, nbytes = self.exchange.average(groups, self.rounds)
        for worker, state in enumerate(self.outer):  # step 3: what w sent is its change less what it kept
            members, offsets = state.fragments[fragment], state.offsets[fragment]
            estimate, feedback = estimates[(worker, fragment)], self.exchange.feedback[worker]
            for index, offset in zip(members, offsets):
                kept = feedback.residual(self.keys[worker][index])
                if kept is None:  # an unused parameter (no change at all): nothing was sent
                    continue
                piece = slice(offset, offset + kept.numel())
                estimate[piece] += changes[worker][piece] - kept.to(torch.float32)
                feedback.clear(self.keys[worker][index])
        mean = means.setdefault(fragment, torch.zeros_like(result))
        mean += result
        averaged.append(mean.clone())  # step 4
        sent += nbytes
    buffers = None
    if self.buffers[0]:  # as the simulator's own sync: the floating buffers' mean
        flats = [torch.cat([b.detach().reshape(-1).to(torch.float32) for b in own]) for own in self.buffers]
        buffers = flats[0].clone()
        for flat in flats[1:]:
            buffers += flat
        buffers.div_(self.workers)
        sent += ring_allreduce_bytes(buffers.numel(), 4, self.workers)
    self.rounds += 1
    self.bytes_outer += sent
    self.bytes_sent += sent
    self.bytes_peak_sync = max(self.bytes_peak_sync, sent)
    self._pending = (fragments, finish_at, averaged, buffers)


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    if argv[:split]:
        raise SystemExit(f"diloco_ef21: no options of its own, got {argv[:split]}; usage: see the docstring")
    SimulatedDiLoCo._start = _start_ef21  # type: ignore[method-assign]
    return run_and_mark(argv[split + 1:], "sync_variant", {"script": "scripts/diloco_ef21.py", "rule": "ef21"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
