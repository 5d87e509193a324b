"""``sampled-topk``: approximate top-k by a magnitude threshold estimated from a sample (DGC).

Exact ``torch.topk`` over millions of elements is slow on the CPU (a selection over the whole
tensor). Deep Gradient Compression (Lin et al., 2018) instead estimates the threshold that
keeps a fraction ``density`` of the elements from a small random sample, selects by that
threshold in one streaming pass, and adjusts the threshold if the count misses.

The count this returns lies within ``±tolerance`` (default 20%) of ``k``: after ``max_tries``
adjustments it falls back to an exact top-k (over the candidates when they cover k elements,
else over the whole tensor), so the bound always holds.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from ..errors import is_integer, is_real
from .base import BudgetSparsifier, register_sparsifier
from .random import generator_for
from .threshold import indices_at_or_above
from .topk import largest_magnitudes, topk_indices

#: Threshold factors when the count is too low / too high, as in DGC; once both a too-low
#: and a too-high threshold are known the search bisects between them (geometrically)
#: instead, which cannot oscillate.
_LOWER = 0.7
_RAISE = 1.3


class ThresholdSearch(BudgetSparsifier):
    """Select by ``|x| >= t`` for an estimated ``t``, adjusting ``t`` until the count is near ``k``.

    Subclasses supply :meth:`initial_threshold`. Each candidate scan keeps the positions and
    magnitudes at or above the lowest threshold tried so far; raising the threshold then only
    filters those (cheap), and only lowering it below every previous try rescans the tensor.
    The count always lies within ``±tolerance`` of ``k``: out of tries, an exact top-k decides.

    Args:
        density: as for :class:`~gradwire.sparsify.base.BudgetSparsifier`.
        k: as for :class:`~gradwire.sparsify.base.BudgetSparsifier`.
        seed: seeds the sample (with the step and tensor id).
        tolerance: allowed relative deviation of the count from ``k``, in [0, 1) (default 0.2).
        max_tries: threshold adjustments before the exact fallback, an int >= 1 (default 10).

    Raises:
        ValueError: a value out of range.
    """

    def __init__(
        self,
        *,
        density: float | None = None,
        k: int | None = None,
        seed: int = 0,
        tolerance: float = 0.2,
        max_tries: int = 10,
    ) -> None:
        super().__init__(density=density, k=k, seed=seed)
        if not (is_real(tolerance) and 0.0 <= tolerance < 1.0):
            raise ValueError(f"tolerance={tolerance!r} must be in [0, 1)")
        if not (is_integer(max_tries) and max_tries >= 1):
            raise ValueError(f"max_tries={max_tries!r} must be an integer >= 1")
        self.tolerance = float(tolerance)
        self.max_tries = int(max_tries)

    @abstractmethod
    def initial_threshold(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> float | None:
        """Estimated ``t`` such that about ``k`` elements have ``|x| >= t``; None: use exact top-k."""

    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        threshold = self.initial_threshold(flat, k, step=step, tensor_id=tensor_id)
        if threshold is None or not math.isfinite(threshold) or threshold <= 0.0:
            return largest_magnitudes(flat, k)
        fewest, most = self.count_bounds(flat.numel())

        scanned = threshold  # lowest threshold scanned so far: candidates hold all |x| >= scanned
        candidates = indices_at_or_above(flat, scanned)
        magnitudes = flat[candidates].abs()
        count = candidates.numel()
        too_many_at, too_few_at = 0.0, math.inf
        for attempt in range(self.max_tries):
            if attempt:
                if count > most:
                    too_many_at = threshold
                    threshold = threshold * _RAISE if too_few_at == math.inf else math.sqrt(threshold * too_few_at)
                else:
                    too_few_at = threshold
                    threshold = threshold * _LOWER if too_many_at == 0.0 else math.sqrt(threshold * too_many_at)
                if threshold < scanned:
                    scanned = threshold
                    candidates = indices_at_or_above(flat, scanned)
                    magnitudes = flat[candidates].abs()
                    count = candidates.numel()
                else:
                    count = int(torch.count_nonzero(magnitudes >= threshold))
            if fewest <= count <= most:
                return candidates if threshold == scanned else candidates[magnitudes >= threshold]
        # Out of tries (ties, a spiky distribution): the candidates are every |x| >= scanned, so if
        # there are at least k of them the true top-k lies among them.
        if candidates.numel() >= k:
            return candidates[topk_indices(magnitudes, k)]
        return largest_magnitudes(flat, k)


@register_sparsifier
class SampledTopK(ThresholdSearch):
    """DGC's sampled top-k: the threshold is the matching quantile of ``|x|`` over a random sample.

    The sample is drawn with replacement from a generator seeded by ``(seed, step, tensor_id)``
    (deterministic). Tensors no larger than the sample get an exact top-k. Takes
    :class:`ThresholdSearch`'s options, and two more.

    Args:
        sample_fraction: the sample's share of the elements, in (0, 1] (default 0.01).
        min_sample: the smallest sample, an int >= 1 (default 4096).

    Raises:
        ValueError: a value out of range.
    """

    name = "sampled-topk"

    def __init__(
        self,
        *,
        density: float | None = None,
        k: int | None = None,
        seed: int = 0,
        tolerance: float = 0.2,
        max_tries: int = 10,
        sample_fraction: float = 0.01,
        min_sample: int = 4096,
    ) -> None:
        super().__init__(density=density, k=k, seed=seed, tolerance=tolerance, max_tries=max_tries)
        if not (is_real(sample_fraction) and 0.0 < sample_fraction <= 1.0):
            raise ValueError(f"sample_fraction={sample_fraction!r} must be in (0, 1]")
        if not (is_integer(min_sample) and min_sample >= 1):
            raise ValueError(f"min_sample={min_sample!r} must be an integer >= 1")
        self.sample_fraction = float(sample_fraction)
        self.min_sample = int(min_sample)

    def initial_threshold(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> float | None:
        numel = flat.numel()
        size = max(self.min_sample, math.ceil(self.sample_fraction * numel))
        if size >= numel:
            return None
        generator = generator_for(self.seed, step, tensor_id)
        positions = torch.randint(0, numel, (size,), generator=generator).to(flat.device)
        sample = flat[positions].abs().float()
        # The sample's rank-th largest value: about k / numel of the sample lies at or above it.
        rank = min(size, max(1, round(k * size / numel)))
        return float(torch.kthvalue(sample, size - rank + 1).values)
