"""The hook's per-rank checkpoint: build, check, gather and select its state dict.

Error-feedback residuals (and DGC velocities) are *per rank*: each rank keeps what its own
gradients did not send. A checkpoint of the hook therefore records whose state it is::

    {"format": "gradwire.commhook/1", "rank": r, "world_size": w, "config": "<options>",
     "config_hash": "<16 hex>", "iteration": n,
     "residuals": {parameter name: float32/float64 tensor (numel,)},   # with error feedback
     "velocities": {...}}                                              # with momentum correction

and loading refuses another rank's, another world size's or other options' state with one
``ValueError`` that names what differs. Tensors are checked (known parameter, 1-D of the
parameter's numel, the accumulation dtype, finite) before any is kept.

Frameworks that write one file from rank 0 (Lightning's ``.ckpt``) use the *gathered* form
(accelerate's ``register_for_checkpointing`` calls ``state_dict()`` on rank 0 only, so it cannot
carry other ranks' residuals: ``gradwire.integrations.accelerate.register`` writes one file per
rank instead): :func:`gather_state` is a collective
that every rank calls; rank 0 gets ``{"format": ..., "gathered": True, "world_size": w, ...,
"ranks": [state of rank 0, state of rank 1, ...]}`` and loading that dict on every rank picks
each rank's own entry. Tensors travel as tensors (``dist.gather`` of flat buffers plus a
presence mask); nothing is pickled.

A different world size: refused. Residuals belong to the ranks that made them; to continue on
another number of ranks, load the model and optimizer but not the hook state (residuals start
from zero, as on a fresh run, and only the not-yet-sent part of recent gradients is lost).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ..lifetime import wait_for

FORMAT = "gradwire.commhook/1"
#: state kinds stored per parameter, in this order
KINDS = ("residuals", "velocities")


@dataclass(frozen=True)
class ParameterSpec:
    """What a stored residual of one parameter must look like: flat, ``numel`` elements, ``dtype``."""

    numel: int
    dtype: torch.dtype


@dataclass
class LocalState:
    """One rank's restored hook state (tensors still on the CPU)."""

    iteration: int
    residuals: dict[str, torch.Tensor]
    velocities: dict[str, torch.Tensor]
    #: the planner's state (``auto``'s online policy), numbers and strings only; None if not saved
    planner: Optional[dict[str, Any]] = None


def config_hash(config: str) -> str:
    """16 hex digits identifying the hook's options (``CommHookState.describe()``)."""
    return hashlib.sha256(config.encode()).hexdigest()[:16]


def parameter_specs(model: torch.nn.Module) -> dict[str, ParameterSpec]:
    """Expected residual layout per parameter name: float64 parameters keep float64 residuals,
    all others float32 (see ``feedback.accumulation_dtype``)."""
    return {name: ParameterSpec(p.numel(), torch.float64 if p.dtype == torch.float64 else torch.float32)
            for name, p in model.named_parameters()}


