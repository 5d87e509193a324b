"""The compression core: one pipeline under every front-end.

compensate -> select -> encode -> exchange -> decode -> residual, for a
:class:`~gradwire.core.group.Group` of tensors (docs/architecture.md tells the path of one
gradient). Front-ends — the DDP hook (:mod:`gradwire.ddp`), :class:`gradwire.GradientExchange`,
FSDP2 and local steps — turn their framework's objects into groups and act on the round's
:class:`~gradwire.core.round.Verdict`; nothing in this package knows a GradBucket, a Future,
FSDP or an optimizer.

* :mod:`.config` — :class:`ExchangeConfig`, every option, validated, frozen, compared across ranks;
* :mod:`.group` — :class:`Group`, :class:`Entry`, where a result goes and how a group ended;
* :mod:`.feedback`, :mod:`.selection` — error feedback and the sparsifier;
* :mod:`.payload`, :mod:`.frames` — one payload per group; the AllGather's frame sizes;
* :mod:`.strategies` — dense, shared-support AllReduce, payload AllGather, sparse AllReduce,
  hierarchical;
* :mod:`.planner` — which strategy a group takes (fixed rules, or ``auto``'s α–β–γ model);
* :mod:`.round` — the round's end: wait, second rounds, agree, error feedback on success;
* :mod:`.pipeline` — :class:`Pipeline`, the composition the front-ends drive;
* :mod:`.stats`, :mod:`.checkpoint` — bytes and seconds; per-rank state dicts.
"""

from .config import ExchangeConfig
from .group import BufferTarget, Entry, Group, Status
from .pipeline import Pipeline
from .round import Verdict

__all__ = ["BufferTarget", "Entry", "ExchangeConfig", "Group", "Pipeline", "Status", "Verdict"]
