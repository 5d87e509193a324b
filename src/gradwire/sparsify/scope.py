"""Scope of a selection: per tensor (layer-wise) or over all tensors at once (global).

Layer-wise keeps ``density`` of every tensor; global keeps ``density`` of the whole model,
so tensors with large gradients get more of the budget (the GlobalTopKReducer of PowerSGD's
experiments, and gTop-k).
"""

from __future__ import annotations

import torch

from .base import Sparsifier


def select_layerwise(sparsifier: Sparsifier, flats: list[torch.Tensor], *, step: int = 0) -> list[torch.Tensor]:
    """One selection per tensor; tensor ``i`` is selected with ``tensor_id=i``.

    Args:
        sparsifier: what chooses the positions; its amount applies to each tensor.
        flats: 1-D float tensors.
        step: the training step.

    Returns:
        For each tensor, ascending int64 indices on its device.
    """
    return [sparsifier.select(flat, step=step, tensor_id=i) for i, flat in enumerate(flats)]


def select_global(sparsifier: Sparsifier, flats: list[torch.Tensor], *, step: int = 0) -> list[torch.Tensor]:
    """One selection over the concatenation of ``flats``, split back into per-tensor indices.

    The amount (``density`` or ``k``) applies to the total element count, and the selection
    uses ``tensor_id=0``.

    Args:
        sparsifier: what chooses the positions.
        flats: 1-D float tensors on one device (dtypes are promoted to a common one for the
            selection).
        step: the training step.

    Returns:
        For each tensor, ascending int64 indices local to that tensor, on its device; their
        union (shifted by the tensor offsets) is exactly the set
        ``sparsifier.select(torch.cat(flats))`` returns.

    Raises:
        ValueError: some tensor is not 1-D.
    """
    if not flats:
        return []
    for flat in flats:
        if flat.dim() != 1:
            raise ValueError(f"every tensor must be 1-D, got shape {tuple(flat.shape)}")
    indices = sparsifier.select(torch.cat(flats), step=step, tensor_id=0)
    sizes = [flat.numel() for flat in flats]
    # Indices are ascending, so each tensor's share is one contiguous run; find the run ends.
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(indices.device)
    counts = torch.diff(torch.searchsorted(indices, ends), prepend=ends.new_zeros(1)).tolist()
    pieces = torch.split(indices, counts)
    offset = 0
    result = []
    for piece, flat, size in zip(pieces, flats, sizes):
        result.append((piece - offset).to(flat.device))
        offset += size
    return result
