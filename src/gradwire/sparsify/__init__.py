"""Sparsifiers: which positions of a flat gradient to keep.

>>> import torch, gradwire.sparsify as sparsify
>>> chooser = sparsify.get_sparsifier("topk", k=2)
>>> chooser.select(torch.tensor([0.1, -3.0, 0.2, 2.0])).tolist()
[1, 3]
>>> sparsify.sparsifiers()
['chunktopk', 'gaussian-k', 'nonzero', 'randomblock', 'randomk', 'sampled-topk', 'threshold', 'topk']

They know nothing of bytes, codecs or ranks; see :mod:`gradwire.sparsify.base` for the
contract (ascending int64 indices on the input's device) and the amount options.
"""

from __future__ import annotations

import torch

from ..sparse import SparseTensor
from . import blocked, chunked, gaussian, nonzero, random, sampled, threshold, topk  # noqa: F401  (each registers itself)
from .base import (BudgetSparsifier, DataSizedSparsifier, Sparsifier, get_sparsifier, register_sparsifier,
                   sparsifier_classes)
from .scope import select_global, select_layerwise


def sparsifiers() -> list[str]:
    """Names of the registered sparsifiers, sorted."""
    return sorted(sparsifier_classes())


def sparsify(flat: torch.Tensor, sparsifier: Sparsifier, *, step: int = 0, tensor_id: int = 0) -> SparseTensor:
    """``sparsifier``'s selection of ``flat`` with its values gathered.

    Args:
        flat: a floating tensor of any shape (flattened), on any device.
        sparsifier: what chooses the positions.
        step: as for :meth:`Sparsifier.select`.
        tensor_id: as for :meth:`Sparsifier.select`.

    Returns:
        The kept values (``flat``'s dtype and device) at their flat positions.
    """
    flat = flat.reshape(-1)
    indices = sparsifier.select(flat, step=step, tensor_id=tensor_id)
    return SparseTensor(flat[indices], indices, flat.numel())


__all__ = [
    "BudgetSparsifier",
    "DataSizedSparsifier",
    "Sparsifier",
    "get_sparsifier",
    "register_sparsifier",
    "select_global",
    "select_layerwise",
    "sparsifiers",
    "sparsify",
]
