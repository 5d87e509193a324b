"""Exchange strategies: each one way of reducing a group over ranks, with one entry point, ``start(group)``.

* :class:`DenseAllReduce` — warm-up, ``compressor="none"``, ``collective="dense"``, ``auto``'s fallback;
* :class:`SharedSupportAllReduce` — values at positions every rank drew from one seed;
* :class:`PayloadAllGather` — encoded per-rank payloads, two-round then framed one-round;
* :class:`SparseAllReduce` — per-rank supports reduced by region: ~2k entries per worker for any p;
* :class:`HierarchicalExchange` — dense inside a node, sparse AllReduce across nodes;
* :class:`QuantizedAllReduce` — dense, in int8/int4 blocks (``quantize=``), with error feedback.
"""

from .allgather import PayloadAllGather, count_slack
from .base import Exchange, ExchangeContext, ExchangeStrategy
from .dense import DenseAllReduce
from .hierarchical import HierarchicalExchange, local_size_of
from .quantized import QuantizedAllReduce
from .shared_support import SharedSupportAllReduce
from .sparse_allreduce import SparseAllReduce

__all__ = [
    "DenseAllReduce",
    "Exchange",
    "ExchangeContext",
    "ExchangeStrategy",
    "HierarchicalExchange",
    "PayloadAllGather",
    "QuantizedAllReduce",
    "SharedSupportAllReduce",
    "SparseAllReduce",
    "count_slack",
    "local_size_of",
]
