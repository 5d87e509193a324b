"""Hierarchical exchange: dense inside a node, sparse AllReduce across nodes, shared inside the node."""

from __future__ import annotations

import os
import time
from typing import Optional, Union

import torch

from ...errors import CollectiveError, DecodeError, collective_failed
from ...exchange.hierarchy import Hierarchy, build_hierarchy, hierarchical_sparse_allreduce
from ...finite import all_finite
from ...sparsify.base import Sparsifier
from ..feedback import ErrorFeedback, accumulation_dtype
from ..group import Group
from .base import DeferredStrategy, ExchangeContext
from .sparse_allreduce import RegionCodecAdapter, averaged_output


def local_size_of(hierarchy: Union[str, int], world_size: int) -> int:
    """Ranks per node: the configured number, or for ``"auto"`` torchrun's ``LOCAL_WORLD_SIZE``
    (1 when unset: one rank per node, so the exchange is the flat sparse AllReduce)."""
    if hierarchy == "auto":
        size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    else:
        size = int(hierarchy)
    if size < 1 or world_size % size:
        raise ValueError(f"hierarchy={hierarchy!r} gives {size} ranks per node, which must divide the world "
                         f"size {world_size}")
    return size


class HierarchicalExchange(DeferredStrategy):
    """1. Every rank's compensated gradient (``grad + its residual``) is reduce-scattered densely
       inside its node (fast local links): local rank j holds the node's sum on shard j;
    2. the sparsifier selects on that shard sum;
    3. the shard's sparse AllReduce runs across nodes among the ranks holding the same shard
       (``exchange.hierarchical_sparse_allreduce``): every shard crosses the slow links in parallel,
       each ``1/local_size`` of the volume;
    4. the shards' results are all-gathered inside the node, and every rank writes the average.
    Error feedback is per rank over its shard: rank r keeps ``node sum on its shard - what of it
    survived`` (zero elsewhere), which telescopes over all ranks. Deferred (:class:`.base.DeferredStrategy`):
    its rounds run at the round's end, blocking, group after group.
    """

    name = "hierarchical"

    def __init__(self, context: ExchangeContext, sparsifier: Sparsifier,
                 feedback: Optional[ErrorFeedback] = None) -> None:
        super().__init__(context)
        self.sparsifier, self.feedback = sparsifier, feedback
        self.codec = RegionCodecAdapter(index_codec=context.index_codec, value_codec=context.value_codec)
        self._hierarchy: Optional[Hierarchy] = None

    def hierarchy(self) -> Hierarchy:
        """The intra- and cross-node groups, built at first use (a collective: every rank builds
        them at its first bucket, in the same order)."""
        if self._hierarchy is None:
            local = local_size_of(self.context.hierarchy, self.context.world_size)
            built = build_hierarchy(local)
            assert built is not None
            self._hierarchy = built
        return self._hierarchy

    def _run(self, group: Group) -> None:
        context = self.context
        k = group.k
        hierarchy = self.hierarchy()
        dense = torch.zeros(group.numel, dtype=torch.float32, device=group.device)
        for entry in group.entries:
            if entry.compensated is not None and not entry.unused:
                dense[entry.offset: entry.offset + entry.numel] = entry.compensated
        if not group.finite:
            dense[0] = float("nan")
        step = context.step
        tensor_id = hash(group.signature()) & 0x7FFFFFFF

        def select(shard_sum: torch.Tensor) -> torch.Tensor:
            if not all_finite(shard_sum):  # one NaN entry tells every rank
                return torch.zeros(1, dtype=torch.int64, device=shard_sum.device)
            return self.sparsifier.select(shard_sum, step=step, tensor_id=tensor_id)

        self.codec.error = None
        started = time.perf_counter()
        try:
            result = hierarchical_sparse_allreduce(dense=dense, k=k if k is not None else group.numel,
                                                   hierarchy=hierarchy, select=select, codec=self.codec)
        except (DecodeError, CollectiveError) as error:
            raise (self.codec.error or error)
        except RuntimeError as error:
            raise collective_failed("hierarchical exchange", step, error) from error
        context.stats.add("seconds_communicate", time.perf_counter() - started)  # blocking: its rounds' wall time
        context.stats.add("bytes_sent", float(sum(result.sent_intra.values()) + sum(result.sent_cross.values())))
        context.stats.add("bytes_sent_cross_node", float(sum(result.sent_cross.values())))
        context.stats.add("count_hierarchical_buckets", 1)
        with context.stats.timer("decode"):
            out = averaged_output(group, result.indices, result.values, finite=result.finite)
            if out is None:
                return
            if self.feedback is not None:  # held in the residuals' storage dtype until the agreement
                residual = result.residual(group.numel)
                for entry in group.entries:
                    piece = residual[entry.offset: entry.offset + entry.numel]
                    group.keep_residual(entry, self.feedback.held_copy(piece, accumulation_dtype(entry.grad)))
            group.write(out)
