"""Which strategy a group takes, and what selection it needs first: :class:`Planner`.

The fixed rules (warm-up and ``compressor="none"`` go dense, shared supports take the AllReduce of
values or the payload AllGather, ``collective=...`` names one) and, for ``collective="auto"`` with
a per-rank support, an α–β–γ model.

For each candidate — dense AllReduce, payload AllGather, sparse AllReduce (lossless index codecs
only), hierarchical (when ``hierarchy`` is set) — :mod:`gradwire.exchange.alphabeta` predicts
``α·rounds + β·bytes + γ·decoded entries`` from numbers every rank holds alike:

* the group's numel and ``k``, the sum of the sparsifier's per-parameter targets (shapes only);
* bytes per coded entry, estimated from the codecs (:func:`entry_bytes`), not from this rank's
  payload, which differs between ranks;
* the link's α and β: configured (``link_gbit``, ``link_alpha``) or measured at the first step
  by timed AllReduces whose results all ranks agree on (the maximum);
* γ, seconds per decoded entry: measured at the first step by decoding a synthetic payload with
  the configured codecs, agreed the same way.

So every rank makes the same choice, and a strategy is chosen only when it is predicted strictly
faster than dense. The AllGather still checks the real payload lengths and falls back to dense
when they turn out larger than predicted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import codecs as codec_layer
from ..codecs.base import IndexCodec, ValueCodec
from ..exchange.alphabeta import (
    Cost,
    Link,
    allgather_payloads,
    choose,
    dense_allreduce,
    hierarchical_cost,
    sparse_allreduce_cost,
)
from ..exchange.calibrate import measure_link
from ..exchange.checked import wait_checked
from ..exchange.collectives import communication_device
from ..exchange.threshold_search import count_dtype
from ..sparsify.base import Sparsifier
from .config import CAST_VALUE_CODECS, ExchangeConfig
from .group import Group
from .strategies.hierarchical import local_size_of

#: Nominal bytes per value of the cast codecs; other value codecs are measured.
_VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp16-scaled": 2.0}


def entry_bytes(index_codec: IndexCodec, value_codec: ValueCodec, *, numel: int, k: int) -> float:
    """Estimated bytes per sent entry: index bits near ``log2(numel/k) + 2`` for a compressed
    index codec (Rice/Elias-Fano sit there), 8 for raw positions; the value codec's nominal bytes."""
    density = max(k, 1) / max(numel, 1)
    index = 8.0 if index_codec.name == "raw" else (math.log2(1.0 / density) + 2.0) / 8.0
    return index + _VALUE_BYTES.get(value_codec.name, 4.0)


@dataclass(frozen=True)
class Calibration:
    """What the choice needs besides shapes: the link and the decode cost, agreed by all ranks."""

    link: Link
    decode_seconds_per_entry: float


def calibrate(group: Optional[dist.ProcessGroup], world_size: int, *, index_codec: IndexCodec,
              value_codec: ValueCodec, link_gbit: Optional[float], link_alpha: Optional[float]) -> Calibration:
    """Measure (or take from the config) α, β and γ; the same numbers on every rank. Blocking."""
    if link_gbit is not None:
        link = Link.from_rate(link_gbit, alpha=20e-6 if link_alpha is None else link_alpha)
    else:
        link = measure_link(group)
        if link_alpha is not None:
            link = Link(link_alpha, link.beta)
    gamma = _decode_seconds_per_entry(index_codec, value_codec)
    if world_size > 1:
        agreed = torch.tensor([gamma], dtype=torch.float64, device=communication_device(group))
        wait_checked(dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True),
                     "auto calibration", "all_reduce (decode cost)")
        gamma = float(agreed.item())
    return Calibration(link, gamma)


def _decode_seconds_per_entry(index_codec: IndexCodec, value_codec: ValueCodec, numel: int = 1 << 20,
                              k: int = 1 << 14) -> float:
    generator = torch.Generator().manual_seed(0)
    indices = torch.sort(torch.randperm(numel, generator=generator)[:k]).values
    values = torch.randn(k, generator=generator)
    payload = codec_layer.encode_tensors([(values, indices, numel)], index_codec, value_codec, check=False).payload
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        codec_layer.decode_tensors(memoryview(payload), expected_numels=[numel])
        best = min(best, time.perf_counter() - start)
    return best / k