def build_state(*, rank: int, world_size: int, config: str, iteration: int,
                residuals: Optional[Mapping[str, torch.Tensor]], velocities: Optional[Mapping[str, torch.Tensor]],
                planner: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One rank's state dict (CPU copies of the tensors). ``planner``: what the planner carries across
    rounds (numbers and strings, the same on every rank: its decisions come from agreed numbers)."""
    out: dict[str, Any] = {"format": FORMAT, "rank": rank, "world_size": world_size, "config": config,
                           "config_hash": config_hash(config), "iteration": int(iteration)}
    if planner is not None:
        out["planner"] = planner
    for kind, tensors in zip(KINDS, (residuals, velocities)):
        if tensors is not None:
            out[kind] = {name: t.detach().cpu().clone() for name, t in tensors.items()}
    return out


def gather_state(local: dict[str, Any], specs: Mapping[str, ParameterSpec],
                 process_group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """Collective (every rank of ``process_group`` calls it): rank 0 returns the gathered form
    holding every rank's state; other ranks return the gathered form holding only their own
    (a file written from them could not restore the job, and loading it says so)."""
    rank, world = local["rank"], local["world_size"]
    header = {key: local[key] for key in ("format", "world_size", "config", "config_hash", "iteration", "planner")
              if key in local}
    if world == 1:
        return {**header, "gathered": True, "ranks": [local]}
    device = communication_device(process_group)
    names = sorted(specs)
    root = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    kinds = [kind for kind in KINDS if kind in local]
    # one presence byte per (kind, parameter), then one flat buffer per (kind, dtype): all
    # ranks know the same names and dtypes, so every rank packs the same sizes
    presence = torch.tensor([name in local[kind] for kind in kinds for name in names], dtype=torch.uint8)
    gathered_presence = gather_to_root(presence.to(device), root, rank, world, process_group)
    per_rank: list[dict[str, Any]] = [{"format": FORMAT, "rank": r, **{k: header[k] for k in header if k != "format"}}
                                      for r in range(world)]
    for kind in kinds:
        for r in range(world):
            per_rank[r][kind] = {}
        for dtype in sorted({specs[n].dtype for n in names}, key=str):
            chosen = [n for n in names if specs[n].dtype == dtype]
            flat = torch.cat([_flat_or_zeros(local[kind].get(n), specs[n]) for n in chosen]) if chosen else \
                torch.zeros(0, dtype=dtype)
            received = gather_to_root(flat.to(device), root, rank, world, process_group)
            if received is None:
                continue
            for r, buffer in enumerate(received):
                buffer = buffer.cpu()
                offset = 0
                for n in chosen:
                    size = specs[n].numel
                    if gathered_presence[r][kinds.index(kind) * len(names) + names.index(n)]:
                        per_rank[r][kind][n] = buffer[offset: offset + size].clone()
                    offset += size
    if rank != 0:
        return {**header, "gathered": True, "ranks": [local]}
    return {**header, "gathered": True, "ranks": per_rank}


def select_state(state: Mapping[str, Any], *, rank: int, world_size: int, config: str,
                 specs: Mapping[str, ParameterSpec], kinds: tuple[str, ...]) -> LocalState:
    """Check ``state`` (one rank's or the gathered form) against this rank, world size, options
    and model, and return this rank's part. Raises one ``ValueError`` saying what differs."""
    if not isinstance(state, Mapping):
        raise ValueError(f"hook state must be a dict from CommHookState.state_dict(), got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"not a gradwire hook state (format={state.get('format')!r}, expected {FORMAT!r}); "
                         "older checkpoints without rank and world size cannot be matched to a rank")
    _check_header(state, world_size=world_size, config=config)
    if state.get("gathered"):
        entries = [e for e in state.get("ranks", []) if isinstance(e, Mapping) and e.get("rank") == rank]
        if not entries:
            held = sorted(e.get("rank") for e in state.get("ranks", []) if isinstance(e, Mapping))
            raise ValueError(f"gathered hook state holds ranks {held}, not rank {rank}: save the dict that "
                             "state_dict(gather=True) returned on rank 0")
        state = entries[0]
        _check_header(state, world_size=world_size, config=config)
    if state.get("rank") != rank:
        raise ValueError(f"hook state belongs to rank {state.get('rank')}, this is rank {rank}: error-feedback "
                         "residuals are per rank (save every rank's file, or use state_dict(gather=True); with "
                         "accelerate, use gradwire.integrations.accelerate.register(accelerator, model, ...) "
                         "instead of accelerator.register_for_checkpointing, which saves rank 0's state only)")
    if not isinstance(state.get("iteration"), int) or state["iteration"] < 0:
        raise ValueError(f"hook state: 'iteration' must be an integer >= 0, got {state.get('iteration')!r}")
    tensors = {}
    for kind in KINDS:
        if kind in kinds:
            if kind not in state:
                raise ValueError(f"hook state lacks {kind!r}, which these options keep")
            tensors[kind] = _checked_tensors(kind, state[kind], specs)
        else:
            tensors[kind] = {}
    planner = state.get("planner")
    if planner is not None and not isinstance(planner, Mapping):
        raise ValueError(f"hook state: 'planner' must be a dict, got {type(planner).__name__}")
    return LocalState(state["iteration"], tensors["residuals"], tensors["velocities"],
                      dict(planner) if planner is not None else None)


def _check_header(state: Mapping[str, Any], *, world_size: int, config: str) -> None:
    for key in ("world_size", "config_hash"):
        if key not in state:
            raise ValueError(f"hook state lacks {key!r}")
    if state["world_size"] != world_size:
        raise ValueError(f"hook state was saved with world size {state['world_size']}, this job has {world_size}: "
                         "residuals are per rank and cannot be re-split; load the model and optimizer without the "
                         "hook state to continue on another number of ranks (residuals restart from zero)")
    if state["config_hash"] != config_hash(config):
        raise ValueError(f"hook state was saved with other options: {state.get('config', '?')!r}; "
                         f"this hook has {config!r}")


def _checked_tensors(kind: str, tensors: Any, specs: Mapping[str, ParameterSpec]) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise ValueError(f"hook state: {kind!r} must map parameter names to tensors")
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise ValueError(f"hook state: {kind} name parameters this model lacks: {', '.join(map(str, unknown[:5]))}")
    out = {}
    for name, tensor in tensors.items():
        spec = specs[name]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"hook state: {kind}[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != (spec.numel,):
            raise ValueError(f"hook state: {kind}[{name!r}] has shape {tuple(tensor.shape)}, "
                             f"expected ({spec.numel},) for this parameter")
        if tensor.dtype != spec.dtype:
            raise ValueError(f"hook state: {kind}[{name!r}] is {tensor.dtype}, expected {spec.dtype}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"hook state: {kind}[{name!r}] holds NaN or Inf")
        out[name] = tensor
    return out


def _flat_or_zeros(tensor: Optional[torch.Tensor], spec: ParameterSpec) -> torch.Tensor:
    if tensor is None:
        return torch.zeros(spec.numel, dtype=spec.dtype)
    return tensor.detach().reshape(-1).to("cpu", spec.dtype)


def gather_to_root(tensor: torch.Tensor, root: int, rank: int, world: int,
            group: Optional[dist.ProcessGroup]) -> Optional[list[torch.Tensor]]:
    """``dist.gather`` to group rank 0: the list of every rank's tensor there, None elsewhere."""
    buffers = [torch.empty_like(tensor) for _ in range(world)] if rank == 0 else None
    wait_for(dist.gather(tensor, gather_list=buffers, dst=root, group=group, async_op=True), None,
             "gather of hook states")
    return buffers


def communication_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
