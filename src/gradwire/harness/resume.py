"""Periodic checkpoints of ``gradwire train``, so that a job restarted by ``torchrun
--max-restarts`` goes on from its last one instead of from step 0.

Layout, per method (``folder = <checkpoint_dir>/<method slug>``)::

    folder/step-000040/rank0.pt, rank1.pt, ...    every rank's own file: model, optimizer, RNG,
                                                  and its own gradwire hook state (residuals)
    folder/step-000040/COMPLETE                   written by rank 0 once every rank's file is on disk

Every rank writes its own file (no gather: a node-local folder works as long as ranks keep their
node; under FSDP2 each file holds the rank's own shards of the parameters and of the optimizer's
state, as plain tensors, put back into the DTensors of the same sharding on load), then a barrier,
then rank 0 marks the step complete and drops all but the last two. On
start, rank 0 finds the latest complete step and broadcasts it, so every rank resumes from the
same step. Files are read with ``torch.load(weights_only=True)``; a hook state saved by another
rank or world size is refused (see :mod:`gradwire.core.checkpoint`).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import datetime

import torch
import torch.distributed as dist

from ..lifetime import barrier, wait_for

COMPLETE = "COMPLETE"
KEEP = 2
_STEP = re.compile(r"^step-(\d+)$")


def _step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:06d}")


def _complete_steps(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = _STEP.match(name)
        if match and os.path.exists(os.path.join(folder, name, COMPLETE)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(folder: str) -> int:
    """Collective: the latest complete checkpoint step in ``folder`` as rank 0 sees it (0: none)."""
    found = torch.tensor([(_complete_steps(folder) or [0])[-1] if dist.get_rank() == 0 else 0], dtype=torch.int64)
    wait_for(dist.broadcast(found, 0, async_op=True), None, "broadcast of the latest checkpoint step")
    return int(found)


def save(folder: str, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         hook_state: Any) -> None:
    """Collective: every rank writes its file for ``step``, then rank 0 marks it complete.

    Each file is written under a temporary name and renamed, and the step counts only once rank 0
    marked it complete after a barrier, so a job killed while saving leaves the previous step as
    the latest; rank 0 then keeps only the last ``KEEP`` complete steps.

    Args:
        folder: the method's checkpoint folder (shared, or node-local while ranks keep their node).
        step: the step just finished.
        model: this rank's model.
        optimizer: its optimizer.
        hook_state: the gradwire hook state (None: a method without the hook).
    """
    rank = dist.get_rank()
    target = _step_folder(folder, step)
    os.makedirs(target, exist_ok=True)
    payload = {"step": step, "rank": rank, "world_size": dist.get_world_size(),
               "model": _local_shards(model.state_dict()), "optimizer": _local_shards(optimizer.state_dict()),
               "rng": torch.get_rng_state(),
               "hook": hook_state.state_dict() if hook_state is not None else None}
    temporary = os.path.join(target, f".rank{rank}.pt.tmp")
    torch.save(payload, temporary)
    os.replace(temporary, os.path.join(target, f"rank{rank}.pt"))  # a killed writer leaves no half file
    barrier()
    if rank == 0:
        with open(os.path.join(target, COMPLETE), "w") as handle:
            handle.write(f"{dist.get_world_size()}\n")
        for old in _complete_steps(folder)[:-KEEP]:
            shutil.rmtree(_step_folder(folder, old), ignore_errors=True)


def load(folder: str, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hook_state: Any,
         device: torch.device) -> None:
    """Restore this rank's file of ``step`` into model, optimizer, RNG and hook state.

    Args:
        folder: the checkpoint folder.
        step: a complete step (:func:`latest_step`).
        model: this rank's model, as built for the run.
        optimizer: its optimizer.
        hook_state: the gradwire hook state (None: a method without the hook).
        device: the gradients' device, for the hook state.

    Raises:
        FileNotFoundError: the step has no file for this rank.
        ValueError: the file was written by a job of another world size, or holds no hook state
            where this method needs one.
    """
    rank = dist.get_rank()
    path = os.path.join(_step_folder(folder, step), f"rank{rank}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint step {step} has no file for rank {rank}: {path}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("world_size") != dist.get_world_size():
        raise ValueError(f"checkpoint {path} was written by a job of {payload.get('world_size')} ranks, this one has "
                         f"{dist.get_world_size()}; start from another --checkpoint-dir")
    _load_model(model, payload["model"], path)
    optimizer.load_state_dict(_as_sharded(payload["optimizer"], optimizer))
    torch.set_rng_state(payload["rng"])
    if hook_state is not None:
        if payload["hook"] is None:
            raise ValueError(f"checkpoint {path} holds no gradwire hook state, but this method uses the hook")
        hook_state.load_state_dict(payload["hook"], device=device)


def _local_shards(state: Any) -> Any:
    """``state`` (a nested state dict) with every DTensor replaced by this rank's local shard: a
    file of plain tensors, which ``torch.load(weights_only=True)`` reads."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local().detach().clone()
    if isinstance(state, dict):
        return {key: _local_shards(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local_shards(value) for value in state)
    return state


def _load_model(model: torch.nn.Module, saved: dict[str, Any], path: str) -> None:
    """Load ``saved`` (from :func:`_local_shards`) into ``model``: a sharded (DTensor) entry takes
    the rank's local shard in place, the others go through ``load_state_dict``."""
    from torch.distributed.tensor import DTensor

    current = model.state_dict()
    plain = {}
    for name, tensor in saved.items():
        target = current.get(name)
        if isinstance(target, DTensor):
            local = target.to_local()
            if not isinstance(tensor, torch.Tensor) or tensor.shape != local.shape:
                raise ValueError(f"checkpoint {path}: {name} holds a shard of shape "
                                 f"{tuple(getattr(tensor, 'shape', ()))}, this rank's is {tuple(local.shape)}")
            with torch.no_grad():
                local.copy_(tensor)
        else:
            plain[name] = tensor
    sharded = {name for name, tensor in current.items() if isinstance(tensor, DTensor)}
    missing = sharded - set(saved)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(sorted(missing)[:5])}")
    model.load_state_dict(plain, strict=not sharded)


