"""threshold keeps exactly |x| >= t, in every float dtype and through the chunked CPU scan."""

from __future__ import annotations

import math

import pytest
import torch

import gradwire.sparsify.threshold as threshold_module
from gradwire.sparsify import get_sparsifier
from gradwire.sparsify.threshold import indices_at_or_above, representable_at_least

from .contract import random_flat


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_representable_at_least_is_the_smallest_value_not_below(dtype: torch.dtype) -> None:
    for t in (0.1, 1.0, 1e-3, 3.3, 1e-30):
        bound = representable_at_least(t, dtype)
        assert bound >= t
        below = torch.nextafter(torch.tensor(bound, dtype=dtype), torch.tensor(0.0, dtype=dtype))
        assert float(below) < t
    assert representable_at_least(1e6, torch.float16) == math.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_representable_at_least_in_numpy_rounds_as_torch_does(monkeypatch: pytest.MonkeyPatch,
                                                               dtype: torch.dtype) -> None:
    # the numpy scalars' path (the dtypes numpy has) against the function's own torch path
    generator = torch.Generator().manual_seed(3)
    magnitudes = torch.exp(torch.empty(2000, dtype=torch.float64).uniform_(-60.0, 60.0, generator=generator))
    finfo = torch.finfo(dtype)
    edges = [0.0, 1e-45, float(finfo.tiny), float(finfo.max), float(finfo.max) * (1 + 1e-9), 1e300, math.inf]
    thresholds = [*magnitudes.tolist(), *edges]
    by_numpy = [representable_at_least(t, dtype) for t in thresholds]
    monkeypatch.setattr(threshold_module, "NUMPY_DTYPES", {})
    for t, rounded in zip(thresholds, by_numpy):
        assert rounded == representable_at_least(t, dtype), t


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_threshold_is_exact_at_the_boundary(dtype: torch.dtype) -> None:
    t = 0.1  # not representable in any of these dtypes
    bound = torch.tensor(representable_at_least(t, dtype), dtype=dtype)
    just_below = torch.nextafter(bound, torch.tensor(0.0, dtype=dtype))
    flat = torch.stack([just_below, bound, -bound, -just_below, torch.tensor(float("inf"), dtype=dtype),
                        torch.tensor(float("nan"), dtype=dtype), torch.tensor(0.0, dtype=dtype)])
    assert get_sparsifier("threshold", threshold=t).select(flat).tolist() == [1, 2, 4]


def test_chunked_scan_matches_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = random_flat(10_007, seed=6)
    expected = torch.nonzero(flat.abs() >= 1.5).view(-1)
    monkeypatch.setattr(threshold_module, "CPU_CHUNK_NUMEL", 1000)  # 10 full chunks and a remainder
    assert torch.equal(indices_at_or_above(flat, 1.5), expected)
    assert indices_at_or_above(flat, 100.0).numel() == 0


def test_count_varies_with_the_values() -> None:
    sparsifier = get_sparsifier("threshold", threshold=1.0)
    assert sparsifier.select(random_flat(1000) * 1e-3).numel() == 0
    assert sparsifier.select(random_flat(1000) * 1e3).numel() > 990
