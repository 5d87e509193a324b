"""Is a model FSDP-sharded? The other front-ends ask before they start, and refuse in one line.

A DDP hook and ``GradientExchange`` average replicated gradients; FSDP's are sharded (each rank
holds a slice), so averaging them as whole tensors is wrong, and torch fails on it deep inside
(FSDP1 calls a comm hook with three arguments; FSDP2's DTensor gradients refuse a broadcast).
"""

from __future__ import annotations

from typing import Any

import torch


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` is, or contains, an FSDP1 (``FullyShardedDataParallel``) or FSDP2
    (``fully_shard``) module."""
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return any(isinstance(module, (FSDPModule, FSDP1)) for module in model.modules())


def refuse_fsdp(model: Any) -> None:
    """Raise one ``ValueError`` for an FSDP model, naming the way out.

    Raises:
        ValueError: ``model`` is FSDP-sharded.
    """
    if is_fsdp(model):
        raise ValueError("this model is FSDP-sharded: gradwire's DDP hook, GradientExchange and the accelerate "
                         "helper need replicated gradients; use gradwire.fsdp.compress(model, ...) for FSDP2")
