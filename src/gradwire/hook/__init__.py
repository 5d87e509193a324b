"""The DDP hook under its wave-1 name: a re-export of :mod:`gradwire.ddp`."""

from ..ddp import CommHookState, HookConfig, NonFiniteGradientError, comm_hook

__all__ = ["CommHookState", "HookConfig", "NonFiniteGradientError", "comm_hook"]
