"""What every integration shares: find the DDP wrapper, per-rank state files, the idle warning."""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..ddp import CommHookState, comm_hook

#: one file per rank next to the framework's checkpoint (as the frameworks' own RNG states)
STATE_FILE = "gradwire_hook_rank{rank}.pt"


class HookNeverRanWarning(UserWarning):
    """Training ended but gradwire's hook exchanged no gradient (it was not registered where
    the gradients go, or the job ran on one process)."""


def find_ddp(module: Any) -> Optional[DistributedDataParallel]:
    """The ``DistributedDataParallel`` inside ``module`` (itself, or under ``torch.compile``'s
    ``_orig_mod``), or None when it is not DDP-wrapped."""
    for _ in range(4):
        if isinstance(module, DistributedDataParallel):
            return module
        module = getattr(module, "_orig_mod", None)
        if module is None:
            return None
    return None


def register(ddp: DistributedDataParallel, options: dict[str, Any]) -> CommHookState:
    """A new hook state for ``ddp`` (knowing its parameter names), registered on it."""
    state = CommHookState(model=ddp, process_group=ddp.process_group, **options)
    ddp.register_comm_hook(state, comm_hook)
    return state


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def state_file(directory: "str | os.PathLike[str]", rank_: Optional[int] = None) -> str:
    return os.path.join(os.fspath(directory), STATE_FILE.format(rank=rank() if rank_ is None else rank_))


def save_rank_state(state: CommHookState, directory: "str | os.PathLike[str]") -> str:
    """Write this rank's hook state to ``directory/gradwire_hook_rank{r}.pt``; returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = state_file(directory)
    torch.save(state.state_dict(), path)
    return path


def read_state(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """A hook state file, read with ``weights_only=True`` (tensors, numbers, strings only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_rank_state(state: CommHookState, directory: "str | os.PathLike[str]", device: Any = "cpu") -> bool:
    """Restore this rank's file from ``directory``; False (and a warning) when it is missing."""
    path = state_file(directory)
    if not os.path.exists(path):
        warnings.warn(f"gradwire: no hook state {path} for rank {rank()}; error-feedback residuals start from zero",
                      stacklevel=3)
        return False
    state.load_state_dict(read_state(path), device=device)
    return True


def warn_if_idle(state: Optional[CommHookState], where: str) -> None:
    """Warn when the hook was never registered or never completed a step."""
    if state is None:
        warnings.warn(f"gradwire: {where}: the model was never wrapped in DistributedDataParallel (one process, "
                      "or the framework did not run data-parallel), so no gradient was compressed",
                      HookNeverRanWarning, stacklevel=3)
    elif state.stats()["step"] == 0:
        warnings.warn(f"gradwire: {where}: the hook is registered but ran no step: no gradient was compressed",
                      HookNeverRanWarning, stacklevel=3)


def parameters_device(module: torch.nn.Module) -> torch.device:
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
