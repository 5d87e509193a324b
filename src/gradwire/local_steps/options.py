"""The local-step options of :class:`~gradwire.local_steps.DiLoCo`, validated, with their canonical text.

The compression options of the outer exchange are the core's (:class:`~gradwire.core.config.ExchangeConfig`);
these are the ones the core does not know. :meth:`LocalStepsConfig.describe` joins both, and every
rank compares a hash of it when the front-end is built, so ranks that would sync on different
schedules fail at once instead of deadlocking at their first mismatched collective.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..core.config import ExchangeConfig
from ..errors import check_choice, is_integer, is_real

#: where what a sync did not send waits: the core's residual, or the rank's own model
UNSENT = ("residual", "model")


def default_unsent(config: ExchangeConfig) -> str:
    """Where a compressed sync's unsent part waits when ``unsent`` is not given: ``"model"`` for a
    sparsifier with plain error feedback, ``"residual"`` otherwise (quantized or dense outer steps,
    momentum correction, whose velocities cannot move into the model, or no error feedback).

    Measured (docs/local-steps.md, "Where the unsent part waits"): with top-k outer steps the model
    rule ended ahead of the residual rule in every pair run, on the byte-level GPT (top-k 10%, two
    seeds: +0.4% and +1.3% against dense outer steps, where the residual rule was +16%) and on the
    MNIST CNN (top-k 10% and 3%, two seeds each)."""
    sparse = config.compressor != "none" and config.quantize is None
    return "model" if sparse and config.error_feedback and config.momentum_correction is None else "residual"
#: how an overlapped sync's result meets the inner steps taken meanwhile: Streaming DiLoCo's mix
#: (``merge_alpha``) or carrying those steps over onto the new θ
OVERLAP_MERGES = ("mix", "carry")
#: options added after checkpoints were written: described only when not at their default
_LATER = frozenset({"overlap_merge"})


@dataclass(frozen=True)
class LocalStepsConfig:
    """See :class:`~gradwire.local_steps.DiLoCo` for what each option means.

    Raises:
        ValueError: an option out of range, naming it and what is allowed.
    """

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    #: the outer optimizer's name when a factory was given (its state must match across ranks too)
    outer_optimizer: Optional[str] = None
    warmup_steps: int = 0
    fragments: int = 1
    overlap_steps: int = 0
    feedback_decay: float = 1.0
    merge_alpha: float = 0.5
    overlap_merge: str = "mix"
    unsent: str = "residual"
    #: the warm-up's gradient exchange: None (dense float32) or "int8" / "int4" (quantized, with error feedback)
    warmup_quantize: Optional[str] = None
    #: with ``warmup_quantize``: the warm-up's first steps average exactly (float32), the rest
    #: quantized; error feedback from step 1 under Adam can fall behind and stay there
    warmup_exact_steps: int = 0

    def __post_init__(self) -> None:
        for name, low in (("sync_every", 1), ("fragments", 1), ("warmup_steps", 0), ("overlap_steps", 0)):
            value = getattr(self, name)
            if not is_integer(value) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if self.sync_every % self.fragments:
            raise ValueError(f"sync_every={self.sync_every} must be a multiple of fragments={self.fragments} "
                             "(each fragment syncs every sync_every / fragments steps)")
        interval = self.sync_every // self.fragments
        if self.overlap_steps > interval:
            raise ValueError(f"overlap_steps={self.overlap_steps} must be at most sync_every / fragments = {interval}: "
                             "a fragment's exchange must end before the next one starts")
        for name, low, high in (("feedback_decay", 0.0, 1.0), ("merge_alpha", 0.0, 1.0)):
            value = getattr(self, name)
            if not (is_real(value) and math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{name}={value!r} must be a number in [{low:g}, {high:g}]")
        if self.outer_optimizer is None:
            if not (is_real(self.outer_lr) and math.isfinite(self.outer_lr) and self.outer_lr > 0):
                raise ValueError(f"outer_lr={self.outer_lr!r} must be a number > 0")
            if not (is_real(self.outer_momentum) and 0 <= self.outer_momentum < 1):
                raise ValueError(f"outer_momentum={self.outer_momentum!r} must be a number in [0, 1)")
        check_choice("unsent", self.unsent, UNSENT)
        check_choice("overlap_merge", self.overlap_merge, OVERLAP_MERGES)
        check_choice("warmup_quantize", self.warmup_quantize, (None, "int8", "int4"))
        if not is_integer(self.warmup_exact_steps) or not 0 <= self.warmup_exact_steps <= self.warmup_steps:
            raise ValueError(f"warmup_exact_steps={self.warmup_exact_steps!r} must be an integer in "
                             f"[0, warmup_steps={self.warmup_steps}]")
        if self.warmup_exact_steps and self.warmup_quantize is None:
            raise ValueError("warmup_exact_steps needs warmup_quantize='int8' or 'int4' (without it the whole "
                             "warm-up is exact)")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov={self.nesterov!r} must be True or False")

    @property
    def interval(self) -> int:
        """Local steps between two syncs (of consecutive fragments): ``sync_every / fragments``."""
        return self.sync_every // self.fragments

    @property
    def carries(self) -> bool:
        """Whether an overlapped sync merges by carrying the inner steps taken meanwhile (its start
        is then kept, :meth:`~.outer.OuterState.pseudo_gradient`)."""
        return self.overlap_steps > 0 and self.overlap_merge == "carry"

    def describe(self) -> str:
        """Canonical ``name=value`` text of every option (all must match across ranks); options added
        later are left out at their defaults, so a checkpoint saved before they existed still loads."""
        return " ".join(f"{field.name}={getattr(self, field.name)!r}" for field in dataclasses.fields(self)
                        if not (field.name in _LATER and getattr(self, field.name) == field.default))


#: the keywords of DiLoCo that are local-step options (the rest go to the exchange's config)
LOCAL_KEYS = frozenset(field.name for field in dataclasses.fields(LocalStepsConfig)) - {"outer_optimizer"}
#: the exchange's defaults for an outer step: a dense float32 AllReduce
OUTER_EXCHANGE_DEFAULTS = {"compressor": "none", "value_codec": "fp32"}


def split_options(**options: object) -> tuple[LocalStepsConfig, ExchangeConfig]:
    """DiLoCo's keyword options (without model and optimizers), validated: its own and the exchange's.

    Raises:
        ValueError: an invalid or missing option (``sync_every`` is required), naming it.
    """
    if "sync_every" not in options:
        raise ValueError("sync_every is required (inner steps between two syncs of a parameter)")
    local = {key: value for key, value in options.items() if key in LOCAL_KEYS}
    exchange = {key: value for key, value in options.items() if key not in LOCAL_KEYS}
    exchange_config = ExchangeConfig(**{**OUTER_EXCHANGE_DEFAULTS, **exchange})  # type: ignore[arg-type]
    if local.get("unsent") is None:  # as DiLoCo resolves it
        local["unsent"] = default_unsent(exchange_config)
    return LocalStepsConfig(**local), exchange_config  # type: ignore[arg-type]
