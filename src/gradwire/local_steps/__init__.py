"""Local steps: DiLoCo-style training whose outer steps go through gradwire's compression core.

* :class:`DiLoCo` — the front-end: inner steps of the user's optimizer, a compressed outer step
  every ``sync_every`` steps from an optimizer post-hook, fragments and overlap (Streaming DiLoCo);
* :mod:`.outer` — the outer step's arithmetic (Δ, the error-feedback decay, the outer optimizer,
  the merge), shared with the single-process simulator;
* :mod:`.fragments` — which parameters sync together, and when.

docs/local-steps.md tells the rules, the commands and the measured results.
"""

from .diloco import DiLoCo
from .fragments import assign_fragments, fragment_due, layers_of
from .options import LocalStepsConfig, split_options
from .outer import OuterState, sgd_factory

__all__ = ["DiLoCo", "LocalStepsConfig", "OuterState", "assign_fragments", "fragment_due", "layers_of",
           "sgd_factory", "split_options"]