def _as_sharded(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict from :func:`_local_shards` with each per-parameter tensor shaped like
    its parameter's local shard made a DTensor of that parameter's sharding again (so the
    optimizer's arithmetic meets DTensors, as before the save)."""
    from torch.distributed.tensor import DTensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    restored = {}
    for index, values in state.get("state", {}).items():
        parameter = parameters[index] if isinstance(index, int) and 0 <= index < len(parameters) else None
        if isinstance(parameter, DTensor) and isinstance(values, dict):
            local_shape = parameter.to_local().shape
            values = {key: DTensor.from_local(value, parameter.device_mesh, parameter.placements,
                                              shape=parameter.shape, stride=parameter.stride())
                      if isinstance(value, torch.Tensor) and value.dim() and value.shape == local_shape else value
                      for key, value in values.items()}
        restored[index] = values
    return {**state, "state": restored}


def trim_metrics(path: str, step: int) -> list[dict[str, Any]]:
    """Keep only the records of steps before ``step`` in a metrics JSONL file, rewriting it.

    Steps from ``step`` on ran before the failure and run again now.

    Returns:
        The records kept (none when the file does not exist).
    """
    import json

    if not os.path.exists(path):
        return []
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    kept = [record for record in records if record.get("step", step) < step]
    with open(path, "w") as handle:
        for record in kept:
            handle.write(json.dumps(record) + "\n")
    return kept


def init_process_group(backend: str, timeout: Optional["datetime.timedelta"] = None) -> None:
    """``dist.init_process_group`` from torchrun's environment, with the store keys of each
    restart kept apart (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's c10d rendezvous lends its own TCP store to the workers and keeps it across
    restarts; a restarted gloo group could then read a dead worker's address from the previous
    attempt and fail with "connectFullMesh ... Connection refused" (seen here in 2 of 3 runs with
    torch 2.13). A prefix per attempt avoids the stale keys."""
    import datetime

    timeout = timeout or datetime.timedelta(minutes=30)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"gradwire/attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def check_options(checkpoint_dir: Optional[str], checkpoint_every: int) -> None:
    """``ValueError`` unless ``checkpoint_every >= 0``, and a folder is given when it is not 0."""
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 0")
    if checkpoint_every and not checkpoint_dir:
        raise ValueError("checkpoint_every needs checkpoint_dir (--checkpoint-dir)")
