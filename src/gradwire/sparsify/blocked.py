"""``blocktopk``: the chunks of ``chunk`` consecutive elements with the most energy, kept whole.

Where indices cost as much as values, a sparse exchange spends half its bytes saying *where*: at
10% density Rice or Elias-Fano take about 5 bits per position, next to 3 to 4 bits for a
quantized value (docs/local-steps.md, "The frontier toward 1/2000"). Keeping whole chunks makes the
positions runs of consecutive elements, which the run-length index code (``rle``) sends in about
``(2 log2(chunk) + 2 log2(chunk / density)) / chunk`` bits per position (about 0.9 bits at
``chunk=32`` and 10%), so almost the whole budget goes to values. The price is the selection's
resolution: a chunk is kept for its sum of squares, with its small elements beside its large ones.
On the outer steps of the byte-level transformer that price was the larger one: at H = 64 and about
the same bytes, 10% in chunks of 16 ended 30% behind dense outer steps where elementwise top-k 4%
ended 15% behind (docs/local-steps.md, "Whole chunks"). Use it where a tensor's energy does sit in
runs along its memory order.

``chunktopk`` is the other per-chunk rule: every chunk keeps its share of ``k``, element by element.
"""

from __future__ import annotations

import math

import torch

from .base import BudgetSparsifier, register_sparsifier
from .chunked import checked_chunk

#: elements per chunk: a run of 32 costs the run-length code 11 bits, a third of a bit per position
DEFAULT_BLOCK_CHUNK = 32


@register_sparsifier
class BlockTopK(BudgetSparsifier):
    """Keep exactly ``k`` elements, whole chunks of ``chunk`` consecutive ones by falling energy.

    The tensor is cut into chunks of ``chunk`` elements (the last may be short); the chunks are
    ranked by their sum of squares (ties by ``torch.topk``'s order) and taken whole until ``k``
    elements are kept; the last chunk taken keeps only its first elements when ``k`` is not a
    multiple of ``chunk``.

    Args:
        density, k, seed: as :class:`~gradwire.sparsify.base.BudgetSparsifier` (``seed`` is ignored).
        chunk: elements per chunk, an int >= 1 (default 32); ``chunk=1`` is plain top-k.

    Raises:
        ValueError: an option out of range.
    """

    name = "blocktopk"

    def __init__(self, *, density: float | None = None, k: int | None = None, seed: int = 0,
                 chunk: int = DEFAULT_BLOCK_CHUNK) -> None:
        super().__init__(density=density, k=k, seed=seed)
        self.chunk = checked_chunk(chunk)

    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        numel = flat.numel()
        chunk = min(self.chunk, numel)
        rows = math.ceil(numel / chunk)
        # squared in float32 at least: a float16 square overflows above |x| of 256, a sum of 32 above 45
        squares = torch.zeros(rows * chunk, dtype=torch.promote_types(flat.dtype, torch.float32), device=flat.device)
        squares[:numel].copy_(flat).square_()
        energy = squares.view(rows, chunk).sum(dim=1)
        # one chunk more than k needs: at most one chunk (the last) is short, so these hold >= k elements
        taken = min(rows, k // chunk + 2)
        _, best = torch.topk(energy, taken, sorted=True)
        positions = (best.unsqueeze(1) * chunk + torch.arange(chunk, device=flat.device)).reshape(-1)
        positions = positions[positions < numel][:k]
        return torch.sort(positions).values
