"""Hierarchical sparse AllReduce: dense inside a node, sparse across nodes, shared inside the node.

The world is ``nodes x local_size`` ranks, node n holding the consecutive ranks
``n*local_size .. (n+1)*local_size - 1``. :func:`build_hierarchy` creates, on every rank in the same
order, the intra-node groups and the cross-node groups (local rank j of every node).

:func:`hierarchical_sparse_allreduce` then runs, for a flat gradient of ``numel`` elements:

1. **Intra-node dense reduce-scatter** (``all_to_all_single``, fast local links): local rank j
   receives its shard ``[s_j, s_{j+1})`` (equal shards, ``1/local_size`` of the space) from every
   local peer and sums them in local-rank order: the node's sum on that shard.
2. **Selection**: the caller's ``select`` picks positions of that shard sum (the exchange knows no
   sparsifier: it is just a callable).
3. **Cross-node sparse AllReduce** of the shard (:func:`.sparse_allreduce`) in the cross-node
   group, keeping ``k_j`` entries, ``k`` split over the shards in proportion to their length. All
   ``local_size`` shards cross the slow links in parallel, each of ``1/local_size`` the volume.
4. **Intra-node AllGather** of the shards' results: every rank gets the whole sparse sum
   (identical on all ranks: each shard's result is identical within its cross group).

**Error feedback** is per rank over its shard of the node sum: rank r (local rank j) keeps
``residual_r = (node sum on shard j) - (its contribution where it survived) + carry`` on shard j
and zero elsewhere (:meth:`HierarchicalResult.residual`), and adds its residual to its next
gradient before step 1. Over all ranks, ``sum_r residual_r = sum_r compensated_r - applied``
(the node sums partition ``sum_r compensated_r``; :mod:`.sparse_allreduce` telescopes on each
shard), so nothing is lost, only delayed.

Bytes per rank: ``(local_size-1)/local_size * 4 numel`` inside the node for step 1 (half a dense
ring AllReduce), about ``2 k/local_size * (nodes-1)/nodes`` entries across nodes, and
``(local_size-1) * k/local_size`` entries inside the node for step 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .checked import allgatherv, alltoallv, group_rank, group_size
from .regions import equal_boundaries
from .sparse_allreduce import RegionCodec, SparseAllreduceResult, sparse_allreduce

WHAT = "hierarchical_sparse_allreduce"


@dataclass(frozen=True)
class Hierarchy:
    """This rank's place in a ``nodes x local_size`` world and its two groups.

    Attributes:
        nodes: nodes in the world.
        local_size: ranks per node.
        node: this rank's node.
        local_rank: this rank's place in its node.
        intra: the group of its node (None in a world of one).
        cross: the group of the same local rank on every node (None in a world of one).
    """

    nodes: int
    local_size: int
    node: int
    local_rank: int
    intra: Optional[dist.ProcessGroup]
    cross: Optional[dist.ProcessGroup]


def build_hierarchy(local_size: int, ranks: Optional[Sequence[int]] = None) -> Optional[Hierarchy]:
    """Create the intra- and cross-node groups over ``ranks``.

    Collective over the whole world: every rank must call it with the same arguments, in the same
    order relative to other group creations (``dist.new_group``'s rule).

    Args:
        local_size: ranks per node, dividing ``len(ranks)``.
        ranks: global ranks (default: the world); node n is
            ``ranks[n*local_size : (n+1)*local_size]``.

    Returns:
        This rank's :class:`Hierarchy`, or None on ranks not in ``ranks``.

    Raises:
        ValueError: ``local_size`` does not divide the number of ranks (naming both).
    """
    world, rank = group_size(None), group_rank(None)
    members = list(range(world)) if ranks is None else [int(r) for r in ranks]
    if local_size < 1 or not members or len(members) % local_size:
        raise ValueError(f"local_size={local_size} must be >= 1 and divide the number of ranks {len(members)}")
    nodes = len(members) // local_size
    if world == 1:
        return Hierarchy(1, 1, 0, 0, None, None)
    intra, _ = dist.new_subgroups_by_enumeration(
        [members[n * local_size: (n + 1) * local_size] for n in range(nodes)])
    cross, _ = dist.new_subgroups_by_enumeration([members[j::local_size] for j in range(local_size)])
    if rank not in members:
        return None
    position = members.index(rank)
    return Hierarchy(nodes, local_size, position // local_size, position % local_size, intra, cross)


@dataclass(frozen=True)
class HierarchicalResult:
    """What :func:`hierarchical_sparse_allreduce` returns.

    Attributes:
        indices: (m,) int64 ascending over the whole flat space, identical on every rank.
        values: (m,) float32, the sum there (not divided by p), identical on every rank.
        finite: False on every rank if any shard saw NaN/Inf.
        shard: this rank's ``[start, stop)``.
        shard_sum: (stop - start,) float32, the node's sum there.
        shard_indices: what ``select`` chose, relative to ``start``.
        inner: the cross-node exchange of the shard.
        sent_intra: bytes this rank sent over the node links, by collective (``sent_cross``: the
            cross-node ones).
    """

    indices: torch.Tensor
    values: torch.Tensor
    finite: bool
    shard: tuple[int, int]
    shard_sum: torch.Tensor
    shard_indices: torch.Tensor
    inner: SparseAllreduceResult
    sent_intra: dict[str, int] = field(default_factory=dict)

    @property
    def sent_cross(self) -> dict[str, int]:
        """Bytes this rank sent across nodes, by collective."""
        return self.inner.sent_by_collective

    def residual(self, numel: int) -> torch.Tensor:
        """This rank's new residual, flat float32 of ``numel``: its shard's rule, zero elsewhere."""
        residual = torch.zeros(numel, dtype=torch.float32, device=self.shard_sum.device)
        start, stop = self.shard
        residual[start:stop] = self.inner.residual(self.shard_sum, indices=self.shard_indices)
        return residual


def node_reduce_scatter(dense: torch.Tensor, hierarchy: Hierarchy) -> tuple[torch.Tensor, int]:
    """Step 1: this rank's shard of the node's dense sum.

    Args:
        dense: this rank's flat float32 gradient, the same length on every rank of the node.
        hierarchy: this rank's place.

    Returns:
        The shard's float32 sum (in local-rank order) and the bytes this rank sent.

    Raises:
        ValueError: the node's ranks passed gradients of different lengths.
        CollectiveError: the exchange failed.
    """
    flat = dense.reshape(-1)
    shards = equal_boundaries(flat.numel(), hierarchy.local_size)
    lengths = [b - a for a, b in zip(shards, shards[1:])]
    received, counts = alltoallv(flat, lengths, hierarchy.intra, what=WHAT,
                                 collective="intra-node reduce-scatter all_to_all_single")
    own = lengths[hierarchy.local_rank]
    if counts != [own] * hierarchy.local_size:
        raise ValueError(f"{WHAT}: ranks of node {hierarchy.node} passed gradients of different lengths")
    total = torch.zeros(own, dtype=torch.float32, device=flat.device)
    for part in torch.split(received, counts):  # local-rank order: the same bits run after run
        total += part
    return total, 4 * (flat.numel() - own) + 8 * (hierarchy.local_size - 1)


def hierarchical_sparse_allreduce(*, dense: torch.Tensor, k: int, hierarchy: Hierarchy,
                                  select: Callable[[torch.Tensor], torch.Tensor],
                                  boundaries: Optional[Sequence[int]] = None, codec: Optional[RegionCodec] = None,
                                  summary_size: Optional[int] = None) -> HierarchicalResult:
    """Dense inside the node, sparse across nodes, shared inside the node (module docstring).

    Blocking; every rank calls it with the same sizes, in the same order.

    Args:
        dense: this rank's compensated gradient, flat float32, the same length on every rank.
        k: entries to keep over the whole space (split over the shards by length).
        hierarchy: this rank's place (:func:`build_hierarchy`).
        select: ``select(shard_sum)`` returns int64 ascending positions in the shard.
        boundaries: cross-node regions within this rank's shard (``nodes + 1`` ints; equal if
            None), e.g. from :func:`.balanced_boundaries` over ``hierarchy.cross``.
        codec: codes the cross-node region payloads (None: raw entries).
        summary_size: the cross-node sparse AllReduce's histogram bins per level (None: sized by
            the shard's k).

    Returns:
        :class:`HierarchicalResult`; the residual rule is :meth:`HierarchicalResult.residual`.

    Raises:
        ValueError: ``dense`` not float32, or mismatched sizes.
        DecodeError: a cross-node payload did not decode (every rank raises).
        CollectiveError: a collective failed.
    """
    if dense.dtype != torch.float32:
        raise ValueError(f"dense must be float32, got {dense.dtype}")
    numel = dense.numel()
    shards = equal_boundaries(numel, hierarchy.local_size)
    start, stop = shards[hierarchy.local_rank], shards[hierarchy.local_rank + 1]
    shard_sum, intra_bytes = node_reduce_scatter(dense, hierarchy)
    chosen = select(shard_sum)
    k_shard = k * stop // numel - k * start // numel if numel else 0  # the shards' k add up to k
    bounds = equal_boundaries(stop - start, hierarchy.nodes) if boundaries is None else boundaries
    inner = sparse_allreduce(indices=chosen, values=shard_sum[chosen], numel=stop - start, k=k_shard,
                             boundaries=bounds, group=hierarchy.cross, codec=codec, summary_size=summary_size)

    # share the shards inside the node: [finite flag | (index as 2 int32, value bits) per entry]
    absolute = (inner.indices + start).view(torch.int32).reshape(-1, 2)
    entries = torch.cat([absolute, inner.values.view(torch.int32)[:, None]], dim=1).reshape(-1)
    block = torch.cat([torch.tensor([int(inner.finite)], dtype=torch.int32, device=entries.device), entries])
    gathered, lengths = allgatherv(block, hierarchy.intra, what=WHAT,
                                   collective="intra-node allgather all_to_all_single")
    parts = [part.reshape(-1) for part in torch.split(gathered, lengths)]
    finite = all(bool(part[0]) for part in parts)
    if finite:
        words = torch.cat([part[1:] for part in parts]).reshape(-1, 3)
    else:
        words = torch.zeros(0, 3, dtype=torch.int32, device=entries.device)
    indices = words[:, :2].reshape(-1).view(torch.int64)
    values = words[:, 2].contiguous().view(torch.float32)
    sent = {"intra-node reduce-scatter": intra_bytes,
            "intra-node allgather": 4 * block.numel() * (hierarchy.local_size - 1) + 8 * (hierarchy.local_size - 1)}
    return HierarchicalResult(indices, values, finite, (start, stop), shard_sum, chosen, inner, sent)
