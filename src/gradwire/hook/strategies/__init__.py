"""Exchange strategies: each one way of averaging a group of buckets over ranks.

* :class:`DenseAllReduce` — warm-up, ``compressor="none"``, ``collective="dense"``, ``auto``'s fallback;
* :class:`SharedSupportAllReduce` — values at positions every rank drew from one seed;
* :class:`PayloadAllGather` — encoded per-rank payloads, two-round then framed one-round.
"""

from .allgather import PayloadAllGather, count_slack
from .base import ExchangeContext, ExchangeStrategy
from .dense import DenseAllReduce
from .shared_support import SharedSupportAllReduce

__all__ = [
    "DenseAllReduce",
    "ExchangeContext",
    "ExchangeStrategy",
    "PayloadAllGather",
    "SharedSupportAllReduce",
    "count_slack",
]
