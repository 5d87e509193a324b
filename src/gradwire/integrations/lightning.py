"""PyTorch Lightning: a DDP strategy that compresses gradients with gradwire, on CPU and GPU.

>>> from gradwire.integrations.lightning import GradwireDDPStrategy
>>> trainer = lightning.Trainer(accelerator="cpu", devices=2,                       # doctest: +SKIP
...                             strategy=GradwireDDPStrategy(hook_options={"compressor": "topk", "density": 0.01}))

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA devices and
drops it silently elsewhere; this strategy registers on the DDP wrapper it builds, whatever the
device. The hook state of every rank goes into the ``.ckpt`` Lightning writes from rank 0, under
``"gradwire_hook"`` (the gathered form of :meth:`CommHookState.state_dict`), and comes back to
its own rank on ``fit(ckpt_path=...)``. Requires ``pip install gradwire[lightning]``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy

from ..ddp import CommHookState
from ._common import find_ddp, parameters_device, register, warn_if_idle

CHECKPOINT_KEY = "gradwire_hook"


class GradwireDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with gradwire's hook, registered whatever the device.

    Args:
        hook_options: :class:`CommHookState`'s keyword options.
        **kwargs: ``DDPStrategy``'s arguments (``ddp_comm_hook`` is refused: the strategy
            registers its own).

    Attributes:
        hook_state: the current :class:`CommHookState` (a new one per ``fit``, since every fit
            builds a new DDP wrapper; None before the first).

    Raises:
        ValueError: a bad hook option (before any process starts) or a ``ddp_comm_hook``.
    """

    strategy_name = "gradwire_ddp"

    def __init__(self, hook_options: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("GradwireDDPStrategy registers gradwire's hook itself; leave ddp_comm_hook unset")
        super().__init__(**kwargs)
        self.hook_options = dict(hook_options or {})
        CommHookState(**self.hook_options)  # a bad option fails here, before any process starts
        self.hook_state: Optional[CommHookState] = None
        self._restored: Optional[dict[str, Any]] = None
        self._fitting = False

    def configure_ddp(self) -> None:  # Lightning calls it when fitting, once per fit
        """Build the DDP wrapper, register the hook on it, and hand it a restored state if any."""
        super().configure_ddp()
        self._fitting = True
        ddp = find_ddp(self.model)
        if ddp is None:
            return
        self.hook_state = register(ddp, self.hook_options)
        if self._restored is not None:
            self.hook_state.load_state_dict(self._restored, device=parameters_device(ddp))
            self._restored = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Add every rank's hook state to ``checkpoint`` under ``"gradwire_hook"``, then save it."""
        # runs on every rank (Lightning writes the file from rank 0): the gather is a collective
        if self.hook_state is not None:
            checkpoint[CHECKPOINT_KEY] = self.hook_state.state_dict(gather=True)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load ``checkpoint_path``, keeping its hook state aside for :meth:`configure_ddp`."""
        # runs on every rank before the DDP wrapper exists: keep the hook state for configure_ddp
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.pop(CHECKPOINT_KEY, None)
        return checkpoint

    def teardown(self) -> None:
        """After a fit, warn (:class:`HookNeverRanWarning`) if the hook compressed nothing."""
        if self._fitting:
            self._fitting = False
            warn_if_idle(self.hook_state, "Lightning fit")
        super().teardown()