def candidates(*, numel: int, k: int, world_size: int, bytes_per_entry: float, sparse_allreduce: bool,
               local_size: Optional[int]) -> list[Cost]:
    """The strategies a per-rank support may take for a group, with their predicted costs."""
    costs = [dense_allreduce(numel, world_size), allgather_payloads(k, world_size, bytes_per_entry, length_round=False)]
    if sparse_allreduce:
        costs.append(sparse_allreduce_cost(k, world_size, bytes_per_entry,
                                           count_bytes=count_dtype(numel).itemsize))
        if local_size and local_size > 1 and world_size % local_size == 0:
            costs.append(hierarchical_cost(numel, k, world_size // local_size, local_size, bytes_per_entry))
    return costs


def choose_strategy(calibration: Calibration, costs: list[Cost], intra: Optional[Link] = None) -> str:
    return choose(costs, calibration.link, decode_per_entry=calibration.decode_seconds_per_entry, intra=intra)


#: In-node links for the hierarchical candidate of ``auto`` (shared memory or NVLink class: an
#: assumption, not a measurement — the model only needs them far faster than the network).
IN_NODE_LINK = Link(5e-6, 1e-10)

#: What a group needs before its strategy starts.
NO_SELECTION, COMPENSATE, SELECT = "none", "compensate", "select"


@dataclass(frozen=True)
class Plan:
    """A group's strategy (a key of the pipeline's strategies) and the selection it needs first:
    ``"none"`` (raw gradients), ``"compensate"`` (``grad + residual`` only: the exchange selects on
    something else) or ``"select"`` (compensate, then the sparsifier)."""

    strategy: str
    selection: str


class Planner:
    """Chooses, the same way on every rank, how each group travels.

    1. ``quantize`` set (after the warm-up): the quantized dense AllReduce; else no sparsifier, a
       warm-up step, or ``collective="dense"``: dense AllReduce of the raw gradients;
    2. a shared support (randomk, randomblock): select (even on a non-finite rank, so the supports
       agree in size), then the AllReduce of values when the value codec is a cast, else the
       payload AllGather;
    3. a per-rank support: the configured collective, or for ``"auto"`` the α–β–γ model's choice
       for the group's layout (computed once per layout; the link and decode cost are calibrated at
       first use, a blocking collective every rank runs at the same group);
       a non-finite rank does not select (its exchange announces NaN instead).

    ``group.k`` (the second selection's count: the sum of the sparsifier's per-entry targets) is
    set here for the strategies that reduce before they select.
    """

    def __init__(self, config: ExchangeConfig, sparsifier: Optional[Sparsifier], process_group: Optional[dist.ProcessGroup],
                 world_size: int) -> None:
        self.config = config
        self.sparsifier = sparsifier
        self.process_group = process_group
        self.world_size = world_size
        self.calibration: Optional[Calibration] = None
        #: the ``auto`` choice per group layout (``Group.signature()``)
        self.choices: dict[tuple[int, ...], str] = {}

    def reset(self) -> None:
        """Forget the per-layout choices (a checkpoint was loaded: every rank chooses again)."""
        self.choices = {}

    def plan(self, group: Group, step: int) -> Plan:
        config = self.config
        if group.sharded:  # FSDP2's reduce-scatter (strategies/reduce_scatter.py)
            return plan_shard_group(config, self.sparsifier, group, step)
        if config.quantize is not None and step >= config.warmup_steps:
            return Plan("quantized", NO_SELECTION)
        if self.sparsifier is None or step < config.warmup_steps or config.collective == "dense":
            return Plan("dense", NO_SELECTION)
        if self.sparsifier.shared_support:
            cast = config.value_codec.name in CAST_VALUE_CODECS
            strategy = "allreduce" if config.collective == "allreduce" or (config.collective == "auto" and cast) \
                else "allgather"
            return Plan(strategy, SELECT)
        strategy = self._per_rank_strategy(group)
        if strategy in ("sparse-allreduce", "hierarchical"):
            group.k = self.target_k(group)
        if strategy == "hierarchical":
            return Plan(strategy, COMPENSATE)
        return Plan(strategy, SELECT if group.finite else NO_SELECTION)

    def target_k(self, group: Group) -> int:
        """The group's k for a second selection: the sum of the sparsifier's per-entry targets
        (the same on every rank); every entry when the sparsifier has no target (threshold)."""
        assert self.sparsifier is not None
        total = 0
        for entry in group.entries:
            target = self.sparsifier.target_k(entry.numel)
            if target is None:
                return group.numel
            total += target
        return total

    def local_size(self) -> int:
        """Ranks per node (1 without ``hierarchy``)."""
        if self.config.hierarchy is None:
            return 1
        return local_size_of(self.config.hierarchy, self.world_size)

    def _per_rank_strategy(self, group: Group) -> str:
        """allgather / sparse-allreduce / hierarchical / dense for a per-rank support."""
        config = self.config
        if config.collective == "sparse-allreduce":
            return "hierarchical" if self.local_size() > 1 else "sparse-allreduce"
        if config.collective != "auto" or self.world_size == 1:
            return "allgather"
        signature = group.signature()
        if signature not in self.choices:
            if self.calibration is None:
                self.calibration = calibrate(self.process_group, self.world_size, index_codec=config.index_codec,
                                             value_codec=config.value_codec, link_gbit=config.link_gbit,
                                             link_alpha=config.link_alpha)
            k = self.target_k(group)
            costs = candidates(numel=group.numel, k=k, world_size=self.world_size,
                               bytes_per_entry=entry_bytes(config.index_codec, config.value_codec, numel=group.numel,
                                                           k=k),
                               sparse_allreduce=config.index_codec.lossless, local_size=self.local_size())
            self.choices[signature] = choose_strategy(self.calibration, costs, intra=IN_NODE_LINK)
        return self.choices[signature]


def plan_shard_group(config: ExchangeConfig, sparsifier: Optional[Sparsifier], group: Group, step: int) -> Plan:
    """A shard group's reduce-scatter (strategies/reduce_scatter.py): quantized when ``quantize`` is
    set, sparse with a sparsifier (selection per entry, i.e. per parameter and destination; none
    on a non-finite rank, which announces NaN instead), else, and during the warm-up, dense."""
    if step < config.warmup_steps:
        return Plan("dense-reduce-scatter", NO_SELECTION)
    if config.quantize is not None:
        return Plan("quantized-reduce-scatter", NO_SELECTION)
    if sparsifier is None or config.collective == "dense":
        return Plan("dense-reduce-scatter", NO_SELECTION)
    return Plan("sparse-reduce-scatter", SELECT if group.finite else NO_SELECTION)
