"""Layer-wise and global scope."""

from __future__ import annotations

import torch

from gradwire.sparsify import get_sparsifier, select_global, select_layerwise

from .contract import random_flat


def test_global_topk_gives_the_budget_to_the_largest_gradients() -> None:
    small, large = random_flat(1000, seed=1) * 1e-3, random_flat(1000, seed=2)
    pieces = select_global(get_sparsifier("topk", density=0.05), [small, large])
    assert pieces[0].numel() == 0 and pieces[1].numel() == 100
    assert torch.equal(pieces[1], get_sparsifier("topk", k=100).select(large))


def test_layerwise_uses_one_tensor_id_per_tensor() -> None:
    sparsifier = get_sparsifier("randomk", k=10)
    flats = [torch.zeros(500), torch.zeros(500)]
    pieces = select_layerwise(sparsifier, flats, step=3)
    assert [p.numel() for p in pieces] == [10, 10]
    assert torch.equal(pieces[1], sparsifier.select(flats[1], step=3, tensor_id=1))
    assert not torch.equal(pieces[0], pieces[1])


def test_global_promotes_mixed_dtypes() -> None:
    flats = [random_flat(300, seed=1, dtype=torch.float16), random_flat(300, seed=2)]
    pieces = select_global(get_sparsifier("topk", k=20), flats)
    assert sum(p.numel() for p in pieces) == 20
