"""randomk draws uniform k-subsets; randomblock is one wrapping block; both agree across ranks."""

from __future__ import annotations

import pytest
import torch

from gradwire.sparsify import get_sparsifier
from gradwire.sparsify.random import generator_for, mixed_seed, random_distinct, wrapped_block


def test_mixed_seed_separates_nearby_inputs() -> None:
    seeds = {mixed_seed(seed, step, tensor_id) for seed in range(4) for step in range(50) for tensor_id in range(20)}
    assert len(seeds) == 4 * 50 * 20
    assert all(0 <= s < 1 << 63 for s in seeds)
    assert mixed_seed(1, 2, 3) == mixed_seed(1, 2, 3) != mixed_seed(1, 3, 2)


@pytest.mark.parametrize("numel, k", [(10, 1), (10, 5), (10, 6), (10, 9), (1000, 1), (1000, 500), (1000, 501),
                                      (1000, 999), (100_000, 3000), (100_000, 60_000)])
def test_random_distinct_returns_exactly_k_sorted_distinct(numel: int, k: int) -> None:
    indices = random_distinct(numel, k, generator_for(0, 1, 2))
    assert indices.numel() == k and indices.dtype == torch.int64
    assert bool((indices[1:] > indices[:-1]).all()) and int(indices[0]) >= 0 and int(indices[-1]) < numel


@pytest.mark.parametrize("k", [3, 7])  # the direct draw and the complement draw (k > numel / 2)
def test_randomk_is_uniform_over_positions(k: int) -> None:
    numel, steps = 12, 3000
    sparsifier = get_sparsifier("randomk", k=k)
    flat = torch.zeros(numel)
    hits = torch.zeros(numel)
    for step in range(steps):
        hits[sparsifier.select(flat, step=step)] += 1
    expected = steps * k / numel
    chi_square = float(((hits - expected) ** 2 / expected).sum())
    assert chi_square < 40.0, hits  # 11 degrees of freedom: P(chi2 > 40) ~ 3e-5


def test_randomk_subsets_are_uniform() -> None:
    # All C(5, 2) = 10 subsets appear about equally often.
    sparsifier = get_sparsifier("randomk", k=2)
    counts: dict[tuple[int, ...], int] = {}
    for step in range(2000):
        key = tuple(sparsifier.select(torch.zeros(5), step=step).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 10
    assert min(counts.values()) > 140 and max(counts.values()) < 270


def test_randomblock_is_one_wrapping_block() -> None:
    numel, k = 100, 30
    sparsifier = get_sparsifier("randomblock", k=k)
    starts = set()
    for step in range(300):
        indices = sparsifier.select(torch.zeros(numel), step=step)
        assert indices.numel() == k
        gaps = torch.diff(indices)
        breaks = int((gaps != 1).sum())
        assert breaks <= 1
        if breaks:  # wrapped: starts at 0, ends at numel - 1
            assert int(indices[0]) == 0 and int(indices[-1]) == numel - 1
            starts.add(int(indices[int(torch.nonzero(gaps != 1)[0]) + 1]))
        else:
            starts.add(int(indices[0]))
    assert len(starts) > 90  # the start is spread over all positions


def test_wrapped_block() -> None:
    assert wrapped_block(10, 4, 8, torch.device("cpu")).tolist() == [0, 1, 8, 9]
    assert wrapped_block(10, 4, 6, torch.device("cpu")).tolist() == [6, 7, 8, 9]
    assert wrapped_block(10, 4, 0, torch.device("cpu")).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("amount", [{"density": 0.01}, {"density": 0.3}, {"density": 1.0}, {"k": 5}])
def test_randomblock_selects_many_tensors_at_once_as_one_by_one(amount: dict) -> None:
    # a bucket's tensors in one call: empty, single-element, whole and wrapping blocks alike
    sparsifier = get_sparsifier("randomblock", seed=3, **amount)
    numels = [0, 1, 7, 64, 1000, 50_000, 3, 999] * 4
    tensor_ids = list(range(100, 100 + len(numels)))
    wrapped = 0
    for step in range(6):
        together = sparsifier.select_segments(numels, step=step, tensor_ids=tensor_ids, device=torch.device("cpu"))
        for numel, tensor_id, indices in zip(numels, tensor_ids, together):
            alone = sparsifier.select(torch.zeros(numel), step=step, tensor_id=tensor_id)
            assert torch.equal(indices, alone), (numel, tensor_id, step)
            wrapped += int(indices.numel() > 1 and bool((indices[1:] - indices[:-1] > 1).any()))
    assert wrapped > 0 or amount.get("density") == 1.0  # the wrapping blocks' rewrite was exercised
    assert get_sparsifier("randomk", density=0.1).select_segments(
        [10], step=0, tensor_ids=[0], device=torch.device("cpu")) is None  # one by one
