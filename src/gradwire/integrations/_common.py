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
#: the second and later models registered on one accelerate ``Accelerator`` (a GAN's discriminator,
#: a student beside its teacher) each get their own files, so none overwrites another's; the first
#: keeps STATE_FILE, so one-model folders read as before and old ones still load
MODEL_STATE_FILE = "gradwire_hook_model{model}_rank{rank}.pt"
#: the key under which a state file records which registered model wrote it (see model_record)
MODEL_KEY = "registered_model"


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
    """A new hook state for ``ddp`` (knowing its parameter names), registered on it.

    Args:
        ddp: the wrapper; it accepts one comm hook.
        options: :class:`CommHookState`'s keyword options.

    Returns:
        The registered state.
    """
    state = CommHookState(model=ddp, process_group=ddp.process_group, **options)
    ddp.register_comm_hook(state, comm_hook)
    return state


def rank() -> int:
    """This process's rank in the default group; 0 without an initialized process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def state_file(directory: "str | os.PathLike[str]", rank_: Optional[int] = None, model: int = 0) -> str:
    """The path of a rank's hook state file in ``directory``.

    Args:
        directory: the framework's checkpoint folder.
        rank_: the rank (default: this process's).
        model: the model's registration index (0: the first or only model, ``STATE_FILE``).

    Returns:
        ``directory/gradwire_hook_rank{r}.pt``, or ``directory/gradwire_hook_model{i}_rank{r}.pt``
        for ``model`` i >= 1.
    """
    name = STATE_FILE if model == 0 else MODEL_STATE_FILE
    return os.path.join(os.fspath(directory), name.format(rank=rank() if rank_ is None else rank_, model=model))


def model_record(module: torch.nn.Module, index: int) -> dict[str, Any]:
    """Which registered model a state file belongs to: its registration index and its parameters'
    names and sizes (a state file holds only tensors, numbers and strings).

    Args:
        module: the model (its parameters as the user named them, without DDP's ``module.``).
        index: the order in which it was registered (0 first).

    Returns:
        ``{"index": i, "parameters": [name, ...], "numels": [numel, ...]}``.
    """
    named = list(module.named_parameters())
    return {"index": index, "parameters": [name for name, _ in named], "numels": [p.numel() for _, p in named]}


def save_rank_state(state: CommHookState, directory: "str | os.PathLike[str]",
                    model: Optional[dict[str, Any]] = None) -> str:
    """Write this rank's hook state into ``directory``.

    Args:
        state: the hook state.
        directory: the checkpoint folder (created if missing).
        model: :func:`model_record` of the hook's model, kept in the file and checked on load;
            its index picks the file name (None: the one model, ``STATE_FILE``).

    Returns:
        The path written.
    """
    os.makedirs(directory, exist_ok=True)
    path = state_file(directory, model=model["index"] if model else 0)
    saved = state.state_dict()
    if model is not None:
        saved[MODEL_KEY] = model
    torch.save(saved, path)
    return path


def read_state(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """A hook state file, read with ``weights_only=True`` (tensors, numbers, strings only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_rank_state(state: CommHookState, directory: "str | os.PathLike[str]", device: Any = "cpu",
                    model: Optional[dict[str, Any]] = None) -> bool:
    """Restore this rank's file from ``directory``.

    Args:
        state: the hook state to restore into.
        directory: the checkpoint folder.
        device: the gradients' device.
        model: :func:`model_record` of the hook's model (None: the one model, ``STATE_FILE``).

    Returns:
        True when restored; False (and a warning) when the file is missing.

    Raises:
        ValueError: the file was written for another registered model, or does not fit this
            hook (another rank, world size, options or parameters; nothing is loaded then).
    """
    index = model["index"] if model else 0
    path = state_file(directory, model=index)
    if not os.path.exists(path):
        warnings.warn(f"gradwire: no hook state {path} for rank {rank()}; error-feedback residuals start from zero",
                      stacklevel=3)
        return False
    saved = read_state(path)
    recorded = saved.pop(MODEL_KEY, None) if isinstance(saved, dict) else None
    if model is not None:
        _check_model(path, recorded, model)
    state.load_state_dict(saved, device=device)
    return True


def _check_model(path: str, recorded: Any, model: dict[str, Any]) -> None:
    """Refuse a file another registered model wrote: with equal shapes and options nothing else
    would tell them apart, and loading it would silently hand this model the other's residuals."""
    if recorded is None:
        if model["index"] == 0:
            return  # a one-model folder from before files recorded their model: it can only be this one
        raise ValueError(f"gradwire: {path} does not record which model wrote it; it cannot be matched to model "
                         f"{model['index']} ({_describe(model)})")
    if not isinstance(recorded, dict) or recorded.get("index") != model["index"]:
        saved_index = recorded.get("index") if isinstance(recorded, dict) else "?"
        raise ValueError(f"gradwire: {path} holds the hook state of registered model {saved_index}, not of model "
                         f"{model['index']} ({_describe(model)}): each model registered on the Accelerator reads "
                         "its own file (were files renamed?)")
    if (recorded.get("parameters"), recorded.get("numels")) != (model["parameters"], model["numels"]):
        raise ValueError(f"gradwire: {path} was saved from a model with other parameters ({_describe(recorded)}) "
                         f"than registered model {model['index']} ({_describe(model)}): register the models in the "
                         "order they were registered when the folder was saved")


def _describe(record: dict[str, Any]) -> str:
    pairs = [f"{name} ({numel:,})" for name, numel in zip(record.get("parameters", []), record.get("numels", []))]
    shown = ", ".join(pairs[:3]) + (", ..." if len(pairs) > 3 else "")
    return f"{len(pairs)} parameters: {shown}"


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
    """Where ``module``'s first parameter lives (the CPU for a module without any): the
    gradients' device, which a restored hook state moves to."""
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
