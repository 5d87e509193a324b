"""Hugging Face accelerate: put gradwire's hook on the model ``prepare()`` returned, and keep
every rank's own hook state in ``save_state``/``load_state`` folders.

>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)      # doctest: +SKIP
>>> state = gradwire.integrations.accelerate.register(accelerator, model, compressor="topk", density=0.01)  # doctest: +SKIP

accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` knows only PyTorch's built-in
hooks, and ``register_for_checkpointing`` writes rank 0's object only (every rank would get rank
0's residuals back). :func:`register` instead registers on the prepared DDP wrapper and adds
save/load pre-hooks, which accelerate runs on every process: each writes and reads
``<folder>/gradwire_hook_rank{r}.pt`` (as accelerate's own ``random_states_{r}.pkl``).
Inside ``accelerator.accumulate(model)`` the hook runs once per optimizer step (accumulation
steps use ``no_sync``). Requires ``pip install gradwire[accelerate]``.
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from typing import Any, Optional

from ..ddp import CommHookState
from ._common import HookNeverRanWarning, find_ddp, load_rank_state, parameters_device, register as _register
from ._common import save_rank_state, warn_if_idle


def register(accelerator: Any, model: Any, **hook_options: Any) -> Optional[CommHookState]:
    """Register gradwire's hook on ``model`` (what ``accelerator.prepare`` returned) and make
    ``accelerator.save_state``/``load_state`` keep each rank's hook state. Returns the
    :class:`CommHookState`, or None (with a warning) when ``prepare`` built no DDP wrapper
    (one process, or no ``ACCELERATE_USE_CPU=1`` / ``Accelerator(cpu=True)`` on a CPU-only machine).
    A warning at exit says so if the hook never ran a step."""
    CommHookState(**hook_options)  # a bad option fails before anything is registered
    ddp = find_ddp(model)
    if ddp is None:
        warnings.warn("gradwire: accelerate built no DistributedDataParallel (one process? on CPU set "
                      "ACCELERATE_USE_CPU=1 or Accelerator(cpu=True)); gradients are not compressed",
                      HookNeverRanWarning, stacklevel=2)
        return None
    state = _register(ddp, hook_options)
    device = parameters_device(ddp)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        save_rank_state(state, output_dir)

    def load(models: Any, input_dir: str) -> None:
        load_rank_state(state, input_dir, device=device)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    atexit.register(_warn_if_idle_at_exit, weakref.ref(state))
    return state


def _warn_if_idle_at_exit(reference: "weakref.ref[CommHookState]") -> None:
    state = reference()
    if state is not None:
        warn_if_idle(state, "accelerate")
