"""Index regions of a sparse AllReduce: rank j owns the flat positions ``[b[j], b[j+1])``.

Boundaries are a list of ``p + 1`` ints, ``0 = b[0] <= b[1] <= ... <= b[p] = numel`` (a region may
be empty). Every rank must pass the same list; :func:`balanced_boundaries` derives one that all
ranks agree on from where the ranks' selected entries lie (Ok-Topk's region repartition), so that
each owner receives and forwards about the same number of entries. The caller refreshes it every
N steps (it costs one small AllReduce); between refreshes the old boundaries stay valid, only less
balanced.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .checked import allreduce_sum_checked, group_size


def equal_boundaries(numel: int, world_size: int) -> list[int]:
    """Regions of (nearly) equal length: ``b[j] = j * numel // p``."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"numel={numel} must be >= 0 and world_size={world_size} >= 1")
    return [j * numel // world_size for j in range(world_size + 1)]


def check_boundaries(boundaries: Sequence[int], numel: int, world_size: int) -> list[int]:
    """``boundaries`` as a list of ints; ``ValueError`` unless it has ``p + 1`` non-decreasing
    entries from 0 to ``numel``."""
    bounds = [int(b) for b in boundaries]
    if len(bounds) != world_size + 1 or bounds[0] != 0 or bounds[-1] != numel or any(
            a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"boundaries={bounds[:8]}{'...' if len(bounds) > 8 else ''} must be {world_size + 1} "
                         f"non-decreasing ints from 0 to numel={numel}")
    return bounds


def balanced_boundaries(indices: torch.Tensor, numel: int, group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """Boundaries that split the ranks' selected positions into regions of about equal counts.

    Each rank with a non-empty selection proposes the cut ``indices[j * nnz // p]`` for
    ``j = 1..p-1`` (its own j-th p-quantile); the cuts are summed with one int64 AllReduce (exact,
    so every rank computes the same result) and averaged over the ranks that proposed. Ranks with
    nothing selected do not vote; if none has anything, the regions are equal. Blocking; one
    collective.

    Args:
        indices: this rank's selected positions, (nnz,) int64, ascending, in ``[0, numel)``.
        numel: positions in the flat space.
        group: the process group (None: the default one).

    Returns:
        ``p + 1`` boundaries, the same on every rank.

    Raises:
        ValueError: ``indices`` is not a 1-D int64 tensor.
        CollectiveError: the AllReduce failed.
    """
    size = group_size(group)
    if size == 1:
        return [0, numel]
    votes = boundary_votes(indices, size)
    allreduce_sum_checked(votes, group, what="balanced_boundaries", collective="all_reduce (cuts)")
    return boundaries_from_votes(votes, numel, size)


def boundary_votes(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """One rank's ballot for :func:`balanced_boundaries`: its ``p - 1`` cuts, then 1 for "voted"
    (all zeros for an empty selection).

    Args:
        indices: this rank's selected positions, (nnz,) int64, ascending.
        world_size: p.

    Returns:
        (p,) int64 on ``indices``' device; the ranks' ballots are summed exactly.

    Raises:
        ValueError: ``indices`` is not a 1-D int64 tensor.
    """
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise ValueError("indices must be a 1-D int64 tensor")
    nnz = indices.numel()
    votes = torch.zeros(world_size, dtype=torch.int64, device=indices.device)
    if nnz:
        positions = torch.arange(1, world_size, device=indices.device) * nnz // world_size
        votes[: world_size - 1] = indices[positions]
        votes[world_size - 1] = 1
    return votes


def boundaries_from_votes(votes: torch.Tensor, numel: int, world_size: int) -> list[int]:
    """The boundaries of the summed ballots (:func:`boundary_votes`): each cut averaged over the
    ranks that voted; equal regions when none did."""
    voters = int(votes[world_size - 1])
    if voters == 0:
        return equal_boundaries(numel, world_size)
    cuts = (votes[: world_size - 1] // voters).clamp(0, numel)
    cuts = torch.cummax(cuts, dim=0).values  # averages of sorted cuts are sorted; guard anyway
    return [0, *[int(c) for c in cuts.tolist()], numel]
