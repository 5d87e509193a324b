"""The Pufferfish schedule: full-rank warm-up epochs, then one switch to the factorized model."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import is_integer
from .factorize import LayerDecision, check_options, factorize

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Warmup:
    """Train ``model`` full-rank for ``warmup_epochs`` epochs, then factorize it in place.

    The training loop reads ``warmup.model`` and ``warmup.optimizer`` (both change at the
    switch) and calls :meth:`step_epoch` once at the end of every epoch. At the switch:

    * the model (``ddp.module`` if wrapped) is factorized with ``rank_ratio``, ``keep_full``,
      ``min_params`` and ``extra_bn`` (see :func:`~gradwire.lowrank.factorize`); the original
      BatchNorm after each conv stays, now after the second factor;
    * the optimizer is rebuilt by ``optimizer_factory(model.parameters())``, then, when it has
      as many parameter groups, takes the old one's current hyperparameters group by group
      (``lr`` etc., so a decayed learning rate stays decayed). Momentum starts fresh, as in the
      paper; ``carry_momentum=True`` keeps the optimizer state of the layers that stayed
      full-rank (same Parameter objects);
    * a DDP-wrapped model is wrapped again with the same device_ids, output_device, process
      group, bucket size and flags (DDP broadcasts rank 0's factors on construction). Comm
      hooks are not carried over: pass ``ddp_factory(module) -> DDP`` to register them again.

    LR schedulers hold the old optimizer: point them at the new one after the switch
    (``scheduler.optimizer = warmup.optimizer``).

    Args:
        model: the model to train, or its DDP wrapper.
        optimizer_factory: builds an optimizer from parameters; called now and at the switch.
        warmup_epochs: full-rank epochs, an int >= 0 (0: factorize at once).
        rank_ratio: as for :func:`~gradwire.lowrank.factorize`.
        keep_full: as for :func:`~gradwire.lowrank.factorize`.
        min_params: as for :func:`~gradwire.lowrank.factorize`.
        extra_bn: as for :func:`~gradwire.lowrank.factorize`.
        carry_momentum: keep the optimizer state of the layers left full-rank.
        ddp_factory: wraps the factorized module again (None: a DDP with the old one's options).

    Raises:
        ValueError: a bad ``warmup_epochs``, or what :func:`~gradwire.lowrank.factorize` would
            raise for these options (checked now, not after the warm-up has been paid for).

    Example:
        >>> import torch
        >>> from gradwire.lowrank import Warmup
        >>> from gradwire.harness.models import build_model
        >>> warmup = Warmup(build_model("cnn"), lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        ...                 warmup_epochs=1, rank_ratio=0.25)
        >>> for epoch in range(2):
        ...     x, y = torch.randn(8, 1, 28, 28), torch.randint(10, (8,))
        ...     warmup.optimizer.zero_grad()
        ...     torch.nn.functional.cross_entropy(warmup.model(x), y).backward()
        ...     warmup.optimizer.step()
        ...     switched = warmup.step_epoch()
        >>> warmup.factorized, [d.name for d in warmup.decisions if d.factorized]
        (True, ['conv2', 'fc1'])
    """

    def __init__(self, model: nn.Module, optimizer_factory: OptimizerFactory, warmup_epochs: int, *,
                 rank_ratio: float = 0.25, keep_full: "Iterable[str] | str | None" = None, min_params: int = 0,
                 extra_bn: bool = False, carry_momentum: bool = False,
                 ddp_factory: Callable[[nn.Module], nn.Module] | None = None) -> None:
        if not is_integer(warmup_epochs) or warmup_epochs < 0:
            raise ValueError(f"warmup_epochs={warmup_epochs!r} must be an integer >= 0")
        # Fail now rather than after the warm-up epochs have been paid for.
        check_options(model.module if isinstance(model, DistributedDataParallel) else model,
                      rank_ratio, keep_full, min_params)
        self.model = model
        self.optimizer = optimizer_factory(model.parameters())
        self.warmup_epochs = warmup_epochs
        self.epochs_done = 0
        self.decisions: tuple[LayerDecision, ...] = ()
        self._optimizer_factory = optimizer_factory
        self._factorize_options: dict[str, Any] = {
            "rank_ratio": rank_ratio, "keep_full": keep_full, "min_params": min_params, "extra_bn": extra_bn}
        self._carry_momentum = carry_momentum
        self._ddp_factory = ddp_factory
        if warmup_epochs == 0:
            self._switch()

    @property
    def factorized(self) -> bool:
        """True once the model has been switched to low rank."""
        return bool(self.decisions)

    def step_epoch(self) -> bool:
        """Count one finished epoch; switch when the warm-up is over. True on the switching call."""
        self.epochs_done += 1
        if self.factorized or self.epochs_done < self.warmup_epochs:
            return False
        self._switch()
        return True

    def _switch(self) -> None:
        wrapped = isinstance(self.model, DistributedDataParallel)
        module = self.model.module if wrapped else self.model
        old_optimizer = self.optimizer
        factorized = factorize(module, inplace=True, **self._factorize_options)
        new_model = factorized
        if wrapped:
            new_model = self._ddp_factory(factorized) if self._ddp_factory else _rewrap(self.model, factorized)
        optimizer = self._optimizer_factory(new_model.parameters())
        if len(optimizer.param_groups) == len(old_optimizer.param_groups):
            for new_group, old_group in zip(optimizer.param_groups, old_optimizer.param_groups):
                new_group.update({key: value for key, value in old_group.items() if key != "params"})
        if self._carry_momentum:
            # Layers left full-rank keep their Parameter objects (factorize ran in place).
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter in old_optimizer.state:
                        optimizer.state[parameter] = old_optimizer.state[parameter]
        self.model, self.optimizer = new_model, optimizer
        self.decisions = factorized.lowrank_decisions


def _rewrap(old: DistributedDataParallel, module: nn.Module) -> DistributedDataParallel:
    """A new DDP around ``module`` with ``old``'s construction options, where they are readable."""
    options: dict[str, Any] = {
        "device_ids": old.device_ids,
        "output_device": old.output_device,
        "dim": old.dim,
        "process_group": old.process_group,
        "bucket_cap_mb": old.bucket_bytes_cap / (1024 * 1024),
        "find_unused_parameters": old.find_unused_parameters,
        "gradient_as_bucket_view": old.gradient_as_bucket_view,
        "static_graph": old.static_graph,
        "mixed_precision": getattr(old, "mixed_precision", None),
        "broadcast_buffers": getattr(old, "broadcast_buffers", None),
        "forward_sync_buffers": getattr(old, "forward_sync_buffers", None),
    }
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in accepted and options["forward_sync_buffers"] is not None:
        options.pop("broadcast_buffers")  # the newer name of the same switch; passing both warns
    options = {key: value for key, value in options.items() if key in accepted and value is not None}
    return DistributedDataParallel(module, **options)
