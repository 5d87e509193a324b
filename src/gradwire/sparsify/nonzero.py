"""``nonzero``: keep exactly the non-zero entries -- lossless sparsification of naturally sparse
gradients.

Embedding tables and the output layers of recommenders produce gradients that are exactly zero
outside the rows a batch touched (DeepReduce's NCF case; OmniReduce sends only non-zero
blocks). Selecting ``x != 0`` sends all of the information and nothing else: with a lossless
value codec (``fp32`` for float32 gradients) what arrives is the gradient itself, so error
feedback keeps a residual of exactly zero, and a parameter whose batch touched no row sends
nothing. The count varies from 0 to ``numel``; a dense parameter simply sends everything (an
index codec that codes runs, e.g. ``rle``, spends a few bytes on a fully dense run, and on each
run of a row-sparse table's ``dim`` consecutive positions).

NaN compares unequal to zero, so it is kept (callers check gradients for NaN/Inf first); a
negative zero is not kept: it adds nothing, though where every rank holds -0.0 the hook's sum
is +0.0 where a dense AllReduce gives -0.0 (equal values, different bits).

Options: ``density`` is accepted and ignored -- the hook fills in a default density when no
amount is given, and the amount here is decided by the data. ``target_k`` is None.
"""

from __future__ import annotations

import torch

from .base import DataSizedSparsifier, check_seed, is_density, register_sparsifier


@register_sparsifier
class NonZero(DataSizedSparsifier):
    """Keep every element ``x`` with ``x != 0`` (NaN included); the count is 0 to ``numel``.

    Args:
        density: accepted and ignored (the hook fills in a default density when no amount is
            given); a number in (0, 1] when given.
        seed: an int >= 0, ignored.

    Raises:
        ValueError: a value out of range.
    """

    name = "nonzero"

    def __init__(self, *, density: "float | None" = None, seed: int = 0) -> None:
        if density is not None and not is_density(density):
            raise ValueError(f"density={density!r} must be in (0, 1] (nonzero ignores it)")
        self.density = None if density is None else float(density)
        self.seed = check_seed(seed)

    def _select(self, flat: torch.Tensor, *, step: int, tensor_id: int) -> torch.Tensor:
        return torch.nonzero(flat).view(-1)
