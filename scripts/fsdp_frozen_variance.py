"""An experiment for docs/fsdp.md: does per-step top-k with error feedback hold under AdamW once Adam's
second moment stops moving (1-bit Adam's rule)?

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/fsdp_frozen_variance.py --freeze-after N [--precondition] \\
        -- simulate --workers 4 --steps 500 --batch-size 16 --optimizer adamw --lr 2e-3 --eval-every 100 \\
           --seed 0 --fsdp SPEC --json PATH

Everything after ``--`` is a ``gradwire`` command line (``simulate`` with ``--optimizer adamw``); this
script only swaps the simulator's AdamW for one whose second moment ``v`` is frozen after
``--freeze-after`` steps:

1. steps ``t <= N``: AdamW as PyTorch computes it (decoupled weight decay, ``m <- b1 m + (1-b1) g``,
   ``v <- b2 v + (1-b2) g^2``, bias corrections ``1-b1^t`` and ``1-b2^t``), up to float rounding;
2. steps ``t > N``: ``v`` (and its bias correction ``1-b2^N``) stay as they were at step N, so the
   step is linear in the gradient: momentum SGD with a fixed per-coordinate scale, under which error
   feedback's residuals telescope (what 1-bit Adam relies on).

``--precondition`` also moves the exchange into Adam's scaled coordinates after step N: every worker
divides its gradient by the frozen denominator ``sqrt(v / (1-b2^N)) + eps`` (identical on every
simulated worker) before the reduction, so top-k picks the coordinates with the largest *steps*
rather than the largest gradients, and the optimizer then applies the momentum of what arrived
(its momentum is divided by the same denominator once, at step N + 1). With a lossless reduction
this is the frozen run up to rounding (checked with ``--fsdp plain``: the same held-out losses
to 4 decimals at steps 100-400, 1.8195 against 1.8197 at step 500). Scaled gradients can exceed fp16's range where
``v`` is tiny (the run with ``values=fp16`` became NaN by step 300): use ``values=fp32`` with it.

Not a library feature: the simulator only (one process, the workers' replicas bit-identical, so
"the" frozen ``v`` is every worker's).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterable, Optional

import torch

import gradwire.harness.simulate as simulator
from experiment_record import install_adamw_variant, run_and_mark


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW whose second moment is frozen after ``freeze_after`` steps (module docstring).

    Args:
        params: the parameters (one group).
        lr, weight_decay, betas, eps: as ``torch.optim.AdamW``.
        freeze_after: the last step that updates ``v`` (>= 1).
        precondition: after that step, expect gradients already divided by :meth:`denominators`.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float,
                 freeze_after: int, precondition: bool, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.freeze_after, self.precondition, self.steps_taken = freeze_after, precondition, 0

    def denominators(self) -> list[torch.Tensor]:
        """``sqrt(v / (1 - b2^min(t, N))) + eps`` per parameter, in the group's order."""
        group = self.param_groups[0]
        correction = 1 - group["betas"][1] ** min(self.steps_taken, self.freeze_after)
        return [(self.state[p]["v"] / correction).sqrt_().add_(group["eps"]) for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:  # type: ignore[override]
        self.steps_taken += 1
        t, frozen_at = self.steps_taken, self.freeze_after
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            scaled = self.precondition and t > frozen_at
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["m"], state["v"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                if scaled and t == frozen_at + 1:  # the momentum moves into the scaled coordinates once
                    m.div_((v / (1 - beta2 ** frozen_at)).sqrt_().add_(group["eps"]))
                m.lerp_(p.grad, 1 - beta1)
                if t <= frozen_at:
                    v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                if scaled:
                    p.add_(m, alpha=-group["lr"] / (1 - beta1 ** t))
                else:
                    denominator = (v / (1 - beta2 ** min(t, frozen_at))).sqrt_().add_(group["eps"])
                    p.addcdiv_(m, denominator, value=-group["lr"] / (1 - beta1 ** t))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze-after", type=int, required=True, help="the last step that updates v")
    parser.add_argument("--precondition", action="store_true", help="exchange gradients divided by the frozen "
                                                                     "denominator after that step")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    if args.freeze_after < 1:
        parser.error(f"--freeze-after={args.freeze_after} must be >= 1")
    built: list[FrozenVarianceAdamW] = install_adamw_variant(
        "fsdp_frozen_variance", lambda parameters, lr, weight_decay: FrozenVarianceAdamW(
            parameters, lr=lr, weight_decay=weight_decay, freeze_after=args.freeze_after,
            precondition=args.precondition))

    plain_simulate = simulator.simulate

    def simulate(*positional: object, **keywords: object) -> object:
        reduce = keywords.get("reduce")
        if reduce is None:  # an exchange the simulator replays by its own plug points: not this experiment's
            raise SystemExit("fsdp_frozen_variance: run it with --fsdp SPEC")

        def scaled_reduce(grads: list[list[torch.Tensor]]) -> object:
            if args.precondition and built[0].steps_taken >= args.freeze_after:
                denominators = built[0].denominators()  # every replica's: they are bit-identical
                grads = [[g / d for g, d in zip(worker, denominators)] for worker in grads]
            return reduce(grads)  # type: ignore[operator]

        keywords["reduce"] = scaled_reduce
        return plain_simulate(*positional, **keywords)

    simulator.simulate = simulate  # type: ignore[assignment]
    return run_and_mark(argv[split + 1:], "optimizer_variant",
                        {"script": "scripts/fsdp_frozen_variance.py", "freeze_after": args.freeze_after,
                         "precondition": args.precondition})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
