"""The optimizers ``gradwire train`` and the simulator build, by name, with per-optimizer defaults.

* ``sgd``: ``torch.optim.SGD`` with momentum (default lr 0.05, momentum 0.9, no weight decay) —
  the harness's optimizer before AdamW existed, still the default;
* ``adamw``: ``torch.optim.AdamW`` with PyTorch's betas (0.9, 0.999) and eps 1e-8 (default lr 2e-3,
  the language-model calibration's, and PyTorch's default weight decay 0.01, applied to every
  parameter).

Both update every element independently, so W replicas that each step their own optimizer on the
same averaged gradient stay bit-identical (what :mod:`~gradwire.harness.simulate` relies on).
:class:`OneBitAdamW` is ``gradwire.fsdp.MomentumAdamW``'s arithmetic for a simulated replica (the
simulator's twin of ``compress(momentum=...)``, with :class:`~.sharding.ShardedReduce`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..errors import check_choice
from ..fsdp.momentum import one_bit_adam_groups

OPTIMIZERS = ("sgd", "adamw")
DEFAULT_LR = {"sgd": 0.05, "adamw": 2e-3}
DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}


def resolve(name: str, lr: Optional[float], weight_decay: Optional[float]) -> tuple[float, float]:
    """(lr, weight_decay) with the optimizer's defaults where None.

    Raises:
        ValueError: an unknown ``name``, ``lr`` <= 0 or ``weight_decay`` < 0 (or not finite).
    """
    check_choice("optimizer", name, OPTIMIZERS)
    lr = DEFAULT_LR[name] if lr is None else lr
    weight_decay = DEFAULT_WEIGHT_DECAY[name] if weight_decay is None else weight_decay
    if not 0 < lr < float("inf"):
        raise ValueError(f"lr={lr} must be > 0")
    if not 0 <= weight_decay < float("inf"):
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")
    return lr, weight_decay


def build_optimizer(name: str, parameters: Iterable[torch.nn.Parameter], *, lr: Optional[float] = None,
                    weight_decay: Optional[float] = None, momentum: float = 0.9) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``parameters``.

    Args:
        name: ``"sgd"`` or ``"adamw"``.
        parameters: what it updates.
        lr: learning rate (None: :data:`DEFAULT_LR`).
        weight_decay: decoupled for AdamW, L2 for SGD (None: :data:`DEFAULT_WEIGHT_DECAY`).
        momentum: SGD's momentum (AdamW ignores it).

    Raises:
        ValueError: as :func:`resolve`.
    """
    lr, weight_decay = resolve(name, lr, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)


class OneBitAdamW(torch.optim.Optimizer):
    """``gradwire.fsdp.MomentumAdamW``'s steps for one simulated replica: AdamW for the first
    ``freeze_after`` steps; after them Adam's ``v`` is frozen and the gradient it is handed is the
    exchanged momentum, kept as ``m`` (:func:`gradwire.fsdp.momentum.one_bit_adam_groups`, the same
    function, so the same arithmetic, the ``v = 0`` fill included).

    Args:
        params: what it updates.
        lr, weight_decay: as ``torch.optim.AdamW``; betas (0.9, 0.999), eps 1e-8.
        freeze_after: N, the exchange's ``warmup_steps`` (>= 1).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float, freeze_after: int,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 1:
            raise ValueError(f"freeze_after={freeze_after!r} must be an integer >= 1")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.freeze_after, self.steps_taken = freeze_after, 0

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.steps_taken += 1  # the simulator applies every step: none is skipped
        one_bit_adam_groups(self, t=self.steps_taken, v_steps=min(self.steps_taken, self.freeze_after),
                            warm=self.steps_taken <= self.freeze_after)
