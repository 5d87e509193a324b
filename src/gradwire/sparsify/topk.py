"""``topk``: the exact k largest magnitudes — the reference every approximate sparsifier is measured against."""

from __future__ import annotations

import torch

from .base import BudgetSparsifier, register_sparsifier


def topk_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries of ``magnitudes`` (1-D, ``k <= numel``).

    Ties at the k-th value are broken by ``torch.topk`` (arbitrary but deterministic on a device);
    NaN ranks above every number.
    """
    # sorted=False: ordering by value is wasted work, we need ordering by position instead.
    _, indices = torch.topk(magnitudes, k, sorted=False)
    indices, _ = torch.sort(indices)
    return indices


@register_sparsifier
class TopK(BudgetSparsifier):
    """Keep exactly the ``k`` elements of largest ``|x|`` (``torch.topk`` over ``abs``)."""

    name = "topk"

    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        return topk_indices(flat.abs(), k)
