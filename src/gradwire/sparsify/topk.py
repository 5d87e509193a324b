"""``topk``: the exact k largest magnitudes — the reference every approximate sparsifier is measured against.

``torch.topk`` over millions of elements is a selection over the whole tensor and slow on the
CPU (about 0.25 s for ResNet-18's 11M gradients, one thread). The result does not need it: if
at least ``k`` elements have ``|x| >= t`` for some ``t``, the k largest are all among them. So
large tensors take a threshold from an evenly spaced sample, set low enough that it almost
always leaves a few more than ``k`` candidates, scan once for ``|x| >= t`` and run the exact
top-k over the candidates only. Too few candidates lower ``t`` and rescan; the answer is exact
either way, only the time depends on the sample.
"""

from __future__ import annotations

import math

import torch

from .base import BudgetSparsifier, register_sparsifier
from .threshold import indices_at_or_above

#: Below this many elements ``torch.topk`` over everything is as fast as a scan.
SCAN_MIN_NUMEL = 1 << 16
#: The scan pays only when it leaves few candidates: above this density use ``torch.topk``.
SCAN_MAX_DENSITY = 0.25
#: Sample size for the threshold estimate (evenly spaced, so deterministic and cheap).
SAMPLE_SIZE = 1 << 13
#: Lowering the threshold when a scan left fewer than ``k`` candidates: widen the sample rank by this.
_WIDEN = 4.0


def topk_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries of ``magnitudes`` (1-D, ``k <= numel``).

    Ties at the k-th value are broken by ``torch.topk`` (arbitrary but deterministic on a device);
    NaN ranks above every number.
    """
    # sorted=False: ordering by value is wasted work, we need ordering by position instead.
    _, indices = torch.topk(magnitudes, k, sorted=False)
    indices, _ = torch.sort(indices)
    return indices


def largest_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest ``|flat|`` (1-D float, ``1 <= k <= numel``).

    Exact. NaN ranks below every number (it is kept only when fewer than ``k`` elements are
    not NaN), on every path.
    """
    numel = flat.numel()
    if numel < SCAN_MIN_NUMEL or k > SCAN_MAX_DENSITY * numel:
        return topk_indices(_magnitudes_nan_last(flat), k)
    stride = max(1, numel // SAMPLE_SIZE)
    sample = flat[::stride].abs().float().nan_to_num_(nan=-1.0)
    size = sample.numel()
    # Expected k*size/numel sample elements lie above the true k-th magnitude; aim for a rank
    # well beyond that (mean + 4 standard deviations + 8) so that one scan almost always suffices.
    expected = k * size / numel
    rank = expected + 4.0 * math.sqrt(expected) + 8.0
    while rank < size:
        threshold = float(torch.kthvalue(sample, size - int(rank) + 1).values)
        if threshold <= 0.0:
            break  # mostly zeros: a scan would keep nearly everything
        candidates = indices_at_or_above(flat, threshold)
        if candidates.numel() >= k:
            return candidates[topk_indices(flat[candidates].abs(), k)]
        rank *= _WIDEN
    return topk_indices(_magnitudes_nan_last(flat), k)


def _magnitudes_nan_last(flat: torch.Tensor) -> torch.Tensor:
    return flat.abs().nan_to_num_(nan=-1.0)


@register_sparsifier
class TopK(BudgetSparsifier):
    """Keep exactly the ``k`` elements of largest ``|x|`` (see :func:`largest_magnitudes`)."""

    name = "topk"

    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        return largest_magnitudes(flat, k)
