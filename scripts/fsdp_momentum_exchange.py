"""An experiment for docs/fsdp.md: 1-bit Adam's own exchange, with top-k in place of the sign.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/fsdp_momentum_exchange.py --freeze-after N \\
        -- simulate --workers 4 --steps 500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
           --seed 0 --fsdp 'topk:density=0.1,values=fp16,indices=rice,warmup_steps=N' --json PATH

docs/fsdp.md's frozen-variance runs compressed the *gradient* and left the momentum to the optimizer
after the exchange. 1-bit Adam (Tang et al., 2021) compresses the *momentum*: after a warm-up of
plain Adam its second moment ``v`` is frozen, and every step

1. each worker w forms its own momentum from the global one of the step before:
   ``m_w = b1 m + (1 - b1) g_w`` (at the first such step, ``m`` is the warm-up's);
2. the workers average the ``m_w`` through the compressed exchange, error feedback included
   (here: the simulator's FSDP reduce-scatter given ``m_w`` where it is given gradients; its
   residuals are per worker, as ever), and every worker keeps the result as the global ``m``;
3. every worker steps ``p <- p (1 - lr wd) - lr m / (1 - b1^t) / (sqrt(v / (1 - b2^N)) + eps)``
   with the frozen ``v``: linear in ``m``, so what error feedback holds back arrives later whole.

``--own``: each worker's base is what it sent itself the step before, ``m_w = b1 sent_w + (1 - b1) g_w``
(started from the global ``m`` at step N + 1, or with ``--zero-start`` from zeros, as gradwire.fsdp
does): an FSDP rank holds only its shard of the global ``m``, but it knows what it sent. The average
of the ``sent_w`` is the global ``m``, so the average of the ``m_w`` is the global rule's; only the
selection, made per rank, differs. Needs error feedback on.

``--local``: each worker keeps its own momentum instead (``m_w <- b1 m_w + (1 - b1) g_w``, started
from the global ``m`` at step N + 1); the average of the ``m_w`` is still the momentum of the
averaged gradient, but error feedback then holds back what the momentum also still carries.

Steps ``t <= N`` are AdamW as PyTorch computes it, with the exchange exact (the spec's
``warmup_steps=N``; the script refuses a spec without it). Everything after ``--`` is a ``gradwire``
command line (``simulate --fsdp SPEC --optimizer adamw``). ``--fsdp plain`` checks the rule itself:
with a lossless exchange it is the frozen-variance run of ``scripts/fsdp_frozen_variance.py`` up to
float rounding.

The optimizer's arithmetic is the library's (``gradwire.fsdp.momentum.one_bit_adam_step``). Since
the first records in docs/fsdp.md were made it also fills ``v = 0`` when ``v`` freezes (coordinates
with no gradient through the warm-up, e.g. the embedding rows of bytes not yet seen), which changes
a run slightly (held-out 2.3215 against 2.3216 at step 200 of the library's rule, seed 0); the
``sim-momentum100-library-*`` records are the library's rule with the fill.

The script replays the rules in the simulator only (its replicas are bit-identical, so "the" global
``m`` and frozen ``v`` are every worker's); the library's rule is ``--own --zero-start``, which
``gradwire simulate --fsdp SPEC,warmup_steps=N,momentum=0.9`` now runs without this script
(``harness.sharding.ShardedReduce(momentum=...)`` with ``harness.optimizers.OneBitAdamW``; a
40-step check printed the same held-out losses as this script's ``--own --zero-start``). The
script stays for the rules the library does not offer (the global ``m``, ``--local``).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional

import torch

import gradwire.harness.simulate as simulator
from experiment_record import install_adamw_variant, run_and_mark
from gradwire.fsdp import layout
from gradwire.harness.optimizers import OneBitAdamW
from gradwire.harness.sharding import ShardedReduce


class MomentumExchangeAdamW(OneBitAdamW):
    """The library's optimizer arithmetic (:class:`gradwire.harness.optimizers.OneBitAdamW`: AdamW
    until ``freeze_after``, then the gradient it is handed is the averaged momentum, module
    docstring step 3, kept as ``m``), with what the script's other rules read of the global ``m``."""

    def local_momenta(self, gradients: list[torch.Tensor], own: Optional[list[torch.Tensor]] = None
                      ) -> list[torch.Tensor]:
        """Step 1 for one worker: ``b1 m + (1 - b1) g`` per parameter, in the group's order; with
        ``own`` (``--local``) the worker's own momenta in place of ``m``, updated in place."""
        group = self.param_groups[0]
        beta1 = group["betas"][0]
        if own is not None:
            return [m.lerp_(g, 1 - beta1) for m, g in zip(own, gradients)]
        return [torch.lerp(self.state[p]["m"], g, 1 - beta1) for p, g in zip(group["params"], gradients)]

    def momenta(self) -> list[torch.Tensor]:
        """Copies of the global ``m`` per parameter (a worker's own momenta start from them)."""
        return [self.state[p]["m"].clone() for p in self.param_groups[0]["params"]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze-after", type=int, required=True, help="N: the last step of plain AdamW")
    parser.add_argument("--own", action="store_true",
                        help="each worker's base is what it sent itself the step before, not the global m: "
                             "m_w = b1 sent_w + (1 - b1) g_w (what an FSDP rank knows)")
    parser.add_argument("--zero-start", action="store_true",
                        help="with --own: start every worker's base from zeros, not the global m (what "
                             "gradwire.fsdp does: a rank holds only its shard of m)")
    parser.add_argument("--local", action="store_true",
                        help="each worker keeps its own momentum (b1 m_w + (1 - b1) g_w, from the global m at "
                             "step N + 1) instead of starting from the global one every step")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.own and args.local:
        parser.error("--own and --local are two different rules: give one")
    if args.own and "ef=false" in command:
        parser.error("--own reads what was sent off the residuals: keep error feedback on")
    if args.freeze_after < 1:
        parser.error(f"--freeze-after={args.freeze_after} must be >= 1")
    spec = command[command.index("--fsdp") + 1] if "--fsdp" in command else ""
    found = re.search(r"warmup_steps=(\d+)", spec)
    if spec != "plain" and (found is None or int(found.group(1)) != args.freeze_after):
        parser.error(f"--fsdp {spec!r}: give it warmup_steps={args.freeze_after} (an exact exchange while "
                     "Adam's v still moves)")
    built: list[MomentumExchangeAdamW] = install_adamw_variant(
        "fsdp_momentum_exchange", lambda parameters, lr, weight_decay: MomentumExchangeAdamW(
            parameters, lr=lr, weight_decay=weight_decay, freeze_after=args.freeze_after))

    plain_simulate = simulator.simulate

    def simulate(*positional: object, **keywords: object) -> object:
        reduce = keywords.get("reduce")
        if reduce is None:
            raise SystemExit("fsdp_momentum_exchange: run it with --fsdp SPEC")

        own: list[list[torch.Tensor]] = []

        def momentum_reduce(grads: list[list[torch.Tensor]]) -> object:
            if built[0].steps_taken >= args.freeze_after and not args.own:  # the step about to be taken is past N
                if args.local and not own:
                    own.extend(built[0].momenta() for _ in grads)
                # replicas' m are identical: the first's stands for every worker's
                grads = [built[0].local_momenta(worker, own[w] if args.local else None)
                         for w, worker in enumerate(grads)]
            return reduce(grads)  # type: ignore[operator]

        keywords["reduce"] = momentum_reduce
        return plain_simulate(*positional, **keywords)

    if args.own:
        plain_sparse = ShardedReduce._sparse

        def own_sparse(self: ShardedReduce, unit: int, flats: list[torch.Tensor], shapes: list[tuple[int, ...]],
                       members: list[int]) -> torch.Tensor:
            """``--own``: ``m_w = b1 sent_w + (1 - b1) g_w`` into the per-rank rule, ``sent_w`` kept per
            unit (the first time: the global ``m``, flattened as the unit's gradient is)."""
            beta1 = built[0].param_groups[0]["betas"][0]
            sent = self.__dict__.setdefault("own_sent", [{} for _ in flats])
            if unit not in sent[0]:
                parameters = built[0].param_groups[0]["params"]
                start = layout.flatten([built[0].state[parameters[i]]["m"].float() for i in members], self.workers)
                if args.zero_start:
                    start.zero_()
                for own in sent:
                    own[unit] = start.clone()
            inputs = [torch.lerp(sent[w][unit], flat, 1 - beta1) for w, flat in enumerate(flats)]
            before = [self._compensated(w, unit, x) for w, x in enumerate(inputs)]
            total = plain_sparse(self, unit, inputs, shapes, members)
            for w, x in enumerate(before):
                sent[w][unit] = x - self.residuals[w][unit].float()
            return total

        ShardedReduce._sparse = own_sparse  # type: ignore[method-assign]
    simulator.simulate = simulate  # type: ignore[assignment]
    return run_and_mark(command, "optimizer_variant",
                        {"script": "scripts/fsdp_momentum_exchange.py", "freeze_after": args.freeze_after,
                         "local": args.local, "own": args.own, "zero_start": args.zero_start})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
