"""``gaussian-k``: the threshold from the mean and standard deviation, assuming a Gaussian gradient.

Shi et al. (2019): if ``x ~ N(mu, sigma^2)``, about a fraction ``density`` of the elements has
``|x - mu| >= sigma * Phi^-1(1 - density / 2)``. This starts the threshold search at
``|mu| + sigma * Phi^-1(1 - density / 2)`` (one reduction over the tensor, no sample) and
then adjusts it like ``sampled-topk`` until the count is within ``±tolerance`` of ``k``. Real
gradients have heavier tails than a Gaussian, so expect more adjustments than with a sample.
"""

from __future__ import annotations

import torch

from .base import register_sparsifier
from .sampled import ThresholdSearch


@register_sparsifier
class GaussianK(ThresholdSearch):
    """Threshold search started from a Gaussian fit of the values (mean, std).

    One reduction over the tensor instead of a sample; real gradients have heavier tails than a
    Gaussian, so expect more adjustments than with ``sampled-topk``. Options and count bound as
    :class:`~gradwire.sparsify.sampled.ThresholdSearch`'s.
    """

    name = "gaussian-k"

    def initial_threshold(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> float | None:
        numel = flat.numel()
        # Mean and root-mean-square are plain reductions, ~20x faster here than the Welford pass of
        # torch.std_mean; the cancellation in rms^2 - mean^2 only matters when |mean| >> std,
        # which gradients are not. float32 accumulation: float16 would lose millions of terms.
        accumulate = torch.float64 if flat.dtype == torch.float64 else torch.float32
        mean = float(flat.mean(dtype=accumulate))
        rms = float(torch.linalg.vector_norm(flat, dtype=accumulate)) / numel**0.5
        std = max(rms * rms - mean * mean, 0.0) ** 0.5
        tail = float(torch.special.ndtri(torch.tensor(1.0 - k / (2.0 * numel), dtype=torch.float64)))
        return abs(mean) + std * tail
