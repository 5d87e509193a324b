"""Exchange strategies: each one way of reducing a group over ranks, with one entry point, ``start(group)``.

* :class:`DenseAllReduce` — warm-up, ``compressor="none"``, ``collective="dense"``, ``auto``'s fallback;
* :class:`SharedSupportAllReduce` — values at positions every rank drew from one seed;
* :class:`PayloadAllGather` — encoded per-rank payloads, two-round then framed one-round;
* :class:`SparseAllReduce` — per-rank supports reduced by region: ~2k entries per worker for any p;
* :class:`HierarchicalExchange` — dense inside a node, sparse AllReduce across nodes;
* :class:`QuantizedAllReduce` — dense, in int8/int4 blocks (``quantize=``), with error feedback;
* :class:`DenseReduceScatter`, :class:`QuantizedReduceScatter`, :class:`SparseReduceScatter` —
  shard groups (FSDP2's reduce-scatter, and HSDP's AllReduce across replicas).

The sparse AllReduce and the hierarchical exchange are :class:`DeferredStrategy` subclasses: their rounds
wait on one another, so they run at the round's end (``settle``), not inside the backward.
"""

from .allgather import PayloadAllGather, count_slack
from .base import DeferredStrategy, Exchange, ExchangeContext, ExchangeStrategy
from .dense import DenseAllReduce
from .hierarchical import HierarchicalExchange, local_size_of
from .quantized import QuantizedAllReduce
from .reduce_scatter import (
    DenseReduceScatter,
    QuantizedReduceScatter,
    SparseReduceScatter,
    shard_strategies,
)
from .shared_support import SharedSupportAllReduce
from .sparse_allreduce import SparseAllReduce

__all__ = [
    "DeferredStrategy",
    "DenseAllReduce",
    "DenseReduceScatter",
    "Exchange",
    "ExchangeContext",
    "ExchangeStrategy",
    "HierarchicalExchange",
    "PayloadAllGather",
    "QuantizedAllReduce",
    "QuantizedReduceScatter",
    "SharedSupportAllReduce",
    "SparseAllReduce",
    "SparseReduceScatter",
    "count_slack",
    "local_size_of",
    "shard_strategies",
]
