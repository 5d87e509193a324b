"""Hugging Face ``transformers.Trainer``: a callback that puts gradwire's hook on the DDP model.

>>> trainer = transformers.Trainer(model=model, args=args, train_dataset=data)   # doctest: +SKIP
>>> GradwireCallback.install(trainer, compressor="topk", density=0.01)            # doctest: +SKIP
>>> trainer.train()                                                                # doctest: +SKIP

The Trainer wraps the model in DDP inside ``train()`` and gives callbacks the *unwrapped*
model, so the callback holds the trainer and registers on ``trainer.model_wrapped`` at
``on_train_begin`` (again whenever the Trainer built a new wrapper). Gradient accumulation needs
nothing: the Trainer runs every micro-batch but the last under ``no_sync``, so the hook runs once
per optimizer step. Every rank writes its own hook state into each checkpoint folder,
``checkpoint-N/gradwire_hook_rank{r}.pt`` (as the Trainer's own ``rng_state_{r}.pth``), and a
resumed run reads it back from ``output_dir/checkpoint-<restored global step>`` (or from
``resume_from`` when the checkpoint lives elsewhere). Requires ``pip install gradwire[hf]``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..ddp import CommHookState
from ._common import find_ddp, load_rank_state, parameters_device, register, save_rank_state, warn_if_idle


class GradwireCallback(TrainerCallback):
    """Registers gradwire's hook on the Trainer's DDP wrapper and checkpoints each rank's state.

    Args:
        trainer: the ``Trainer`` this callback is added to (callbacks are not given it).
        resume_from: a checkpoint folder to read the hook state from when ``train()`` resumes
            (default: ``args.output_dir/checkpoint-<global step>``).
        hook_options: :class:`CommHookState`'s keyword options.
    """

    def __init__(self, trainer: Any, *, resume_from: "Optional[str | os.PathLike[str]]" = None,
                 **hook_options: Any) -> None:
        CommHookState(**hook_options)  # a bad option fails here, not inside train()
        self.trainer = trainer
        self.resume_from = resume_from
        self.hook_options = hook_options
        self.hook_state: Optional[CommHookState] = None
        self._wrapper: Any = None

    @classmethod
    def install(cls, trainer: Any, **options: Any) -> "GradwireCallback":
        """Create the callback for ``trainer``, add it, and return it."""
        callback = cls(trainer, **options)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Register the hook on the Trainer's DDP wrapper; on a resumed run, restore this rank's state."""
        ddp = find_ddp(self.trainer.model_wrapped)
        if ddp is None:
            self.hook_state = None
            return
        if ddp is not self._wrapper:  # a DDP accepts one registration; a new wrapper needs its own
            self.hook_state = register(ddp, self.hook_options)
            self._wrapper = ddp
        if state.global_step > 0:
            folder = self.resume_from or os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            load_rank_state(self.hook_state, folder, device=parameters_device(ddp))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's hook state into ``checkpoint-<global step>``."""
        # runs on every rank, after the Trainer wrote checkpoint-N
        if self.hook_state is not None:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            save_rank_state(self.hook_state, folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Warn (:class:`HookNeverRanWarning`) if the hook compressed nothing."""
        warn_if_idle(self.hook_state, "transformers Trainer")
