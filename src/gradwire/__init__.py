"""gradwire: send far fewer gradient bytes in PyTorch data-parallel training.

One line in a DDP script::

    ddp_model.register_comm_hook(gradwire.CommHookState(compressor="topk", density=0.01), gradwire.comm_hook)
"""

from __future__ import annotations

from . import codecs
from .errors import CollectiveError, DecodeError, DivergenceError, NonFiniteGradientError, StepFailedError
from .sparse import SparseTensor

__version__ = "0.1.0"


def __getattr__(name: str):  # the core pulls in sparsify/exchange; load it on first use
    if name in ("CommHookState", "HookConfig", "comm_hook"):
        from . import ddp

        return getattr(ddp, name)
    if name == "ExchangeConfig":
        from .core.config import ExchangeConfig

        return ExchangeConfig
    if name == "DiLoCo":
        from .local_steps import DiLoCo

        return DiLoCo
    if name == "GradientExchange":
        from .tensors import GradientExchange

        return GradientExchange
    if name == "lowrank":
        import importlib

        return importlib.import_module(".lowrank", __name__)
    raise AttributeError(f"module 'gradwire' has no attribute {name!r}")


__all__ = [
    "CollectiveError",
    "CommHookState",
    "DecodeError",
    "DiLoCo",
    "DivergenceError",
    "ExchangeConfig",
    "GradientExchange",
    "HookConfig",
    "NonFiniteGradientError",
    "SparseTensor",
    "StepFailedError",
    "codecs",
    "comm_hook",
    "lowrank",
    "__version__",
]
