"""``chunktopk``: the largest magnitudes of every chunk of ``chunk`` consecutive elements.

A plain top-k of a tensor may spend its whole budget on one region (a few rows of a weight, the
embedding of frequent symbols) and leave the rest waiting for error feedback. DeMo and SparseLoCo
select per chunk (64-element DCT chunks; 4096-element chunks of the pseudo-gradient) so that every
region sends its share each round. Here the k of the tensor is dealt to its chunks in proportion to
their length (the last chunk may be short) by cumulative rounding, so the total is exactly k and no
chunk is asked for more than it holds; each chunk keeps its own largest magnitudes.
"""

from __future__ import annotations

import math

import torch

from ..errors import is_integer
from .base import BudgetSparsifier, register_sparsifier

#: SparseLoCo's chunk: 64 x 64 elements
DEFAULT_CHUNK = 4096


def checked_chunk(chunk: object) -> int:
    """A ``chunk=`` option as an int.

    Raises:
        ValueError: ``chunk`` is not an integer >= 1.
    """
    if not (is_integer(chunk) and chunk >= 1):
        raise ValueError(f"chunk={chunk!r} must be an integer >= 1")
    return int(chunk)


def chunk_quotas(numel: int, k: int, chunk: int) -> torch.Tensor:
    """How many of ``k`` each chunk of ``chunk`` elements of ``numel`` keeps: int64 (chunks,),
    summing to ``k``, the c-th ``floor(k L_c / n) - floor(k L_(c-1) / n)`` with ``L_c`` the
    elements up to the c-th chunk's end (so each quota is at most its chunk's length)."""
    ends = torch.arange(1, math.ceil(numel / chunk) + 1, dtype=torch.int64).mul_(chunk).clamp_(max=numel)
    cumulative = torch.div(ends * k, numel, rounding_mode="floor")
    return torch.diff(cumulative, prepend=torch.zeros(1, dtype=torch.int64))


@register_sparsifier
class ChunkTopK(BudgetSparsifier):
    """Keep exactly ``k`` elements: each chunk of ``chunk`` consecutive elements its share of ``k``
    (:func:`chunk_quotas`), its largest ``|x|`` (ties by ``torch.topk``'s order).

    Args:
        density, k, seed: as :class:`~gradwire.sparsify.base.BudgetSparsifier` (``seed`` is ignored).
        chunk: elements per chunk, an int >= 1 (default 4096).

    Raises:
        ValueError: an option out of range.
    """

    name = "chunktopk"

    def __init__(self, *, density: float | None = None, k: int | None = None, seed: int = 0,
                 chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__(density=density, k=k, seed=seed)
        self.chunk = checked_chunk(chunk)

    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        numel = flat.numel()
        chunk = min(self.chunk, numel)
        quotas = chunk_quotas(numel, k, chunk).to(flat.device)
        rows = quotas.numel()
        magnitudes = torch.full((rows * chunk,), -1.0, dtype=flat.dtype, device=flat.device)
        magnitudes[:numel] = flat.abs()  # the short last chunk's padding (-1) is never among its largest
        most = int(quotas.max())
        _, columns = torch.topk(magnitudes.view(rows, chunk), most, dim=1, sorted=True)
        keep = torch.arange(most, device=flat.device).unsqueeze(0) < quotas.unsqueeze(1)
        positions = (columns + torch.arange(rows, device=flat.device).unsqueeze(1) * chunk)[keep]
        return torch.sort(positions).values
