"""Hugging Face accelerate: put gradwire's hook on the model ``prepare()`` returned, and keep
every rank's own hook state in ``save_state``/``load_state`` folders.

>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP
>>> state = gradwire.integrations.accelerate.register(  # doctest: +SKIP
...     accelerator, model, compressor="topk", density=0.01)

accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` knows only PyTorch's built-in
hooks, and ``register_for_checkpointing`` writes rank 0's object only (every rank would get rank
0's residuals back). :func:`register` instead registers on the prepared DDP wrapper and adds
save/load pre-hooks, which accelerate runs on every process: each writes and reads
``<folder>/gradwire_hook_rank{r}.pt`` (as accelerate's own ``random_states_{r}.pkl``).
Several models on one ``Accelerator`` (a GAN, a teacher and a student): the second model
registered writes ``gradwire_hook_model1_rank{r}.pt``, the third ``..._model2_...``, and so on;
each file records which model (registration index, parameter names and sizes) wrote it, and
loading refuses another model's file with one ``ValueError``. Register the models in the same
order when resuming.
Inside ``accelerator.accumulate(model)`` the hook runs once per optimizer step (accumulation
steps use ``no_sync``). Requires ``pip install gradwire[accelerate]``.
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from typing import Any, Optional

from ..ddp import CommHookState
from ..fsdp.detect import refuse_fsdp
from ._common import HookNeverRanWarning, find_ddp, load_rank_state, model_record, parameters_device
from ._common import register as _register, save_rank_state, warn_if_idle

#: how many models got gradwire's hook on each Accelerator: the next one's index (its files' names)
_REGISTERED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def register(accelerator: Any, model: Any, **hook_options: Any) -> Optional[CommHookState]:
    """Register gradwire's hook on ``model`` and make ``accelerator.save_state``/``load_state``
    keep each rank's hook state.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: what ``accelerator.prepare`` returned. Each model registered on one accelerator
            gets its own state files, in registration order (see the module's docstring).
        hook_options: :class:`CommHookState`'s keyword options.

    Returns:
        The :class:`CommHookState`, or None (with a :class:`HookNeverRanWarning`) when ``prepare``
        built no DDP wrapper (one process, or no ``ACCELERATE_USE_CPU=1`` / ``Accelerator(cpu=True)``
        on a CPU-only machine): training then runs uncompressed. A warning at exit says so if the
        hook never ran a step.

    Raises:
        ValueError: a bad hook option (before anything is registered), an FSDP model (use
            ``gradwire.fsdp.compress``); from ``load_state``: a
            file that belongs to another rank, world size, options or registered model.
    """
    CommHookState(**hook_options)  # a bad option fails before anything is registered
    refuse_fsdp(model)
    ddp = find_ddp(model)
    if ddp is None:
        warnings.warn("gradwire: accelerate built no DistributedDataParallel (one process? on CPU set "
                      "ACCELERATE_USE_CPU=1 or Accelerator(cpu=True)); gradients are not compressed",
                      HookNeverRanWarning, stacklevel=2)
        return None
    state = _register(ddp, hook_options)
    index = _REGISTERED.get(accelerator, 0)
    _REGISTERED[accelerator] = index + 1
    record = model_record(ddp.module, index)
    device = parameters_device(ddp)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        save_rank_state(state, output_dir, model=record)

    def load(models: Any, input_dir: str) -> None:
        load_rank_state(state, input_dir, device=device, model=record)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    where = "accelerate" if index == 0 else f"accelerate model {index}"
    atexit.register(_warn_if_idle_at_exit, weakref.ref(state), where)
    return state


def _warn_if_idle_at_exit(reference: "weakref.ref[CommHookState]", where: str) -> None:
    state = reference()
    if state is not None:
        warn_if_idle(state, where)
