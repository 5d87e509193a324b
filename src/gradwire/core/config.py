"""Every option of the compression core in one frozen, validated record.

:class:`ExchangeConfig` is the single list of options that every front-end shares (the DDP
hook's :class:`~gradwire.HookConfig` is this class). The cross-rank mismatch check and
:meth:`ExchangeConfig.describe` both derive from its fields, so an option added here can never
escape the check (a field marked ``rank_local`` — a logging period, a timeout — may differ
between ranks and is left out).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from .. import codecs as codec_layer
from ..codecs.base import IndexCodec, ValueCodec
from ..errors import check_choice, is_integer
from ..exchange import COLLECTIVES
from ..sparsify import get_sparsifier, sparsifiers
from ..sparsify.base import Sparsifier

if TYPE_CHECKING:
    import torch

SCOPES = ("layer", "global")
NONFINITE_POLICIES = ("raise", "skip")
VERIFY_POLICIES = ("digest", "none")
#: Value codecs an AllReduce of values can apply (a cast); others need a payload exchange.
CAST_VALUE_CODECS = ("fp32", "fp16", "bf16")
#: A collective that has not finished after this many seconds fails the step (gloo's own
#: default is 30 minutes: far too long to notice a dead peer or a rank without the hook).
DEFAULT_COLLECTIVE_TIMEOUT = 120.0

_LOCAL = {"rank_local": True}
#: Options added after checkpoints were first written: left out of describe() at their default,
#: so an existing checkpoint's option hash still matches.
_LATER = {"omit_default": True}
QUANTIZE_CHOICES = (None, "int8", "int4")
#: residual storage: "float32" is the accumulation dtype (float64 for float64 gradients)
RESIDUAL_DTYPES = ("float32", "bfloat16")
QUANTIZE_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class ExchangeConfig:
    """The core's options; see :class:`gradwire.CommHookState` for what each one means.

    Codecs may be given as names, config dicts or instances; they are resolved (with
    ``codec_options`` routed to them) by :meth:`build_codecs`. Invalid values raise
    ``ValueError`` naming the option and the allowed values.
    """

    compressor: str = "topk"
    density: Optional[float] = None
    k: Optional[int] = None
    threshold: Optional[float] = None
    value_codec: Any = "fp32"
    index_codec: Any = "eliasfano"
    codec_options: dict[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    momentum_correction: Optional[float] = None
    scope: str = "layer"
    collective: str = "auto"
    hierarchy: Union[str, int, None] = None
    seed: int = 0
    warmup_steps: int = 0
    nonfinite: str = "raise"
    verify: str = "digest"
    link_gbit: Optional[float] = None
    link_alpha: Optional[float] = None
    quantize: Optional[str] = field(default=None, metadata=_LATER)
    quantize_block: int = field(default=128, metadata=_LATER)
    residual_dtype: str = field(default="float32", metadata=_LATER)
    feedback_decay: float = field(default=1.0, metadata=_LATER)
    #: the sparsifier's chunk (``chunktopk``, ``blocktopk``); None: the sparsifier's default
    chunk: Optional[int] = field(default=None, metadata=_LATER)
    collective_timeout: float = field(default=DEFAULT_COLLECTIVE_TIMEOUT, metadata=_LOCAL)
    log_every: int = field(default=0, metadata=_LOCAL)

    def __post_init__(self) -> None:
        check_choice("compressor", self.compressor, ("none", *sparsifiers()))
        check_choice("scope", self.scope, SCOPES)
        check_choice("collective", self.collective, COLLECTIVES)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_choice("verify", self.verify, VERIFY_POLICIES)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if not isinstance(self.log_every, int) or self.log_every < 0:
            raise ValueError(f"log_every={self.log_every!r} must be an integer >= 0")
        if not (isinstance(self.collective_timeout, (int, float)) and math.isfinite(self.collective_timeout)
                and self.collective_timeout > 0):
            raise ValueError(f"collective_timeout={self.collective_timeout!r} must be a number of seconds > 0")
        if self.hierarchy not in (None, "auto") and not (isinstance(self.hierarchy, int) and self.hierarchy >= 1):
            raise ValueError(f"hierarchy={self.hierarchy!r} is not supported; allowed: None, 'auto', "
                             "or the number of ranks per node (an integer >= 1)")
        object.__setattr__(self, "codec_options", dict(self.codec_options or {}))
        check_choice("quantize", self.quantize, QUANTIZE_CHOICES)
        check_choice("residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        if self.residual_dtype != "float32" and self.momentum_correction is not None:
            raise ValueError(f"residual_dtype={self.residual_dtype!r} is not supported with momentum_correction "
                             "(its velocities stay float32); use error_feedback")
        if not (isinstance(self.feedback_decay, (int, float)) and not isinstance(self.feedback_decay, bool)
                and 0.0 <= self.feedback_decay <= 1.0):
            raise ValueError(f"feedback_decay={self.feedback_decay!r} must be a number in [0, 1] "
                             "(1: plain error feedback; β of the rule e <- β (x - sent))")
        if self.feedback_decay != 1.0 and self.momentum_correction is not None:
            raise ValueError(f"feedback_decay={self.feedback_decay!r} is not supported with momentum_correction; "
                             "use error_feedback")
        if not is_integer(self.quantize_block) or self.quantize_block < 1:
            raise ValueError(f"quantize_block={self.quantize_block!r} must be an integer >= 1 (values per scale)")
        if self.quantize is not None and (self.compressor != "none" or self.collective not in ("auto", "dense")):
            raise ValueError(f"quantize={self.quantize!r} is a dense exchange of quantized blocks: it needs "
                             f"compressor='none' and collective 'auto' or 'dense' (got compressor={self.compressor!r}, "
                             f"collective={self.collective!r}); for sparse values use a value codec (e.g. 'qsgd')")
        for name in ("link_gbit", "link_alpha"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a number > 0 (or None: measured at the first step)")
        if self.hierarchy is not None and self.collective not in ("auto", "sparse-allreduce"):
            raise ValueError(f"hierarchy={self.hierarchy!r} needs collective='sparse-allreduce' or 'auto'; "
                             f"got collective={self.collective!r}")
        if self.compressor != "none" and self.density is None and self.k is None and self.threshold is None:
            object.__setattr__(self, "density", 0.01)
        sparsifier = self.build_sparsifier()  # validates the amount against the sparsifier
        value_codec, index_codec = self.build_codecs()
        object.__setattr__(self, "value_codec", value_codec)
        object.__setattr__(self, "index_codec", index_codec)
        shared = bool(sparsifier is not None and sparsifier.shared_support)
        if self.collective == "allreduce" and not shared:
            raise ValueError(
                f"collective='allreduce' needs a shared support (randomk, randomblock); "
                f"compressor={self.compressor!r} picks different positions per rank: use 'allgather', "
                "'sparse-allreduce' or 'auto'"
            )
        if self.collective == "allreduce" and value_codec.name not in CAST_VALUE_CODECS:
            raise ValueError(
                f"collective='allreduce' sums values on the wire, so value_codec must be one of "
                f"{', '.join(CAST_VALUE_CODECS)}; got {value_codec.name!r}"
            )
        if self.collective == "sparse-allreduce" and (sparsifier is None or shared):
            raise ValueError(
                f"collective='sparse-allreduce' needs a per-rank support (topk, sampled-topk, gaussian-k, "
                f"threshold); compressor={self.compressor!r} has {'none' if sparsifier is None else 'a shared one'}"
            )
        if self.collective == "sparse-allreduce" and not index_codec.lossless:
            raise ValueError(f"collective='sparse-allreduce' sums entries by position, so index_codec must be "
                             f"lossless; got {index_codec.name!r}")
        if self.hierarchy is not None and self.momentum_correction is not None:
            raise ValueError("hierarchy is not supported with momentum_correction (its residual lives on the "
                             "node's sum, not on this rank's momentum); use error_feedback")

    # ------------------------------------------------------------------------------ building
    def build_sparsifier(self) -> Optional[Sparsifier]:
        if self.compressor == "none":
            return None
        options = {} if self.chunk is None else {"chunk": self.chunk}  # refused by sparsifiers without chunks
        return get_sparsifier(self.compressor, density=self.density, k=self.k, threshold=self.threshold,
                              seed=self.seed, **options)

    def build_codecs(self) -> tuple[ValueCodec, IndexCodec]:
        return codec_layer.resolve_codecs(self.value_codec, self.index_codec, dict(self.codec_options))

    @property
    def residual_storage(self) -> "Optional[torch.dtype]":
        """The dtype residuals are stored in (None: the accumulation dtype)."""
        import torch

        return None if self.residual_dtype == "float32" else getattr(torch, self.residual_dtype)

    @property
    def shared_support(self) -> bool:
        return self.compressor in _shared_support_sparsifiers()

    # --------------------------------------------------------------------------- comparing
    def describe(self) -> str:
        """Canonical ``name=value`` text of every option that must match across ranks."""
        parts = []
        for option in dataclasses.fields(self):
            if option.metadata.get("rank_local"):
                continue
            value = getattr(self, option.name)
            if option.metadata.get("omit_default") and value == option.default:
                continue
            if hasattr(value, "get_config"):
                value = value.get_config()
            parts.append(f"{option.name}={value!r}")
        return " ".join(parts)

    def digest(self) -> str:
        """A short hash of :meth:`describe` (recorded in checkpoints)."""
        return hashlib.sha256(self.describe().encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "ExchangeConfig":
        return dataclasses.replace(self, **changes)


def _shared_support_sparsifiers() -> frozenset[str]:
    from ..sparsify.base import sparsifier_classes

    return frozenset(name for name, cls in sparsifier_classes().items() if getattr(cls, "shared_support", False))
